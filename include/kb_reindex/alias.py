"""What the alias history says: which versions served, the rollback target, and the advice for an alias
that points elsewhere than the state DB says (drift)."""

from __future__ import annotations

from kb_reindex.lifecycle import DELETED, FAILED
from kb_reindex.runtime import Deps
from kb_reindex.state import VersionRecord


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


def rollback_target(deps: Deps, live: VersionRecord | None = None) -> VersionRecord | None:
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
