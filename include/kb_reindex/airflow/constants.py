"""The Airflow names every DAG and task shares: the run id a DAG run is recorded under, the pool of Qdrant
writes and the alias Asset. Imports only the Airflow SDK, so DAG parsing stays light."""

from __future__ import annotations

import os

from airflow.sdk import Asset, get_current_context

from kb_reindex.services.state.dag_runs import kb_run_id

#: the pool every task that writes to Qdrant takes a slot of (docker/airflow/init.sh creates it)
POOL = "kb_qdrant_writes"

ALIAS = os.environ.get("KB_ALIAS", "mall_knowledge")
#: updated whenever the alias moves (promotion, migration, rollback); consumers can schedule on it
KNOWLEDGE_ALIAS = Asset(name=f"kb_alias_{ALIAS}", uri=f"qdrant://{ALIAS}")


def current_run_id() -> str:
    """`kb_run_id` of the DAG run the calling task belongs to."""
    context = get_current_context()
    return kb_run_id(context["dag"].dag_id, context["run_id"])


#: points per mapped build task: the reindex's `build_slice_size` Param default, and the migration's size
BUILD_SLICE_SIZE = 2000
