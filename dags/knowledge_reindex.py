"""
### knowledge_reindex: rebuild the help-centre index without ever serving a half-built one

1. **plan**: SHA-256 per document and chunk against live's manifest; nothing changed → `no_change`. Otherwise
   the plan is snapshotted in the state DB (the only task that reads `knowledge/`).
2. **create_version** → `<alias>__<model>__v<N>` (an unfinished or ready version of the same plan is taken over).
3. **build** (mapped over slices): copy unchanged vectors from live, embed the rest; a retry skips what is written.
4. **validate**: exact count and IDs, dimension, payload, golden set (hit@k, MRR, no regression). Fails → alias stays.
5. **promote**: compare-and-swap of the alias; the previous version is kept for rollback. A frozen alias
   (`kb-reindex freeze`, a rollback's freeze) skips it: the version is kept unpromoted, the run ends `frozen`.
6. **watch** (`KB_WATCH_MINUTES` > 0) rolls back automatically on a regression; **cleanup** applies retention,
   never touching live or the rollback target.

Params: `force_full_rebuild`, `dry_run`, `build_slice_size`, `payload_layout` (empty: keep live's layout).
What on-call sees and does at each step: `docs/runbook.md` (rollback, locks, every status message).
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import Param, TriggerRule, dag, task
from kb_reindex.assets import KNOWLEDGE_ALIAS, POOL
from kb_reindex.dag_support import current_run_id, release_run_lock


@dag(
    schedule=os.environ.get("KB_REINDEX_SCHEDULE", "@daily") or None,  # set empty: triggered runs only
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    # a run that fails as a whole (marked failed in the UI, timed out) lets its lock go too; the lock's
    # liveness check asks Airflow about the run as well, so nothing depends on this callback firing
    on_failure_callback=release_run_lock,
    doc_md=__doc__,
    tags=["knowledge", "qdrant"],
    # the run holds the alias's reindex lock from plan to cleanup; a task that fails for good releases it
    # KB_RETRY_DELAY_S: seconds before a failed task's first retry (a test stack shortens it)
    default_args={"retries": 2, "retry_delay": timedelta(seconds=int(os.environ.get("KB_RETRY_DELAY_S", "60"))),
                  "retry_exponential_backoff": True, "on_failure_callback": release_run_lock},
    params={
        "force_full_rebuild": Param(False, type="boolean", title="Force full rebuild",
                                    description="Embed every chunk again; reuse no vector from live.", section="Build"),
        "dry_run": Param(False, type="boolean", title="Dry run",
                         description="Plan only: report what would change and stop.", section="Build"),
        "payload_layout": Param(None, type=["null", "string"], title="Payload layout",
                                description="Empty: keep the layout live serves (KB_PAYLOAD_LAYOUT only shapes a "
                                            "first build). Set to change it on purpose: native, langchain4j (or "
                                            "langchain4j:<text key>), langchain, llamaindex; vectors are copied.",
                                section="Build"),
        "build_slice_size": Param(2000, type="integer", minimum=1, title="Points per build task",
                                  description="Size of each mapped build slice.", section="Build"),
    },
)
def knowledge_reindex():
    @task
    def plan(params: dict | None = None) -> dict:
        from kb_reindex.airflow_tasks import plan_task

        return plan_task(run_id=current_run_id(), force_full=params["force_full_rebuild"], dry_run=params["dry_run"],
                         layout=params.get("payload_layout"))

    # skips only the build path; cleanup follows its own trigger rule
    @task.short_circuit(ignore_downstream_trigger_rules=False)
    def has_changes(plan: dict, params: dict | None = None) -> bool:
        from kb_reindex.airflow_tasks import should_build_task

        return should_build_task(plan=plan, dry_run=params["dry_run"], run_id=current_run_id())

    @task(pool=POOL)
    def create_version(plan: dict) -> dict:
        from kb_reindex.airflow_tasks import create_version_task

        return create_version_task(plan=plan, run_id=current_run_id())

    @task
    def build_slices(version: dict, params: dict | None = None) -> list[dict]:
        from kb_reindex.airflow_tasks import build_slices_task

        return build_slices_task(version=version, slice_size=params["build_slice_size"], run_id=current_run_id())

    @task(pool=POOL, retries=3)
    def build(work: dict) -> dict:
        from kb_reindex.airflow_tasks import build_task

        return build_task(version=work, run_id=current_run_id(), window=(work["offset"], work["limit"]))

    @task
    def validate(version: dict) -> dict:
        from kb_reindex.airflow_tasks import validate_task

        return validate_task(version=version, run_id=current_run_id())

    @task(pool=POOL, outlets=[KNOWLEDGE_ALIAS])
    def promote(plan: dict, version: dict) -> dict:
        from kb_reindex.airflow_tasks import promote_task

        return promote_task(plan=plan, version=version, run_id=current_run_id())

    @task
    def watch(promoted: dict) -> dict:
        from kb_reindex.airflow_tasks import watch_task

        return watch_task(promoted=promoted, run_id=current_run_id())

    @task(pool=POOL, trigger_rule=TriggerRule.NONE_FAILED)
    def cleanup(params: dict | None = None) -> dict:
        from kb_reindex.airflow_tasks import cleanup_task

        return cleanup_task(dry_run=params["dry_run"], run_id=current_run_id())

    planned = plan()
    version = create_version(planned)
    has_changes(planned) >> version
    built = build.expand(work=build_slices(version))
    checked = validate(version)
    built >> checked
    promoted = promote(planned, version)
    checked >> promoted >> cleanup()
    watch(promoted)  # beside cleanup, which never drops live or the rollback target


knowledge_reindex()
