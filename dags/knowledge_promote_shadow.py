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

from datetime import datetime

from airflow.sdk import Param, dag, task
from kb_reindex.airflow.constants import KNOWLEDGE_ALIAS, POOL, current_run_id


@dag(
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    is_paused_upon_creation=False,  # on-call's DAG: runs from the first minute of a fresh install
    doc_md=__doc__,
    tags=["knowledge", "qdrant", "on-call"],
    params={
        "version": Param(None, type=["null", "integer"], minimum=1, title="Shadow version",
                         description="Number of the shadow version to serve (status `ready`, never served).",
                         section="Promotion"),
        "live_version": Param(None, type=["null", "integer"], minimum=1, title="Live version you saw",
                              description="The version you saw serving (empty only when nothing serves); "
                                          "refused if another serves now.", section="Promotion"),
        "reason": Param("", type="string", minLength=1, title="Reason",
                        description="Why this shadow goes live now; recorded in the alias history.",
                        section="Promotion"),
        "confirm": Param(False, type="boolean", title="Confirm",
                         description="Tick to really move the alias to the shadow version.", section="Promotion"),
    },
)
def knowledge_promote_shadow():
    @task(pool=POOL, retries=0, outlets=[KNOWLEDGE_ALIAS])
    def promote_shadow(params: dict | None = None) -> dict:
        from kb_reindex.airflow.tasks import promote_shadow_task

        return promote_shadow_task(run_id=current_run_id(), version=params["version"], reason=params["reason"],
                                   confirm=params["confirm"], live_version=params["live_version"])

    promote_shadow()


knowledge_promote_shadow()
