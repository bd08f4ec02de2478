"""The "Knowledge index" page: a FastAPI app the Airflow plugin mounts on the API server.

It shows what the alias serves, every version with its scores (table and chart) and, for a failed one, why;
build progress, the state DB's runs, held locks and notes, the freeze, the alias history, the metrics and the
reports; and, from Airflow, whether our DAGs are paused and their recent runs. It offers a rollback button
(versions that served and pass the structural check), a separate shadow promotion (versions never served), a
pause toggle for the reindex, and a freeze (Pause/Unfreeze) of the alias. The status is read-only
(kb_reindex.pageview: never creates a state DB; answers from the state DB alone while a build holds the local
Qdrant store).

Every route is behind Airflow's login, checked by Airflow's own API dependency (`get_user`: the auth manager
validates the JWT of the `Authorization: Bearer` header or the `_token` cookie): anonymous JSON requests get
401; the page and the report links redirect to the auth manager's login, as Airflow's UI does. The buttons are
shown only to a caller Airflow would allow, and move nothing themselves: the caller must be allowed to act on
the DAG (Airflow's `requires_access_dag`), and the action goes through Airflow's REST API *with the caller's
own token*, so Airflow's authorization decides twice. Runs and the paused flags are read the same way, as the
caller. A trigger carries the live version on-call confirmed ("vX -> vY") and is refused once the alias has
moved; a paused on-call DAG is unpaused first only when on-call agreed in the dialog.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from typing import Any, Literal
from urllib.parse import quote

import httpx
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
)

from kb_reindex.config import Settings
from kb_reindex.errors import KbError

REINDEX_DAG = "knowledge_reindex"
ROLLBACK_DAG = "knowledge_rollback"
MIGRATION_DAG = "knowledge_model_migration"
PROMOTE_SHADOW_DAG = "knowledge_promote_shadow"
#: the DAGs whose runs the page lists and follows (no other DAG is proxied)
OUR_DAGS = (REINDEX_DAG, ROLLBACK_DAG, MIGRATION_DAG, PROMOTE_SHADOW_DAG)
RECENT_RUNS_PER_DAG = 5


def _status(settings: Settings) -> dict[str, Any]:
    """The page's status (kb_reindex.pageview: read-only, never creates a state DB, fast while a build holds
    the local Qdrant store); a missing or unreadable state DB is a 503 naming KB_STATE_URL."""
    from kb_reindex.errors import ConfigError
    from kb_reindex.pageview import read_status

    try:
        return json.loads(json.dumps(read_status(settings).to_json(), default=str))
    except ConfigError as exc:
        raise HTTPException(503, str(exc)) from None


#: how long a freeze from the page waits for a promotion in progress (the alias lock) before saying so
FREEZE_WAIT_S = 10.0


def _set_freeze(settings: Settings, by: str, reason: str | None) -> dict[str, Any]:
    """Freeze (a reason) or unfreeze (None) the alias in the state DB, which must exist (never created)."""
    from kb_reindex.errors import ConfigError, LockHeldError
    from kb_reindex.state import StateStore

    try:
        state = StateStore(settings.state_url, create=False)
    except ConfigError as exc:
        raise HTTPException(503, str(exc)) from None
    try:
        if reason is None:
            lifted = state.unfreeze(settings.alias, by=by)
            return {"frozen": False, "lifted": lifted.view() if lifted else None}
        return state.freeze(settings.alias, reason=reason, by=by, wait_s=FREEZE_WAIT_S).view()
    except LockHeldError as exc:
        raise HTTPException(409, f"a promotion holds the alias lock, nothing was frozen; try again in a moment ({exc})") \
            from None
    finally:
        state.dispose()


def last_error_line(content: list[Any]) -> str | None:
    """The last error of a task log as Airflow's API returns it (structured messages): the exception raised
    (its value; the type too unless it is the AirflowFailException our tasks wrap an error in, whose value
    names the error) when the message carries one, else the message."""
    for entry in reversed(content):
        if not isinstance(entry, dict) or str(entry.get("level", "")).lower() not in ("error", "critical"):
            continue
        for detail in entry.get("error_detail") or []:
            if isinstance(detail, dict) and detail.get("exc_value"):
                kind = detail.get("exc_type") or "Error"
                text = str(detail["exc_value"]) if kind == "AirflowFailException" else f"{kind}: {detail['exc_value']}"
                return text.splitlines()[0]
        return str(entry.get("event", "")).splitlines()[0] or None
    return None


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
                   params: dict[str, Any] | None = None, action: dict[str, str] | None = None) -> dict[str, Any]:
        """`action` names what a write would have done, for the message when its fate is unknown."""
        token = _caller_token(request)
        if not token:
            raise HTTPException(401, "sign in to Airflow first: the page acts as you, through the Airflow API")
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                answer = await client.request(method, f"{self.base_url}/api/v2/{path}", params=params, json=body,
                                              headers={"Authorization": f"Bearer {token}",
                                                       "Accept": "application/json"})
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

    async def trigger(self, request: Request, dag_id: str, conf: dict[str, Any], *, fallback: str,
                      unpause: bool) -> dict[str, Any]:
        """A manual run of an on-call DAG. A paused DAG would leave the run queued for ever: unpaused first
        when on-call agreed to it in the page's dialog (`unpause`), else refused with what to do. On-call
        DAGs have no schedule, so unpausing one starts nothing but the runs on-call triggers."""
        unpaused = False
        before = {"fallback": fallback, "unknown": f"nothing was triggered. {fallback}"}
        if (await self.call(request, "GET", f"dags/{dag_id}", action=before)).get("is_paused"):
            if not unpause:
                raise HTTPException(409, f"{dag_id} is paused in Airflow: a run triggered now would stay queued "
                                         "until it is unpaused. Let the page unpause it (it asks first), or "
                                         f"`airflow dags unpause {dag_id}`; nothing was triggered")
            await self.call(request, "PATCH", f"dags/{dag_id}", body={"is_paused": False},
                            action={"fallback": fallback, "unknown": f"{dag_id} may have been unpaused; nothing was "
                                                                     f"triggered. {fallback}"})
            unpaused = True
        run = await self.call(request, "POST", f"dags/{dag_id}/dagRuns", body={"logical_date": None, "conf": conf},
                              action={"fallback": fallback,
                                      "unknown": f"a {dag_id} run may have been created. Check its runs (or "
                                                 "`kb-reindex status`) before trying again"})
        return {**run_summary(dag_id, run), "unpaused": unpaused}

    async def failure(self, request: Request, dag_id: str, run_id: str) -> str | None:
        """The failing task's last error line, from its log in Airflow (None when no log says one)."""
        base = f"dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances"
        tasks = (await self.call(request, "GET", base)).get("task_instances", [])
        for task in (t for t in tasks if t.get("state") == "failed"):
            log = await self.call(request, "GET", f"{base}/{quote(task['task_id'], safe='')}/logs/"
                                                  f"{task.get('try_number') or 1}",
                                  params={"map_index": task.get("map_index", -1)})
            line = last_error_line(log.get("content") or [])
            if line:
                return f"{task['task_id']}: {line}"
        return None


def create_app(
    *,
    settings_factory: Callable[[], Settings] = Settings.from_env,
    airflow_api_url: str | None = None,
) -> FastAPI:
    # Airflow's own checks, imported here (not at module import) because only the API server needs them
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import (
        DagAccessEntity,
        DagDetails,
    )
    from airflow.api_fastapi.core_api.security import (
        bearer_scheme,
        get_user,
        requires_access_dag,
    )
    from airflow.models.dag import DagModel

    app = FastAPI(title="Knowledge index", docs_url=None, redoc_url=None)
    api_url = (airflow_api_url or os.environ.get("KB_AIRFLOW_API_URL", "http://localhost:8080")).rstrip("/")
    airflow = AirflowApi(api_url)
    signed_in = [Depends(get_user)]

    def may_trigger(dag_id: str) -> list[Any]:
        return [Depends(requires_access_dag("POST", DagAccessEntity.RUN, param_dag_id=dag_id))]

    def allowed(user: Any, method: Literal["GET", "POST", "PUT", "DELETE"], dag_id: str, entity: Any = None) -> bool:
        """What requires_access_dag would answer, asked in advance: the page hides what would be refused."""
        return get_auth_manager().is_authorized_dag(
            method=method, access_entity=entity, user=user,
            details=DagDetails(id=dag_id, team_name=DagModel.get_team_name(dag_id)))

    async def login_redirect(request: Request) -> Response | None:
        """A browser without a valid login is sent to the auth manager's login page and back, as Airflow's UI
        does (its API answers 401 and the UI redirects): a bare 401 would strand on-call on raw JSON."""
        try:
            await get_user(request, None, await bearer_scheme(request))
        except HTTPException as refused:
            if refused.status_code not in (401, 403):
                raise
            return RedirectResponse(get_auth_manager().get_url_login(next_url=str(request.url)))
        return None

    async def status_now() -> dict[str, Any]:
        return await asyncio.to_thread(_status, settings_factory())

    async def version_row(number: int) -> dict[str, Any]:
        row = next((v for v in (await status_now())["versions"] if v["version"] == number), None)
        if row is None:
            raise HTTPException(404, f"no version {number}")
        return row

    async def confirmed_live(body: dict[str, Any]) -> int | None:
        """The live version on-call saw and confirmed ("vX -> vY"): refused when the alias has moved since."""
        confirmed = body.get("live_version")
        if confirmed is not None and (isinstance(confirmed, bool) or not isinstance(confirmed, int)):
            raise HTTPException(422, "live_version must be the version number the page showed live")
        live = (await status_now())["live"]
        now = live["version"] if live else None
        if confirmed != now:
            raise HTTPException(409, f"{settings_factory().alias} serves {f'v{now}' if now else 'nothing'} now, not "
                                     f"{f'v{confirmed}' if confirmed else 'nothing'} as you confirmed: reload the page "
                                     "and confirm again; nothing was triggered")
        return now

    def reason_of(body: dict[str, Any]) -> str:
        reason = str(body.get("reason") or "").strip()
        if not reason:
            raise HTTPException(422, "a reason is required")
        return reason

    @app.get("/api/status")
    async def status(user: Any = Depends(get_user)) -> JSONResponse:  # noqa: B008 - FastAPI's form
        data = await status_now()
        data["may"] = {"rollback": allowed(user, "POST", ROLLBACK_DAG, DagAccessEntity.RUN),
                       "promote_shadow": allowed(user, "POST", PROMOTE_SHADOW_DAG, DagAccessEntity.RUN),
                       "pause_reindex": allowed(user, "PUT", REINDEX_DAG), "freeze": allowed(user, "PUT", REINDEX_DAG)}
        return JSONResponse(data)

    @app.get("/reports/v{version}/{name}")
    async def report(version: int, name: str, request: Request) -> Response:
        from kb_reindex.reports import REPORT_FILES, report_dir

        if (login := await login_redirect(request)) is not None:
            return login
        if name not in REPORT_FILES:
            raise HTTPException(404, "unknown report")
        settings = settings_factory()
        path = report_dir(settings.reports_dir, settings.alias, version) / name
        if not path.is_file():
            raise HTTPException(404, f"no {name} for v{version}")
        return FileResponse(path)

    @app.post("/api/rollback", dependencies=may_trigger(ROLLBACK_DAG))
    async def rollback(request: Request) -> JSONResponse:
        from kb_reindex.pageview import check_rollback_target

        body = await request.json()
        reason = reason_of(body)
        to_version = body.get("to_version")
        if not isinstance(to_version, int) or isinstance(to_version, bool) or to_version < 1:
            raise HTTPException(422, "to_version must be a positive integer (the version to roll back to)")
        live = await confirmed_live(body)
        if live is None:
            raise HTTPException(409, "nothing is live: there is nothing to roll back from")
        row = await version_row(to_version)
        if not row["rollback_allowed"]:
            raise HTTPException(409, f"v{to_version} never served or is not kept: a rollback returns only to a "
                                     "version that served (a shadow goes live by promotion)")
        try:
            problems = await asyncio.to_thread(check_rollback_target, settings_factory(), to_version)
        except KbError as exc:
            raise HTTPException(409, f"the structural check of v{to_version} cannot run now ({exc}); nothing was "
                                     "triggered") from None
        if problems:
            raise HTTPException(409, f"v{to_version} ({row['collection']}) is not whole, a rollback to it would be "
                                     f"refused: {'; '.join(problems)}. Nothing was triggered")
        run = await airflow.trigger(request, ROLLBACK_DAG,
                                    {"to_version": to_version, "reason": reason, "confirm": True, "live_version": live},
                                    fallback="On-call can run `kb-reindex rollback` instead",
                                    unpause=body.get("unpause") is True)
        return JSONResponse(run)

    @app.post("/api/promote-shadow", dependencies=may_trigger(PROMOTE_SHADOW_DAG))
    async def promote_shadow(request: Request) -> JSONResponse:
        body = await request.json()
        reason = reason_of(body)
        version = body.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise HTTPException(422, "version must be a positive integer")
        live = await confirmed_live(body)
        if not (await version_row(version))["shadow"]:
            raise HTTPException(409, f"v{version} is not a shadow (ready, never served); a version that served "
                                     "goes back through a rollback")
        run = await airflow.trigger(request, PROMOTE_SHADOW_DAG,
                                    {"version": version, "reason": reason, "confirm": True, "live_version": live},
                                    fallback=f"On-call can run `kb-reindex promote --version {version}` instead",
                                    unpause=body.get("unpause") is True)
        return JSONResponse(run)

    @app.get("/api/runs/{dag_id}/{run_id}", dependencies=signed_in)
    async def dag_run(dag_id: str, run_id: str, request: Request) -> JSONResponse:
        """One run of our DAGs, read as the caller: the page follows a run it triggered to its end; a failed
        one comes with its failing task's last error line."""
        if dag_id not in OUR_DAGS:
            raise HTTPException(404, "not a knowledge DAG")
        run = run_summary(dag_id, await airflow.call(request, "GET", f"dags/{dag_id}/dagRuns/{quote(run_id, safe='')}"))
        if run["state"] == "failed":
            try:
                run["error"] = await airflow.failure(request, dag_id, run_id)
            except HTTPException as refused:
                run["error"] = f"its task log could not be read: {refused.detail}"
        return JSONResponse(run)

    @app.get("/api/airflow", dependencies=signed_in)
    async def airflow_view(request: Request) -> JSONResponse:
        """Whether our DAGs are paused and their recent runs, from Airflow's own records (runs that failed
        before reaching our code included), as the caller may see them."""
        async def paused(dag_id: str) -> bool | str:
            try:
                return bool((await airflow.call(request, "GET", f"dags/{dag_id}")).get("is_paused"))
            except HTTPException as refused:
                return f"{dag_id}: {refused.detail}"

        async def runs_of(dag_id: str) -> list[dict[str, Any]] | str:
            try:
                page = await airflow.call(request, "GET", f"dags/{dag_id}/dagRuns",
                                          params={"order_by": "-run_after", "limit": RECENT_RUNS_PER_DAG})
            except HTTPException as refused:
                return f"{dag_id}: {refused.detail}"
            return [run_summary(dag_id, run) for run in page.get("dag_runs", [])]

        flags = dict(zip(OUR_DAGS, await asyncio.gather(*(paused(dag_id) for dag_id in OUR_DAGS)), strict=True))
        if isinstance(flags[REINDEX_DAG], str):
            return JSONResponse({"reindex_paused": None, "paused": {}, "runs": [], "errors": [flags[REINDEX_DAG]]})
        found = await asyncio.gather(*(runs_of(dag_id) for dag_id in OUR_DAGS))
        runs = sorted((run for result in found if isinstance(result, list) for run in result),
                      key=lambda run: run["run_after"] or "", reverse=True)
        errors = [f for f in flags.values() if isinstance(f, str)] + [r for r in found if isinstance(r, str)]
        return JSONResponse({"reindex_paused": flags[REINDEX_DAG], "runs": runs, "errors": errors,
                             "paused": {d: f for d, f in flags.items() if isinstance(f, bool)}})

    @app.post("/api/reindex-paused", dependencies=[Depends(requires_access_dag("PUT", param_dag_id=REINDEX_DAG))])
    async def pause_reindex(request: Request) -> JSONResponse:
        """Runbook step 3 after a rollback: pause the reindex so it does not rebuild the bad change."""
        paused = (await request.json()).get("paused")
        if not isinstance(paused, bool):
            raise HTTPException(422, "paused must be true or false")
        dag = await airflow.call(request, "PATCH", f"dags/{REINDEX_DAG}", body={"is_paused": paused})
        return JSONResponse({"dag_id": REINDEX_DAG, "reindex_paused": dag.get("is_paused")})

    may_freeze = [Depends(requires_access_dag("PUT", param_dag_id=REINDEX_DAG))]

    @app.post("/api/freeze", dependencies=may_freeze)
    async def freeze(request: Request, user: Any = Depends(get_user)) -> JSONResponse:  # noqa: B008 - FastAPI's form
        """Pause the product: no promotion moves the alias until unfrozen (rollbacks still do). Written to the
        state DB as the signed-in user; allowed to whoever may pause knowledge_reindex."""
        reason = reason_of(await request.json())
        frozen = await asyncio.to_thread(_set_freeze, settings_factory(), user.get_name(), reason)
        return JSONResponse(frozen)

    @app.post("/api/unfreeze", dependencies=may_freeze)
    async def unfreeze(user: Any = Depends(get_user)) -> JSONResponse:  # noqa: B008 - FastAPI's form
        return JSONResponse(await asyncio.to_thread(_set_freeze, settings_factory(), user.get_name(), None))

    @app.get("/ui", response_class=HTMLResponse)
    async def page(request: Request) -> Response:
        if (login := await login_redirect(request)) is not None:
            return login
        return HTMLResponse(render_page(settings_factory()))

    return app


def render_page(settings: Settings) -> str:
    """The page (templates/page.html.j2, autoescaped); its script fills everything else in from /api/status."""
    from kb_reindex.templating import templates

    return templates().get_template("page.html.j2").render(alias=settings.alias, timezone=airflow_timezone())


def airflow_timezone() -> str:
    """Airflow's [core] default_timezone as an IANA name (`system` resolved): the page shows times in UTC and,
    when this differs, in this zone too."""
    from airflow.settings import TIMEZONE

    return str(getattr(TIMEZONE, "name", None) or "UTC")
