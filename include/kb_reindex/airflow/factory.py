"""The one definition of a knowledge run as a DAG: `knowledge_reindex` and `knowledge_model_migration` are
both built here and differ only in their kind, Params and schedule.

plan -> has_changes -> create_version -> build_slices -> build (mapped) -> validate -> promote -> watch,
and cleanup after promote (beside the watch). Each task is a thin call of kb_reindex.airflow.tasks, imported
inside the task: parsing a DAG file imports the Airflow SDK and this module only, never Qdrant or pandas.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import DAG, Param, TriggerRule, dag, task

from kb_reindex.airflow.constants import BUILD_SLICE_SIZE, KNOWLEDGE_ALIAS, POOL, current_run_id
from kb_reindex.domain.model import RunKind


def release_run_lock(context: Any) -> None:
    """The failure callback (kb_reindex.airflow.callbacks), imported when it fires: it opens the state DB."""
    from kb_reindex.airflow.callbacks import release_run_lock as release

    release(context)


def knowledge_dag(dag_id: str, *, kind: RunKind, doc_md: str | None, params: dict[str, Param],
                  schedule: str | None, tags: list[str]) -> DAG:
    """The run of `kind` as a DAG: the same tasks for a reindex and a migration; what a Param a DAG lacks
    would say takes its default (no dry run, no forced rebuild, the golden set's thresholds, promotion on)."""

    @dag(
        dag_id=dag_id,
        schedule=schedule,
        start_date=datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,
        # a run that fails as a whole (marked failed in the UI, timed out) lets its lock go too; the lock's
        # liveness check asks Airflow about the run as well, so nothing depends on this callback firing
        on_failure_callback=release_run_lock,
        doc_md=doc_md,
        tags=tags,
        # the run holds the alias's reindex lock from plan to cleanup; a task that fails for good releases it.
        # KB_RETRY_DELAY_S: seconds before a failed task's first retry (a test stack shortens it)
        default_args={"retries": 2, "retry_delay": timedelta(seconds=int(os.environ.get("KB_RETRY_DELAY_S", "60"))),
                      "retry_exponential_backoff": True, "on_failure_callback": release_run_lock},
        params=params,
    )
    def knowledge_run() -> None:
        # a task's arguments are XCom references while the DAG is defined, their dicts when it runs: typed Any
        @task
        def plan(params: dict | None = None) -> dict:
            from kb_reindex.airflow import tasks

            p = params or {}
            return tasks.plan_task(run_id=current_run_id(), kind=kind, force_full=p.get("force_full_rebuild", False),
                                   dry_run=p.get("dry_run", False), embedder=p.get("embedder"), model=p.get("model"),
                                   dim=p.get("dimension"), layout=p.get("payload_layout"))

        # skips only the build path; cleanup follows its own trigger rule
        @task.short_circuit(ignore_downstream_trigger_rules=False)
        def has_changes(plan: Any, params: dict | None = None) -> bool:
            from kb_reindex.airflow import tasks

            return tasks.should_build_task(plan=plan, dry_run=(params or {}).get("dry_run", False),
                                           run_id=current_run_id())

        @task(pool=POOL)
        def create_version(plan: Any) -> dict:
            from kb_reindex.airflow import tasks

            return tasks.create_version_task(plan=plan, run_id=current_run_id())

        @task
        def build_slices(version: Any, params: dict | None = None) -> list[dict]:
            from kb_reindex.airflow import tasks

            size = (params or {}).get("build_slice_size", BUILD_SLICE_SIZE)
            return tasks.build_slices_task(version=version, slice_size=size, run_id=current_run_id())

        @task(pool=POOL, retries=3)
        def build(work: dict) -> dict:
            from kb_reindex.airflow import tasks

            return tasks.build_task(version=work, run_id=current_run_id(), window=(work["offset"], work["limit"]))

        @task
        def validate(version: Any, params: dict | None = None) -> dict:
            from kb_reindex.airflow import tasks

            p = params or {}
            return tasks.validate_task(version=version, run_id=current_run_id(), min_hit_rate=p.get("min_hit_rate"),
                                       min_mrr=p.get("min_mrr"))

        @task(pool=POOL, outlets=[KNOWLEDGE_ALIAS])
        def promote(plan: Any, version: Any, params: dict | None = None) -> dict:
            from kb_reindex.airflow import tasks

            return tasks.promote_task(plan=plan, version=version, run_id=current_run_id(),
                                      promote=(params or {}).get("promote", True))

        @task
        def watch(promoted: Any) -> dict:
            from kb_reindex.airflow import tasks

            return tasks.watch_task(promoted=promoted, run_id=current_run_id())

        # after a promotion, a kept version or nothing to build; never after a failure
        @task(pool=POOL, trigger_rule=TriggerRule.NONE_FAILED)
        def cleanup(params: dict | None = None) -> dict:
            from kb_reindex.airflow import tasks

            return tasks.cleanup_task(dry_run=(params or {}).get("dry_run", False), run_id=current_run_id())

        planned = plan()
        version = create_version(planned)
        has_changes(planned) >> version
        built = build.expand(work=build_slices(version))
        checked = validate(version)
        built >> checked
        promoted = promote(planned, version)
        checked >> promoted >> cleanup()
        watch(promoted)  # beside cleanup, which never drops live or the rollback target

    return knowledge_run()
