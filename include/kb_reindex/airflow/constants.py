"""The Airflow names every DAG and task shares: the run id a DAG run is recorded under and the Asset of an
alias. Imports only the Airflow SDK, so DAG parsing stays light."""

from __future__ import annotations

from airflow.sdk import Asset, get_current_context

from kb_reindex.services.state.dag_runs import kb_run_id


def alias_asset(alias: str) -> Asset:
    """The Asset of an alias, `qdrant://<alias>`: updated whenever the alias moves (promotion, migration,
    rollback), so consumers can schedule on it. Each knowledge base has its own."""
    return Asset(name=f"kb_alias_{alias}", uri=f"qdrant://{alias}")


def current_run_id() -> str:
    """`kb_run_id` of the DAG run the calling task belongs to."""
    context = get_current_context()
    return kb_run_id(context["dag"].dag_id, context["run_id"])


def triggering_user() -> str | None:
    """Who triggered the calling task's DAG run, as Airflow recorded it from the trigger's login (the page
    triggers as the signed-in user, with their token); None for a scheduled run."""
    dag_run = get_current_context().get("dag_run")
    return getattr(dag_run, "triggering_user_name", None) or None


#: points per mapped build task: the reindex's `build_slice_size` Param default, and the migration's size
BUILD_SLICE_SIZE = 2000
