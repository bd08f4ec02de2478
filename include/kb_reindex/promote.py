"""Steps 5 and 6: move the alias (compare-and-swap, one atomic request), then retention.

The alias moves only if it still points where the run planned; the state DB records every move. The
previous collection is kept: it is the rollback target, and retention never deletes it.
"""

from __future__ import annotations

import logging
from typing import Any

from kb_reindex.errors import AliasMovedError, ConfigError, KbError, RollbackRefused, StoreError
from kb_reindex.runtime import Deps
from kb_reindex.state import VersionRecord, utcnow

log = logging.getLogger(__name__)


#: alias events that undo a promotion: on-call's rollback and the watch's automatic one
ROLLBACK_ACTIONS = ("rollback", "auto-rollback")


def alias_lock_name(alias: str) -> str:
    return f"alias:{alias}"


def switch_alias(
    deps: Deps,
    target: VersionRecord,
    *,
    expected_from: str | None,
    action: str,
    run_id: str | None,
    reason: str | None = None,
) -> VersionRecord | None:
    """CAS + atomic alias update + state record, under the alias lock. Returns the version moved away from.

    If a previous attempt moved the alias and died before the state write, the alias already points at
    the target: the state side is completed instead of failing.
    """
    alias = deps.settings.alias
    with deps.state.lock(alias_lock_name(alias), ttl_s=300, wait_s=deps.settings.lock_wait_s):
        previous = deps.state.live_version(alias)
        current = deps.store.alias_target(alias)
        if current == target.collection and (previous is None or previous.id != target.id):
            log.warning("kb_reindex: alias %s already points at %s; completing the state record", alias, target.collection)
        else:
            deps.store.swap_alias(alias, to=target.collection, expected_from=expected_from)
        if previous is not None and previous.id == target.id:
            return None
        deps.state.record_switch(alias=alias, action=action, to=target, previous=previous, run_id=run_id, reason=reason)
    try:
        deps.store.annotate(target.collection, {"served": True, "last_served_at": utcnow().isoformat(timespec="seconds") + "Z"})
    except Exception as exc:  # noqa: BLE001 - the move is done and recorded; only the Qdrant-side note is missing
        log.warning("kb_reindex: could not note on %s that it served (%s: %s); the state DB has it, a state "
                    "rebuilt from Qdrant would not", target.collection, type(exc).__name__, exc)
    return previous


def promote(deps: Deps, version_number: int, *, run_id: str | None = None) -> dict[str, Any]:
    alias = deps.settings.alias
    version = deps.state.get_version(alias, version_number)
    if version is None:
        raise KbError(f"version {version_number} of {alias} does not exist")
    if version.status == "live" and deps.store.alias_target(alias) == version.collection:
        return {"version": version.version, "collection": version.collection, "previous_version": None, "already_live": True}
    if version.status != "ready":
        raise KbError(f"v{version.version} is {version.status}, not ready; only a validated version can be promoted")
    try:
        previous = switch_alias(
            deps, version, expected_from=version.base_collection,
            action="migrate" if version.kind == "migration" else "promote", run_id=run_id,
        )
    except (AliasMovedError, StoreError) as exc:
        deps.state.mark_failed(version.id, step="promote", error=str(exc))
        raise
    if previous is not None:
        log.info("kb_reindex: promoted v%d (%s); previous v%d kept for rollback", version.version, version.collection,
                 previous.version)
    else:
        log.info("kb_reindex: promoted v%d (%s), the first version behind %s", version.version, version.collection, alias)
    return {"version": version.version, "collection": version.collection,
            "previous_version": previous.version if previous else None, "already_live": False}


def promote_shadow(deps: Deps, version_number: int, *, run_id: str | None = None,
                   reason: str = "explicit promotion of a shadow version") -> dict[str, Any]:
    """Put a shadow (built and validated, never served) behind the alias on purpose: validated again
    against what serves now, then the same compare-and-swap, from the version live at this moment."""
    from kb_reindex.validate import validate

    alias = deps.settings.alias
    version = deps.state.get_version(alias, version_number)
    if version is None:
        raise ConfigError(f"version {version_number} of {alias} does not exist")
    if version.status != "ready":
        hint = " (a rollback returns to a version that served)" if version.status == "retired" else ""
        raise ConfigError(f"v{version.version} is {version.status}; only a ready shadow version can be promoted{hint}")
    live = deps.state.live_version(alias)
    # re-checked against what serves now, by the thresholds it was built with; a failure leaves it a shadow
    built_with = (version.validation or {}).get("thresholds") or {}
    checked = validate(deps, version.version, min_hit_rate=built_with.get("min_hit_rate"),
                       min_mrr=built_with.get("min_mrr"), record=False)
    deps.state.update_version(version.id, validation=checked)
    previous = switch_alias(deps, version, expected_from=live.collection if live else None,
                            action="migrate" if version.kind == "migration" else "promote", run_id=run_id,
                            reason=reason)
    log.info("kb_reindex: promoted shadow v%d (%s, %s %d-d)", version.version, version.collection,
             version.embed_model, version.embed_dim)
    return {"version": version.version, "collection": version.collection, "embed_model": version.embed_model,
            "dim": version.embed_dim, "previous_version": previous.version if previous else None}


# --- rollback ------------------------------------------------------------------------------------


def has_served(version: VersionRecord) -> bool:
    """Served behind the alias at some point: every move to live stamps `promoted_at`."""
    return version.promoted_at is not None


def rollback_candidates(deps: Deps) -> list[VersionRecord]:
    """Versions a rollback may reach: kept, not live, and served before (any model: that undoes a migration)."""
    return [v for v in deps.state.list_versions(deps.settings.alias)
            if v.status in ("retired", "ready") and has_served(v)]



def rollback_target(deps: Deps) -> VersionRecord | None:
    """The version the alias pointed to before the current one became live, from the alias history.

    Rollback events are passed over: after rolling v5 back to v4, the target is what preceded v4,
    not the bad v5 just rolled away from.
    """
    alias = deps.settings.alias
    live = deps.state.live_version(alias)
    if live is None:
        return None
    for event in reversed(deps.state.alias_events(alias)):
        if event["action"] in ROLLBACK_ACTIONS:
            continue
        if event["to_version"] == live.version and event["from_version"] is not None:
            candidate = deps.state.get_version(alias, event["from_version"])
            if candidate is not None and candidate.status not in ("failed", "deleted"):
                return candidate
            return None
    return None


# --- retention -----------------------------------------------------------------------------------


def retention_victims(
    versions: list[VersionRecord], *, keep: int, protected: set[int], pinned: set[int] | frozenset[int] = frozenset()
) -> list[VersionRecord]:
    """Versions whose collections may go: failed builds and retired versions beyond `keep`.

    Never the live one, never the newest retired one, never a protected one (the rollback target),
    never a shadow (ready, unpromoted) version, never one still building, never a pinned one (`pinned`:
    version ids; they are kept on top of `keep`, not in its place).
    """
    protected = set(protected) | set(pinned)
    retired = sorted((v for v in versions if v.status == "retired" and v.id not in pinned),
                     key=lambda v: (v.retired_at or v.created_at, v.version), reverse=True)
    keep_ids = {v.id for v in retired[: max(keep, 1)]} | protected
    victims = [v for v in retired if v.id not in keep_ids]
    victims += [v for v in versions if v.status == "failed" and v.id not in protected]
    return sorted(victims, key=lambda v: v.version)


def cleanup(deps: Deps) -> dict[str, Any]:
    alias = deps.settings.alias
    with deps.state.lock(alias_lock_name(alias), ttl_s=300, wait_s=deps.settings.lock_wait_s):
        target = rollback_target(deps)
        serving = deps.store.alias_target(alias)
        from kb_reindex.build import run_is_active

        versions = deps.state.list_versions(alias)
        protected = {v.id for v in versions if v.collection == serving}
        if target is not None:
            protected.add(target.id)
        # a failed or unfinished build whose run may still retry is left alone; an abandoned one goes
        protected |= {v.id for v in versions if v.status in ("failed", "building") and v.run_id
                      and run_is_active(deps, v.run_id)}
        for v in versions:
            if v.status == "building" and v.id not in protected:
                deps.state.mark_failed(v.id, step="build", error="abandoned: its run ended without finishing the build")
        versions = deps.state.list_versions(alias)
        pinned = pinned_ids(deps, versions)
        deleted = []
        for victim in retention_victims(versions, keep=deps.settings.keep_versions, protected=protected,
                                        pinned=pinned):
            dropped, snapshot = _drop_collection(deps, victim)
            deleted.append({"version": victim.version, "collection": victim.collection, "was": victim.status,
                            "collection_dropped": dropped, "snapshot": snapshot})
            log.info("kb_reindex: retention deleted v%d (%s, was %s)", victim.version, victim.collection, victim.status)
        if deleted:  # the chunk texts of the plans only these versions needed go with them
            deps.state.drop_unneeded_texts()
    return {"deleted": deleted, "rollback_target": target.version if target else None,
            "pinned": sorted(v.version for v in versions if v.id in pinned)}


def drop_version(deps: Deps, version_number: int) -> dict[str, Any]:
    """Explicitly drop a kept version (e.g. a shadow migration): never the live one or the rollback target."""
    alias = deps.settings.alias
    with deps.state.lock(alias_lock_name(alias), ttl_s=300, wait_s=deps.settings.lock_wait_s):
        version = deps.state.get_version(alias, version_number)
        if version is None:
            raise KbError(f"version {version_number} of {alias} does not exist")
        target = rollback_target(deps)
        if version.status == "live" or deps.store.alias_target(alias) == version.collection:
            raise KbError(f"v{version.version} is live; roll back or promote another version first")
        if target is not None and target.id == version.id:
            raise KbError(f"v{version.version} is the rollback target; it is kept")
        if version.status == "building":
            raise KbError(f"v{version.version} is still building")
        pin = deps.state.active_pins(alias).get(version.version)
        if pin is not None and version.status != "deleted":
            raise KbError(f"v{version.version} is pinned ({pin['reason']!r}, by {pin['pinned_by']} at "
                          f"{pin['pinned_at']:%Y-%m-%d %H:%M:%S} UTC); `kb-reindex unpin --version {version.version}` "
                          "first if it should go")
        if version.status == "deleted":
            return {"version": version.version, "collection": version.collection, "was": "deleted",
                    "collection_dropped": False, "already_deleted": True}
        dropped, snapshot = _drop_collection(deps, version)
        deps.state.drop_unneeded_texts()
    return {"version": version.version, "collection": version.collection, "was": version.status,
            "collection_dropped": dropped, "snapshot": snapshot}


# --- pins ----------------------------------------------------------------------------------------


def pinned_ids(deps: Deps, versions: list[VersionRecord]) -> set[int]:
    """Ids of the versions pinned now (a known-good baseline retention never drops)."""
    numbers = set(deps.state.active_pins(deps.settings.alias))
    return {v.id for v in versions if v.version in numbers}


def pin_by() -> str:
    """Who pins: the login user on this host (recorded with the pin)."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name in some containers; the host still says where
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def pin_version(deps: Deps, version_number: int, *, reason: str, by: str | None = None) -> dict[str, Any]:
    """Keep a version whatever retention decides, until unpinned. Only a whole version can be kept:
    a failed, building or deleted one is refused by name."""
    alias = deps.settings.alias
    if not reason or not reason.strip():
        raise ConfigError("pin needs --reason (it is recorded with the pin)")
    version = deps.state.get_version(alias, version_number)
    if version is None:
        raise ConfigError(f"--version {version_number}: {alias} has no version {version_number}")
    if version.status in ("failed", "deleted", "building"):
        raise ConfigError(f"v{version.version} is {version.status}; only a live, ready or retired version can be pinned")
    existing = deps.state.active_pins(alias).get(version.version)
    pin = deps.state.pin_version(alias=alias, version=version.version, reason=reason.strip(), by=by or pin_by())
    log.info("kb_reindex: pinned v%d of %s (%s)", version.version, alias, pin["reason"])
    return {"version": version.version, "collection": version.collection, "pinned": True,
            "already_pinned": existing is not None, "reason": pin["reason"], "pinned_by": pin["pinned_by"],
            "pinned_at": pin["pinned_at"].isoformat(timespec="seconds") + "Z"}


def unpin_version(deps: Deps, version_number: int, *, by: str | None = None) -> dict[str, Any]:
    alias = deps.settings.alias
    if deps.state.get_version(alias, version_number) is None:
        raise ConfigError(f"--version {version_number}: {alias} has no version {version_number}")
    ended = deps.state.unpin_version(alias=alias, version=version_number, by=by or pin_by())
    if ended is not None:
        log.info("kb_reindex: unpinned v%d of %s; retention may drop it again", version_number, alias)
    return {"version": version_number, "pinned": False, "was_pinned": ended is not None,
            "reason": ended["reason"] if ended else None}


def _drop_collection(deps: Deps, version: VersionRecord) -> tuple[bool, str | None]:
    """Delete a version's collection and mark it deleted; with KB_SNAPSHOT_BEFORE_DROP, snapshot it first.

    The snapshot's name is kept where the version's record already holds JSON about it: its `validation`
    under `snapshot` (with the collection and the time), shown by `kb-reindex status --json`. A failed
    snapshot keeps the collection: nothing is dropped without the copy that was asked for."""
    snapshot = None
    if deps.settings.snapshot_before_drop and deps.store.exists(version.collection):
        try:
            snapshot = deps.store.snapshot(version.collection)
        except KbError:
            raise
        except Exception as exc:
            raise StoreError(f"snapshot of {version.collection} (v{version.version}) failed, so it is not dropped: "
                             f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
        taken = {"name": snapshot, "collection": version.collection,
                 "at": utcnow().isoformat(timespec="seconds") + "Z"}
        deps.state.update_version(version.id, validation={**(version.validation or {}), "snapshot": taken})
        log.info("kb_reindex: snapshot %s of %s (v%d) taken before dropping it", snapshot, version.collection,
                 version.version)
    dropped = deps.store.delete_collection(version.collection)
    deps.state.update_version(version.id, status="deleted", deleted_at=utcnow())
    return dropped, snapshot


def rollback(
    deps: Deps,
    *,
    reason: str,
    to_version: int | None = None,
    run_id: str | None = None,
    revalidate: bool = True,
    action: str = "rollback",
    expected_live: int | None = None,
) -> dict[str, Any]:
    """Put a previous version back behind the alias, after checking it is structurally whole.

    `action="auto-rollback"` is the watch's; `expected_live` refuses the rollback unless that version is
    still live (the watch undoes only its own promotion)."""
    from kb_reindex.validate import validate

    alias = deps.settings.alias
    if not reason or not reason.strip():
        raise RollbackRefused("a rollback needs a reason (it is recorded in the alias history)")
    live = deps.state.live_version(alias)
    if live is None:
        raise RollbackRefused(f"{alias} has no live version; there is nothing to roll back from")
    if expected_live is not None and live.version != expected_live:
        raise AliasMovedError(f"{alias} serves v{live.version} now, not v{expected_live}: nothing was rolled back")
    target = deps.state.get_version(alias, to_version) if to_version is not None else rollback_target(deps)
    if target is None:
        raise RollbackRefused(
            f"no version {to_version} of {alias}" if to_version is not None
            else f"no previous version of {alias} in the alias history; name one with --to-version"
        )
    if target.id == live.id:
        raise RollbackRefused(f"v{target.version} is already live")
    if target.status in ("failed", "deleted", "building"):
        raise RollbackRefused(f"v{target.version} is {target.status}; only a complete, kept version can serve")
    if not has_served(target):
        raise RollbackRefused(
            f"v{target.version} ({target.embed_model}, {target.embed_dim}-d) never served behind {alias}: a rollback "
            "returns only to a version that served before. A shadow goes live through a promotion that validates "
            f"it again: `kb-reindex promote --version {target.version}`"
        )
    problems = structural_problems(deps, target)
    if problems:
        raise RollbackRefused(f"v{target.version} ({target.collection}) is not whole: " + "; ".join(problems))
    scores = None
    if revalidate:
        # Scores are for the record: a golden set that names newer documents, a bad file in the folder
        # or an embedder outage must not stand between on-call and a structurally whole version.
        try:
            result = validate(deps, target.version, compare_live=False, raise_on_failure=False)
            scores = {"passed": result["passed"], "hit_rate": result["hit_rate"], "mrr": result["mrr"],
                      "report": result["report"]}
        except KbError as exc:
            scores = {"passed": None, "error": str(exc)}
            log.warning("kb_reindex: re-scoring v%d failed (%s); rolling back anyway", target.version, exc)
    switch_alias(deps, target, expected_from=live.collection, action=action, run_id=run_id, reason=reason.strip())
    log.info("kb_reindex: rolled %s back from v%d to v%d (%s)", alias, live.version, target.version, reason.strip())
    return {"outcome": "rolled_back", "from_version": live.version, "to_version": target.version,
            "collection": target.collection, "validation": scores, "error": None}


def structural_problems(deps: Deps, version: VersionRecord) -> list[str]:
    """Exact count and IDs against the manifest, dimension and distance against the record."""
    store = deps.store
    if not store.exists(version.collection):
        return [f"collection {version.collection} does not exist"]
    shape = store.shape(version.collection)
    manifest = {row.point_id for row in deps.state.manifest_refs(version.id)}
    problems = []
    if shape.points != len(manifest):
        problems.append(f"{shape.points} points, manifest lists {len(manifest)}")
    elif any(store.id_differences(version.collection, sorted(manifest), points=shape.points)):
        problems.append("point IDs differ from the manifest")
    if shape.dim != version.embed_dim:
        problems.append(f"dimension {shape.dim}, record says {version.embed_dim}")
    if shape.distance != version.distance:
        problems.append(f"distance {shape.distance}, record says {version.distance}")
    return problems
