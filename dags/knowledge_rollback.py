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

from datetime import datetime

from airflow.sdk import Param, dag, task
from kb_reindex.airflow.constants import KNOWLEDGE_ALIAS, current_run_id


@dag(
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    # on-call's way back must work from the first minute of a fresh install
    is_paused_upon_creation=False,
    doc_md=__doc__,
    tags=["knowledge", "qdrant", "on-call"],
    params={
        "live_version": Param(None, type=["null", "integer"], minimum=1, title="Live version you saw",
                              description="The version you saw serving; refused if another serves now.",
                              section="Rollback"),
        "reason": Param("", type="string", minLength=1, title="Reason",
                        description="Why the rollback is needed; recorded in the alias history.", section="Rollback"),
        "to_version": Param(None, type=["null", "integer"], minimum=1, title="Target version",
                            description="Empty: the version before the current one.", section="Rollback"),
        "confirm": Param(False, type="boolean", title="Confirm",
                         description="Tick to really move the alias.", section="Rollback"),
        "freeze": Param(True, type="boolean", title="Freeze the alias",
                        description="Hold every later promotion (runs, migrations, shadows) until `kb-reindex "
                                    "unfreeze`: the rolled-back change is usually still in the knowledge folder.",
                        section="Rollback"),
        "revalidate": Param(True, type="boolean", title="Score the target on the golden set",
                            description="Reported only; does not block a confirmed rollback.", section="Checks"),
    },
)
def knowledge_rollback():
    # default_pool, not kb_qdrant_writes: the build slices of a long reindex fill that one
    @task(retries=0, outlets=[KNOWLEDGE_ALIAS])
    def rollback(params: dict | None = None) -> dict:
        from kb_reindex.airflow.tasks import rollback_task

        return rollback_task(
            run_id=current_run_id(),
            live_version=params["live_version"],
            to_version=params["to_version"],
            reason=params["reason"],
            confirm=params["confirm"],
            revalidate=params["revalidate"],
            freeze=params["freeze"],
        )

    rollback()


knowledge_rollback()
