"""The app factory: the page's FastAPI app, which the Airflow plugin mounts on the API server."""

from __future__ import annotations

import os
from collections.abc import Callable

from fastapi import FastAPI

from kb_reindex.services.config import Settings
from kb_reindex.web.actions import add_actions
from kb_reindex.web.airflow_api import AirflowApi
from kb_reindex.web.auth import AirflowAuth
from kb_reindex.web.context import PageContext
from kb_reindex.web.views import add_views


def create_app(
    *,
    settings_factory: Callable[[], Settings] = Settings.from_env,
    airflow_api_url: str | None = None,
) -> FastAPI:
    """The page's routes (web.views: what it reads; web.actions: what it does), every one behind Airflow's
    login; Airflow's REST API at `airflow_api_url` (default KB_AIRFLOW_API_URL) is called as the caller."""
    app = FastAPI(title="Knowledge index", docs_url=None, redoc_url=None)
    api_url = (airflow_api_url or os.environ.get("KB_AIRFLOW_API_URL", "http://localhost:8080")).rstrip("/")
    ctx = PageContext(settings_factory=settings_factory, airflow=AirflowApi(api_url), auth=AirflowAuth())
    add_views(app, ctx)
    add_actions(app, ctx)
    return app
