"""The narrow parts of the state store that the version model's steps use (slots, build, restore, retention,
the duplicate screen, a held version's review, the query log) and the rules they call: each part a `Protocol`
that `StateStore` satisfies as it is. A step names the parts it reads and writes, not the whole eleven-mixin
store, so its signature says what it can touch and mypy holds it to that (a step that starts pruning manifests
must say so in its signature)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, Unpack

if TYPE_CHECKING:
    import sqlalchemy as sa

    from kb_reindex.domain.model import VersionStatus
    from kb_reindex.services.state.history import AliasEvent, PinRecord
    from kb_reindex.services.state.runs import RunRecord
    from kb_reindex.services.state.manifests import (ManifestChunk, ManifestDocument, ManifestRef,
                                                     PlanSnapshotRow, SliceDifference)
    from kb_reindex.services.state.slots import SlotRow
    from kb_reindex.services.state.versions import VersionFields, VersionRecord


class VersionReads(Protocol):
    """The version records, read."""

    def get_version(self, alias: str, number: int) -> VersionRecord | None: ...

    def version_by_id(self, version_id: int, *, conn: sa.Connection | None = None) -> VersionRecord: ...

    def list_versions(self, alias: str, *, statuses: Iterable[str] | None = None) -> list[VersionRecord]: ...

    def live_version(self, alias: str) -> VersionRecord | None: ...


class VersionWrites(VersionReads, Protocol):
    """The version records, read and moved along their lifecycle."""

    def update_version(self, version_id: int, *, validation: Mapping[str, Any] | None = None,
                       **columns: Unpack[VersionFields]) -> None: ...

    def transition_version(self, version_id: int, *, from_: Iterable[VersionStatus | str], to: VersionStatus | str,
                           conn: sa.Connection | None = None, validation: Mapping[str, Any] | None = None,
                           **columns: Unpack[VersionFields]) -> None: ...

    def mark_failed(self, version_id: int, *, step: str, error: str,
                    from_: Iterable[VersionStatus | str] = ...) -> None: ...


class LockReads(Protocol):
    """Who holds a lock (fencing, whether a run is still active)."""

    def holds_lock(self, name: str, *, owner: str) -> bool: ...

    def lock_held_by(self, name: str) -> str | None: ...


class Locking(LockReads, Protocol):
    """A lock taken for a block (the alias lock around a slot's change of hands, retention)."""

    def lock(self, name: str, *, owner: str | None = None, ttl_s: float = 3600,
             wait_s: float = 0.0) -> AbstractContextManager[str]: ...


class AliasHistory(VersionReads, Protocol):
    """The alias's moves, for the rollback target and the version rolled away from."""

    def alias_events(self, alias: str) -> list[AliasEvent]: ...


class Pins(Protocol):
    def active_pins(self, alias: str) -> dict[int, PinRecord]: ...


class Pinning(Pins, Protocol):
    def pin_version(self, *, alias: str, version: int, reason: str, by: str) -> PinRecord: ...

    def unpin_version(self, *, alias: str, version: int, by: str) -> PinRecord | None: ...


class SlotRecords(Protocol):
    """Which slot holds which version, and the moves between them."""

    def slots(self, alias: str, *, profile: str | None = None, role: str | None = ...) -> list[SlotRow]: ...

    def slot(self, collection: str) -> SlotRow | None: ...

    def add_slot(self, *, alias: str, collection: str, profile: str, role: str = ...) -> SlotRow: ...

    def take_slot(self, *, version_id: int, collection: str, base_version: int | None,
                  evicted_name: str | None) -> None: ...

    def leave_slot(self, *, version_id: int, evicted_name: str) -> None: ...

    def forget_slot(self, collection: str) -> None: ...

    def mark_slot_exact(self, *, version_id: int, collection: str) -> None: ...


class ManifestReads(Protocol):
    """A version's manifest, and its difference from the version its slot held."""

    def manifest_size(self, version_id: int) -> int: ...

    def iter_manifest_refs(self, version_id: int) -> Iterator[ManifestRef]: ...

    def manifest_documents(self, version_id: int, keys: Iterable[str] | None = None) -> list[ManifestDocument]: ...

    def snapshot(self, version_id: int) -> PlanSnapshotRow | None: ...

    def slice_rows(self, version_id: int, window: tuple[int, int] | None = None) -> list[ManifestChunk]: ...

    def slice_difference(self, version_id: int, base_id: int, window: tuple[int, int] | None = None
                         ) -> SliceDifference: ...

    def kept_sample(self, version_id: int, base_id: int, positions: Iterable[int]) -> list[str]: ...

    def added_chunks(self, version_id: int, base_id: int) -> list[ManifestChunk]: ...

    def dropped_chunks(self, version_id: int, base_id: int) -> list[ManifestChunk]: ...

    def chunks_by_hash(self, version_ids: Iterable[int], hashes: Iterable[str]) -> dict[str, tuple[int, str]]: ...


class DuplicateReads(Protocol):
    """What the duplicate screen reads of a version's manifest (`steps.duplicates`)."""

    def shared_chunks(self, version_id: int, keys: Collection[str] | None = None) -> list[ManifestChunk]: ...

    def embedded_chunks(self, version_id: int, keys: Iterable[str] | None = None) -> list[ManifestChunk]: ...

    def manifest_documents(self, version_id: int, keys: Iterable[str] | None = None) -> list[ManifestDocument]: ...


class ReviewReads(Protocol):
    """What a person's review of a held version reads (`steps.review`): its plan's snapshot and the chunk texts
    its flagged lines are shown among."""

    def snapshot(self, version_id: int) -> PlanSnapshotRow | None: ...

    def document_chunks(self, version_id: int, keys: Iterable[str]) -> list[ManifestChunk]: ...

    def texts(self, hashes: Iterable[str]) -> dict[str, tuple[str, str]]: ...


class HeldVersions(VersionWrites, Pins, Protocol):
    """What superseding older held versions reads and writes (`steps.review.supersede_held`): the versions, the
    run each was built by (how it ended), the pins, and the decline."""

    def get_run(self, run_id: str) -> RunRecord | None: ...


class OwnTable(Protocol):
    """The state DB's engine alone, for a step that owns a table of its own there (`steps.querylog`'s log) and
    reads or writes nothing of the store's."""

    @property
    def engine(self) -> sa.Engine: ...


class ManifestUpkeep(Protocol):
    """What retention drops from the state DB once no kept version needs it."""

    def prune_manifests(self, alias: str) -> int: ...

    def drop_unneeded_texts(self, versions_gone: Iterable[int] | None = None) -> int: ...


class ShapeState(VersionReads, ManifestReads, Protocol):
    """The structural check: a version's manifest against its collection."""


class SlotProtection(AliasHistory, Pins, LockReads, Protocol):
    """Which versions no build may take the slot of (`rules.slots.protected_ids`)."""


class SlotState(VersionWrites, SlotRecords, ShapeState, Locking, SlotProtection, Protocol):
    """Bringing a slot to a version, and restoring a kept version into one (`steps.slots`, `steps.restore`)."""


class RetentionState(SlotState, Pinning, ManifestUpkeep, Protocol):
    """Retention, drops and pins (`steps.retention`)."""


class SlotView(VersionReads, SlotRecords, Protocol):
    """Which slot holds which version, with the versions read."""


class BuildState(SlotState, Protocol):
    """A build: its slot, the chunk texts it embeds, and the counts it adds to its version and run."""

    def texts(self, hashes: Iterable[str]) -> dict[str, tuple[str, str]]: ...

    def add_points_written(self, version_id: int, count: int) -> None: ...

    def add_run_chunks(self, run_id: str, *, embedded: int, reused: int) -> None: ...
