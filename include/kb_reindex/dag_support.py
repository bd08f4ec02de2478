"""What the DAG files share: the alias Asset, the pool, the run id. Imports only the Airflow SDK, so
DAG parsing stays light."""

from __future__ import annotations

import os
from typing import Any

from airflow.sdk import Asset, get_current_context

ALIAS = os.environ.get("KB_ALIAS", "mall_knowledge")
#: updated whenever the alias moves (promotion, migration, rollback); consumers can schedule on it
KNOWLEDGE_ALIAS = Asset(name=f"kb_alias_{ALIAS}", uri=f"qdrant://{ALIAS}")
POOL = "kb_qdrant_writes"


def current_run_id() -> str:
    """The id a task records its run under in the state DB: unique across DAGs and runs."""
    context = get_current_context()
    return f"airflow__{context['dag'].dag_id}__{context['run_id']}"


def release_run_lock(context: Any) -> None:
    """`on_failure_callback` of every task of a reindex or migration run: a task that failed for good ends the
    run, so its reindex lock is let go (the logic, and its heavy imports, live in kb_reindex.airflow_tasks)."""
    from kb_reindex.airflow_tasks import release_run_lock as release

    release(context)
