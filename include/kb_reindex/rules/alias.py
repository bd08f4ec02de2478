"""The alias: how it moves (compare-and-swap under the alias lock, recorded; from the version on-call
confirmed serving), what its history says (which versions served, the rollback target), and the advice for
an alias that points elsewhere than the state DB says (drift)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kb_reindex.domain.errors import AliasMovedError, KbError
from kb_reindex.rules.fence import Fence
from kb_reindex.rules.freeze import ensure_not_frozen
from kb_reindex.rules.retirement import ensure_not_retired
from kb_reindex.domain.lifecycle import DELETED, FAILED, LIVE, SWITCHABLE
from kb_reindex.rules.locking import alias_lock_name
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.services.state.clock import utc_stamp, utcnow

if TYPE_CHECKING:  # the types alone: importing a rule never imports Qdrant's client
    from kb_reindex.services.runtime import Deps, StepDeps
    from kb_reindex.services.state.ports import AliasHistory

log = logging.getLogger(__name__)


def drift_advice(deps: Deps, serving: str | None, live: VersionRecord | None) -> str:
    """What to do when the alias and the state DB disagree: one command that gets out, never a loop."""
    alias = deps.settings.alias
    said = f"alias {alias} points to {serving or 'nothing'} but the state DB says live is " + (
        f"v{live.version} ({live.collection})" if live else "nothing")
    known = deps.state.list_versions(alias)
    if serving is not None and not known:
        return (f"{said}, and the state DB knows no version of {alias} (lost or replaced?): rebuild it from Qdrant "
                "with `kb-reindex reconcile --rebuild-state`")
    if serving is None:
        return (f"{said}: readers get nothing. `kb-reindex reconcile` points the alias back at "
                f"v{live.version if live else 'N'} after checking its collection is whole")
    usable = next((v for v in known if v.collection == serving and v.status != DELETED), None)
    if usable is None:
        return (f"{said}, a collection the state DB does not know as a usable version: point the alias at a known "
                "version (`kb-reindex rollback --to-version N --reason ...`), or, if the state DB is stale, rebuild "
                "it from Qdrant with `kb-reindex reconcile --rebuild-state --replace`")
    if live is not None and usable.version < live.version:
        return (f"{said}: the alias was moved back to an older version (a rollback that crashed before its state "
                f"write, or by hand). Record it as a rollback: `kb-reindex rollback --to-version {usable.version} "
                "--reason ...`")
    return f"{said}; run `kb-reindex reconcile` to record what Qdrant serves"


#: alias events that undo a promotion: on-call's rollback and the watch's automatic one
ROLLBACK_ACTIONS = ("rollback", "auto-rollback")


def has_served(version: VersionRecord) -> bool:
    """Served behind the alias at some point: every move to live stamps `promoted_at`."""
    return version.promoted_at is not None


def rollback_target(deps: StepDeps[AliasHistory], live: VersionRecord | None = None) -> VersionRecord | None:
    """The version the alias pointed to before `live` (default: the current one) became live, from the alias
    history.

    Rollback events are passed over: after rolling v5 back to v4, the target is what preceded v4,
    not the bad v5 just rolled away from.
    """
    alias = deps.settings.alias
    live = live or deps.state.live_version(alias)
    if live is None:
        return None
    for event in reversed(deps.state.alias_events(alias)):
        if event.action in ROLLBACK_ACTIONS:
            continue
        if event.to_version == live.version and event.from_version is not None:
            candidate = deps.state.get_version(alias, event.from_version)
            if candidate is not None and candidate.status not in (FAILED, DELETED):
                return candidate
            return None
    return None


def moved_from(deps: StepDeps[AliasHistory], live: VersionRecord | None = None, *, by_rollback: bool = False) -> VersionRecord | None:
    """The version the alias served just before `live` (default: the current one), whatever moved it: after
    rolling v2 back to v1 it is v2, so going forward again stays one alias move away. `by_rollback`: only when a
    rollback put `live` live (what on-call may want to undo)."""
    alias = deps.settings.alias
    live = live or deps.state.live_version(alias)
    if live is None:
        return None
    for event in reversed(deps.state.alias_events(alias)):
        if event.to_version == live.version:
            if event.from_version is None or (by_rollback and event.action != "rollback"):
                return None
            candidate = deps.state.get_version(alias, event.from_version)
            return candidate if candidate is not None and candidate.status not in (FAILED, DELETED) else None
    return None


def switch_alias(
    deps: Deps,
    target: VersionRecord,
    *,
    expected_from: str | None,
    action: str,
    run_id: str | None,
    reason: str | None = None,
    fence: Fence | None = None,
    by: str | None = None,
) -> VersionRecord | None:
    """CAS + atomic alias update + state record, under the alias lock. Returns the version moved away from.

    If a previous attempt moved the alias and died before the state write, the alias already points at
    the target: the state side is completed instead of failing. Under the same lock: `fence` (a run's
    lock, which it must still hold), the target's record (dropped or failed meanwhile: nothing moves) and that
    the knowledge base was not retired (`kb-reindex retire`).
    `by`: who moves it (the signed-in Airflow user who triggered the run, the CLI's login user), recorded.
    """
    alias = deps.settings.alias
    with deps.state.lock(alias_lock_name(alias), ttl_s=300, wait_s=deps.settings.lock_wait_s):
        if fence is not None:
            fence.check(deps.state, before=f"moving {alias} to v{target.version}; nothing was promoted")
        ensure_not_retired(deps)  # a retired knowledge base's alias moves no more, forward or back
        fresh = deps.state.get_version(alias, target.version)
        if fresh is None or fresh.status not in (*SWITCHABLE, LIVE):
            raise KbError(f"v{target.version} is {fresh.status if fresh else 'gone'} now; {alias} was not moved")
        if fresh.collection != target.collection:  # its slot went to a newer build since it was checked
            raise KbError(f"v{target.version} no longer resides in {target.collection} (a build took the slot); "
                          f"{alias} was not moved. Restore it first: `kb-reindex restore --version {target.version}`")
        previous = deps.state.live_version(alias)
        current = deps.store.alias_target(alias)
        if current == target.collection and (previous is None or previous.id != target.id):
            log.warning("kb_reindex: alias %s already points at %s; completing the state record", alias, target.collection)
        else:
            ensure_not_frozen(deps, target, action=action)  # rollbacks pass; a forward move waits for unfreeze
            deps.store.swap_alias(alias, to=target.collection, expected_from=expected_from)
        if previous is not None and previous.id == target.id:
            return None
        deps.state.record_switch(alias=alias, action=action, to=target, previous=previous, run_id=run_id, reason=reason,
                                 by=by)
    try:
        deps.store.annotate(target.collection, {"served": True, "last_served_at": utc_stamp(utcnow())})
    except Exception as exc:  # the move is done and recorded; only the Qdrant-side note is missing
        log.warning("kb_reindex: could not note on %s that it served (%s: %s); the state DB has it, a state "
                    "rebuilt from Qdrant would not", target.collection, type(exc).__name__, exc)
    return previous


def confirmed_live(deps: Deps, expected_live: int | None, *, undone: str) -> str | None:
    """The collection of the version on-call saw serving (`expected_live`, None: nothing served), checked
    against what serves now; the caller's compare-and-swap from it makes the check atomic with the move."""
    alias = deps.settings.alias
    live = deps.state.live_version(alias)
    if (live.version if live else None) != expected_live:
        raise AliasMovedError(
            f"{alias} serves {f'v{live.version}' if live else 'nothing'} now, not "
            f"{f'v{expected_live}' if expected_live is not None else 'nothing'} (which you confirmed): nothing was "
            f"{undone}. Check `kb-reindex status` and confirm again against what serves now")
    return live.collection if live else None
