"""The version model: versions live in a few physical collections per alias and embedding profile (slots),
reused in turn, so a routine run's work grows with what changed, not with the collection.

- A new version takes a **free slot**: one whose resident (if any) nothing protects. Protected are live, the
  rollback target, a pinned version, a version built and never served (a shadow, a held or frozen one) and a
  build whose run still holds its lock. With live and the rollback target protected, three slots rotate.
- The slot is brought from the version it holds to the new manifest by the **difference**: points the new
  manifest lacks are deleted (their vectors saved to the profile's vault first), points it adds are written
  (vectors copied from live where the chunk exists there, embedded otherwise), points of documents whose
  payload changed get their payload rewritten. The rest is not touched. A slot whose points are not known
  exactly (a build that stopped half-way, a different payload layout) is emptied first: never taken for
  complete.
- The version that resided in the taken slot resides nowhere from then on; it stays kept (KB_KEEP_VERSIONS) and
  comes back by a **restore**: a slot rebuilt from its manifest with vectors from the other slots and the vault,
  nothing embedded.
- Model migrations and shadows are versions of another profile: slots of their own, built whole.

Every decision of the model is made here; the Qdrant mechanics are `services/store.py`'s, the records
`services/state/slots.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kb_reindex.domain.lifecycle import BUILDING, FAILED, LIVE, READY
from kb_reindex.rules.alias import moved_from, rollback_target
from kb_reindex.rules.locking import run_is_active
from kb_reindex.services.layouts import version_profile
from kb_reindex.services.state.slots import SlotRow
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.domain.collections import collection_name, model_slug

if TYPE_CHECKING:  # the types alone: importing a rule never imports Qdrant's client
    from kb_reindex.services.runtime import StepDeps
    from kb_reindex.services.state.ports import SlotProtection

#: slots a profile keeps when nothing else is protected: live, the rollback target and the next candidate
SLOTS_KEPT = 3


def own_name(version: VersionRecord) -> str:
    """The name a version has when it resides in no slot: its collection name of old (`alias__model__vN`), which
    no new version creates, so `exists` says it needs a restore. A version made before slots keeps its own
    collection under that very name and is resident there."""
    return collection_name(version.alias, version.embed_model, version.version)


def slot_name(alias: str, model: str, number: int) -> str:
    return f"{alias}__{model_slug(model)}__s{number}"


def vault_name(alias: str, model: str, number: int) -> str:
    return f"{alias}__{model_slug(model)}__vault{number}"


def next_number(taken: set[str], alias: str) -> int:
    """The lowest slot number no collection of the alias uses (slots and vaults share the count)."""
    used = set()
    for name in taken:
        if not name.startswith(f"{alias}__"):
            continue
        tail = name.rsplit("__", 1)[-1]
        digits = tail[1:] if tail.startswith("s") else tail[5:] if tail.startswith("vault") else ""
        if digits.isdigit():
            used.add(int(digits))
    number = 1
    while number in used:
        number += 1
    return number


def protected_ids(deps: StepDeps[SlotProtection], versions: list[VersionRecord]) -> set[int]:
    """Versions whose slot no build may take: live (by the state DB and by the alias), the rollback target,
    the version served just before live (after a rollback: the one rolled away from), pinned ones, ready ones (built and never served: shadows, held or frozen builds) and builds whose run still
    holds the reindex lock."""
    alias = deps.settings.alias
    serving = deps.store.alias_target(alias)
    ids = {v.id for v in versions if v.status in (LIVE, READY) or v.collection == serving}
    ids |= {v.id for v in (rollback_target(deps), moved_from(deps)) if v is not None}
    pinned = set(deps.state.active_pins(alias))
    ids |= {v.id for v in versions if v.version in pinned}
    ids |= {v.id for v in versions if v.status in (BUILDING, FAILED) and v.run_id and run_is_active(deps, v.run_id)}
    return ids


@dataclass(frozen=True)
class Occupancy:
    """A slot with the version whose points it holds (`holder`, None: none known) and whether that version
    still resides there (`resident`: its record names the slot)."""

    slot: SlotRow
    holder: VersionRecord | None

    @property
    def resident(self) -> VersionRecord | None:
        holder = self.holder
        return holder if holder is not None and holder.collection == self.slot.collection else None


@dataclass(frozen=True)
class SlotChoice:
    """Where a version is built: `collection` (None: a new slot), the version whose exact points it holds
    (`base`: the difference is taken from it), whether it must be emptied first (`clear`), and the resident
    it takes the slot from (`evict`)."""

    collection: str | None
    base: VersionRecord | None = None
    clear: bool = False
    evict: VersionRecord | None = None
    resumed: bool = False  # it resides there already: its recorded base (`slot_base`) stands


def choose_slot(occupancies: list[Occupancy], *, version: VersionRecord, protected: set[int]) -> SlotChoice:
    """The slot `version` is built in: the one it resides in already (a resumed build keeps its base), else a
    free slot of its profile holding an exact version of its layout (the newest: the smallest difference),
    else any free slot (emptied first), else a new one."""
    profile = version_profile(version)
    mine = [o for o in occupancies if o.slot.embed_profile == profile]
    for o in mine:
        if o.resident is not None and o.resident.id == version.id:
            return SlotChoice(o.slot.collection, resumed=True)
    free = [o for o in mine if o.resident is None or o.resident.id not in protected]
    exact = [o for o in free if o.slot.exact and o.holder is not None
             and o.holder.payload_layout == version.payload_layout and o.holder.id != version.id]
    if exact:
        best = max(exact, key=lambda o: o.holder.version if o.holder else -1)
        return SlotChoice(best.slot.collection, base=best.holder, evict=best.resident)
    if free:
        # a slot whose points are unknown (half-built) or of another layout: emptied, then filled whole
        first = min(free, key=lambda o: (o.resident is not None, o.holder.version if o.holder else -1))
        return SlotChoice(first.slot.collection, clear=True, evict=first.resident)
    return SlotChoice(None)


def surplus_slots(occupancies: list[Occupancy], *, protected: set[int], live_profile: str | None) -> list[SlotRow]:
    """Slots retention may drop: of live's profile the free ones beyond what makes SLOTS_KEPT with the protected
    ones, of any other profile every free one (a finished migration's old model keeps only what is protected).
    The slots whose holders are oldest go first."""
    out: list[SlotRow] = []
    by_profile: dict[str, list[Occupancy]] = {}
    for o in occupancies:
        by_profile.setdefault(o.slot.embed_profile, []).append(o)
    for profile, group in by_profile.items():
        free = [o for o in group if o.resident is None or o.resident.id not in protected]
        keep = max(SLOTS_KEPT - (len(group) - len(free)), 0) if profile == live_profile else 0
        ordered = sorted(free, key=lambda o: (o.resident is not None, o.holder.version if o.holder else -1))
        out += [o.slot for o in ordered[:max(len(free) - keep, 0)]]
    return out


@dataclass(frozen=True)
class Residence:
    """Where a kept version stands for a rollback: `resident` (one alias move away) or not (a restore writes
    `restore_points` points first)."""

    version: int
    resident: bool
    restore_points: int

    def to_dict(self) -> dict[str, object]:
        return {"version": self.version, "one_move_away": self.resident,
                "restore_points": 0 if self.resident else self.restore_points}
