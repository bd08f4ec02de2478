"""
### knowledge_reindex: rebuild the help-centre index without ever serving a half-built one

Runbook (also in the README):

1. **plan**: hash every Markdown file in `knowledge/docs` and every chunk; diff against the live
   version's manifest. Nothing changed (docs, model, chunking) → the run stops here as `no_change`.
   Otherwise it snapshots the plan in the state DB (version N, manifest, texts to embed): the only task
   that reads the knowledge folder; a file edited after it waits for the next run.
2. **create_version**: allocate version N and create `<alias>__<model>__v<N>`; an unfinished build of the
   same plan is resumed instead. (Only this build path is skipped on no change: cleanup still runs.)
3. **build** (mapped over slices of point IDs): copy vectors of unchanged chunks from live, embed the
   rest in batches. A retry skips points already written.
4. **validate**: exact point count and IDs, dimension, payload sample, golden set (hit@k, MRR, no
   regression against live). Failure fails the run; the alias stays where it was.
5. **promote**: compare-and-swap of the alias in one request; the previous version is kept for rollback.
   It updates the alias Asset with `extra` {alias, action, version, collection, model, dimension,
   previous_version}; a version already live moves nothing and the task is skipped (no Asset event).
6. **watch** (beside cleanup; skipped when `KB_WATCH_MINUTES` is 0): for that window, every
   `KB_WATCH_INTERVAL_S`, the golden probes through the alias and the query log's empty-result rate; a
   regression rolls back automatically (alias event `auto-rollback`, only while the alias still points at
   this run's version) and fails the task.
7. **cleanup**: retention (`KB_KEEP_VERSIONS`); never the live version or the rollback target. Runs after
   a promotion *and* after a no-change plan (abandoned builds are reclaimed on a quiet knowledge base),
   never after a failure, never on a dry run.

Params: `force_full_rebuild` (embed everything, reuse nothing), `dry_run` (plan only), `payload_layout`
(empty: keep live's layout; set it to change the layout on purpose).
A frozen alias (`kb-reindex freeze`, a rollback's freeze) holds the promotion: the run builds and validates,
then ends `frozen` with the version kept unpromoted; `promote` is skipped and says why.
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
