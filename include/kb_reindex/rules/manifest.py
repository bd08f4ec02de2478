"""A version's manifest: written once by the plan's snapshot from what the plan was computed from
(`Prepared`), and the rule that finds an unfinished (or ready, never served) version of the same plan to take
over instead of starting again."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kb_reindex.domain.errors import KbError
from kb_reindex.services.corpus import CorpusScan, KnownDocument, ScannedDocument
from kb_reindex.services.layouts import version_profile
from kb_reindex.domain.lifecycle import BUILDING, FAILED, READY, may_resume
from kb_reindex.rules.locking import run_is_active
from kb_reindex.domain.planning import Plan
from kb_reindex.services.corpus import ChunkRef
from kb_reindex.services.state.manifests import CopiedRows, ManifestChunk, ManifestDocument, ManifestPart
from kb_reindex.services.state.versions import VersionRecord

if TYPE_CHECKING:  # the types alone: importing a rule never imports Qdrant's client
    from kb_reindex.services.runtime import Deps


@dataclass(frozen=True)
class Prepared:
    """The plan plus what it was computed from (facts and references, no texts); never leaves the process.
    Made by `plan.prepare`, snapshotted by `snapshot.snapshot_plan`."""

    plan: Plan
    scan: CorpusScan | None  # None when unchanged files were recognised without reading them (no change)
    reuse: dict[str, str] = field(default_factory=dict)  # chunk_hash -> point id in the live collection
    live: VersionRecord | None = None
    live_documents: list[ManifestDocument] = field(default_factory=list)  # live's, as the plan read them


def same_plan(version: VersionRecord, plan: Plan) -> bool:
    return (
        version.kind == plan.kind
        and version.corpus_fingerprint == plan.fingerprint
        and (version.embedder, version.embed_model, version.chunking_version)
        == (plan.embedder, plan.embed_model, plan.chunking_version)
        and (plan.embed_dim is None or version.embed_dim == plan.embed_dim)
        and (version.base_version, version.base_collection) == (plan.base_version, plan.base_collection)
        and version.payload_layout == plan.payload_layout
        and plan.embed_profile in (None, version_profile(version))
    )


def owned_by_another_active_run(deps: Deps, version: VersionRecord, run_id: str | None) -> bool:
    if not version.run_id or version.run_id == run_id:
        return False
    return run_is_active(deps, version.run_id)


def resumable(deps: Deps, plan: Plan, run_id: str | None) -> VersionRecord | None:
    """An unfinished version of exactly this plan: rerunning continues it instead of starting over. Also
    one built and validated but never promoted (`ready`, never served: its run was killed before the alias
    move, Qdrant refused the move, or the alias was frozen): the rerun validates it again and promotes it,
    embedding nothing. The plan is the same when the manifest (corpus fingerprint), the base (the live
    version it was planned against: live now, as this plan's base is), the model, recipe and layout are.

    Not one that another run is still building: two concurrent runs build two versions, and the
    compare-and-swap lets exactly one of them be promoted.
    """
    for version in deps.state.list_versions(plan.alias, statuses=[BUILDING, FAILED, READY]):
        if version.status == FAILED and not may_resume(version.status, version.failed_step):
            continue
        if version.status == READY and version.promoted_at is not None:  # served: a rollback target
            continue
        if owned_by_another_active_run(deps, version, run_id):
            continue
        # a forced (or migration) plan reuses nothing, so only a version built the same way fits it: none copied
        # from live, none allowed to take the vectors its profile keeps
        if same_plan(version, plan) and (not plan.force_full or _built_anew(deps, version)):
            return version
    return None


def _built_anew(deps: Deps, version: VersionRecord) -> bool:
    """The version embedded every chunk it wrote: it copied none from live and its snapshot let it take none from
    the vectors its profile keeps (`kb_snapshots.reuse_kept`)."""
    snapshot = deps.state.snapshot(version.id)
    return version.chunks_reused == 0 and (snapshot is None or not snapshot.reuse_kept)


def write_manifest(deps: Deps, version: VersionRecord, scan: CorpusScan, reuse: dict[str, str],
                   base: VersionRecord | None = None, base_documents: Sequence[ManifestDocument] = ()) -> None:
    """The plan's documents and chunks (with the live point each reused chunk is copied from) as the version's
    manifest, and its counts on the version row. `base`: live, whose manifest the scan's known documents
    (`CorpusScan.known`, taken unread from it, their chunks counted, not read) come from: their rows are copied
    inside the database (`manifest_parts`), so an edit writes its changed documents' rows, not the knowledge
    base's. A base whose rows are not where its documents' counts put them is read for those rows and the
    manifest written whole. `base_documents`: the base's documents, as the plan read them."""
    if scan.known:
        if base is None:
            raise KbError(f"v{version.version}: the plan took documents unread from a live version but names none")
        # the known documents' rows are the base's as they are (`KnownDocument`): copied in the database too
        read = [_document(d) for d in scan.documents if d.info.knowledge_key not in scan.known]
        if not deps.state.write_manifest_from(version.id, base.id, read, manifest_parts(scan, reuse, base_documents),
                                              copied_documents=scan.known):
            rows = _known_rows(deps, base, scan)
            deps.state.write_manifest(version.id, [_document(d) for d in scan.documents], (
                row for d in scan.documents
                for row in (rows[d.info.knowledge_key] if isinstance(d, KnownDocument)
                            else [_row(c, reuse) for c in d.chunks])))
    else:  # rows are made as they are inserted, a batch at a time, never all at once
        deps.state.write_manifest(version.id, [_document(d) for d in scan.documents],
                                  (_row(c, reuse) for c in scan.read_chunks()))
    total = scan.chunk_total
    reused = scan.reused_chunks(reuse)
    deps.state.update_version(
        version.id, docs_count=len(scan.documents), points_expected=total,
        chunks_reused=reused, chunks_embedded=total - reused,
    )


def _document(d: ScannedDocument | KnownDocument) -> ManifestDocument:
    info = d.info
    return ManifestDocument(knowledge_key=info.knowledge_key, source=info.source, title=info.title,
                            category=info.category, tenant=info.tenant, content_hash=info.content_hash,
                            chunk_count=d.chunk_count)


def _known_rows(deps: Deps, base: VersionRecord, scan: CorpusScan) -> dict[str, list[ManifestChunk]]:
    """The known documents' rows as the base's manifest holds them, each its own vector's source: for a manifest
    written whole. A known document the base holds fewer or more rows of than its count stops the plan: the
    base's manifest is not what its documents say, and no chunk is taken on a guess."""
    rows: dict[str, list[ManifestChunk]] = {key: [] for key in scan.known}
    for row in deps.state.manifest_chunks(base.id):
        if row.knowledge_key in rows:
            rows[row.knowledge_key].append(row._replace(source_point_id=row.point_id))
    for d in scan.documents:
        if isinstance(d, KnownDocument) and len(rows[d.info.knowledge_key]) != d.chunk_count:
            raise KbError(
                f"live v{base.version}'s manifest holds {len(rows[d.info.knowledge_key])} chunk rows of "
                f"{d.info.source} ({d.info.knowledge_key}) but counts {d.chunk_count}: nothing was built. Rebuild "
                "with `kb-reindex run --force-full`, which reads every file")
    return rows


def _row(c: ChunkRef, reuse: dict[str, str]) -> ManifestChunk:
    return ManifestChunk(point_id=c.point_id, knowledge_key=c.knowledge_key, source_point_id=reuse.get(c.chunk_hash),
                         chunk_index=c.chunk_index, chunk_hash=c.chunk_hash)


def manifest_parts(scan: CorpusScan, reuse: dict[str, str], base_documents: Sequence[ManifestDocument]
                   ) -> list[ManifestPart]:
    """The scan's manifest as rows to write and runs of the base's rows to copy: a known document (its chunks
    the base's rows, each reusing its vector) whose base rows sit next to the previous known document's joins
    its run. The base's positions are its documents' chunk counts summed in key order, as its manifest was
    written; `write_manifest_from` counts each run's rows before copying it."""
    starts: dict[str, int] = {}
    position = 0
    for doc in base_documents:  # by knowledge key: manifest order
        starts[doc.knowledge_key] = position
        position += doc.chunk_count
    parts: list[ManifestPart] = []
    run: list[Any] | None = None  # the run of known documents being joined: [start, size, first key, last key]
    for d in scan.documents:
        key = d.info.knowledge_key
        if isinstance(d, KnownDocument):
            start = starts.get(key, -1)
            if run is not None and run[0] + run[1] == start:
                run[1] += d.chunk_count
                run[3] = key
            else:
                if run is not None:
                    parts.append(CopiedRows(*run))
                run = [start, d.chunk_count, key, key]
            continue
        if run is not None:
            parts.append(CopiedRows(*run))
            run = None
        last = parts[-1] if parts else None
        if isinstance(last, list):
            last.extend(_row(c, reuse) for c in d.chunks)
        else:
            parts.append([_row(c, reuse) for c in d.chunks])
    if run is not None:
        parts.append(CopiedRows(*run))
    return parts
