"""The Airflow names every DAG and task shares: the alias Asset and the pool of Qdrant writes. Imports only
the Airflow SDK, so DAG parsing stays light."""

from __future__ import annotations

import os

from airflow.sdk import Asset

ALIAS = os.environ.get("KB_ALIAS", "mall_knowledge")
#: updated whenever the alias moves (promotion, migration, rollback); consumers can schedule on it
KNOWLEDGE_ALIAS = Asset(name=f"kb_alias_{ALIAS}", uri=f"qdrant://{ALIAS}")
POOL = "kb_qdrant_writes"
