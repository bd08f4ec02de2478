"""Airflow plugin: the "Knowledge index" page on the API server, linked under Browse."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from kb_reindex.web.app import deployment_app


class KnowledgeIndexPlugin(AirflowPlugin):
    name = "knowledge_index"
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
