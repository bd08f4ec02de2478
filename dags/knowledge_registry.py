"""
### The registry of knowledge bases (KB_REGISTRY): no DAG here, only its check

With `KB_REGISTRY` set, every other DAG file makes its DAG for each knowledge base the registry lists
(`knowledge_reindex__<alias>`, ...). An entry the registry refuses (an unknown key, a missing `source`, an
alias Qdrant would refuse, a golden set that does not exist) keeps only on-call's `knowledge_rollback__<alias>`
(an alias Airflow takes) while the good entries keep theirs; this file then fails to import, so Airflow's import
errors name the file, the knowledge base and the key.
Without a registry it checks nothing.
"""

from __future__ import annotations

from kb_reindex.airflow.factory import check_registry

check_registry()
