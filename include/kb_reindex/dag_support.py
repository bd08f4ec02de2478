"""What the DAG files share besides the Asset and the pool (kb_reindex.assets): the run id and the failure
callback. Imports only the Airflow SDK, so DAG parsing stays light."""

from __future__ import annotations

from typing import Any

from airflow.sdk import get_current_context


def current_run_id() -> str:
    """The id a task records its run under in the state DB: unique across DAGs and runs."""
    context = get_current_context()
    return f"airflow__{context['dag'].dag_id}__{context['run_id']}"


def release_run_lock(context: Any) -> None:
    """`on_failure_callback` of every task of a reindex or migration run: a task that failed for good ends the
    run, so its reindex lock is let go (the logic, and its heavy imports, live in kb_reindex.airflow_tasks)."""
    from kb_reindex.airflow_tasks import release_run_lock as release

    release(context)
