"""Restore: bring a kept version that resides in no slot back into one, from its manifest, embedding nothing.

Its vectors come from the versions that reside in slots of its profile (by chunk hash) and from the profile's
vault, where a slot keeps what it gave up; its payloads from its own manifest. The slot is taken as a build
takes one (`steps/slots.prepare_slot`: never live's, the rollback target's or a protected version's), then
checked in full against the manifest. A rollback to it is then one alias move. Runs under the reindex lock
(`kb-reindex restore`), so no build takes the slot meanwhile.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kb_reindex.services.qdrant import models

from kb_reindex.domain.errors import ConfigError, StoreError
from kb_reindex.domain.lifecycle import DELETED, LIVE, READY, RETIRED
from kb_reindex.rules.checks import structural_problems
from kb_reindex.services.chunking import Chunk
from kb_reindex.services.corpus import DocumentInfo
from kb_reindex.services.embedding import batched
from kb_reindex.services.layouts import payload_text, text_field
from kb_reindex.services.runtime import StepDeps
from kb_reindex.services.state.manifests import ManifestChunk
from kb_reindex.services.state.ports import SlotState
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.steps.build import Progress, payload_for
from kb_reindex.steps.slots import KeptVectors, prepare_slot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreResult:
    version: int
    collection: str
    written: int  # points written (vectors from other slots or the vault)
    kept: int  # points the slot held already
    rewritten: int  # of those, payloads written anew
    already: bool = False  # it resided in a slot already: nothing was done

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "collection": self.collection, "written": self.written, "kept": self.kept,
                "rewritten": self.rewritten, "already_resident": self.already}


def restore_points(deps: StepDeps[SlotState], version: VersionRecord) -> int:
    """How many points a restore of `version` writes at most (its manifest; the slot it takes may hold some)."""
    return 0 if deps.store.exists(version.collection) else version.points_expected


def restore_version(deps: StepDeps[SlotState], number: int) -> RestoreResult:
    alias = deps.settings.alias
    version = deps.state.get_version(alias, number)
    if version is None:
        raise ConfigError(f"--version {number}: {alias} has no version {number}")
    if version.status not in (RETIRED, READY, LIVE):
        hint = " (deleted by retention: beyond KB_KEEP_VERSIONS)" if version.status == DELETED else ""
        raise ConfigError(f"v{number} is {version.status}{hint}; only a kept, whole version can be restored")
    if deps.store.exists(version.collection):
        return RestoreResult(number, version.collection, 0, version.points_expected, 0, already=True)
    if deps.state.snapshot(version.id) is None and not deps.state.manifest_documents(version.id):
        raise ConfigError(f"v{number} has no manifest in the state DB; it cannot be restored")
    version = prepare_slot(deps, version)
    base = deps.state.get_version(alias, version.slot_base) if version.slot_base is not None else None
    if base is None:
        wanted, rewrite, kept = deps.state.slice_rows(version.id), [], 0
    else:
        diff = deps.state.slice_difference(version.id, base.id)
        wanted, rewrite, kept = diff.added, diff.rewrite, diff.kept
    documents = {d.knowledge_key: DocumentInfo(knowledge_key=d.knowledge_key, source=d.source, title=d.title,
                                               category=d.category, tenant=d.tenant, content_hash=d.content_hash)
                 for d in deps.state.manifest_documents(version.id, {r.knowledge_key for r in [*wanted, *rewrite]})}
    present: set[str] = set()
    for batch in batched([r.point_id for r in wanted], deps.settings.copy_batch_size):
        present.update(str(r.id) for r in deps.store.retrieve(version.collection, batch, payload=False))
    wanted = [row for row in wanted if row.point_id not in present]
    sources = _Sources(deps, version)
    progress = Progress(f"restore v{number}", len(wanted))
    for batch in batched(wanted, deps.settings.copy_batch_size):
        found = sources.fetch(list(batch))
        deps.store.upsert(version.collection, [
            models.PointStruct(id=row.point_id, vector=vector,
                               payload=payload_for(Chunk(knowledge_key=row.knowledge_key, chunk_index=row.chunk_index,
                                                         section=section, text=text, chunk_hash=row.chunk_hash,
                                                         point_id=row.point_id), documents[row.knowledge_key], version))
            for row, (vector, text, section) in zip(batch, found, strict=True)])
        progress.advance(len(batch))
    if wanted:
        progress.report()
    spec = base.payload_layout if base is not None else version.payload_layout
    for batch in batched(rewrite, deps.settings.copy_batch_size):
        records = {str(r.id): r for r in deps.store.retrieve(version.collection, [r.point_id for r in batch],
                                                             payload=["section", text_field(spec)])}
        payloads = {}
        for row in batch:
            payload = (records[row.point_id].payload or {}) if row.point_id in records else {}
            text, section = payload_text(payload, spec), payload.get("section")
            if not isinstance(text, str) or not isinstance(section, str):
                raise StoreError(f"slot {version.collection} lacks point {row.point_id} v{number} keeps; start again")
            payloads[row.point_id] = payload_for(Chunk(knowledge_key=row.knowledge_key, chunk_index=row.chunk_index,
                                                       section=section, text=text, chunk_hash=row.chunk_hash,
                                                       point_id=row.point_id), documents[row.knowledge_key], version)
        deps.store.overwrite_payloads(version.collection, payloads)
    problems = structural_problems(deps, version)
    if problems:
        raise StoreError(f"v{number} restored into {version.collection} is not whole: " + "; ".join(problems))
    deps.state.mark_slot_exact(version_id=version.id, collection=version.collection)
    log.info("kb_reindex: v%d restored into %s: %d point(s) written, %d kept (%d payloads rewritten); nothing "
             "embedded. A rollback to it is one alias move now", number, version.collection, len(wanted),
             kept, len(rewrite))
    return RestoreResult(number, version.collection, written=len(wanted), kept=kept, rewritten=len(rewrite))


class _Sources:
    """Where a restored chunk's vector, text and section come from (`steps.slots.KeptVectors`): every one must be
    found, nothing is embedded."""

    def __init__(self, deps: StepDeps[SlotState], version: VersionRecord) -> None:
        self.version, self.kept = version, KeptVectors(deps, version)

    def fetch(self, rows: list[ManifestChunk]) -> list[tuple[list[float], str, str]]:
        hashes = [row.chunk_hash for row in rows]
        found = self.kept.find(hashes)
        lost = [h for h in hashes if h not in found]
        if lost:
            raise StoreError(
                f"v{self.version.version} cannot be restored without embedding: {len(lost)} of its chunks are in no "
                f"slot and not in the vault (first: {lost[0][:12]}). Build it again instead: `kb-reindex run "
                "--force-full` from its sources")
        return [found[h] for h in hashes]
