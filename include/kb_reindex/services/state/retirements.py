"""A knowledge base taken out of service by on-call (`kb-reindex retire`): who retired its alias, when and why,
whether its collections were dropped, and an undo (`retire --undo`). While a retirement is in force nothing
builds, promotes or rolls back the alias (`kb_reindex.rules.retirement`), and the lists of knowledge bases
leave it out (`kb_reindex.run.bases`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kb_reindex.domain.errors import ConfigError
from kb_reindex.services.state.clock import utc_stamp
from kb_reindex.services.state.schema import _table_missing, ensure_table, retirements, rows_unless_missing

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from kb_reindex.services.state.clock import Clock


def _alias_lock_name(alias: str) -> str:
    """The alias lock every alias move holds (`kb_reindex.rules.locking.alias_lock_name`, the same name)."""
    return f"alias:{alias}"


@dataclass(frozen=True)
class Retirement:
    """A retirement in force: the alias, why, who retired it and when (UTC, naive as every state timestamp);
    `dropped_at`: when its collections were dropped (None: kept, the alias still serves)."""

    alias: str
    reason: str
    retired_by: str
    retired_at: datetime
    dropped_by: str | None = None
    dropped_at: datetime | None = None

    @property
    def since(self) -> str:
        return utc_stamp(self.retired_at)

    def describe(self) -> str:
        return f"{self.alias} was retired by {self.retired_by} at {self.since}: {self.reason}"

    def view(self) -> dict[str, Any]:
        """As the JSON answers show it."""
        return {"alias": self.alias, "reason": self.reason, "retired_by": self.retired_by, "retired_at": self.since,
                "collections_dropped": self.dropped_at is not None, "dropped_by": self.dropped_by,
                "dropped_at": utc_stamp(self.dropped_at) if self.dropped_at else None}


@dataclass(frozen=True)
class RetirementEvent:
    """A retirement, its collections dropped, or its undo, as a history event."""

    at: datetime
    action: str  # "retire" | "drop-collections" | "unretire"
    by: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _record(row: Any) -> Retirement:
    return Retirement(alias=row["alias"], reason=row["reason"], retired_by=row["retired_by"],
                      retired_at=row["retired_at"], dropped_by=row["dropped_by"], dropped_at=row["dropped_at"])


class RetirementsMixin:
    """Retirements of `StateStore`."""

    engine: sa.Engine
    clock: Clock

    if TYPE_CHECKING:
        def lock(self, name: str, *, owner: str | None = None, ttl_s: float = 3600,
                 wait_s: float = 0.0) -> AbstractContextManager[str]: ...

    def retire(self, alias: str, *, reason: str, by: str, wait_s: float = 60.0) -> tuple[Retirement, bool]:
        """Retire `alias`: (the retirement in force, whether this call recorded it). One already in force is
        kept as it is (its reason, who and when). Taken under the alias lock, as every alias move checks it:
        once this returns, no move started before it can still move the alias."""
        if not reason or not reason.strip():
            raise ConfigError("a retirement needs a reason (--reason): it is recorded with who retired it and when")
        if not by or not by.strip():
            raise ConfigError("a retirement needs who retires it (by)")
        ensure_table(self.engine, retirements)  # a state DB older than retirements, opened by a state-only command
        with self.lock(_alias_lock_name(alias), ttl_s=60, wait_s=wait_s), self.engine.begin() as conn:
            current = self._active(conn, alias)
            if current is not None:
                return current, False
            conn.execute(retirements.insert().values(alias=alias, reason=reason.strip(), retired_by=by.strip(),
                                                     retired_at=self.clock.now()))
            made = self._active(conn, alias)
        assert made is not None
        return made, True

    def mark_retirement_dropped(self, alias: str, *, by: str) -> Retirement | None:
        """Its collections and alias were dropped (the first time is kept: a rerun that found less to drop)."""
        with self.engine.begin() as conn:
            conn.execute(retirements.update().where(retirements.c.alias == alias, retirements.c.undone_at.is_(None),
                                                    retirements.c.dropped_at.is_(None))
                         .values(dropped_by=by.strip() or "unknown", dropped_at=self.clock.now()))
            return self._active(conn, alias)

    def undo_retirement(self, alias: str, *, by: str) -> Retirement | None:
        """End the retirement of `alias` (kept as history: who undid it, when); the ended one, None if there
        was none."""
        try:
            with self.engine.begin() as conn:
                current = self._active(conn, alias)
                if current is None:
                    return None
                conn.execute(retirements.update().where(retirements.c.alias == alias,
                                                        retirements.c.undone_at.is_(None))
                             .values(undone_by=by.strip() or "unknown", undone_at=self.clock.now()))
        except sa.exc.DBAPIError as exc:
            if _table_missing(exc, retirements.name):  # never retired on a state DB older than retirements
                return None
            raise
        return current

    def retirement(self, alias: str) -> Retirement | None:
        """The retirement in force on `alias`, None when it is not retired (or the state DB predates them)."""
        try:
            with self.engine.connect() as conn:
                return self._active(conn, alias)
        except sa.exc.DBAPIError as exc:
            if _table_missing(exc, retirements.name):
                return None
            raise

    def retired_aliases(self) -> dict[str, Retirement]:
        """Every retirement in force, by alias (none on a state DB older than the table)."""
        rows = rows_unless_missing(self.engine, sa.select(retirements).where(retirements.c.undone_at.is_(None))
                                   .order_by(retirements.c.id), retirements)
        found: dict[str, Retirement] = {}
        for row in rows or ():
            found.setdefault(row["alias"], _record(row))
        return found

    def retirement_events(self, alias: str) -> Iterator[RetirementEvent]:
        """Every retirement of `alias`, its collections dropped and its undo, as history events."""
        rows = rows_unless_missing(self.engine, sa.select(retirements).where(retirements.c.alias == alias)
                                   .order_by(retirements.c.id), retirements)
        for row in rows or ():
            yield RetirementEvent(at=row["retired_at"], action="retire", by=row["retired_by"], reason=row["reason"])
            if row["dropped_at"] is not None:
                yield RetirementEvent(at=row["dropped_at"], action="drop-collections", by=row["dropped_by"],
                                      reason="the alias and every collection of it dropped")
            if row["undone_at"] is not None:
                yield RetirementEvent(at=row["undone_at"], action="unretire", by=row["undone_by"],
                                      reason=f"undoes the retirement of {row['retired_at']:%Y-%m-%d %H:%M:%S} UTC "
                                             f"({row['reason']})")

    @staticmethod
    def _active(conn: sa.Connection, alias: str) -> Retirement | None:
        row = conn.execute(sa.select(retirements).where(retirements.c.alias == alias, retirements.c.undone_at.is_(None))
                           .order_by(retirements.c.id).limit(1)).mappings().first()
        return _record(row) if row else None
