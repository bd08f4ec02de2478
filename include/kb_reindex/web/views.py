"""What the page reads: its HTML, the status JSON, the reports, and Airflow's runs of our DAGs as the caller."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass, replace
from collections.abc import Mapping
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response

from kb_reindex.services.config import Settings
from kb_reindex.run.pageview import FreshInstall, PageStatus
from kb_reindex.run.status import KEPT_NOTES
from kb_reindex.steps.templating import templates
from kb_reindex.web.airflow_api import AirflowApi, DagIds, DagJson, DagRun, Schedule
from kb_reindex.web.context import PageContext
from kb_reindex.web.guard import TOKEN_HEADER, page_json, token_for


def render_page(settings: Settings, dags: DagIds, registry_error: str | None = None, *, page_token: str = "") -> str:
    """The page (templates/page.html.j2, autoescaped); its script fills everything else in from /api/status.
    `registry_error`: its registry entry does not load, said at the top. `page_token`: what its script sends
    with every request that acts (web.guard)."""
    return templates().get_template("page.html.j2").render(alias=settings.alias, timezone=airflow_timezone(), dags=dags,
                                                               registered=dags != DagIds(), kept_notes=KEPT_NOTES,
                                                               registry_error=registry_error, page_token=page_token,
                                                               token_header=TOKEN_HEADER)


def airflow_timezone() -> str:
    """Airflow's [core] default_timezone as an IANA name (`system` resolved): the page shows times in UTC and,
    when this differs, in this zone too."""
    from airflow.settings import TIMEZONE

    return str(getattr(TIMEZONE, "name", None) or "UTC")


@dataclass(frozen=True)
class StatusAnswer:
    """/api/status: the typed status (or, on a fresh install, what to do first), with the buttons this caller
    may use; `to_dict()` is its JSON."""

    status: PageStatus | FreshInstall
    may: dict[str, bool]

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(json.dumps(self.status.to_json(), default=str))
        return {**data, "may": self.may}


@dataclass(frozen=True)
class RunAnswer:
    """One run of our DAGs as the page follows it; a failed one with its failing task's last error line (None:
    no log says one), or why the log could not be read."""

    run: DagRun
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**self.run.to_dict(), **({"error": self.error} if self.run.state == "failed" else {})}


@dataclass(frozen=True)
class SourceWatchView:
    """Whether the knowledge base's source is watched (kb_reindex.airflow.triggers), how often, and when the
    watcher last saw a change (its Asset's newest event; None: none yet, or Airflow did not say)."""

    watched: bool
    poll_s: float
    quiet_s: float
    last_change: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class AirflowAnswer:
    """/api/airflow: whether our DAGs are paused (None: the reindex's flag could not be read, then nothing else
    was asked), the reindex's schedule and next run, and their recent runs, newest first (a running one with
    the task waiting for a retry); what could not be read, said."""

    reindex_paused: bool | None
    paused: dict[str, bool]
    runs: tuple[DagRun, ...]
    errors: tuple[str, ...]
    schedule: Schedule | None = None
    source: SourceWatchView | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"reindex_paused": self.reindex_paused, "paused": dict(self.paused),
                "schedule": asdict(self.schedule) if self.schedule else None,
                "source": asdict(self.source) if self.source else None,
                "runs": [r.to_dict() for r in self.runs], "errors": list(self.errors)}


async def status_json(ctx: PageContext, user: Any) -> StatusAnswer:
    """/api/status: the typed status at the JSON edge (a fresh install: what to do first, not an error), with
    the buttons this caller may use."""
    return StatusAnswer(await ctx.page_now(), ctx.auth.may(user))


async def run_json(airflow: AirflowApi, dags: DagIds, request: Request, dag_id: str, run_id: str) -> RunAnswer:
    """One run of our DAGs, read as the caller: the page follows a run it triggered to its end; a failed
    one comes with its failing task's last error line."""
    if dag_id not in dags.all:
        raise HTTPException(404, "not a knowledge DAG")
    run = await airflow.run(request, dag_id, run_id)
    if run.state != "failed":
        return RunAnswer(run)
    try:
        return RunAnswer(run, await airflow.failure(request, dag_id, run_id))
    except HTTPException as refused:
        return RunAnswer(run, f"its task log could not be read: {refused.detail}")


async def source_watch(airflow: AirflowApi, settings: Settings, request: Request) -> SourceWatchView:
    watched = settings.source_poll_s > 0
    view = SourceWatchView(watched=watched, poll_s=settings.source_poll_s, quiet_s=settings.source_quiet_s)
    if not watched:
        return view
    try:
        return replace(view, last_change=await airflow.last_asset_event(request, f"kb_source_{settings.alias}"))
    except HTTPException as refused:
        return replace(view, error=str(refused.detail))


async def airflow_json(airflow: AirflowApi, dags: DagIds, request: Request,
                       settings: Settings | None = None) -> AirflowAnswer:
    """Whether our DAGs are paused and their recent runs, from Airflow's own records (runs that failed
    before reaching our code included), as the caller may see them; what could not be read is said."""
    async def dag(dag_id: str) -> DagJson | str:
        try:
            return await airflow.dag(request, dag_id)
        except HTTPException as refused:
            return f"{dag_id}: {refused.detail}"

    async def runs_of(dag_id: str) -> list[DagRun] | str:
        try:
            return await airflow.recent_runs(request, dag_id)
        except HTTPException as refused:
            return f"{dag_id}: {refused.detail}"

    found_dags = dict(zip(dags.all, await asyncio.gather(*(dag(dag_id) for dag_id in dags.all)), strict=True))
    flags = {d: f if isinstance(f, str) else bool(f.get("is_paused")) for d, f in found_dags.items()}
    reindex, reindex_dag = flags[dags.reindex], found_dags[dags.reindex]
    if isinstance(reindex, str) or isinstance(reindex_dag, str):
        return AirflowAnswer(reindex_paused=None, paused={}, runs=(), errors=(str(reindex),))
    found = await asyncio.gather(*(runs_of(dag_id) for dag_id in dags.all))
    runs = sorted((run for result in found if isinstance(result, list) for run in result),
                  key=lambda run: run.run_after or "", reverse=True)
    errors = [f for f in flags.values() if isinstance(f, str)] + [r for r in found if isinstance(r, str)]
    return AirflowAnswer(reindex_paused=reindex, runs=tuple(runs), errors=tuple(errors),
                         paused={d: f for d, f in flags.items() if isinstance(f, bool)},
                         schedule=Schedule.of(reindex_dag) if "timetable_summary" in reindex_dag else None,
                         source=await source_watch(airflow, settings, request) if settings else None)


def try_out(settings: Settings, body: Mapping[str, Any]) -> Any:
    """One question to one version's collection, read-only (no state DB or store is created); a refusal of
    search_version (unknown or deleted version, empty question) is a 422 naming it, Qdrant busy or down a 503."""
    from kb_reindex.domain.errors import ConfigError, classify
    from kb_reindex.services.runtime import open_deps
    from kb_reindex.steps.tryout import search_version

    version, question, tenant = body.get("version"), body.get("question"), body.get("tenant") or None
    if not isinstance(version, int) or isinstance(version, bool) or not isinstance(question, str):
        raise HTTPException(422, "give a version number and a question")
    try:
        with open_deps(settings, create=False) as deps:
            return search_version(deps, version, question, k=4, tenant=tenant if isinstance(tenant, str) else None)
    except ConfigError as exc:
        raise HTTPException(422, str(exc)) from None
    except Exception as exc:  # Qdrant busy (a build holds the local folder) or down, the state DB away: said
        failure = classify(exc)
        if not failure.expected:
            raise
        raise HTTPException(503, failure.message) from None


def add_views(app: FastAPI, ctx: PageContext) -> None:
    """The routes that read: the page, its status, the reports, and Airflow's runs of our DAGs."""
    auth = ctx.auth

    @app.get("/api/status")
    async def status(user: Any = Depends(auth.get_user)) -> JSONResponse:  # noqa: B008 - FastAPI's form
        return JSONResponse((await status_json(ctx, user)).to_dict())

    @app.post("/api/try", dependencies=auth.signed_in())
    async def try_version(body: Annotated[Mapping[str, Any], Depends(page_json)]) -> JSONResponse:
        """The question box for a chosen version: `kb-reindex query --version N` (steps/tryout.search_version)."""
        return JSONResponse((await asyncio.to_thread(try_out, ctx.settings_factory(), body)).to_dict())

    @app.get("/reports/v{version}/{name}")
    async def report(version: int, name: str, request: Request) -> Response:
        from kb_reindex.steps.reports import REPORT_FILES, report_dir  # imports pandas: only when a report is asked for

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
        return JSONResponse((await run_json(ctx.airflow, ctx.dags, request, dag_id, run_id)).to_dict())

    @app.get("/api/airflow", dependencies=auth.signed_in())
    async def airflow_view(request: Request) -> JSONResponse:
        return JSONResponse((await airflow_json(ctx.airflow, ctx.dags, request, ctx.settings_factory())).to_dict())

    @app.get("/ui", response_class=HTMLResponse)
    async def page(request: Request) -> Response:
        if (login := await auth.login_redirect(request)) is not None:
            return login
        return HTMLResponse(render_page(ctx.settings_factory(), ctx.dags, ctx.registry_error,
                                        page_token=token_for(request)))
