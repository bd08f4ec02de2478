"""The bodies of the DAG tasks: Airflow Connections in, one kb_reindex.run.pipeline step each, small dicts out
(XCom: the plan, version numbers and windows, summaries; never a vector).

Every failure goes through the run recorder (`runs.Recorder.fail`, i.e. errors.classify, the one error
policy): a permanent one fails the task at once (AirflowFailException, no retry) and ends the run; a
transient one is raised for Airflow to retry, and ends the run only on the last try.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from airflow.sdk import PokeReturnValue, get_current_context
from airflow.sdk.exceptions import AirflowFailException, AirflowRescheduleException, AirflowSkipException

from kb_reindex.run import dag_lock
from kb_reindex.airflow.connections import state_url, task_base, task_deps, task_settings
from kb_reindex.airflow.constants import alias_asset
from kb_reindex.airflow.waiting import rescheduling
from kb_reindex.domain.freshness import merged_feed
from kb_reindex.domain.errors import PERMANENT, UNAVAILABLE, KbError, StateUnreachable, StoreError, classify
from kb_reindex.rules.fence import Fence
from kb_reindex.rules.freeze import freeze_for_rollback
from kb_reindex.rules.run_path import RunPath, run_path
from kb_reindex.services.layouts import version_profile
from kb_reindex.rules.locking import reindex_lock_name
from kb_reindex.domain.model import RunKind, RunOutcome, WatchOutcome
from kb_reindex.run.pipeline import (
    RunRequest,
    build_step,
    build_windows,
    builds,
    cleanup_step,
    create_version_step,
    finish_unbuilt,
    plan_step,
    Promotion,
    promote_shadow,
    promote_step,
    recorded_version,
    validate_step,
)
from kb_reindex.domain.planning import CreatedVersion, Plan
from kb_reindex.run.runs import Recorder, exclusive, run_rollback
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.store import StateStore
from kb_reindex.services.state.versions import VersionRecord

__all__ = ["PERMANENT", "build_slices_task", "build_task", "cleanup_task", "create_version_task", "path_task", "plan_task",
           "promote_shadow_task", "promote_task", "rollback_task", "should_build_task", "small_run_task", "step", "task_deps",
           "validate_task", "watch_task"]

log = logging.getLogger(__name__)


def _last_try() -> bool:
    """True when Airflow will not retry this task again (a retried step's run is still in progress)."""
    try:
        ti = get_current_context()["ti"]
        return bool(ti.try_number > ti.max_tries)
    except Exception:  # outside a task context: treat as final
        return True


@contextmanager
def step(deps: Deps, run_id: str) -> Iterator[None]:
    """Record the run as failed when it really ends, and tell Airflow whether to retry. A wait giving its slot
    back (kb_reindex.airflow.waiting) is no failure: it passes through."""
    try:
        yield
    except AirflowRescheduleException:
        raise
    except Exception as exc:
        failure = Recorder.of(deps, run_id).fail(exc, retry_left=not _last_try())
        if failure.kind == "state_unreachable" and not isinstance(exc, KbError):
            raise StateUnreachable(failure.message) from None  # nothing to record it in: the next run does
        if not failure.transient:
            raise AirflowFailException(f"{type(exc).__name__}: {exc}") from None
        if not isinstance(exc, KbError) and failure.expected:  # Qdrant unreachable: one line, and a retry
            raise StoreError(failure.message) from None
        raise


@contextmanager
def task_step(run_id: str, kb: str | None = None, *, reschedules: bool = False) -> Iterator[Deps]:
    """`task_deps` inside `step`, under the run's reindex lock (renewed now and all along the step): an error
    while opening the stores (Qdrant down, a bad Connection) is decided like one in the step's body.
    `reschedules`: the step's waits give the worker slot back between looks (a task safe to start again)."""
    with opened_deps(run_id, kb) as deps:
        if reschedules:
            deps.waiter = rescheduling(lock_ttl_s=deps.settings.lock_ttl_s)
        with step(deps, run_id), dag_lock.held(deps, run_id):
            yield deps


@contextmanager
def opened_deps(run_id: str, kb: str | None = None) -> Iterator[Deps]:
    """`task_deps`, an error while opening them recorded as the run's (`_opening_failed`)."""
    stack = ExitStack()
    try:
        deps = stack.enter_context(task_deps(kb))
    except KbError as exc:
        stack.close()
        _opening_failed(run_id, exc)
        raise
    with stack:
        yield deps


def _opening_failed(run_id: str, exc: KbError) -> None:
    """The stores could not be opened: recorded through the state DB alone (the rest may be what failed)."""
    try:
        url = state_url()
        state = StateStore(url, create=False)
        try:
            recorder = Recorder(state, run_id, judge=lambda e: classify(e, state_url=url))
            failure = recorder.fail(exc, retry_left=not _last_try())
        finally:
            state.dispose()
    except KbError as unrecorded:  # the state DB itself is what failed: Airflow's log is the record
        log.warning("kb_reindex: run %s failed and could not be recorded: %s", run_id, unrecorded)
        if isinstance(exc, PERMANENT):
            raise AirflowFailException(f"{type(exc).__name__}: {exc}") from None
        return
    if not failure.transient:
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from None


def run_fence(deps: Deps, run_id: str) -> Fence:
    """The DAG run's lock, which every write batch and the promotion of the run check it still holds."""
    return Fence(reindex_lock_name(deps.settings.alias), dag_lock.dag_run_owner(run_id))


# --- knowledge_reindex & knowledge_model_migration ---------------------------------------------------


def change_feed_of(events: Any) -> tuple[str, ...] | None:
    """The change feed of the source watcher's events that started this run (Airflow's
    `triggering_asset_events`; each event's `extra` holds the trigger's payload): `freshness.merged_feed`."""
    payloads = [(event.extra or {}).get("payload") for queue in (events or {}).values() for event in queue]
    return merged_feed([payload.get("changed") if isinstance(payload, dict) else None for payload in payloads])


def plan_task(*, kb: str | None = None, run_id: str, kind: str = RunKind.REINDEX, force_full: bool = False, embedder: str | None = None,
              model: str | None = None, dim: int | None = None, layout: str | None = None,
              dry_run: bool = False, events: Any = None) -> dict[str, Any]:
    """Start the run's record and take its reindex lock (held until cleanup, or the failure callback, lets it
    go), then plan: the only task that reads the knowledge folder (`events`: the Asset events that started the
    run, whose change feed it is told: `change_feed_of`)."""
    request = RunRequest(kind=RunKind(kind), force_full=force_full, dry_run=dry_run, embedder=embedder, model=model,
                         dim=dim, layout=layout, layout_from="Param payload_layout", changed=change_feed_of(events))
    with task_deps(kb) as deps:
        deps.waiter = rescheduling(lock_ttl_s=deps.settings.lock_ttl_s)  # another run's lock: wait off the slot
        recorder = Recorder.of(deps, run_id)
        recorder.start(request.kind, "airflow")
        with step(deps, run_id):
            dag_lock.take(deps, run_id)
            if kb is not None:  # the entry this run loaded: what on-call acts from if it stops loading
                deps.state.record_entry(task_base(kb).recorded())
            return plan_step(deps, recorder, request).to_dict()


def should_build_task(*, kb: str | None = None, plan: dict[str, Any], dry_run: bool, run_id: str) -> bool:
    """False ends the run here (short-circuit): nothing changed, or only a dry run was asked for."""
    with task_deps(kb) as deps:
        dag_lock.renew(deps, run_id)
        planned = Plan.from_dict(plan)
        if builds(planned, dry_run=dry_run):
            return True
        outcome = finish_unbuilt(Recorder.of(deps, run_id), planned)
        log.info("kb_reindex: %s; nothing is built", outcome)
        if dry_run:  # nothing else of this run writes (cleanup skips a dry run); a no-change run's cleanup does
            dag_lock.release(deps, run_id)
    return False


def create_version_task(*, kb: str | None = None, plan: dict[str, Any], run_id: str) -> dict[str, Any]:
    with task_step(run_id, kb) as deps:
        return create_version_step(deps, Recorder.of(deps, run_id), Plan.from_dict(plan)).to_dict()


def build_slices_task(*, kb: str | None = None, version: dict[str, Any], slice_size: int, run_id: str | None = None) -> list[dict[str, Any]]:
    """(offset, limit) windows over the version's manifest, for dynamic task mapping of the build."""
    with task_deps(kb) as deps:
        if run_id is not None:
            dag_lock.renew(deps, run_id)
        windows = build_windows(deps, version["version"], slice_size)
    return [{"version": version["version"], "offset": offset, "limit": limit} for offset, limit in windows]


def build_task(*, kb: str | None = None, version: dict[str, Any], run_id: str, window: tuple[int, int] | None = None) -> dict[str, Any]:
    with task_step(run_id, kb) as deps:
        return build_step(deps, Recorder.of(deps, run_id), version["version"], run_fence(deps, run_id),
                          window=window).to_dict()


def validate_task(*, kb: str | None = None, version: dict[str, Any], run_id: str, min_hit_rate: float | None = None,
                  min_mrr: float | None = None) -> dict[str, Any]:
    with task_step(run_id, kb, reschedules=True) as deps:  # Qdrant still indexing: wait off the slot
        return validate_step(deps, version["version"],
                             RunRequest(min_hit_rate=min_hit_rate, min_mrr=min_mrr)).to_dict()


def promote_task(*, kb: str | None = None, plan: dict[str, Any], version: dict[str, Any], run_id: str, promote: bool = True,
                 watch_minutes: float | None = None) -> dict[str, Any]:
    """Move the alias and announce it on the alias Asset, whose event starts knowledge_watch: `watch_minutes`
    (the run's Param; None: KB_WATCH_MINUTES where the watch runs) and this run's id go with it. The task is
    skipped (no Asset event, no watch; `cleanup` still runs) when nothing moved: the version was already live
    (unless this very run moved it in an attempt that died before reporting), the alias is frozen (the run ends
    `frozen`), or `promote` is off (a migration's shadow: the run ends `shadow`)."""
    with task_step(run_id, kb) as deps:
        promotion = _promote(deps, plan=plan, number=version["version"], run_id=run_id, promote=promote,
                             watch_minutes=watch_minutes)
    return _promotion_end(promotion)


def _promote(deps: Deps, *, plan: dict[str, Any], number: int, run_id: str, promote: bool,
             watch_minutes: float | None) -> Promotion:
    promotion = promote_step(deps, Recorder.of(deps, run_id), Plan.from_dict(plan), number, run_fence(deps, run_id),
                             request=RunRequest(promote=promote))
    if promotion.moved:
        record = recorded_version(deps, number)
        announce_alias_move(deps, action=_move_action(record), version=record,
                            previous_version=promotion.previous_version,
                            watch={"minutes": watch_minutes, "run_id": run_id})
    return promotion


def _promotion_end(promotion: Promotion) -> dict[str, Any]:
    """The task's end for how the promotion went: skipped (no Asset event) when nothing moved, failed (no
    retry) when held for a person, its summary when the alias moved."""
    number = promotion.version
    if promotion.outcome == RunOutcome.FROZEN and promotion.frozen is not None:  # outside `step`: not a failure
        raise AirflowSkipException(promotion.frozen.message)
    if promotion.outcome == RunOutcome.HELD and promotion.held is not None:
        # recorded `held`, not failed; the task fails (no retry) so the DAG run is red and a person looks
        raise AirflowFailException(promotion.held_message())
    if promotion.outcome == RunOutcome.SHADOW:
        raise AirflowSkipException(f"promote is off: v{number} is kept as a shadow (built and validated, never "
                                   "served); knowledge_promote_shadow puts it live")
    if not promotion.moved:
        raise AirflowSkipException(f"v{number} is already live: the alias did not move")
    return promotion.to_dict()


def path_task(*, kb: str | None = None, version: dict[str, Any], slice_size: int,
              small_run_points: int | None = None) -> list[str]:
    """The branch after create_version (kb_reindex.rules.run_path): `small_run` alone, or the mapped slices
    with `cleanup` after their promotion. `small_run_points`: the run's Param (None: KB_SMALL_RUN_POINTS).
    Reads only the settings: no store is opened, no model loaded."""
    created = CreatedVersion.from_dict(version)
    limit = task_base(kb).settings().small_run_points if small_run_points is None else small_run_points
    chosen = run_path(points_to_write=created.points_to_write, small_run_points=limit, slice_size=slice_size)
    log.info("kb_reindex: v%d has %d point(s) to write: %s", created.version, created.points_to_write,
             "one task (small_run)" if chosen is RunPath.SMALL else "mapped build slices")
    return [str(chosen)] if chosen is RunPath.SMALL else [str(chosen), "cleanup"]


def small_run_task(*, kb: str | None = None, plan: dict[str, Any], version: dict[str, Any], run_id: str,
                   promote: bool = True, watch_minutes: float | None = None, min_hit_rate: float | None = None,
                   min_mrr: float | None = None) -> dict[str, Any]:
    """A small plan's build, validate, promote and cleanup in one task: the mapped path's steps in its order,
    under the same lock and fence, with the same records and Asset event. Its waits (Qdrant's index) stay in
    the slot: a small build's index is quick, and giving the slot back would start the build again. A retry
    resumes (written points are skipped, a promotion this run made is recognised)."""
    number = version["version"]
    with opened_deps(run_id, kb) as deps, step(deps, run_id):
        with dag_lock.held(deps, run_id):
            with deps.state.sharing_differences():  # the version against its slot's base: asked once for both
                build_step(deps, Recorder.of(deps, run_id), number, run_fence(deps, run_id))
                validate_step(deps, number, RunRequest(min_hit_rate=min_hit_rate, min_mrr=min_mrr))
            promotion = _promote(deps, plan=plan, number=number, run_id=run_id, promote=promote,
                                 watch_minutes=watch_minutes)
            held = promotion.outcome == RunOutcome.HELD  # the task fails; the failure callback lets the lock go
            if not held:
                cleanup_step(deps)  # retention under the run's lock, as the mapped path's cleanup task
        if not held:
            dag_lock.release(deps, run_id)
    return _promotion_end(promotion)


def _move_action(record: VersionRecord) -> str:
    return "migrate" if record.kind == RunKind.MIGRATION else "promote"


def alias_move_extra(*, alias: str, action: str, version: VersionRecord,
                     previous_version: int | None) -> dict[str, Any]:
    """What an Asset event of the alias says moved: consumers (a cache warmer, an evaluation DAG) need not
    ask the state DB which collection, model and dimension now serve, nor how its payloads look."""
    return {"alias": alias, "action": action, "version": version.version, "collection": version.collection,
            "model": version.embed_model, "dimension": version.embed_dim, "previous_version": previous_version,
            "payload_layout": version.payload_layout, "embed_profile": version_profile(version)}


def announce_alias_move(deps: Deps, *, action: str, version: VersionRecord, previous_version: int | None,
                        watch: dict[str, Any] | None = None) -> dict[str, Any]:
    """Set the `extra` of this task's outlet event for the alias Asset (emitted when the task succeeds); `watch`
    (a run's promotion only): what knowledge_watch needs, the window asked for and the promoting run."""
    extra = alias_move_extra(alias=deps.settings.alias, action=action, version=version,
                             previous_version=previous_version) | ({"watch": watch} if watch is not None else {})
    get_current_context()["outlet_events"][alias_asset(deps.settings.alias)].extra = extra
    log.info("kb_reindex: alias %s moved: %s", deps.settings.alias, extra)
    return extra


def cleanup_task(*, kb: str | None = None, dry_run: bool = False, run_id: str | None = None) -> dict[str, Any]:
    """Retention after any run that did not fail: a quiet knowledge base reclaims abandoned builds too.
    A dry run promised to change nothing, so it deletes nothing either. The run's last step: retention runs
    under the run's lock, then lets it go (a failed retention keeps it for its retry, or the failure callback)."""
    if dry_run:
        if run_id is not None:
            with task_deps(kb) as deps:
                dag_lock.release(deps, run_id)
        raise AirflowSkipException("dry run: retention deletes nothing")
    with task_deps(kb) as deps:
        if run_id is None:
            return cleanup_step(deps).to_dict()
        with dag_lock.held(deps, run_id):
            result = cleanup_step(deps)
        dag_lock.release(deps, run_id)
        return result.to_dict()


def promotion_to_watch(events: Any) -> dict[str, Any]:
    """The newest run's promotion among the alias Asset events that started a knowledge_watch run (Airflow's
    `triggering_asset_events`: several when promotions queued while the previous watch ran): its `extra`,
    whose `watch` promote_task set (a rollback's event, or a shadow's a person promoted, has none). None there:
    the task is skipped, saying what moved the alias."""
    moves = sorted((event for queue in (events or {}).values() for event in queue), key=lambda e: e.timestamp)
    promotions = [dict(event.extra) for event in moves if isinstance((event.extra or {}).get("watch"), dict)]
    if not promotions:
        actions = ", ".join(f"{(e.extra or {}).get('action')} of v{(e.extra or {}).get('version')}" for e in moves)
        raise AirflowSkipException(f"the alias moved by {actions or 'no event'}: only a reindex's or a migration's "
                                   "promotion is watched")
    return promotions[-1]


def watch_after_promotion(*, kb: str | None = None, events: Any, run_id: str) -> PokeReturnValue:
    """knowledge_watch's look: the newest run's promotion that started it, for the window that run asked for."""
    promoted = promotion_to_watch(events)
    log.info("kb_reindex: watching v%s, promoted by %s", promoted.get("version"), promoted["watch"].get("run_id"))
    return watch_task(kb=kb, promoted=promoted, run_id=run_id, minutes=promoted["watch"].get("minutes"))


def watch_task(*, kb: str | None = None, promoted: dict[str, Any], run_id: str,
               minutes: float | None = None) -> PokeReturnValue:
    """One look of the watch after a promotion (knowledge_watch's sensor pokes it every KB_WATCH_INTERVAL_S in
    reschedule mode: between looks it holds no worker slot), until `minutes` (the promoting run's watch_minutes
    Param; None: KB_WATCH_MINUTES) after the promotion (0: skipped). An
    automatic rollback, or a regression with nowhere to go back to, fails the task without retry: on-call must
    hear of it. The rollback moves the alias only from the version this run promoted, and is recorded under
    `run_id` (the knowledge_watch run's). A look long after the window ended is not taken (`late_by`): skipped."""
    from kb_reindex.run.watch import late_by, look_once, prepare_watch

    settings, _headers = task_settings(kb)
    minutes = settings.watch_minutes if minutes is None else minutes
    if minutes <= 0:
        raise AirflowSkipException("KB_WATCH_MINUTES (or the watch_minutes Param) is 0: no watch after the promotion")
    watch_run = run_id[:255]
    try:
        with task_deps(kb) as deps:
            setup = prepare_watch(deps, promoted["version"])
            since, now = setup.version.serving_since, deps.state.clock.now()
            late = late_by(now, since, minutes=minutes, interval_s=deps.settings.watch_interval_s)
            if late > 0:
                raise AirflowSkipException(f"the {minutes:g}-minute window of v{promoted['version']} (promoted {since}) "
                                           f"ended {late:.0f} s before this look could be taken (knowledge_watch "
                                           "paused or queued): not watched, nothing moved")
            last = since is None or now >= since + timedelta(minutes=minutes)
            _check, result = look_once(deps, setup, last=last, run_id=watch_run, trigger="watch")
            if result is not None and result.outcome == WatchOutcome.ALIAS_MOVED:
                # a try after this watch's own rollback (Airflow may retry a rescheduled sensor, or run a poke
                # twice): it says the rollback again, never a quiet success
                undone = [e for e in deps.state.alias_events(deps.settings.alias)
                          if e.action == "auto-rollback" and e.run_id == watch_run
                          and e.from_version == promoted["version"]]
                if undone:
                    raise AirflowFailException(f"v{promoted['version']} was rolled back to v{undone[-1].to_version} "
                                               f"automatically: {undone[-1].reason}")
    except tuple(UNAVAILABLE) as exc:  # a server away for a look: the next look tries again
        log.warning("kb_reindex: watch of v%s: no look this time: %s", promoted["version"], exc)
        return PokeReturnValue(is_done=False)
    if result is None:
        return PokeReturnValue(is_done=False)
    if result.outcome == WatchOutcome.ROLLED_BACK:
        raise AirflowFailException(f"v{promoted['version']} was rolled back to v{result.to_version} "
                                   f"automatically: {result.reason}")
    if result.outcome == WatchOutcome.REGRESSED:
        raise AirflowFailException(f"v{promoted['version']} regressed after its promotion and could not be rolled "
                                   f"back: {'; '.join(result.signals or ())}; {result.error}")
    return PokeReturnValue(is_done=True, xcom_value=result.to_dict())


# --- knowledge_rollback ----------------------------------------------------------------------------


def rollback_task(*, kb: str | None = None, run_id: str, live_version: int | None, to_version: int | None, reason: str, confirm: bool,
                  revalidate: bool, freeze: bool = True, triggered_by: str | None = None) -> dict[str, Any]:
    """On-call's rollback from `live_version` (the version they saw serving) to `to_version` (default: the one
    before it): refused, moving nothing, if another version serves by the move. No reindex lock: it completes
    while a build runs, and that build's promotion then fails its compare-and-swap. `freeze`: set the
    product's freeze before the alias moves back (kb_reindex.rules.freeze), so no later run promotes the bad change
    again; the result says so. `triggered_by`: the Airflow user who triggered the run (the page's signed-in
    user), recorded as who froze the alias and who moved it."""
    if not confirm:
        raise AirflowFailException("rollback not confirmed: set the 'confirm' param to true; nothing changed")
    if live_version is None:
        raise AirflowFailException("name the version you saw serving (the 'live_version' param, from the Knowledge "
                                   "index page or `kb-reindex status`); nothing changed")
    try:
        base = task_base(kb, on_call=True)
    except PERMANENT as exc:  # an alias never registered, or one retired: a retry would answer the same
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from None
    if base.problem is not None:  # its golden set may be what its entry got wrong: not scored
        log.warning("kb_reindex: %s; rolling back from %s, the target not scored on a golden set", base.problem,
                    f"its entry as it last loaded ({base.recorded_at})" if base.recorded_at else "its alias alone")
        revalidate = False
    with task_deps(kb, on_call=True) as deps:
        try:
            by = f"{triggered_by} (knowledge_rollback {run_id})" if triggered_by else f"knowledge_rollback ({run_id})"
            held = freeze_for_rollback(deps, reason=reason, by=by).view() if freeze else None
            result = run_rollback(deps, reason=reason, to_version=to_version, run_id=run_id, trigger="airflow",
                                  revalidate=revalidate, expected_live=live_version, by=triggered_by)
        except PERMANENT as exc:
            raise AirflowFailException(f"{type(exc).__name__}: {exc}") from None
        target = recorded_version(deps, result.to_version)
        announce_alias_move(deps, action="rollback", version=target, previous_version=result.from_version)
        return {**result.to_dict(), "freeze": held}


# --- knowledge_promote_shadow ------------------------------------------------------------------------


def promote_shadow_task(*, kb: str | None = None, run_id: str, version: int | None, reason: str, confirm: bool,
                        live_version: int | None, triggered_by: str | None = None) -> dict[str, Any]:
    """Put a shadow (built, validated, never served) live on purpose: validated again against what serves
    now, under the alias's lock, and announced on the alias Asset. A retired or unknown version is refused:
    a version that served goes back through a rollback. Moves only from `live_version`, the version on-call
    saw serving (None: only when nothing serves). `triggered_by`: the Airflow user who triggered it, recorded
    with the alias move."""
    if version is None:
        raise AirflowFailException("name the shadow version to promote (the 'version' param)")
    if not confirm:
        raise AirflowFailException("promotion not confirmed: set the 'confirm' param to true; nothing changed")
    if not reason or not reason.strip():
        raise AirflowFailException("a promotion needs a reason (it is recorded in the alias history)")
    with task_deps(kb) as deps:
        # a reindex holding the lock: wait for it off on-call's slot (started again at each look, as `plan` is;
        # everything before the lock is idempotent), never asleep in the lane's few slots
        deps.waiter = rescheduling(lock_ttl_s=deps.settings.lock_ttl_s)
        recorder = Recorder.of(deps, run_id)
        recorder.start(RunKind.PROMOTE, "airflow")
        with step(deps, run_id), exclusive(deps, run_id=run_id):
            result = promote_shadow(deps, version, expected_live=live_version, run_id=run_id, reason=reason.strip(),
                                    by=triggered_by)
        recorder.finish(RunOutcome.PROMOTED, version=version)
        record = recorded_version(deps, version)
        announce_alias_move(deps, action=_move_action(record), version=record,
                            previous_version=result.previous_version)
        return result.to_dict()
