"""
### knowledge_promote_shadow: put a shadow version live on purpose (on-call, migrations)

Manual only. A *shadow* is a version built and validated but never served (a migration run with
**promote** off). A rollback never reaches it: rollbacks return only to versions that served. This DAG
is the one way a shadow goes live from Airflow:

- **version** (required): the shadow's number (`kb-reindex status` or the Knowledge index page lists
  them as `shadow`, with model and dimension).
- **live_version**: the version you saw serving (empty only when nothing serves yet); if another serves
  by the time the alias moves, nothing moves and the task says what serves now.
- **reason** (required): recorded in the alias history.
- **confirm**: must be ticked, or nothing happens.

Under the alias's lock, the shadow is validated again against what serves now (golden set, structure),
then the alias moves with the same compare-and-swap as a promotion; the version it moves away from is
kept as the rollback target. A retired, failed, deleted or unknown version is refused and nothing moves.
On success the alias Asset is updated with `extra` {alias, action (`migrate` for a migration's shadow),
version, collection, model, dimension, previous_version}.

Without Airflow: `kb-reindex promote --version N`. On-call's steps: `docs/runbook.md`.
"""

from __future__ import annotations

from kb_reindex.airflow.factory import for_each_knowledge_base, promote_shadow_dag

globals().update(for_each_knowledge_base(lambda kb: promote_shadow_dag(kb, doc_md=__doc__)))
