"""The product's freeze of an alias: set by on-call (`kb-reindex freeze`, a rollback's `--freeze`, the page's
Pause button), lifted by `kb-reindex unfreeze`. While it is in force nothing moves the alias forward: every
promotion checks it under the alias lock (`kb_reindex.rules.freeze`); rollbacks are never held by it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kb_reindex.domain.errors import ConfigError
from kb_reindex.services.state.clock import utc_stamp
from kb_reindex.services.state.schema import _table_missing, ensure_table, freezes, rows_unless_missing

if TYPE_CHECKING:
    from collections.abc import Iterator
    from contextlib import AbstractContextManager

    from kb_reindex.services.state.clock import Clock

#: how long `freeze` waits for a promotion in progress (the alias lock) before it is refused by name
FREEZE_WAIT_S = 60.0


def _alias_lock_name(alias: str) -> str:
    """The alias lock every alias move holds (`kb_reindex.rules.locking.alias_lock_name`, the same name)."""
    return f"alias:{alias}"


@dataclass(frozen=True)
class FreezeEvent:
    """A freeze or unfreeze of an alias, as a history event."""

    at: datetime
    action: str  # "freeze" | "unfreeze"
    by: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Freeze:
    """A freeze in force: which alias, why, who set it and when (UTC, naive as every state timestamp)."""

    alias: str
    reason: str
    set_by: str
    set_at: datetime

    @property
    def since(self) -> str:
        return utc_stamp(self.set_at)

    def describe(self) -> str:
        return f"{self.alias} is frozen since {self.since} by {self.set_by}: {self.reason}"

    def view(self) -> dict[str, Any]:
        """As status, the page and the JSON answers show it."""
        return {"frozen": True, "alias": self.alias, "reason": self.reason, "set_by": self.set_by,
                "set_at": self.since, "message": self.describe()}


def _record(row: Any) -> Freeze:
    return Freeze(alias=row["alias"], reason=row["reason"], set_by=row["set_by"], set_at=row["set_at"])


class FreezesMixin:
    """Freezes of `StateStore`."""

    engine: sa.Engine
    clock: Clock

    if TYPE_CHECKING:
        def lock(self, name: str, *, owner: str | None = None, ttl_s: float = 3600,
                 wait_s: float = 0.0) -> AbstractContextManager[str]: ...

    def freeze(self, alias: str, *, reason: str, by: str, wait_s: float = FREEZE_WAIT_S) -> Freeze:
        """Freeze `alias`; the freeze in force when it already is (its reason, who and when kept).

        Taken under the alias lock, as every alias move checks the freeze: once this returns, no promotion
        started before it can still move the alias."""
        if not reason or not reason.strip():
            raise ConfigError("a freeze needs a reason (--reason): it is shown with the freeze and kept in the history")
        if not by or not by.strip():
            raise ConfigError("a freeze needs who sets it (by)")
        ensure_table(self.engine, freezes)  # a state DB older than freezes, opened by a state-only command
        with self.lock(_alias_lock_name(alias), ttl_s=60, wait_s=wait_s), self.engine.begin() as conn:
            current = self._active_freeze(conn, alias)
            if current is not None:
                return current
            conn.execute(freezes.insert().values(alias=alias, reason=reason.strip(), set_by=by.strip(),
                                                 set_at=self.clock.now()))
            frozen = self._active_freeze(conn, alias)
        assert frozen is not None
        return frozen

    def unfreeze(self, alias: str, *, by: str) -> Freeze | None:
        """Lift the freeze of `alias` (kept as history: who lifted it, when); the lifted freeze, None if
        there was none."""
        with self.engine.begin() as conn:
            current = self._active_freeze(conn, alias)
            if current is None:
                return None
            conn.execute(freezes.update().where(freezes.c.alias == alias, freezes.c.lifted_at.is_(None))
                         .values(lifted_by=by.strip() or "unknown", lifted_at=self.clock.now()))
        return current

    def freeze_status(self, alias: str) -> Freeze | None:
        """The freeze in force on `alias`, None when it is not frozen (or the state DB predates freezes)."""
        try:
            with self.engine.connect() as conn:
                return self._active_freeze(conn, alias)
        except sa.exc.DBAPIError as exc:
            if _table_missing(exc, freezes.name):  # a read-only command on a state DB older than freezes
                return None
            raise

    def freeze_events(self, alias: str) -> Iterator[FreezeEvent]:
        """Every freeze and unfreeze of `alias`, as history events (at, action, by, reason)."""
        rows = rows_unless_missing(self.engine, sa.select(freezes).where(freezes.c.alias == alias)
                                   .order_by(freezes.c.id), freezes)
        for row in rows or ():
            yield FreezeEvent(at=row["set_at"], action="freeze", by=row["set_by"], reason=row["reason"])
            if row["lifted_at"] is not None:
                yield FreezeEvent(at=row["lifted_at"], action="unfreeze", by=row["lifted_by"],
                                  reason=f"lifts the freeze of {row['set_at']:%Y-%m-%d %H:%M:%S} UTC ({row['reason']})")

    @staticmethod
    def _active_freeze(conn: sa.Connection, alias: str) -> Freeze | None:
        row = conn.execute(sa.select(freezes).where(freezes.c.alias == alias, freezes.c.lifted_at.is_(None))
                           .order_by(freezes.c.id).limit(1)).mappings().first()
        return _record(row) if row else None
