"""Versions of an alias: allocated, updated through their life (building -> ready -> live -> retired/deleted).

Every status write is `transition_version`: a conditional UPDATE checked against `kb_reindex.domain.lifecycle`."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from typing import TYPE_CHECKING, Any, Unpack

import sqlalchemy as sa

from kb_reindex.domain import lifecycle
from kb_reindex.domain.errors import KbError
from kb_reindex.domain.model import VersionStatus
from kb_reindex.services.state.clock import utc_stamp
from kb_reindex.services.state.manifests import delete_manifests
from kb_reindex.services.state.schema import slots, versions

if TYPE_CHECKING:
    from kb_reindex.services.state.clock import Clock

STATUSES = tuple(VersionStatus)


class VersionFields(lifecycle.StatusStamps, total=False):
    """kb_versions columns as the keywords of a write (`update_version`, `transition_version`), written as
    they are; the validation record, stored as JSON, is a parameter of its own."""

    alias: str
    version: int
    collection: str
    status: str
    kind: str
    embedder: str
    embed_model: str
    embed_dim: int
    distance: str
    chunking_version: str
    corpus_fingerprint: str
    base_version: int | None
    base_collection: str | None
    run_id: str | None
    docs_count: int
    points_expected: int
    points_written: int
    chunks_embedded: int
    chunks_reused: int
    created_at: datetime
    updated_at: datetime
    payload_layout: str
    embed_profile: str | None
    qdrant_snapshot: str | None
    qdrant_snapshot_at: datetime | None
    doc_changes: str | None
    slot_base: int | None
    synced_at: datetime | None


class VersionColumns(VersionFields, total=False):
    """kb_versions columns as the table stores them (`_encoded`): the validation record as JSON."""

    validation: str | None


@dataclass(frozen=True)
class QdrantSnapshotRef:
    """The Qdrant snapshot taken of a version's collection before it was dropped, as status shows it; `at`
    the time as ISO UTC text (`Z`), None when not noted."""

    name: str
    collection: str
    at: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "collection": self.collection, "at": self.at}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QdrantSnapshotRef:
        """As a row written before the snapshot had its own columns keeps it, in its validation record."""
        return cls(name=data["name"], collection=data["collection"], at=data.get("at"))


@dataclass
class VersionRecord:
    id: int
    alias: str
    version: int
    collection: str
    status: str
    kind: str
    embedder: str
    embed_model: str
    embed_dim: int
    distance: str
    chunking_version: str
    corpus_fingerprint: str
    base_version: int | None
    base_collection: str | None
    run_id: str | None
    docs_count: int
    points_expected: int
    points_written: int
    chunks_embedded: int
    chunks_reused: int
    validation: dict[str, Any] | None
    error: str | None
    failed_step: str | None
    created_at: datetime
    updated_at: datetime
    ready_at: datetime | None
    promoted_at: datetime | None
    retired_at: datetime | None
    deleted_at: datetime | None
    payload_layout: str = "native"
    embed_profile: str | None = None
    # the Qdrant snapshot taken before its collection was dropped (KB_SNAPSHOT_BEFORE_DROP), and when
    qdrant_snapshot: str | None = None
    qdrant_snapshot_at: datetime | None = None
    #: what its plan added, changed and removed against its base ({"docs": counts, "doc_keys": keys}); None
    #: for a version planned before it was recorded (or rebuilt from Qdrant)
    doc_changes: dict[str, Any] | None = None
    #: the version whose exact points the slot held when this one took it (its diff's base; None: built whole)
    slot_base: int | None = None
    #: when its points were checked to be exactly its manifest (validation's structural check)
    synced_at: datetime | None = None
    #: the latest move to live (`promoted_at` is the first, kept by a rollback to it); None: never live, or
    #: last live before the column existed (`promoted_at` then says when)
    live_since: datetime | None = None

    @property
    def serving_since(self) -> datetime | None:
        """When it last became live: what a watch window and "live since" count from."""
        return self.live_since or self.promoted_at

    @classmethod
    def from_row(cls, row: sa.RowMapping) -> VersionRecord:
        data = {f.name: row[f.name] for f in fields(cls)}
        data["validation"] = json.loads(data["validation"]) if data["validation"] else None
        data["doc_changes"] = json.loads(data["doc_changes"]) if data["doc_changes"] else None
        return cls(**data)

    def snapshot_view(self) -> QdrantSnapshotRef | None:
        """The Qdrant snapshot of its dropped collection as status shows it; a row written before the column
        existed keeps it in its validation record, under `snapshot`."""
        if self.qdrant_snapshot is None:
            old = (self.validation or {}).get("snapshot")
            return QdrantSnapshotRef.from_dict(old) if old else None
        at = self.qdrant_snapshot_at
        # Qdrant names a snapshot after the collection it was taken of: a version that left its slot was
        # snapshotted there (`<alias>__<model>__s<k>-...`), and its record now names no collection of Qdrant's
        taken_of = self.collection
        in_slot = re.match(r"^(.+__s\d+)-", self.qdrant_snapshot)
        if not self.qdrant_snapshot.startswith(f"{self.collection}-") and in_slot:
            taken_of = in_slot.group(1)
        return QdrantSnapshotRef(name=self.qdrant_snapshot, collection=taken_of, at=utc_stamp(at) if at else None)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able view the CLI and XCom carry (no validation detail, no snapshot)."""
        out = asdict(self)
        for detail in ("validation", "qdrant_snapshot", "qdrant_snapshot_at", "doc_changes", "slot_base", "synced_at"):
            out.pop(detail)
        for key, value in out.items():
            if isinstance(value, datetime):
                out[key] = utc_stamp(value)
        return out


class VersionsMixin:
    """Version rows of `StateStore` (needs `drop_unneeded_texts` of the manifests mixin to forget)."""

    engine: sa.Engine
    clock: Clock
    drop_unneeded_texts: Callable[..., int]  # annotation only: the method is the manifests mixin's

    def allocate_version(self, *, alias: str, collection_for: Any, **columns: Any) -> VersionRecord:
        """Take the next N for this alias. The unique (alias, version) key makes a race lose, then retry."""
        for _attempt in range(20):
            with self.engine.begin() as conn:
                current = conn.execute(sa.select(sa.func.max(versions.c.version)).where(versions.c.alias == alias)).scalar()
                number = (current or 0) + 1
                now = self.clock.now()
                try:
                    result = conn.execute(
                        versions.insert().values(
                            alias=alias,
                            version=number,
                            collection=collection_for(number),
                            status=lifecycle.CREATED,
                            created_at=now,
                            updated_at=now,
                            **columns,
                        )
                    )
                except sa.exc.IntegrityError:
                    continue
                return self.version_by_id(_inserted_id(result), conn=conn)
        raise KbError(f"could not allocate a version number for alias {alias!r} after 20 attempts")

    def insert_version(self, *, alias: str, version: int, **columns: Any) -> VersionRecord:
        """A version with a known number (rebuilt from Qdrant), not allocated, in one of `lifecycle.REBUILT`."""
        if columns.get("status") not in lifecycle.REBUILT:
            raise KbError(f"a version rebuilt from Qdrant cannot be {columns.get('status')!r}")
        now = self.clock.now()
        with self.engine.begin() as conn:
            result = conn.execute(versions.insert().values(**{"created_at": now, "updated_at": now, **columns},
                                                           alias=alias, version=version))
            return self.version_by_id(_inserted_id(result), conn=conn)

    def forget_versions(self, alias: str) -> None:
        """Drop this alias's version rows and manifests (a state being replaced); history and runs stay."""
        with self.engine.begin() as conn:
            delete_manifests(conn, list(conn.execute(sa.select(versions.c.id).where(versions.c.alias == alias)).scalars()))
            conn.execute(versions.delete().where(versions.c.alias == alias))
            # the slots stay (their collections do), but whose points they hold is no longer known
            conn.execute(slots.update().where(slots.c.alias == alias).values(holds=None, holds_exact=None))
        self.drop_unneeded_texts()

    def version_by_id(self, version_id: int, *, conn: sa.Connection | None = None) -> VersionRecord:
        query = sa.select(versions).where(versions.c.id == version_id)
        if conn is not None:
            return VersionRecord.from_row(conn.execute(query).mappings().one())
        with self.engine.connect() as own:
            return VersionRecord.from_row(own.execute(query).mappings().one())

    def get_version(self, alias: str, number: int) -> VersionRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(versions).where(versions.c.alias == alias, versions.c.version == number)
            ).mappings().first()
        return VersionRecord.from_row(row) if row else None

    def list_versions(self, alias: str, *, statuses: Iterable[str] | None = None) -> list[VersionRecord]:
        query = sa.select(versions).where(versions.c.alias == alias)
        if statuses is not None:
            query = query.where(versions.c.status.in_(list(statuses)))
        with self.engine.connect() as conn:
            rows = conn.execute(query.order_by(versions.c.version.desc())).mappings().all()
        return [VersionRecord.from_row(row) for row in rows]

    def live_version(self, alias: str) -> VersionRecord | None:
        live = self.list_versions(alias, statuses=[lifecycle.LIVE])
        if len(live) > 1:
            raise KbError(
                f"state DB marks {len(live)} versions of {alias!r} live "
                f"({', '.join(str(v.version) for v in live)}); run `kb-reindex status` and reconcile"
            )
        return live[0] if live else None

    def update_version(self, version_id: int, *, validation: Mapping[str, Any] | None = None,
                       **columns: Unpack[VersionFields]) -> None:
        """Columns other than the status (counts, the validation record unless None); the status moves by
        `transition_version`."""
        if "status" in columns:
            raise KbError("a version's status moves only through StateStore.transition_version (kb_reindex.domain.lifecycle)")
        values = _encoded(columns, validation)
        values["updated_at"] = self.clock.now()
        with self.engine.begin() as conn:
            conn.execute(versions.update().where(versions.c.id == version_id).values(**values))

    def transition_version(self, version_id: int, *, from_: Iterable[VersionStatus | str], to: VersionStatus | str,
                           conn: sa.Connection | None = None, validation: Mapping[str, Any] | None = None,
                           **columns: Unpack[VersionFields]) -> None:
        """Move a version from one of `from_` to `to` (a move `kb_reindex.domain.lifecycle.TRANSITIONS` allows), with
        the columns the move stamps (`lifecycle.stamps`) and the caller's, as one conditional UPDATE. A row
        that is no longer in `from_` (or gone) updates nothing: `lifecycle.StatusMoved` names what it found.
        `conn`: inside the caller's transaction (an alias switch writes its event and both versions at once)."""
        expected = lifecycle.check(from_, to)
        now = self.clock.now()
        values: VersionColumns = {**lifecycle.stamps(to, now), **_encoded(columns, validation),
                                  "status": VersionStatus(to), "updated_at": now}
        first: dict[str, Any] = {}
        if "promoted_at" in values and "promoted_at" not in columns:  # the first promotion stays (a rollback to it)
            first["promoted_at"] = sa.func.coalesce(versions.c.promoted_at, values.pop("promoted_at"))
        query = (versions.update().where(versions.c.id == version_id, versions.c.status.in_(expected))
                 .values(**values, **first))
        if conn is not None:
            self._moved_or_done(conn, conn.execute(query).rowcount, version_id, expected, to)
            return
        with self.engine.begin() as own:
            self._moved_or_done(own, own.execute(query).rowcount, version_id, expected, to)

    @staticmethod
    def _moved_or_done(conn: sa.Connection, rowcount: int, version_id: int, expected: Iterable[str],
                       to: VersionStatus | str) -> None:
        if rowcount:
            return
        row = conn.execute(sa.select(versions.c.alias, versions.c.version, versions.c.status)
                           .where(versions.c.id == version_id)).first()
        raise lifecycle.StatusMoved(lifecycle.moved_message(
            version=row.version if row else None, alias=row.alias if row else None, expected=expected, to=str(to),
            found=row.status if row else None))

    def add_points_written(self, version_id: int, count: int) -> None:
        with self.engine.begin() as conn:
            conn.execute(versions.update().where(versions.c.id == version_id)
                         .values(points_written=versions.c.points_written + count, updated_at=self.clock.now()))

    def mark_failed(self, version_id: int, *, step: str, error: str,
                    from_: Iterable[VersionStatus | str] = lifecycle.sources(lifecycle.FAILED)) -> None:
        """Failed at `step` (a rerun resumes it when the step is one of `lifecycle.RESUMABLE_STEPS`)."""
        self.transition_version(version_id, from_=from_, to=lifecycle.FAILED, failed_step=step, error=error[:4000])


def _encoded(columns: VersionFields, validation: Mapping[str, Any] | None) -> VersionColumns:
    """Columns as the table stores them: the validation record (when given) as JSON."""
    out: VersionColumns = {**columns}
    if validation is not None:
        out["validation"] = json.dumps(validation, ensure_ascii=False)
    return out


def _inserted_id(result: sa.CursorResult[Any]) -> int:
    """The id of the row an INSERT just made; a driver that reports none is an error, not a guess."""
    key = result.inserted_primary_key
    if key is None:
        raise KbError("the state DB did not report the id of the kb_versions row just inserted")
    return int(key[0])
