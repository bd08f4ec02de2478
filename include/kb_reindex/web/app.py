"""The app factory: the page's FastAPI app, which the Airflow plugin mounts on the API server.

Without KB_REGISTRY: one knowledge base, its page at `ui` and its routes beside it, as always. With a registry:
`ui` lists every knowledge base (what serves, frozen, the last run, a problem marker), and each one's own page,
routes and buttons live under `kb/<alias>/`, acting on that alias and its DAGs only. The registry is read again
on every request, so an entry added shows up without restarting the API server.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kb_reindex.domain.errors import ConfigError
from kb_reindex.domain.names import escaped
from kb_reindex.run.bases import bases_view, on_call_base
from kb_reindex.services.config import Settings, project_root, state_url_from_env
from kb_reindex.services.registry import KnowledgeBase, environment_base, load_registry, registry_path
from kb_reindex.steps.templating import templates
from kb_reindex.web.actions import add_actions
from kb_reindex.web.airflow_api import AirflowApi, DagIds
from kb_reindex.web.auth import AirflowAuth
from kb_reindex.web.context import PageContext
from kb_reindex.web.views import add_views

#: where a knowledge base's own page and routes live in the registry form
KB_PREFIX = "/kb/"


def create_app(
    *,
    settings_factory: Callable[[], Settings] | None = None,
    airflow_api_url: str | None = None,
    kb: KnowledgeBase | None = None,
) -> FastAPI:
    """The page's routes (web.views: what it reads; web.actions: what it does), every one behind Airflow's
    login; Airflow's REST API at `airflow_api_url` (default KB_AIRFLOW_API_URL) is called as the caller.
    `kb`: the knowledge base whose page it is (its settings and DAGs); none: the environment's one."""
    api_url = _api_url(airflow_api_url)
    kb = kb or environment_base()
    app = FastAPI(title=f"Knowledge index: {kb.alias}", docs_url=None, redoc_url=None)
    dags = DagIds.of(kb)
    # on-call's page: a mistake in a setting it does not read is a problem it shows, never a page that fails
    ctx = PageContext(settings_factory=settings_factory or functools.partial(kb.settings, on_call=True),
                      airflow=AirflowApi(api_url),
                      auth=AirflowAuth(dags), dags=dags, registry_error=kb.problem)
    add_views(app, ctx)
    add_actions(app, ctx)
    return app


class PerKnowledgeBase:
    """ASGI: `kb/<alias>/...` to that knowledge base's own app (made once per registry entry as it stands),
    anything else to the list's app."""

    def __init__(self, app: ASGIApp, make: Callable[[KnowledgeBase], FastAPI]) -> None:
        self.app, self.make = app, make
        self.apps: dict[str, tuple[KnowledgeBase, FastAPI]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        from starlette._utils import get_route_path

        route = get_route_path(scope) if scope["type"] in ("http", "websocket") else ""
        if not route.startswith(KB_PREFIX):
            await self.app(scope, receive, send)
            return
        alias = route[len(KB_PREFIX):].split("/", 1)[0]
        try:
            # an entry that no longer loads keeps its page: made from its last entry that loaded, or its alias alone
            kb = on_call_base(load_registry(), alias, state_url_from_env())
        except ConfigError:
            # said to anyone, signed in or not: neither the registry's path nor the other knowledge bases'
            # names (the list, behind the login, has them and why an entry is refused)
            await refused_page(scope, unknown_base(alias), route)(scope, receive, send)
            return
        made = self.apps.get(alias)
        if made is None or made[0] != kb:  # the entry changed: its page follows
            made = self.apps[alias] = (kb, self.make(kb))
        child = dict(scope, root_path=scope.get("root_path", "") + KB_PREFIX + alias)
        await made[1](child, receive, send)


def unknown_base(alias: str) -> str:
    """What a request for a knowledge base no page can open is told."""
    return (f"no knowledge base {escaped(alias[:100])!r} can be opened here: the list of knowledge bases, signed in, "
            "names those that are registered and why one is refused")


def shown(message: str) -> str:
    """A refusal as the page shows it: paths under the project named from there, not from the server's root."""
    return message.replace(str(project_root()) + os.sep, "")


def refused_page(scope: Scope, message: str, route: str) -> Response:
    """A knowledge base the page cannot open: a page saying why for a browser (an API call gets JSON), with the
    registry named by its place under the project, never the server's absolute path."""
    message = shown(message)
    headers = dict(scope.get("headers") or [])
    wants_json = route.split("/", 3)[-1].startswith("api/") or b"text/html" not in headers.get(b"accept", b"")
    if wants_json:
        return JSONResponse({"detail": message}, status_code=404)
    return HTMLResponse(templates().get_template("refused.html.j2").render(message=message), status_code=404)


def _api_url(airflow_api_url: str | None) -> str:
    return (airflow_api_url or os.environ.get("KB_AIRFLOW_API_URL", "http://localhost:8080")).rstrip("/")


def deployment_app(*, airflow_api_url: str | None = None) -> ASGIApp:
    """What the plugin mounts: the one knowledge base's page (no KB_REGISTRY), or the registry's list at `ui`
    (and `api/bases`), each knowledge base's page under `kb/<alias>/`."""
    api_url = _api_url(airflow_api_url)
    if registry_path() is None:
        return create_app(airflow_api_url=api_url)
    app = FastAPI(title="Knowledge index", docs_url=None, redoc_url=None)
    auth = AirflowAuth()

    def view() -> dict[str, Any]:
        registry = load_registry()
        return bases_view(registry, state_url_from_env()).to_dict()

    @app.get("/api/bases", dependencies=auth.signed_in())
    async def bases() -> JSONResponse:
        try:
            return JSONResponse(view())
        except ConfigError as exc:
            raise HTTPException(503, str(exc)) from None

    @app.get("/ui", response_class=HTMLResponse)
    async def page(request: Request) -> Response:
        if (login := await auth.login_redirect(request)) is not None:
            return login
        try:
            answer = view()
        except ConfigError as exc:
            answer = {"knowledge_bases": [], "refused": [shown(str(exc))]}
        from kb_reindex.run.bases import when_it_runs

        return HTMLResponse(templates().get_template("bases.html.j2").render(**answer, when_it_runs=when_it_runs))

    return PerKnowledgeBase(app, lambda kb: create_app(kb=kb, airflow_api_url=api_url))
