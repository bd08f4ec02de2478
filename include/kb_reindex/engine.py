"""The names the CLI, the benchmarks and the tests have always called for whole runs: a run is
`kb_reindex.pipeline`'s step sequence, recorded by `kb_reindex.runs`; the status views live in
`kb_reindex.status`.
"""

from __future__ import annotations

from kb_reindex.pipeline import RunResult, chunk_counts, empty_result, run_reindex, validation_summary
from kb_reindex.runs import exclusive, failure_of, run_rollback

__all__ = ["RunResult", "chunk_counts", "empty_result", "exclusive", "failure_of", "run_reindex", "run_rollback",
           "validation_summary"]
