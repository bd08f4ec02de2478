"""What happened to an alias and what must be kept: alias events (promote, rollback), pins, audits."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kb_reindex import lifecycle
from kb_reindex.model import VersionStatus
from kb_reindex.state.schema import _table_missing, alias_events, audits, pins, versions

if TYPE_CHECKING:
    from kb_reindex.state.clock import Clock
    from kb_reindex.state.versions import VersionRecord


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

    def alias_events(self, alias: str) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(alias_events).where(alias_events.c.alias == alias).order_by(alias_events.c.id)
            ).mappings().all()
        return [dict(row) for row in rows]

    # --- pins and audits ------------------------------------------------------------------------

    def pin_version(self, *, alias: str, version: int, reason: str, by: str) -> dict[str, Any]:
        """Pin (idempotent: an existing pin is returned as it is, its reason kept)."""
        with self.engine.begin() as conn:
            current = self._active_pin(conn, alias, version)
            if current is not None:
                return current
            conn.execute(pins.insert().values(alias=alias, version=version, reason=reason, pinned_by=by,
                                              pinned_at=self.clock.now()))
            return self._active_pin(conn, alias, version)  # type: ignore[return-value]

    def unpin_version(self, *, alias: str, version: int, by: str) -> dict[str, Any] | None:
        """End the pin (kept as a record, who and when); None when the version was not pinned."""
        with self.engine.begin() as conn:
            current = self._active_pin(conn, alias, version)
            if current is None:
                return None
            now = self.clock.now()
            conn.execute(pins.update().where(pins.c.id == current["id"]).values(unpinned_by=by, unpinned_at=now))
            return {**current, "unpinned_by": by, "unpinned_at": now}

    @staticmethod
    def _active_pin(conn: sa.Connection, alias: str, version: int) -> dict[str, Any] | None:
        row = conn.execute(sa.select(pins).where(pins.c.alias == alias, pins.c.version == version,
                                                 pins.c.unpinned_at.is_(None)).order_by(pins.c.id)).mappings().first()
        return dict(row) if row else None

    def active_pins(self, alias: str) -> dict[int, dict[str, Any]]:
        """Version number -> its pin (reason, pinned_by, pinned_at)."""
        try:
            with self.engine.connect() as conn:
                rows = conn.execute(sa.select(pins).where(pins.c.alias == alias, pins.c.unpinned_at.is_(None))
                                    .order_by(pins.c.id)).mappings().all()
        except sa.exc.DBAPIError as exc:
            if _table_missing(exc, pins.name):  # a read-only command on a state DB older than pins
                return {}
            raise
        return {row["version"]: dict(row) for row in rows}

    def record_audit(self, *, alias: str, version: int, collection: str, run_id: str | None, expected: int,
                     points: int, missing: int, orphans: int) -> None:
        with self.engine.begin() as conn:
            conn.execute(audits.insert().values(alias=alias, version=version, collection=collection, run_id=run_id,
                                                expected=expected, points=points, missing=missing, orphans=orphans,
                                                at=self.clock.now()))

    def last_audit(self, alias: str) -> dict[str, Any] | None:
        try:
            with self.engine.connect() as conn:
                row = conn.execute(sa.select(audits).where(audits.c.alias == alias).order_by(audits.c.id.desc())
                                   .limit(1)).mappings().first()
        except sa.exc.DBAPIError as exc:
            if _table_missing(exc, audits.name):  # a read-only command on a state DB older than audits
                return None
            raise
        return dict(row) if row else None

