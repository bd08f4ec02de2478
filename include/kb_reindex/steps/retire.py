"""Retiring a knowledge base (`kb-reindex retire`): on-call takes it out of service for good, or until undone.

1. The retirement is recorded (who, when, why) under the alias lock, so from then on no run plans it and no move
   of its alias goes through (`kb_reindex.rules.retirement`), whatever started before.
2. Its reindex lock is taken from a run in progress (recorded in the lock history, as `unlock` does): that run's
   next write batch or renewal finds the lock gone and stops, fenced (`kb_reindex.rules.fence`), before it writes
   or promotes anything more. Runs still recorded running with a version are recorded as failed, and its
   versions still building as failed at their build (a rerun after an undo resumes them).
3. Asked for (`--drop-collections`), under the alias lock: the alias is deleted and every collection of the
   alias (every version's, slot and vault) is dropped; the versions are recorded deleted, their rows kept as
   history. Without it the alias and its collections stay: the assistant keeps reading what was live.

Every part is safe to repeat: a second `retire` finds the retirement in force (kept as it was), no lock, no run
in progress, and (with `--drop-collections`) drops whatever is left, e.g. what a build that was still stopping
made meanwhile. Reads the state DB only, and Qdrant only to drop: a build that holds a local-mode store does
not keep on-call from retiring.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from kb_reindex.domain.errors import ConfigError, KbError, StoreError
from kb_reindex.domain.lifecycle import BUILDING, DELETED, FAILED, LIVE, RETIRED, StatusMoved
from kb_reindex.domain.model import VersionStatus
from kb_reindex.rules.locking import alias_lock_name, reindex_lock_name
from kb_reindex.rules.slots import own_name
from kb_reindex.services.runtime import Deps, StateDeps
from kb_reindex.services.state.retirements import Retirement
from kb_reindex.services.store import KnowledgeStore, has_store, open_store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dropped:
    """What `--drop-collections` removed: the collection the alias pointed to (None: there was no alias), the
    collections dropped now, the snapshots taken first (KB_SNAPSHOT_BEFORE_DROP), the versions recorded deleted."""

    alias_was: str | None
    collections: tuple[str, ...]
    snapshots: tuple[str, ...]
    versions_deleted: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"alias_was": self.alias_was, "collections": list(self.collections), "snapshots": list(self.snapshots),
                "versions_deleted": list(self.versions_deleted)}


@dataclass(frozen=True)
class RetireResult:
    """What `retire` did. `already`: the knowledge base was retired before (the retirement kept as it was);
    `lock_taken`: the owner of the reindex lock taken from a run in progress; `dropped`: None without
    `--drop-collections` (the alias and its collections are kept)."""

    retirement: Retirement
    already: bool
    lock_taken: str | None
    failed_runs: tuple[str, ...]
    failed_versions: tuple[int, ...]
    dropped: Dropped | None

    @property
    def message(self) -> str:
        r = self.retirement
        lines = [f"{r.alias} was already retired by {r.retired_by} at {r.since}: {r.reason} (kept as it was)"
                 if self.already else f"{r.describe()}"]
        if self.lock_taken:
            lines.append(f"took its reindex lock from {self.lock_taken}: that build is fenced, it stops at its next "
                         "write or renewal and promotes nothing")
        if self.failed_runs:
            lines.append(f"recorded as failed: run(s) {', '.join(self.failed_runs)}")
        if self.failed_versions:
            lines.append(f"recorded as failed: building version(s) {', '.join(f'v{n}' for n in self.failed_versions)}")
        if self.dropped is None:
            lines.append(f"kept: the alias {r.alias} and its collections; the assistant keeps reading what was live "
                         "(`--drop-collections` drops them)")
        else:
            d = self.dropped
            lines.append(f"dropped: the alias {r.alias} (was {d.alias_was})" if d.alias_was else
                         f"no alias {r.alias} to drop")
            lines.append(f"dropped {len(d.collections)} collection(s): {', '.join(d.collections)}" if d.collections
                         else "no collection of it left to drop")
            if d.snapshots:
                lines.append(f"snapshots taken first: {', '.join(d.snapshots)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"alias": self.retirement.alias, "retired": True, "already_retired": self.already,
                "retirement": self.retirement.view(), "lock_taken": self.lock_taken,
                "failed_runs": list(self.failed_runs), "failed_versions": list(self.failed_versions),
                "collections_kept": self.dropped is None,
                "dropped": self.dropped.to_dict() if self.dropped else None, "message": self.message}


def retire(deps: Deps | StateDeps, *, reason: str, by: str, drop_collections: bool = False) -> RetireResult:
    """Retire the knowledge base of `deps` (see the module): recorded, its reindexing ended, and with
    `drop_collections` its alias and collections dropped (through `deps.store` when `deps` has one, else a
    store opened for the drop alone)."""
    alias = deps.settings.alias
    retirement, recorded = deps.state.retire(alias, reason=reason, by=by, wait_s=deps.settings.lock_wait_s)
    why = f"{alias} was retired by {retirement.retired_by} at {retirement.since} ({retirement.reason})"
    holder = deps.state.break_lock(reindex_lock_name(alias), by=by, reason=f"retire: {retirement.reason}")
    if holder is not None:
        log.warning("kb_reindex: took the reindex lock of %s from %s: its next write is fenced", alias, holder.owner)
    failed_runs = deps.state.fail_orphaned_runs(alias, current="", error=f"ended: {why}; its lock was taken")
    failed_versions = []
    for version in deps.state.list_versions(alias, statuses=[BUILDING]):
        try:
            deps.state.mark_failed(version.id, step="build", error=f"not finished: {why}", from_=[BUILDING])
        except StatusMoved:  # the fenced build recorded its own end meanwhile
            continue
        failed_versions.append(version.version)
    dropped = _drop(deps) if drop_collections else None
    if dropped is not None:
        retirement = deps.state.mark_retirement_dropped(alias, by=by) or retirement
    log.info("kb_reindex: %s%s", why, "" if recorded else " (already)")
    return RetireResult(retirement=retirement, already=not recorded,
                        lock_taken=holder.owner if holder is not None else None, failed_runs=tuple(failed_runs),
                        failed_versions=tuple(failed_versions), dropped=dropped)


def unretire(deps: Deps | StateDeps, *, by: str) -> Retirement | None:
    """Undo the retirement (kept as history); the ended one, None when the knowledge base was not retired. Its
    runs, promotions and rollbacks go on again; dropped collections are not brought back (the next run builds
    version from scratch)."""
    return deps.state.undo_retirement(deps.settings.alias, by=by)


def alias_collections(deps: Deps) -> list[str]:
    """Every collection of the alias Qdrant holds: each version's, slot's and vault's the state DB records,
    and any named `<alias>__<model>__v<N>|s<k>|vault<k>` it does not (a build that died before recording it).
    An alias holds no `__`, so no other alias's collection matches."""
    alias = deps.settings.alias
    named = re.compile(rf"^{re.escape(alias)}__[a-z0-9-]+__(?:v|s|vault)\d+$")
    recorded = ({row.collection for row in deps.state.slots(alias, role=None)}
                | {v.collection for v in deps.state.list_versions(alias)})
    return sorted(name for name in deps.store.collection_names() if name in recorded or named.match(name))


def _drop(deps: Deps | StateDeps) -> Dropped:
    if isinstance(deps, Deps):
        return drop_alias_and_collections(deps, deps.store)
    if not has_store(deps.settings):  # nothing was ever stored in its local-mode folder
        return drop_alias_and_collections(deps, None)
    with open_store(deps.settings, create=False) as store:
        return drop_alias_and_collections(deps, store)


def drop_alias_and_collections(deps: Deps | StateDeps, store: KnowledgeStore | None) -> Dropped:
    """Under the alias lock: delete the alias, drop every collection of it from `store` (snapshotted first with
    KB_SNAPSHOT_BEFORE_DROP; a failed snapshot drops nothing), forget its slots and record every version
    deleted. `store` None: nothing was ever stored (no local-mode folder), only the records change."""
    alias = deps.settings.alias
    if deps.state.retirement(alias) is None:
        raise ConfigError(f"{alias} is not retired: its collections are dropped only by `kb-reindex retire "
                          "--drop-collections`")
    with deps.state.lock(alias_lock_name(alias), ttl_s=300, wait_s=deps.settings.lock_wait_s):
        was, names, snapshots = None, [], []
        if store is not None:
            names = alias_collections(Deps(settings=deps.settings, state=deps.state, store=store))
            snapshots = _snapshots(store, alias, names) if deps.settings.snapshot_before_drop else []
            was = store.delete_alias(alias)
            for name in names:
                store.delete_collection(name)
        for row in deps.state.slots(alias, role=None):
            deps.state.forget_slot(row.collection)
        deleted = _record_deleted(deps)
        deps.state.drop_unneeded_texts()
    log.info("kb_reindex: %s retired: alias %s, %d collection(s) dropped", alias, "deleted" if was else "absent",
             len(names))
    return Dropped(alias_was=was, collections=tuple(names), snapshots=tuple(snapshots), versions_deleted=deleted)


def _snapshots(store: KnowledgeStore, alias: str, names: list[str]) -> list[str]:
    """A snapshot of each collection before anything is dropped, as retention takes them; one that fails stops
    the drop with nothing dropped."""
    taken = []
    for name in names:
        try:
            taken.append(store.snapshot(name))
        except KbError:
            raise
        except Exception as exc:
            raise StoreError(f"snapshot of {name} failed, so nothing of {alias} is dropped: "
                             f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
        log.info("kb_reindex: snapshot %s of %s taken before dropping it", taken[-1], name)
    return taken


#: the moves that bring a version of each status to deleted (`kb_reindex.domain.lifecycle.TRANSITIONS`)
_TO_DELETED: dict[str, tuple[VersionStatus, ...]] = {LIVE: (RETIRED, DELETED), BUILDING: (FAILED, DELETED)}


def _record_deleted(deps: Deps | StateDeps) -> tuple[int, ...]:
    """Every version not yet deleted recorded deleted (its row, manifest and scores kept as history), renamed to
    the name it has outside a slot, as retention leaves a slot."""
    deleted = []
    for version in sorted(deps.state.list_versions(deps.settings.alias), key=lambda v: v.version):
        if version.status == DELETED:
            continue
        if version.collection != own_name(version):
            deps.state.leave_slot(version_id=version.id, evicted_name=own_name(version))
        status = version.status
        for to in _TO_DELETED.get(status, (DELETED,)):
            deps.state.transition_version(version.id, from_=[status], to=to)
            status = to
        deleted.append(version.version)
    return tuple(deleted)
