"""
### knowledge_watch: watch each promoted version, roll it back by itself on a regression

Started by the alias Asset (`kb_alias_<alias>`): each promotion of `knowledge_reindex` or
`knowledge_model_migration` emits an event on it. The promoting run ends at its promotion, so the next change of
the source is built at once, while the version it promoted is watched here.

- **watch** (a sensor in reschedule mode: between its looks, every `KB_WATCH_INTERVAL_S`, it holds no worker
  slot) looks for `watch_minutes` of the promoting run (empty: `KB_WATCH_MINUTES`; 0, the default: skipped at
  once). On a regression it rolls the alias back from the version it watches to the one before (compare-and-swap:
  never from a version someone else put there since) and fails, so on-call hears of it.
- The alias moved on (a newer promotion, a rollback): the watch ends at its next look; a newer promotion's watch
  starts after it (`max_active_runs=1`), and judges the older version only through the newer one (its rollback
  goes back to it). A rollback or a shadow promoted by a person starts a run that is skipped, and so does a watch
  that could not start until long after its window ended (paused, or queued).

Unpaused from the start. What on-call sees and does: `docs/runbook.md` ("The watch after a promotion").
"""

from __future__ import annotations

from kb_reindex.airflow.factory import for_each_knowledge_base, watch_dag

globals().update(for_each_knowledge_base(lambda kb: watch_dag(kb, doc_md=__doc__)))
