"""The plan's snapshot: what every later step needs, written into the state DB once, by the plan.

A plan that builds allocates its version (or takes over an unfinished build of the same plan) and writes,
in this order: the normalised text and section of every chunk it embeds (by chunk hash, shared with other
versions; only hashes not stored yet), the manifest (documents with their payload fields, chunks with their
position), and last the snapshot row with the instruction-like lines and the golden set for validation.
From then on create,
the build slices, validate, promote and cleanup are functions of (alias, version) and never read the
knowledge folder: a file edited during a build changes nothing of it, and the next plan picks the edit up.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kb_reindex.services.corpus import DocumentTexts
from kb_reindex.services.embedding import make_embedder
from kb_reindex.domain.errors import KbError
from kb_reindex.services.layouts import embedding_profile
from kb_reindex.domain.lifecycle import BUILDING, FAILED, READY
from kb_reindex.rules.manifest import Prepared, resumable, write_manifest
from kb_reindex.domain.model import VersionStatus
from kb_reindex.domain.planning import DocChanges, Plan
from kb_reindex.domain.validation_model import NoGoldenSet
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.domain.collections import collection_name
from kb_reindex.services.store import DISTANCE

log = logging.getLogger(__name__)


def snapshot_plan(deps: Deps, prepared: Prepared, *, run_id: str | None = None) -> Plan:
    """Write the plan's snapshot; the plan naming its version (`version`, `collection`, `resumed`).

    Rerun-safe: a plan that dies half-way leaves a version without a snapshot row, which the rerun of the
    same plan takes over and writes again (manifest replaced, texts already stored kept)."""
    plan = prepared.plan
    scan = prepared.scan
    if plan.no_change or scan is None:
        raise KbError("a plan that found nothing to change has nothing to snapshot")
    version = resumable(deps, plan, run_id)
    resumed = version is not None
    if version is None:
        version = _allocate(deps, plan, run_id)
    else:
        was = (f"{version.status} at {version.failed_step}" if version.status == VersionStatus.FAILED
               else version.status)
        deps.state.transition_version(version.id, from_=[BUILDING, FAILED, READY], to=BUILDING, run_id=run_id)
        log.info("kb_reindex: resuming v%d (%s, was %s): the same plan; what it holds is not written again",
                 version.version, version.collection, was)
    try:
        to_embed = _store_texts(deps, prepared, label=f"the plan of v{version.version}")
        write_manifest(deps, version, scan, prepared.reuse, prepared.live, prepared.live_documents)
        # what it changes against its base, for the page's versions table (the plan's own counts and keys)
        changes = DocChanges(docs=plan.docs, doc_keys=plan.doc_keys)
        deps.state.update_version(version.id, doc_changes=json.dumps(changes.to_dict(), ensure_ascii=False))
        # the golden set as the plan checked it (moments ago): the build's validation reads no file; none for a
        # knowledge base that has no golden set (its settings say so again at validation)
        source = deps.settings.golden_set
        golden = None if isinstance(source, NoGoldenSet) else source.read_text(encoding="utf-8")
        # a forced run embeds everything anew; any other may take what it embeds from the vectors its profile
        # keeps (another slot, the vault) where the chunk is there
        deps.state.finish_snapshot(version.id, run_id=run_id, chunks_to_embed=to_embed, flagged=scan.flagged_lines(),
                                   golden=golden, reuse_kept=not plan.force_full)
    except Exception as exc:
        # "create": a rerun of the same plan takes this version over and writes its snapshot again
        deps.state.mark_failed(version.id, step="create", error=str(exc) if isinstance(exc, KbError)
                               else f"{type(exc).__name__}: {exc}", from_=[BUILDING])
        raise
    log.info("kb_reindex: plan snapshot of v%d written (%d chunks, %d to embed)", version.version,
             plan.chunks.total, to_embed)
    return plan.with_snapshot(version=version.version, collection=version.collection, resumed=resumed)


def _allocate(deps: Deps, plan: Plan, run_id: str | None) -> VersionRecord:
    """A new version for the plan, its collection named after the model; a dimension still unknown is
    probed from the embedder now."""
    dim = plan.embed_dim
    if dim is None:
        settings = deps.settings.with_embedder(embedder=plan.embedder, model=plan.embed_model, dim=None)
        dim = make_embedder(settings, headers=deps.ollama_headers).dimension
    return deps.state.allocate_version(
        alias=plan.alias,
        collection_for=lambda n: collection_name(plan.alias, plan.embed_model, n),
        kind=plan.kind, embedder=plan.embedder, embed_model=plan.embed_model, embed_dim=dim,
        distance=DISTANCE.value, chunking_version=plan.chunking_version,
        corpus_fingerprint=plan.fingerprint, base_version=plan.base_version,
        base_collection=plan.base_collection, run_id=run_id, payload_layout=plan.payload_layout,
        embed_profile=embedding_profile(embedder=plan.embedder, model=plan.embed_model, dim=dim,
                                        distance=DISTANCE.value, chunking_version=plan.chunking_version),
    )


def _store_texts(deps: Deps, prepared: Prepared, *, label: str) -> int:
    """Store the texts of the chunks to embed that are not stored yet, reading only their documents again
    (the scan keeps no texts); a file changed since the scan stops the plan by name. The number to embed."""
    settings = deps.settings
    scan = prepared.scan
    assert scan is not None
    reuse = prepared.reuse
    # the known documents' chunks are live's, each reused: only the documents read can have any to embed
    read = scan.read_documents()
    wanted = {c.chunk_hash for d in read for c in d.chunks if c.chunk_hash not in reuse}
    missing = deps.state.missing_texts(wanted)
    if missing:
        texts = DocumentTexts(deps.knowledge, {d.info.knowledge_key: d.info for d in scan.documents},
                              max_bytes=settings.max_doc_bytes, chunk_size=settings.chunk_size,
                              overlap=settings.chunk_overlap, version_label=label,
                              default_tenant=settings.default_tenant)

        def rows() -> Any:
            for d in read:
                for c in d.chunks:
                    if c.chunk_hash in missing:
                        chunk = texts.chunk(c.knowledge_key, c.point_id)
                        missing.discard(c.chunk_hash)  # the same text in two places is stored once
                        yield {"chunk_hash": chunk.chunk_hash, "section": chunk.section, "text": chunk.text}

        deps.state.add_texts(rows())
    return sum(1 for d in read for c in d.chunks if c.chunk_hash not in reuse)
