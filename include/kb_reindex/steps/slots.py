"""Bringing a slot to a version: take the slot `rules.slots.choose_slot` names, under the alias lock, then empty
it or give up the points the new manifest lacks (their vectors saved to the profile's vault first). What the
version adds is written by the build (`steps/build.py`) or a restore (`steps/restore.py`).

Crash-safe in this order: the state DB records the move first (the version resides in the slot, which holds it
unchecked); a rerun finds the version there and repeats what follows, each part idempotent (deleting an absent
point is no error, a vaulted chunk is not vaulted twice, an emptied slot carries the version's number in its
metadata so it is not emptied again)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import cast

from kb_reindex.services.qdrant import models

from kb_reindex.domain.errors import KbError, StoreError
from kb_reindex.rules.collection_setup import collection_metadata, version_collection_config
from kb_reindex.rules.locking import alias_lock_name
from kb_reindex.rules.slots import Occupancy, choose_slot, next_number, own_name, protected_ids, slot_name, vault_name
from kb_reindex.services.embedding import batched
from kb_reindex.services.layouts import payload_text, text_field, version_profile
from kb_reindex.services.runtime import StepDeps
from kb_reindex.services.state.manifests import ManifestChunk
from kb_reindex.services.state.ports import SlotRecords, SlotState, SlotView
from kb_reindex.domain.lifecycle import DELETED
from kb_reindex.services.state.slots import VAULT
from kb_reindex.services.state.versions import VersionRecord

log = logging.getLogger(__name__)

#: vault points are named by their chunk's hash: one vector per text and profile, written once
VAULT_NAMESPACE = uuid.UUID("6f1d3a52-9c1b-4d7e-8f0a-2b5c7e9d4a13")
#: metadata keys a version's notes add to its collection (validation, the alias): reset when a slot changes hands
NOTES = {"served": False, "validated": False, "hit_rate": None, "mrr": None, "last_served_at": None}


def vault_point_id(chunk_hash: str) -> str:
    return str(uuid.uuid5(VAULT_NAMESPACE, chunk_hash))


def occupancies(deps: StepDeps[SlotView], alias: str) -> list[Occupancy]:
    holders = {v.id: v for v in deps.state.list_versions(alias)}
    return [Occupancy(slot=row, holder=holders.get(row.holds) if row.holds is not None else None)
            for row in deps.state.slots(alias)]


def in_a_slot(deps: StepDeps[SlotRecords], version: VersionRecord) -> bool:
    row = deps.state.slot(version.collection)
    return row is not None and row.role != VAULT


def prepare_slot(deps: StepDeps[SlotState], version: VersionRecord) -> VersionRecord:
    """The version, residing in a slot brought to the point where only its additions are missing: a slot of
    its own already (resumed), a free one taken from its resident (the difference from the exact version it
    holds, or emptied), or a new one. A version made before slots whose own collection exists (a build begun
    by the previous release) goes on in it."""
    alias = version.alias
    if not in_a_slot(deps, version) and deps.store.exists(version.collection):
        return version  # its own collection of old: built there as before
    clear = False
    marked = False  # the slot's metadata names this version already (a resumed build)
    with deps.state.lock(alias_lock_name(alias), ttl_s=300, wait_s=deps.settings.lock_wait_s):
        fresh = deps.state.version_by_id(version.id)
        protected = protected_ids(deps, deps.state.list_versions(alias)) - {fresh.id}
        choice = choose_slot(occupancies(deps, alias), version=fresh, protected=protected)
        config = None
        if choice.resumed:
            collection = fresh.collection
            marked = deps.store.exists(collection) and deps.store.collection_metadata(
                collection).get("kb_version") == fresh.version
            clear = fresh.slot_base is None and not marked
        elif choice.collection is None:
            taken = {row.collection for row in deps.state.slots(alias, role=None)} | deps.store.collection_names()
            collection = slot_name(alias, fresh.embed_model, next_number(taken, alias))
            deps.state.add_slot(alias=alias, collection=collection, profile=version_profile(fresh))
            deps.state.take_slot(version_id=fresh.id, collection=collection, base_version=None, evicted_name=None)
            config = version_collection_config(deps, fresh.base_collection)
            deps.store.create_collection(collection, dim=fresh.embed_dim, config=config,
                                         metadata=collection_metadata(fresh, config))
            log.info("kb_reindex: v%d gets a new slot %s", fresh.version, collection)
        else:
            collection = choice.collection
            base = None if choice.clear or choice.base is None else choice.base.version
            deps.state.take_slot(version_id=fresh.id, collection=collection, base_version=base,
                                 evicted_name=own_name(choice.evict) if choice.evict else None)
            clear = choice.clear
            if choice.evict is not None:
                log.info("kb_reindex: v%d takes slot %s from v%d (kept; a rollback to it restores it first)",
                         fresh.version, collection, choice.evict.version)
    fresh = deps.state.version_by_id(version.id)
    if clear:
        config = version_collection_config(deps, fresh.base_collection)
        deps.store.delete_collection(collection)
        deps.store.create_collection(collection, dim=fresh.embed_dim, config=config,
                                     metadata=collection_metadata(fresh, config))
        log.info("kb_reindex: slot %s emptied for v%d (what it held was not known exactly)", collection, fresh.version)
    elif config is None and not marked:
        shape = deps.store.shape(collection)
        if shape.dim != fresh.embed_dim:
            raise StoreError(f"slot {collection} holds {shape.dim}-d vectors; v{fresh.version} needs {fresh.embed_dim}")
        deps.store.annotate(collection, {**collection_metadata(fresh), **NOTES})
    if fresh.slot_base is not None:
        base_version = deps.state.get_version(alias, fresh.slot_base)
        if base_version is None:
            raise KbError(f"v{fresh.version}'s slot {collection} was taken from v{fresh.slot_base}, which the state DB "
                          "no longer knows; start a new run")
        give_up(deps, fresh, base_version)
    # what the slot holds of the version now (kept points, a resumed build's writes): the page's progress
    # starts there, and mapped slices add only what they write
    deps.state.update_version(fresh.id, points_written=deps.store.count(collection))
    return deps.state.version_by_id(fresh.id)


def vault_of(deps: StepDeps[SlotRecords], version: VersionRecord, *, create: bool) -> str | None:
    """The collection that keeps the vectors of version's profile a slot gave up (by chunk hash)."""
    profile = version_profile(version)
    found = deps.state.slots(version.alias, profile=profile, role=VAULT)
    if found:
        return found[0].collection
    if not create:
        return None
    taken = {row.collection for row in deps.state.slots(version.alias, role=None)} | deps.store.collection_names()
    name = vault_name(version.alias, version.embed_model, next_number(taken, version.alias))
    deps.state.add_slot(alias=version.alias, collection=name, profile=profile, role=VAULT)
    deps.store.create_collection(name, dim=version.embed_dim)
    return name


def give_up(deps: StepDeps[SlotState], version: VersionRecord, base: VersionRecord) -> int:
    """Delete from the version's slot the base's points its manifest lacks, each batch's vectors (with text and
    section) saved to the vault first unless it has their chunk already. The number of points given up."""
    dropped = deps.state.dropped_chunks(version.id, base.id)
    if not dropped:
        return 0
    slot = version.collection
    vault = vault_of(deps, version, create=True)
    assert vault is not None
    layout = text_field(base.payload_layout)
    for batch in batched(dropped, deps.settings.copy_batch_size):
        unique = {row.chunk_hash: row for row in batch}
        have = {str(r.id) for r in deps.store.retrieve(vault, [vault_point_id(h) for h in unique], payload=False)}
        need = [row for h, row in unique.items() if vault_point_id(h) not in have]
        if need:
            records = {str(r.id): r for r in deps.store.retrieve(slot, [r.point_id for r in need], vectors=True,
                                                                  payload=["section", layout])}
            deps.store.upsert(vault, [_vault_point(row, records[row.point_id], base.payload_layout)
                                      for row in need if row.point_id in records])
        deps.store.delete_points(slot, [row.point_id for row in batch])
    log.info("kb_reindex: v%d: %d point(s) of v%d given up in %s (vectors kept in %s)", version.version,
             len(dropped), base.version, slot, vault)
    return len(dropped)


def _vault_point(row: ManifestChunk, record: models.Record, layout: str) -> models.PointStruct:
    payload = record.payload or {}
    if not isinstance(record.vector, list):
        raise StoreError(f"point {row.point_id} returned no vector; the slot drifted: start a new run")
    return models.PointStruct(id=vault_point_id(row.chunk_hash), vector=record.vector,
                              payload={"chunk_hash": row.chunk_hash, "text": payload_text(payload, layout),
                                       "section": payload.get("section")})


def vaulted(deps: StepDeps[object], vault: str | None, hashes: Sequence[str]) -> dict[str, models.Record]:
    """The vault's records (vector, text, section) of these chunk hashes, by hash."""
    if vault is None or not hashes:
        return {}
    out: dict[str, models.Record] = {}
    for batch in batched(list(hashes), deps.settings.copy_batch_size):
        for record in deps.store.retrieve(vault, [vault_point_id(h) for h in batch], vectors=True):
            out[str((record.payload or {}).get("chunk_hash"))] = record
    return out


class KeptVectors:
    """The vectors `version`'s embedding profile keeps, found by chunk hash: in the versions that reside in slots of
    that profile (their manifests say which point holds a hash; the point's own payload must say the same hash),
    then in the profile's vault, where a slot keeps what it gave up. A restore takes every vector from here; a
    build takes from here what live lacks (a held first build saved again, an edit reverted) before embedding."""

    def __init__(self, deps: StepDeps[SlotState], version: VersionRecord) -> None:
        self.deps, self.version = deps, version
        profile = version_profile(version)
        self.residents = {v.id: v for v in deps.state.list_versions(version.alias)
                          if v.id != version.id and v.status != DELETED and version_profile(v) == profile
                          and deps.store.exists(v.collection)}
        self.vault = vault_of(deps, version, create=False)

    def find(self, hashes: Sequence[str]) -> dict[str, tuple[list[float], str, str]]:
        """chunk hash -> (vector, text, section) for those of `hashes` kept anywhere; the others are absent."""
        wanted = list(dict.fromkeys(hashes))
        found: dict[str, tuple[list[float], str, str]] = {}
        if not wanted:
            return found
        located = self.deps.state.chunks_by_hash(list(self.residents), wanted)
        by_collection: dict[int, list[str]] = {}
        for version_id, point_id in located.values():
            by_collection.setdefault(version_id, []).append(point_id)
        for version_id, point_ids in by_collection.items():
            holder = self.residents[version_id]
            field = text_field(holder.payload_layout)
            for batch in batched(point_ids, self.deps.settings.copy_batch_size):
                for record in self.deps.store.retrieve(holder.collection, batch, vectors=True,
                                                       payload=["section", "chunk_hash", field]):
                    payload = record.payload or {}
                    text = payload_text(payload, holder.payload_layout)
                    if isinstance(record.vector, list) and isinstance(text, str):
                        found[str(payload.get("chunk_hash"))] = (cast(list[float], record.vector), text,
                                                                 str(payload.get("section") or ""))
        rest = [h for h in wanted if h not in found]
        for chunk_hash, record in vaulted(self.deps, self.vault, rest).items():
            payload = record.payload or {}
            if isinstance(record.vector, list):
                found[chunk_hash] = (cast(list[float], record.vector), str(payload.get("text")),
                                     str(payload.get("section") or ""))
        return {h: found[h] for h in wanted if h in found}
