"""Step 6, retention: drop failed builds and retired versions beyond `KB_KEEP_VERSIONS`; explicit drops; pins.

Never the live version, the rollback target, a shadow, a build whose run may still retry, or a pinned
version: all of it under the alias lock, so it never races a promotion.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kb_reindex.rules.alias import rollback_target
from kb_reindex.domain.errors import ConfigError, KbError, StoreError
from kb_reindex.domain.lifecycle import BUILDING, DELETED, FAILED, LIVE, READY, RETIRED
from kb_reindex.rules.locking import alias_lock_name, pin_by, run_is_active
from kb_reindex.services.runtime import StepDeps
from kb_reindex.services.state.ports import Pins, RetentionState
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.services.state.clock import utc_stamp, utcnow
from kb_reindex.rules.slots import own_name, protected_ids, surplus_slots
from kb_reindex.services.layouts import version_profile
from kb_reindex.services.state.slots import VAULT
from kb_reindex.steps.slots import in_a_slot, occupancies

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dropped:
    """One version whose collection retention or `kb-reindex drop` dropped (`was`: its status before)."""

    version: int
    collection: str
    was: str
    collection_dropped: bool
    snapshot: str | None = None
    already_deleted: bool = False

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version, "collection": self.collection, "was": str(self.was),
                               "collection_dropped": self.collection_dropped}
        if self.already_deleted:
            return {**out, "already_deleted": True}
        return {**out, "snapshot": self.snapshot}


@dataclass(frozen=True)
class CleanupResult:
    """What a retention pass dropped, the rollback target it kept and the pinned versions it kept too."""

    deleted: tuple[Dropped, ...]
    rollback_target: int | None
    pinned: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"deleted": [d.to_dict() for d in self.deleted], "rollback_target": self.rollback_target,
                "pinned": list(self.pinned)}


@dataclass(frozen=True)
class PinResult:
    version: int
    collection: str
    already_pinned: bool
    reason: str
    pinned_by: str
    pinned_at: str  # ISO, UTC, `Z`

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "collection": self.collection, "pinned": True,
                "already_pinned": self.already_pinned, "reason": self.reason, "pinned_by": self.pinned_by,
                "pinned_at": self.pinned_at}


@dataclass(frozen=True)
class UnpinResult:
    version: int
    was_pinned: bool
    reason: str | None  # the ended pin's

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "pinned": False, "was_pinned": self.was_pinned, "reason": self.reason}


def retention_victims(
    versions: list[VersionRecord], *, keep: int, protected: set[int], pinned: set[int] | frozenset[int] = frozenset()
) -> list[VersionRecord]:
    """Versions whose collections may go: failed builds and retired versions beyond `keep`.

    `keep` counts retired versions besides the protected ones (live, the rollback target) and the pinned
    ones (`pinned`: version ids), as documented: with `KB_KEEP_VERSIONS=2` the rollback target and two more
    retired versions stay. Never a protected one, never a shadow (ready, unpromoted) version, never one
    still building; and while no retired version is protected (no rollback target), never the newest
    retired one, so a rollback stays possible even with `keep` 0.
    """
    protected = set(protected) | set(pinned)
    retired = sorted((v for v in versions if v.status == RETIRED),
                     key=lambda v: (v.retired_at or v.created_at, v.version), reverse=True)
    others = [v for v in retired if v.id not in protected]
    floor = keep if len(others) < len(retired) else max(keep, 1)
    keep_ids = {v.id for v in others[:floor]} | protected
    victims = [v for v in retired if v.id not in keep_ids]
    victims += [v for v in versions if v.status == FAILED and v.id not in protected]
    return sorted(victims, key=lambda v: v.version)


def cleanup(deps: StepDeps[RetentionState]) -> CleanupResult:
    alias = deps.settings.alias
    with deps.state.lock(alias_lock_name(alias), ttl_s=300, wait_s=deps.settings.lock_wait_s):
        target = rollback_target(deps)
        serving = deps.store.alias_target(alias)
        versions = deps.state.list_versions(alias)
        protected = {v.id for v in versions if v.collection == serving}
        if target is not None:
            protected.add(target.id)
        # a failed or unfinished build whose run may still retry is left alone; an abandoned one goes
        protected |= {v.id for v in versions if v.status in (FAILED, BUILDING) and v.run_id
                      and run_is_active(deps, v.run_id)}
        for v in versions:
            if v.status == BUILDING and v.id not in protected:
                deps.state.mark_failed(v.id, step="build", error="abandoned: its run ended without finishing the build",
                                       from_=[BUILDING])
        versions = deps.state.list_versions(alias)
        pinned = pinned_ids(deps, versions)
        deleted: list[Dropped] = []
        gone: list[int] = []
        for victim in retention_victims(versions, keep=deps.settings.keep_versions, protected=protected,
                                        pinned=pinned):
            dropped, snapshot = _drop_collection(deps, victim)
            gone.append(victim.id)
            deleted.append(Dropped(version=victim.version, collection=victim.collection, was=victim.status,
                                   collection_dropped=dropped, snapshot=snapshot))
            log.info("kb_reindex: retention deleted v%d (%s, was %s)", victim.version, victim.collection, victim.status)
        if gone:  # the chunk texts of the plans only these versions needed go with them
            deps.state.drop_unneeded_texts(versions_gone=gone)
        drop_surplus_slots(deps, protected | pinned | {v.id for v in versions if v.status == READY})
        deps.state.prune_manifests(alias)
    return CleanupResult(deleted=tuple(deleted), rollback_target=target.version if target else None,
                         pinned=tuple(sorted(v.version for v in versions if v.id in pinned)))


def drop_version(deps: StepDeps[RetentionState], version_number: int) -> Dropped:
    """Explicitly drop a kept version (e.g. a shadow migration): never the live one or the rollback target."""
    alias = deps.settings.alias
    with deps.state.lock(alias_lock_name(alias), ttl_s=300, wait_s=deps.settings.lock_wait_s):
        version = deps.state.get_version(alias, version_number)
        if version is None:
            raise KbError(f"version {version_number} of {alias} does not exist")
        target = rollback_target(deps)
        if version.status == LIVE or deps.store.alias_target(alias) == version.collection:
            raise KbError(f"v{version.version} is live; roll back or promote another version first")
        if target is not None and target.id == version.id:
            raise KbError(f"v{version.version} is the rollback target; it is kept")
        if version.status == BUILDING:
            raise KbError(f"v{version.version} is still building")
        pin = deps.state.active_pins(alias).get(version.version)
        if pin is not None and version.status != DELETED:
            raise KbError(f"v{version.version} is pinned ({pin.reason!r}, by {pin.pinned_by} at "
                          f"{pin.pinned_at:%Y-%m-%d %H:%M:%S} UTC); `kb-reindex unpin --version {version.version}` "
                          "first if it should go")
        if version.status == DELETED:
            return Dropped(version=version.version, collection=version.collection, was=DELETED,
                           collection_dropped=False, already_deleted=True)
        dropped, snapshot = _drop_collection(deps, version)
        deps.state.drop_unneeded_texts()
    return Dropped(version=version.version, collection=version.collection, was=version.status,
                   collection_dropped=dropped, snapshot=snapshot)


# --- pins ----------------------------------------------------------------------------------------


def pinned_ids(deps: StepDeps[Pins], versions: list[VersionRecord]) -> set[int]:
    """Ids of the versions pinned now (a known-good baseline retention never drops)."""
    numbers = set(deps.state.active_pins(deps.settings.alias))
    return {v.id for v in versions if v.version in numbers}


def pin_version(deps: StepDeps[RetentionState], version_number: int, *, reason: str, by: str | None = None) -> PinResult:
    """Keep a version whatever retention decides, until unpinned. Only a whole version can be kept:
    a failed, building or deleted one is refused by name."""
    alias = deps.settings.alias
    if not reason or not reason.strip():
        raise ConfigError("pin needs --reason (it is recorded with the pin)")
    version = deps.state.get_version(alias, version_number)
    if version is None:
        raise ConfigError(f"--version {version_number}: {alias} has no version {version_number}")
    if version.status in (FAILED, DELETED, BUILDING):
        raise ConfigError(f"v{version.version} is {version.status}; only a live, ready or retired version can be pinned")
    existing = deps.state.active_pins(alias).get(version.version)
    pin = deps.state.pin_version(alias=alias, version=version.version, reason=reason.strip(), by=by or pin_by())
    log.info("kb_reindex: pinned v%d of %s (%s)", version.version, alias, pin.reason)
    return PinResult(version=version.version, collection=version.collection, already_pinned=existing is not None,
                     reason=pin.reason, pinned_by=pin.pinned_by,
                     pinned_at=utc_stamp(pin.pinned_at))


def unpin_version(deps: StepDeps[RetentionState], version_number: int, *, by: str | None = None) -> UnpinResult:
    alias = deps.settings.alias
    if deps.state.get_version(alias, version_number) is None:
        raise ConfigError(f"--version {version_number}: {alias} has no version {version_number}")
    ended = deps.state.unpin_version(alias=alias, version=version_number, by=by or pin_by())
    if ended is not None:
        log.info("kb_reindex: unpinned v%d of %s; retention may drop it again", version_number, alias)
    return UnpinResult(version=version_number, was_pinned=ended is not None, reason=ended.reason if ended else None)


def _drop_collection(deps: StepDeps[RetentionState], version: VersionRecord) -> tuple[bool, str | None]:
    """Delete a version's collection and mark it deleted; with KB_SNAPSHOT_BEFORE_DROP, snapshot it first.

    The snapshot's name and time are kept on the version (`qdrant_snapshot`, `qdrant_snapshot_at`), shown by
    `kb-reindex status --json`. A failed snapshot keeps the collection: nothing is dropped without the copy
    that was asked for."""
    snapshot = None
    if deps.settings.snapshot_before_drop and deps.store.exists(version.collection):
        try:
            snapshot = deps.store.snapshot(version.collection)
        except KbError:
            raise
        except Exception as exc:
            raise StoreError(f"snapshot of {version.collection} (v{version.version}) failed, so it is not dropped: "
                             f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
        deps.state.update_version(version.id, qdrant_snapshot=snapshot, qdrant_snapshot_at=utcnow())
        log.info("kb_reindex: snapshot %s of %s (v%d) taken before dropping it", snapshot, version.collection,
                 version.version)
    if in_a_slot(deps, version):
        # a slot outlives its versions: it keeps the points (and says whose) for the next build's difference,
        # unless the model keeps no more slots of its profile (a shadow of another model dropped)
        slot = version.collection
        deps.state.leave_slot(version_id=version.id, evicted_name=own_name(version))
        protected = protected_ids(deps, deps.state.list_versions(deps.settings.alias)) - {version.id}
        dropped = slot in drop_surplus_slots(deps, protected)
    else:
        dropped = deps.store.delete_collection(version.collection)
    deps.state.transition_version(version.id, from_=[version.status], to=DELETED)
    return dropped, snapshot


def drop_surplus_slots(deps: StepDeps[RetentionState], protected: set[int]) -> list[str]:
    """Slots beyond what the version model keeps (`rules.slots.surplus_slots`) that no kept version resides
    in, and vaults of profiles with no slot and no kept version left: dropped. Their names."""
    alias = deps.settings.alias
    live = deps.state.live_version(alias)
    occupied = occupancies(deps, alias)
    dropped = []
    for row in surplus_slots(occupied, protected=protected, live_profile=version_profile(live) if live else None):
        resident = next((o.resident for o in occupied if o.slot.collection == row.collection), None)
        if resident is not None and resident.status not in (DELETED, FAILED):
            continue  # a kept version lives there: dropped with it, not before
        if resident is not None:
            deps.state.leave_slot(version_id=resident.id, evicted_name=own_name(resident))
        deps.store.delete_collection(row.collection)
        deps.state.forget_slot(row.collection)
        dropped.append(row.collection)
    kept_profiles = {version_profile(v) for v in deps.state.list_versions(alias) if v.status != DELETED}
    slot_profiles = {row.embed_profile for row in deps.state.slots(alias)}
    for vault in deps.state.slots(alias, role=VAULT):
        if vault.embed_profile not in kept_profiles and vault.embed_profile not in slot_profiles:
            deps.store.delete_collection(vault.collection)
            deps.state.forget_slot(vault.collection)
            dropped.append(vault.collection)
    for name in dropped:
        log.info("kb_reindex: retention dropped %s, a slot no version needs", name)
    return dropped
