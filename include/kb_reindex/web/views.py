"""What the page reads: its HTML, the status JSON, the reports, and Airflow's runs of our DAGs as the caller."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response

from kb_reindex.config import Settings
from kb_reindex.templating import templates
from kb_reindex.web.airflow_api import OUR_DAGS, REINDEX_DAG, AirflowApi
from kb_reindex.web.context import PageContext


def render_page(settings: Settings) -> str:
    """The page (templates/page.html.j2, autoescaped); its script fills everything else in from /api/status."""
    return templates().get_template("page.html.j2").render(alias=settings.alias, timezone=airflow_timezone())


def airflow_timezone() -> str:
    """Airflow's [core] default_timezone as an IANA name (`system` resolved): the page shows times in UTC and,
    when this differs, in this zone too."""
    from airflow.settings import TIMEZONE

    return str(getattr(TIMEZONE, "name", None) or "UTC")


async def status_json(ctx: PageContext, user: Any) -> dict[str, Any]:
    """/api/status: the typed status at the JSON edge, with the buttons this caller may use."""
    data = json.loads(json.dumps((await ctx.status_now()).to_json(), default=str))
    return {**data, "may": ctx.auth.may(user)}


async def run_json(airflow: AirflowApi, request: Request, dag_id: str, run_id: str) -> dict[str, Any]:
    """One run of our DAGs, read as the caller: the page follows a run it triggered to its end; a failed
    one comes with its failing task's last error line."""
    if dag_id not in OUR_DAGS:
        raise HTTPException(404, "not a knowledge DAG")
    run = await airflow.run(request, dag_id, run_id)
    answer = run.to_dict()
    if run.state == "failed":
        try:
            answer["error"] = await airflow.failure(request, dag_id, run_id)
        except HTTPException as refused:
            answer["error"] = f"its task log could not be read: {refused.detail}"
    return answer


async def airflow_json(airflow: AirflowApi, request: Request) -> dict[str, Any]:
    """Whether our DAGs are paused and their recent runs, from Airflow's own records (runs that failed
    before reaching our code included), as the caller may see them; what could not be read is said."""
    async def paused(dag_id: str) -> bool | str:
        try:
            return await airflow.is_paused(request, dag_id)
        except HTTPException as refused:
            return f"{dag_id}: {refused.detail}"

    async def runs_of(dag_id: str) -> list[dict[str, Any]] | str:
        try:
            return [run.to_dict() for run in await airflow.recent_runs(request, dag_id)]
        except HTTPException as refused:
            return f"{dag_id}: {refused.detail}"

    flags = dict(zip(OUR_DAGS, await asyncio.gather(*(paused(dag_id) for dag_id in OUR_DAGS)), strict=True))
    if isinstance(flags[REINDEX_DAG], str):
        return {"reindex_paused": None, "paused": {}, "runs": [], "errors": [flags[REINDEX_DAG]]}
    found = await asyncio.gather(*(runs_of(dag_id) for dag_id in OUR_DAGS))
    runs = sorted((run for result in found if isinstance(result, list) for run in result),
                  key=lambda run: run["run_after"] or "", reverse=True)
    errors = [f for f in flags.values() if isinstance(f, str)] + [r for r in found if isinstance(r, str)]
    return {"reindex_paused": flags[REINDEX_DAG], "runs": runs, "errors": errors,
            "paused": {d: f for d, f in flags.items() if isinstance(f, bool)}}


def add_views(app: FastAPI, ctx: PageContext) -> None:
    """The routes that read: the page, its status, the reports, and Airflow's runs of our DAGs."""
    auth = ctx.auth

    @app.get("/api/status")
    async def status(user: Any = Depends(auth.get_user)) -> JSONResponse:  # noqa: B008 - FastAPI's form
        return JSONResponse(await status_json(ctx, user))

    @app.get("/reports/v{version}/{name}")
    async def report(version: int, name: str, request: Request) -> Response:
        from kb_reindex.reports import REPORT_FILES, report_dir  # imports pandas: only when a report is asked for

        if (login := await auth.login_redirect(request)) is not None:
            return login
        if name not in REPORT_FILES:
            raise HTTPException(404, "unknown report")
        settings = ctx.settings_factory()
        path = report_dir(settings.reports_dir, settings.alias, version) / name
        if not path.is_file():
            raise HTTPException(404, f"no {name} for v{version}")
        return FileResponse(path)

    @app.get("/api/runs/{dag_id}/{run_id}", dependencies=auth.signed_in())
    async def dag_run(dag_id: str, run_id: str, request: Request) -> JSONResponse:
        return JSONResponse(await run_json(ctx.airflow, request, dag_id, run_id))

    @app.get("/api/airflow", dependencies=auth.signed_in())
    async def airflow_view(request: Request) -> JSONResponse:
        return JSONResponse(await airflow_json(ctx.airflow, request))

    @app.get("/ui", response_class=HTMLResponse)
    async def page(request: Request) -> Response:
        if (login := await auth.login_redirect(request)) is not None:
            return login
        return HTMLResponse(render_page(ctx.settings_factory()))
