"""What the page does, each behind Airflow's own authorization: a rollback or a shadow promotion triggered as
the caller through Airflow's REST API (carrying the live version on-call confirmed, refused once the alias has
moved), the reindex paused, and the alias frozen or unfrozen in the state DB as the signed-in user."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from collections.abc import Coroutine, Mapping
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from kb_reindex.services.config import Settings
from kb_reindex.domain.errors import LockHeldError
from kb_reindex.run.pageview import QdrantAccess
from kb_reindex.services.state.freezes import Freeze
from kb_reindex.services.state.store import StateStore
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.web.airflow_api import Triggered
from kb_reindex.web.context import PageContext, positive_int, reason_of, refusal
from kb_reindex.web.guard import page_json

#: a state-changing request's body, once it showed it comes from the page (web.guard)
PageBody = Annotated[Mapping[str, Any], Depends(page_json)]

#: a rollback request finding Qdrant busy (local mode: one client at a time) reads again this often, this long
BUSY_RETRIES, BUSY_RETRY_S = 4, 0.5

#: how long a freeze from the page waits for a promotion in progress (the alias lock) before saying so
FREEZE_WAIT_S = 10.0


@dataclass(frozen=True)
class FreezeChange:
    """What a freeze or an unfreeze from the page left: the freeze in force (a freeze: the new one, or the one
    already in force), or, unfrozen, the freeze lifted (None: there was none). `to_dict()` is the JSON answer."""

    in_force: Freeze | None
    lifted: Freeze | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.in_force is not None:
            return self.in_force.view()
        return {"frozen": False, "lifted": self.lifted.view() if self.lifted else None}


#: triggers under way: a request whose caller went away (the page left, the connection closed) still finishes
#: its trigger, so a click the page sent is never half-taken (the tasks are kept here until they end)
_UNDER_WAY: set[asyncio.Task[Triggered]] = set()


async def durable(trigger: Coroutine[Any, Any, Triggered]) -> Triggered:
    """Run `trigger` to its end even when the request awaiting it is cancelled (the client disconnected)."""
    task = asyncio.ensure_future(trigger)
    _UNDER_WAY.add(task)
    task.add_done_callback(_UNDER_WAY.discard)
    return await asyncio.shield(task)


async def rollback(ctx: PageContext, request: Request, body: Mapping[str, Any]) -> Triggered:
    """Trigger the rollback DAG to a version that served and is whole, from the live version on-call saw. The
    request reads the status once and checks what it shows (kept, in a slot, every point there); the full
    structural check, IDs included, is the rollback task's own (`steps.rollback`), so the click reaches Airflow
    in the time of one status read, not of a scroll through the target's IDs."""
    reason = reason_of(body)
    to_version = positive_int(body, "to_version", " (the version to roll back to)")
    page = await ctx.status_now()
    for _ in range(BUSY_RETRIES):  # local mode: the page's own poll may hold the folder for a moment
        if page.qdrant is QdrantAccess.READ:
            break
        await asyncio.sleep(BUSY_RETRY_S)
        page = await ctx.status_now()
    live = ctx.confirmed_live(page, body)
    if live is None:
        raise HTTPException(409, "nothing is live: there is nothing to roll back from")
    row = ctx.version_row(page, to_version)
    if not row.rollback_allowed:
        raise HTTPException(409, f"v{to_version} never served or is not kept: a rollback returns only to a "
                                 "version that served (a shadow goes live by promotion)")
    if page.qdrant is not QdrantAccess.READ:
        raise HTTPException(409, f"the structural check of v{to_version} cannot run now ({page.qdrant_detail}); "
                                 "nothing was triggered")
    problems = page.rollback_problems.get(to_version, ())
    if problems:
        raise HTTPException(409, f"v{to_version} ({row.collection}) is not whole, a rollback to it would be "
                                 f"refused: {'; '.join(problems)}. Nothing was triggered")
    return await durable(ctx.airflow.trigger(
        request, ctx.dags.rollback, {"to_version": to_version, "reason": reason, "confirm": True, "live_version": live},
        fallback="On-call can run `kb-reindex rollback` instead", unpause=body.get("unpause") is True))


async def promote_shadow(ctx: PageContext, request: Request, body: Mapping[str, Any]) -> Triggered:
    """Trigger the shadow promotion DAG for a ready version that never served."""
    reason = reason_of(body)
    version = positive_int(body, "version")
    page = await ctx.status_now()
    live = ctx.confirmed_live(page, body)
    if not ctx.version_row(page, version).shadow:
        raise HTTPException(409, f"v{version} is not a shadow (ready, never served); a version that served "
                                 "goes back through a rollback")
    return await durable(ctx.airflow.trigger(
        request, ctx.dags.promote_shadow, {"version": version, "reason": reason, "confirm": True, "live_version": live},
        fallback=f"On-call can run `kb-reindex promote --version {version}` instead",
        unpause=body.get("unpause") is True))


def keep_live(settings: Settings, by: str, version: int, reason: str) -> VersionRecord:
    """The other answer to a held version (`steps.review.decline`), in the state DB, which must exist: the
    version as it now stands."""
    from kb_reindex.steps.review import decline

    try:
        state = StateStore(settings.state_url, create=False)
    except Exception as exc:
        raise refusal(exc, settings, status=503) from None
    try:
        declined = decline(state, settings.alias, version, by=by, reason=reason)
    except Exception as exc:
        raise refusal(exc, settings) from None
    finally:
        state.dispose()
    return declined


def set_freeze(settings: Settings, by: str, reason: str | None) -> FreezeChange:
    """Freeze (a reason) or unfreeze (None) the alias in the state DB, which must exist (never created); the
    freeze as the page shows it."""
    try:
        state = StateStore(settings.state_url, create=False)
    except Exception as exc:
        raise refusal(exc, settings, status=503) from None
    try:
        if reason is None:
            return FreezeChange(in_force=None, lifted=state.unfreeze(settings.alias, by=by))
        return FreezeChange(in_force=state.freeze(settings.alias, reason=reason, by=by, wait_s=FREEZE_WAIT_S))
    except Exception as exc:
        refused = refusal(exc, settings)
        if isinstance(exc, LockHeldError):
            refused.detail = (f"a promotion holds the alias lock, nothing was frozen; try again in a moment "
                              f"({refused.detail})")
        raise refused from None
    finally:
        state.dispose()


def add_actions(app: FastAPI, ctx: PageContext) -> None:
    """The routes that act, each requiring what Airflow requires for it."""
    auth, dags = ctx.auth, ctx.dags

    @app.post("/api/rollback", dependencies=auth.may_trigger(dags.rollback))
    async def rollback_route(request: Request, body: PageBody) -> JSONResponse:
        return JSONResponse((await rollback(ctx, request, body)).to_dict())

    @app.post("/api/promote-shadow", dependencies=auth.may_trigger(dags.promote_shadow))
    async def promote_shadow_route(request: Request, body: PageBody) -> JSONResponse:
        return JSONResponse((await promote_shadow(ctx, request, body)).to_dict())

    @app.post("/api/reindex-paused", dependencies=auth.may_edit(dags.reindex))
    async def pause_reindex(request: Request, body: PageBody) -> JSONResponse:
        """Runbook step 3 after a rollback: pause the reindex so it does not rebuild the bad change."""
        paused = body.get("paused")
        if not isinstance(paused, bool):
            raise HTTPException(422, "paused must be true or false")
        now = await ctx.airflow.set_paused(request, dags.reindex, paused)
        return JSONResponse({"dag_id": dags.reindex, "reindex_paused": now})

    @app.post("/api/keep-live", dependencies=auth.may_trigger(dags.promote_shadow))
    async def keep_live_route(body: PageBody, user: Any = Depends(auth.get_user)) -> JSONResponse:  # noqa: B008
        """A held version not promoted, as the signed-in user, with why: allowed to whoever may promote it."""
        version, reason = positive_int(body, "version"), reason_of(body)
        declined = await asyncio.to_thread(keep_live, ctx.settings_factory(), user.get_name(), version, reason)
        return JSONResponse({"version": declined.version, "status": declined.status, "error": declined.error})

    may_freeze = auth.may_edit(dags.reindex)

    @app.post("/api/freeze", dependencies=may_freeze)
    async def freeze(body: PageBody, user: Any = Depends(auth.get_user)) -> JSONResponse:  # noqa: B008 - FastAPI's form
        """Pause the product: no promotion moves the alias until unfrozen (rollbacks still do). Written to the
        state DB as the signed-in user; allowed to whoever may pause knowledge_reindex."""
        reason = reason_of(body)
        changed = await asyncio.to_thread(set_freeze, ctx.settings_factory(), user.get_name(), reason)
        return JSONResponse(changed.to_dict())

    @app.post("/api/unfreeze", dependencies=may_freeze)
    async def unfreeze(_body: PageBody, user: Any = Depends(auth.get_user)) -> JSONResponse:  # noqa: B008
        changed = await asyncio.to_thread(set_freeze, ctx.settings_factory(), user.get_name(), None)
        return JSONResponse(changed.to_dict())
