"""Airflow plugin: the "Knowledge index" page on the API server, linked under Browse; and the scheduler's
listener that creates a new knowledge base's pools before its first run needs them (kb_reindex.airflow.listeners)."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from kb_reindex.airflow import listeners as kb_listeners
from kb_reindex.web.app import deployment_app


class KnowledgeIndexPlugin(AirflowPlugin):
    name = "knowledge_index"
    listeners = [kb_listeners]
    fastapi_apps = [{"app": deployment_app(), "url_prefix": "/knowledge-index", "name": "Knowledge index"}]
    external_views = [
        {
            "name": "Knowledge index",
            "href": "knowledge-index/ui",
            "destination": "nav",
            "category": "browse",
            "url_route": "knowledge-index",
        }
    ]
