"""The Airflow names every DAG and task shares: the run id a DAG run is recorded under, the pool of Qdrant
writes and the alias Asset. Imports only the Airflow SDK, so DAG parsing stays light."""

from __future__ import annotations

import os

from airflow.sdk import Asset, get_current_context

#: the pool every task that writes to Qdrant takes a slot of (docker/airflow/init.sh creates it)
POOL = "kb_qdrant_writes"
#: what the state DB's run ids of DAG runs start with (kb_reindex.services.state.dag_runs reads them back)
RUN_ID_PREFIX = "airflow"

ALIAS = os.environ.get("KB_ALIAS", "mall_knowledge")
#: updated whenever the alias moves (promotion, migration, rollback); consumers can schedule on it
KNOWLEDGE_ALIAS = Asset(name=f"kb_alias_{ALIAS}", uri=f"qdrant://{ALIAS}")


def kb_run_id(dag_id: str, dag_run_id: str) -> str:
    """The id a DAG run is recorded under in the state DB: unique across DAGs and runs."""
    return f"{RUN_ID_PREFIX}__{dag_id}__{dag_run_id}"


def current_run_id() -> str:
    """`kb_run_id` of the DAG run the calling task belongs to."""
    context = get_current_context()
    return kb_run_id(context["dag"].dag_id, context["run_id"])


#: points per mapped build task: the reindex's `build_slice_size` Param default, and the migration's size
BUILD_SLICE_SIZE = 2000
