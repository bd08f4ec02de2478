"""
### knowledge_rollback: put the previous index back behind the alias (on-call)

Manual only. Fill in the form:

- **live_version** (required): the version you saw serving (Knowledge index page or `kb-reindex status`).
  If another version serves by the time the alias moves (a reindex promoted meanwhile), the rollback is
  refused, nothing moves, and the task says what serves now: look again and confirm against that.
- **reason** (required): recorded in the alias history.
- **to_version** (optional): leave empty for the version the alias pointed to before `live_version`.
- **confirm**: must be ticked, or nothing happens.
- **revalidate**: score the target on the golden set and report it (does not block a confirmed
  rollback unless the target is structurally broken).

The target is checked first: its collection exists, its point count and IDs equal its manifest, its
dimension and distance match its record, and it is not `failed` or `deleted`. The switch is the same
compare-and-swap as a promotion; the version rolled away from becomes `retired` and is kept.

- **freeze** (default on): freeze the alias before it moves back. While frozen, no reindex, migration or
  shadow promotion moves the alias forward: they still build and validate, and keep the version unpromoted,
  saying why. The bad change is usually still in `knowledge/`, and the next run (or a migration) would
  build and promote it again; untick only when the cause is already fixed at the source. Lift it with
  `kb-reindex unfreeze` (or the Knowledge index page), then promote the kept version if wanted.

A reindex or migration building meanwhile does not delay it (no reindex lock, its own pool slot): that
run's promotion then fails its compare-and-swap and keeps its version `ready`, unpromoted.

Without Airflow: `kb-reindex rollback --reason "..." --freeze --yes`. On-call's steps: `docs/runbook.md`.
"""

from __future__ import annotations

from kb_reindex.airflow.factory import for_each_knowledge_base, rollback_dag

# every knowledge base's, and a refused entry's too: a typo never takes on-call's way back away
globals().update(for_each_knowledge_base(lambda kb: rollback_dag(kb, doc_md=__doc__), on_call=True))
