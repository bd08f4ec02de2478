"""The "Knowledge index" page: a FastAPI app the Airflow plugin mounts on the API server.

It shows what the alias serves, every version with its scores (table and chart), build progress, held
locks and notes, the alias history, the metrics and the reports; and, from Airflow, whether
`knowledge_reindex` is paused and the recent runs of our DAGs. It offers a rollback button (versions that
served), a separate shadow promotion (versions never served), and a pause toggle.

Every route is behind Airflow's login, checked by Airflow's own API dependency (`get_user`: the auth manager
validates the JWT of the `Authorization: Bearer` header or the `_token` cookie): anonymous JSON and report
requests get 401, the page redirects to the auth manager's login, as Airflow's UI does. The buttons move
nothing themselves: the caller must be allowed to act on the DAG (Airflow's `requires_access_dag`), and the
action goes through Airflow's REST API *with the caller's own token*, so Airflow's authorization decides
twice. Runs and the paused flag are read the same way, as the caller.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response

from kb_reindex.config import Settings

REINDEX_DAG = "knowledge_reindex"
ROLLBACK_DAG = "knowledge_rollback"
MIGRATION_DAG = "knowledge_model_migration"
PROMOTE_SHADOW_DAG = "knowledge_promote_shadow"
#: the DAGs whose runs the page lists and follows (no other DAG is proxied)
OUR_DAGS = (REINDEX_DAG, ROLLBACK_DAG, MIGRATION_DAG, PROMOTE_SHADOW_DAG)
RECENT_RUNS_PER_DAG = 5


def _snapshot(settings: Settings) -> dict[str, Any]:
    from kb_reindex import engine
    from kb_reindex.runtime import open_deps

    with open_deps(settings) as deps:
        status = engine.status(deps)
        status["history"] = engine.history(deps)
    return status


def _caller_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip() or None
    return request.cookies.get("_token")


def run_ui_path(dag_id: str, run_id: str) -> str:
    """Where Airflow's UI shows a run (the page is served by the same api-server)."""
    return f"/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"


def run_summary(dag_id: str, run: dict[str, Any]) -> dict[str, Any]:
    """The fields of an Airflow dag run the page shows, with the link to it."""
    run_id = run.get("dag_run_id") or ""
    return {"dag_id": dag_id, "dag_run_id": run_id, "state": run.get("state"), "run_type": run.get("run_type"),
            "run_after": run.get("run_after"), "start_date": run.get("start_date"), "end_date": run.get("end_date"),
            "url": run_ui_path(dag_id, run_id)}


class AirflowApi:
    """Airflow's REST API called *as the signed-in user* (their token), with answers on-call can act on."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    async def call(self, request: Request, method: str, path: str, *, body: dict[str, Any] | None = None,
                   params: dict[str, Any] | None = None, action: str | None = None) -> dict[str, Any]:
        """`action` names what a write would have done, for the message when its fate is unknown."""
        token = _caller_token(request)
        if not token:
            raise HTTPException(401, "sign in to Airflow first: the page acts as you, through the Airflow API")
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                answer = await client.request(method, f"{self.base_url}/api/v2/{path}", params=params, json=body,
                                              headers={"Authorization": f"Bearer {token}"})
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.InvalidURL) as exc:
            raise HTTPException(502, f"Airflow API at {self.base_url} (KB_AIRFLOW_API_URL) could not be reached: "
                                     f"{type(exc).__name__}: {exc}"
                                     + (f"; nothing was triggered, the alias is unchanged. {action['fallback']}"
                                        if action else "")) from None
        except httpx.HTTPError as exc:  # the request may have arrived: a second click must not follow blindly
            raise HTTPException(502, f"Airflow API at {self.base_url} (KB_AIRFLOW_API_URL) gave no answer: "
                                     f"{type(exc).__name__}: {exc}"
                                     + (f"; {action['unknown']}" if action else "")) from None
        if answer.status_code in (401, 403):
            raise HTTPException(answer.status_code, f"Airflow refused: you may not {method} {path}")
        if answer.status_code == 404:
            raise HTTPException(404, f"Airflow has no {path}")
        if answer.status_code >= 400:
            raise HTTPException(502, f"Airflow API answered {answer.status_code}: {answer.text[:300]}")
        return answer.json()

    async def trigger(self, request: Request, dag_id: str, conf: dict[str, Any], *, fallback: str) -> dict[str, Any]:
        run = await self.call(request, "POST", f"dags/{dag_id}/dagRuns", body={"logical_date": None, "conf": conf},
                              action={"fallback": fallback,
                                      "unknown": f"a {dag_id} run may have been created. Check its runs (or "
                                                 "`kb-reindex status`) before trying again"})
        return run_summary(dag_id, run)


def confirmed_live_version(body: dict[str, Any], *, required: bool) -> int | None:
    """The version on-call saw serving when they pressed the button: the DAG moves the alias only from it."""
    live_version = body.get("live_version")
    if live_version is None and not required:
        return None
    if not isinstance(live_version, int) or isinstance(live_version, bool) or live_version < 1:
        raise HTTPException(422, "live_version (the version you saw serving) must be a positive integer; reload "
                                 "the page and try again")
    return live_version


def create_app(
    *,
    settings_factory: Callable[[], Settings] = Settings.from_env,
    airflow_api_url: str | None = None,
) -> FastAPI:
    # Airflow's own checks, imported here (not at module import) because only the API server needs them
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import bearer_scheme, get_user, requires_access_dag

    app = FastAPI(title="Knowledge index", docs_url=None, redoc_url=None)
    api_url = (airflow_api_url or os.environ.get("KB_AIRFLOW_API_URL", "http://localhost:8080")).rstrip("/")
    airflow = AirflowApi(api_url)
    signed_in = [Depends(get_user)]

    def may_trigger(dag_id: str) -> list[Any]:
        return [Depends(requires_access_dag("POST", DagAccessEntity.RUN, param_dag_id=dag_id))]

    async def version_row(number: int) -> dict[str, Any]:
        status = await asyncio.to_thread(_snapshot, settings_factory())
        row = next((v for v in status["versions"] if v["version"] == number), None)
        if row is None:
            raise HTTPException(404, f"no version {number}")
        return row

    def reason_of(body: dict[str, Any]) -> str:
        reason = str(body.get("reason") or "").strip()
        if not reason:
            raise HTTPException(422, "a reason is required")
        return reason

    @app.get("/api/status", dependencies=signed_in)
    async def status() -> JSONResponse:
        data = await asyncio.to_thread(_snapshot, settings_factory())
        return JSONResponse(json.loads(json.dumps(data, default=str)))

    @app.get("/reports/v{version}/{name}", dependencies=signed_in)
    async def report(version: int, name: str) -> FileResponse:
        from kb_reindex.reports import REPORT_FILES, report_dir

        if name not in REPORT_FILES:
            raise HTTPException(404, "unknown report")
        settings = settings_factory()
        path = report_dir(settings.reports_dir, settings.alias, version) / name
        if not path.is_file():
            raise HTTPException(404, f"no {name} for v{version}")
        return FileResponse(path)

    @app.post("/api/rollback", dependencies=may_trigger(ROLLBACK_DAG))
    async def rollback(request: Request) -> JSONResponse:
        body = await request.json()
        reason = reason_of(body)
        to_version = body.get("to_version")
        if to_version is not None and (not isinstance(to_version, int) or to_version < 1):
            raise HTTPException(422, "to_version must be a positive integer")
        live_version = confirmed_live_version(body, required=True)
        if to_version is not None and not (await version_row(to_version))["rollback_allowed"]:
            raise HTTPException(409, f"v{to_version} never served or is not kept: a rollback returns only to a "
                                     "version that served (a shadow goes live by promotion)")
        run = await airflow.trigger(request, ROLLBACK_DAG,
                                    {"to_version": to_version, "live_version": live_version, "reason": reason,
                                     "confirm": True},
                                    fallback="On-call can run `kb-reindex rollback` instead")
        return JSONResponse(run)

    @app.post("/api/promote-shadow", dependencies=may_trigger(PROMOTE_SHADOW_DAG))
    async def promote_shadow(request: Request) -> JSONResponse:
        body = await request.json()
        reason = reason_of(body)
        version = body.get("version")
        if not isinstance(version, int) or version < 1:
            raise HTTPException(422, "version must be a positive integer")
        if not (await version_row(version))["shadow"]:
            raise HTTPException(409, f"v{version} is not a shadow (ready, never served); a version that served "
                                     "goes back through a rollback")
        live_version = confirmed_live_version(body, required=False)
        run = await airflow.trigger(request, PROMOTE_SHADOW_DAG, {"version": version, "live_version": live_version,
                                                                  "reason": reason, "confirm": True},
                                    fallback=f"On-call can run `kb-reindex promote --version {version}` instead")
        return JSONResponse(run)

    @app.get("/api/runs/{dag_id}/{run_id}", dependencies=signed_in)
    async def dag_run(dag_id: str, run_id: str, request: Request) -> JSONResponse:
        """One run of our DAGs, read as the caller: the page follows a run it triggered to its end."""
        if dag_id not in OUR_DAGS:
            raise HTTPException(404, "not a knowledge DAG")
        run = await airflow.call(request, "GET", f"dags/{dag_id}/dagRuns/{quote(run_id, safe='')}")
        return JSONResponse(run_summary(dag_id, run))

    @app.get("/api/airflow", dependencies=signed_in)
    async def airflow_view(request: Request) -> JSONResponse:
        """Whether the reindex is paused and the recent runs of our DAGs, from Airflow's own records (runs
        that failed before reaching our code included), as the caller may see them."""
        async def runs_of(dag_id: str) -> list[dict[str, Any]] | str:
            try:
                page = await airflow.call(request, "GET", f"dags/{dag_id}/dagRuns",
                                          params={"order_by": "-run_after", "limit": RECENT_RUNS_PER_DAG})
            except HTTPException as refused:
                return f"{dag_id}: {refused.detail}"
            return [run_summary(dag_id, run) for run in page.get("dag_runs", [])]

        try:
            reindex = await airflow.call(request, "GET", f"dags/{REINDEX_DAG}")
        except HTTPException as refused:
            return JSONResponse({"reindex_paused": None, "runs": [], "errors": [str(refused.detail)]})
        found = await asyncio.gather(*(runs_of(dag_id) for dag_id in OUR_DAGS))
        runs = sorted((run for result in found if isinstance(result, list) for run in result),
                      key=lambda run: run["run_after"] or "", reverse=True)
        return JSONResponse({"reindex_paused": reindex.get("is_paused"), "runs": runs,
                             "errors": [result for result in found if isinstance(result, str)]})

    @app.post("/api/reindex-paused", dependencies=[Depends(requires_access_dag("PUT", param_dag_id=REINDEX_DAG))])
    async def pause_reindex(request: Request) -> JSONResponse:
        """Runbook step 3 after a rollback: pause the reindex so it does not rebuild the bad change."""
        paused = (await request.json()).get("paused")
        if not isinstance(paused, bool):
            raise HTTPException(422, "paused must be true or false")
        dag = await airflow.call(request, "PATCH", f"dags/{REINDEX_DAG}", body={"is_paused": paused})
        return JSONResponse({"dag_id": REINDEX_DAG, "reindex_paused": dag.get("is_paused")})

    @app.get("/ui", response_class=HTMLResponse)
    async def page(request: Request) -> Response:
        """A browser without a valid login is sent to the auth manager's login page and back, as Airflow's
        UI does (its API answers 401 and the UI redirects): a bare 401 would strand on-call on a blank page."""
        try:
            await get_user(request, None, await bearer_scheme(request))
        except HTTPException as refused:
            if refused.status_code not in (401, 403):
                raise
            return RedirectResponse(get_auth_manager().get_url_login(next_url=str(request.url)))
        return HTMLResponse(render_page(settings_factory()))

    return app


def render_page(settings: Settings) -> str:
    """The page (templates/page.html.j2, autoescaped); its script fills everything else in from /api/status."""
    from kb_reindex.templating import templates

    return templates().get_template("page.html.j2").render(alias=settings.alias)
