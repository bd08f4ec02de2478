"""What happened to an alias and what must be kept: alias events (promote, rollback), pins, audits."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kb_reindex.domain import lifecycle
from kb_reindex.domain.model import VersionStatus
from kb_reindex.services.state.schema import _table_missing, alias_events, audits, pins, versions

if TYPE_CHECKING:
    from kb_reindex.services.state.clock import Clock
    from kb_reindex.services.state.versions import VersionRecord


@dataclass(frozen=True)
class AliasEvent:
    """One row of `kb_alias_events`: the alias moved (promote, rollback, reconcile, ...) from one version to
    another, by which run and why."""

    id: int
    alias: str
    action: str
    from_collection: str | None
    to_collection: str
    from_version: int | None
    to_version: int | None
    run_id: str | None
    reason: str | None
    at: datetime
    #: who moved it (the Airflow user who triggered the run, the CLI's login user); None: a scheduled run
    moved_by: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> AliasEvent:
        return cls(id=row["id"], alias=row["alias"], action=row["action"], from_collection=row["from_collection"],
                   to_collection=row["to_collection"], from_version=row["from_version"],
                   to_version=row["to_version"], run_id=row["run_id"], reason=row["reason"], at=row["at"],
                   moved_by=row.get("moved_by"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PinRecord:
    """One row of `kb_pins`: a version kept whatever retention decides, why, by whom and since when; an ended
    pin keeps its row, with who ended it and when."""

    id: int
    alias: str
    version: int
    reason: str
    pinned_by: str
    pinned_at: datetime
    unpinned_by: str | None = None
    unpinned_at: datetime | None = None

    @classmethod
    def from_row(cls, row: Any) -> PinRecord:
        return cls(id=row["id"], alias=row["alias"], version=row["version"], reason=row["reason"],
                   pinned_by=row["pinned_by"], pinned_at=row["pinned_at"], unpinned_by=row["unpinned_by"],
                   unpinned_at=row["unpinned_at"])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class AuditRecord:
    """One row of `kb_audits`: a full audit of a live version against its manifest (`kb_reindex.rules.audit`)."""

    id: int
    alias: str
    version: int
    collection: str
    run_id: str | None
    expected: int
    points: int
    missing: int
    orphans: int
    at: datetime

    @classmethod
    def from_row(cls, row: Any) -> AuditRecord:
        return cls(id=row["id"], alias=row["alias"], version=row["version"], collection=row["collection"],
                   run_id=row["run_id"], expected=row["expected"], points=row["points"], missing=row["missing"],
                   orphans=row["orphans"], at=row["at"])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class HistoryMixin:
    """Alias events, pins and audits of `StateStore`."""

    engine: sa.Engine
    clock: Clock
    transition_version: Callable[..., None]  # annotation only: the method is the versions mixin's

    # --- alias events ---------------------------------------------------------------------------

    def record_switch(
        self,
        *,
        alias: str,
        action: str,
        to: VersionRecord,
        previous: VersionRecord | None,
        run_id: str | None,
        reason: str | None = None,
        from_: Iterable[VersionStatus | str] = lifecycle.SWITCHABLE,
        by: str | None = None,
    ) -> None:
        """The state side of an alias move, in one transaction: the event, `previous` live -> retired, `to`
        (in one of `from_`) -> live. A version found elsewhere than that (or another one live besides
        `previous`) undoes all of it and raises `lifecycle.StatusMoved`."""
        with self.engine.begin() as conn:
            conn.execute(
                alias_events.insert().values(
                    alias=alias,
                    action=action,
                    from_collection=previous.collection if previous else None,
                    to_collection=to.collection,
                    from_version=previous.version if previous else None,
                    to_version=to.version,
                    run_id=run_id,
                    reason=reason,
                    at=self.clock.now(),
                    moved_by=by,
                )
            )
            if previous is not None and previous.id != to.id:
                self.transition_version(previous.id, from_=[lifecycle.LIVE], to=lifecycle.RETIRED, conn=conn)
            others = conn.execute(sa.select(versions.c.version).where(
                versions.c.alias == alias, versions.c.status == lifecycle.LIVE, versions.c.id != to.id)).scalars().all()
            if others:
                raise lifecycle.StatusMoved(
                    f"v{', v'.join(map(str, others))} of {alias} is live now, not "
                    f"{f'v{previous.version}' if previous else 'nothing'} as expected: it was changed underneath this "
                    f"move to v{to.version}; nothing was recorded. Check `kb-reindex status`")
            self.transition_version(to.id, from_=from_, to=lifecycle.LIVE, conn=conn)

    def add_alias_event(self, *, alias: str, action: str, to: VersionRecord, previous: VersionRecord | None,
                        run_id: str | None, reason: str | None = None) -> None:
        with self.engine.begin() as conn:
            conn.execute(alias_events.insert().values(
                alias=alias, action=action, from_collection=previous.collection if previous else None,
                to_collection=to.collection, from_version=previous.version if previous else None,
                to_version=to.version, run_id=run_id, reason=reason, at=self.clock.now()))

    def alias_events(self, alias: str) -> list[AliasEvent]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(alias_events).where(alias_events.c.alias == alias).order_by(alias_events.c.id)
            ).mappings().all()
        return [AliasEvent.from_row(row) for row in rows]

    # --- pins and audits ------------------------------------------------------------------------

    def pin_version(self, *, alias: str, version: int, reason: str, by: str) -> PinRecord:
        """Pin (idempotent: an existing pin is returned as it is, its reason kept)."""
        with self.engine.begin() as conn:
            current = self._active_pin(conn, alias, version)
            if current is not None:
                return current
            conn.execute(pins.insert().values(alias=alias, version=version, reason=reason, pinned_by=by,
                                              pinned_at=self.clock.now()))
            return self._active_pin(conn, alias, version)  # type: ignore[return-value]

    def unpin_version(self, *, alias: str, version: int, by: str) -> PinRecord | None:
        """End the pin (kept as a record, who and when); None when the version was not pinned."""
        with self.engine.begin() as conn:
            current = self._active_pin(conn, alias, version)
            if current is None:
                return None
            now = self.clock.now()
            conn.execute(pins.update().where(pins.c.id == current.id).values(unpinned_by=by, unpinned_at=now))
            return replace(current, unpinned_by=by, unpinned_at=now)

    @staticmethod
    def _active_pin(conn: sa.Connection, alias: str, version: int) -> PinRecord | None:
        row = conn.execute(sa.select(pins).where(pins.c.alias == alias, pins.c.version == version,
                                                 pins.c.unpinned_at.is_(None)).order_by(pins.c.id)).mappings().first()
        return PinRecord.from_row(row) if row else None

    def active_pins(self, alias: str) -> dict[int, PinRecord]:
        """Version number -> its pin (reason, pinned_by, pinned_at)."""
        try:
            with self.engine.connect() as conn:
                rows = conn.execute(sa.select(pins).where(pins.c.alias == alias, pins.c.unpinned_at.is_(None))
                                    .order_by(pins.c.id)).mappings().all()
        except sa.exc.DBAPIError as exc:
            if _table_missing(exc, pins.name):  # a read-only command on a state DB older than pins
                return {}
            raise
        return {row["version"]: PinRecord.from_row(row) for row in rows}

    def record_audit(self, *, alias: str, version: int, collection: str, run_id: str | None, expected: int,
                     points: int, missing: int, orphans: int) -> None:
        with self.engine.begin() as conn:
            conn.execute(audits.insert().values(alias=alias, version=version, collection=collection, run_id=run_id,
                                                expected=expected, points=points, missing=missing, orphans=orphans,
                                                at=self.clock.now()))

    def last_audit(self, alias: str) -> AuditRecord | None:
        try:
            with self.engine.connect() as conn:
                row = conn.execute(sa.select(audits).where(audits.c.alias == alias).order_by(audits.c.id.desc())
                                   .limit(1)).mappings().first()
        except sa.exc.DBAPIError as exc:
            if _table_missing(exc, audits.name):  # a read-only command on a state DB older than audits
                return None
            raise
        return AuditRecord.from_row(row) if row else None

