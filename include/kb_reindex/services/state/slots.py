"""The slots of an alias (`kb_slots`): which physical collections its versions live in, which version's points
each holds, and whether those points were checked to be exactly that version's manifest.

A version *resides* in a slot when its `kb_versions.collection` names it; a version that resides nowhere (its
slot was given to a newer version) is named by its own collection name, which does not exist in Qdrant, and
comes back by a restore. The decisions (which slot a build takes, what is protected) are
`kb_reindex.rules.slots`'; this module only records them, each move in one transaction."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import sqlalchemy as sa

from kb_reindex.domain.errors import KbError
from kb_reindex.services.state.schema import slots, versions

if TYPE_CHECKING:
    from kb_reindex.services.state.clock import Clock

SLOT = "slot"
VAULT = "vault"


@dataclass(frozen=True)
class SlotRow:
    collection: str
    alias: str
    embed_profile: str
    role: str
    holds: int | None  # the kb_versions id whose points it holds
    holds_exact: datetime | None
    created_at: datetime

    @property
    def exact(self) -> bool:
        return self.holds is not None and self.holds_exact is not None


class SlotsMixin:
    """Slot rows of `StateStore`."""

    engine: sa.Engine
    clock: Clock

    def slots(self, alias: str, *, profile: str | None = None, role: str | None = SLOT) -> list[SlotRow]:
        query = sa.select(slots).where(slots.c.alias == alias)
        if profile is not None:
            query = query.where(slots.c.embed_profile == profile)
        if role is not None:
            query = query.where(slots.c.role == role)
        with self.engine.connect() as conn:
            rows = conn.execute(query.order_by(slots.c.created_at, slots.c.collection)).mappings().all()
        return [SlotRow(**dict(row)) for row in rows]

    def slot(self, collection: str) -> SlotRow | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(slots).where(slots.c.collection == collection)).mappings().first()
        return SlotRow(**dict(row)) if row else None

    def add_slot(self, *, alias: str, collection: str, profile: str, role: str = SLOT) -> SlotRow:
        """Record a new slot (or vault); one that exists already is returned as it is (a rerun)."""
        found = self.slot(collection)
        if found is not None:
            if (found.alias, found.embed_profile, found.role) != (alias, profile, role):
                raise KbError(f"collection {collection} is recorded as a {found.role} of {found.alias} "
                              f"({found.embed_profile}), not of {alias} ({profile})")
            return found
        try:
            with self.engine.begin() as conn:
                conn.execute(slots.insert().values(collection=collection, alias=alias, embed_profile=profile,
                                                   role=role, holds=None, holds_exact=None,
                                                   created_at=self.clock.now()))
        except sa.exc.IntegrityError:  # another process recorded it first
            pass
        made = self.slot(collection)
        assert made is not None
        return made

    def forget_slot(self, collection: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(slots.delete().where(slots.c.collection == collection))

    def take_slot(self, *, version_id: int, collection: str, base_version: int | None,
                  evicted_name: str | None) -> None:
        """`version_id` moves into the slot, in one transaction: the version residing there (if any) is named
        `evicted_name` from now on (it resides nowhere), the slot holds the newcomer, not yet checked
        (`holds_exact` NULL), and the newcomer records the base its difference is taken from."""
        now = self.clock.now()
        with self.engine.begin() as conn:
            resident = conn.execute(sa.select(versions.c.id).where(versions.c.collection == collection,
                                                                   versions.c.id != version_id)).scalar()
            if resident is not None:
                if evicted_name is None:
                    raise KbError(f"slot {collection} is taken by another version; nothing was moved")
                conn.execute(versions.update().where(versions.c.id == resident)
                             .values(collection=evicted_name, updated_at=now))
            conn.execute(versions.update().where(versions.c.id == version_id)
                         .values(collection=collection, slot_base=base_version, synced_at=None, updated_at=now))
            conn.execute(slots.update().where(slots.c.collection == collection)
                         .values(holds=version_id, holds_exact=None))

    def mark_slot_exact(self, *, version_id: int, collection: str) -> None:
        """The slot's points were checked to be exactly its version's manifest (validation's structure)."""
        now = self.clock.now()
        with self.engine.begin() as conn:
            conn.execute(slots.update().where(slots.c.collection == collection, slots.c.holds == version_id)
                         .values(holds_exact=now))
            conn.execute(versions.update().where(versions.c.id == version_id, versions.c.collection == collection)
                         .values(synced_at=now))

    def leave_slot(self, *, version_id: int, evicted_name: str) -> None:
        """The version resides nowhere from now on (retention dropped it): its slot keeps its points and
        still says whose they are, so the next build there takes the difference from them."""
        with self.engine.begin() as conn:
            conn.execute(versions.update().where(versions.c.id == version_id)
                         .values(collection=evicted_name, updated_at=self.clock.now()))

    def versions_by_ids(self, ids: Iterable[int]) -> dict[int, str]:
        """id -> status of these versions (what a slot's holder became)."""
        wanted = list(set(ids))
        if not wanted:
            return {}
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(versions.c.id, versions.c.status).where(versions.c.id.in_(wanted))).all()
        return {row.id: row.status for row in rows}
