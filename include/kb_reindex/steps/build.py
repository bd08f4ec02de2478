"""Steps 2 and 3: allocate a version with its collection, then fill it.

Unchanged chunks get their vector copied from the live collection; only the rest is embedded. Point IDs
are stable, and points already in the collection are skipped, so a retried or rerun build resumes where
it stopped: no duplicate points, no embedding twice.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, cast

from kb_reindex.services.qdrant import models

from kb_reindex.services.chunking import Chunk
from kb_reindex.services.corpus import DocumentInfo
from kb_reindex.services.embedding import Embedder, batched
from kb_reindex.domain.errors import EmbeddingError, FencedError, KbError, StoreError, one_line
from kb_reindex.rules.fence import Fence
from kb_reindex.services.layouts import payload_text, shape_payload, text_field
from kb_reindex.domain.lifecycle import BUILDABLE, BUILDING, FAILED, may_resume
from kb_reindex.domain.model import VersionStatus
from kb_reindex.domain.planning import BuildResult, CreatedVersion, Plan
from kb_reindex.services.runtime import StepDeps
from kb_reindex.services.sources import Document, sha256_text
from kb_reindex.services.state.manifests import ManifestChunk
from kb_reindex.services.state.ports import BuildState
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.steps.slots import KeptVectors, prepare_slot
from kb_reindex.domain.vectors import check_vectors

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 1.0


@dataclass
class BuildCounts:
    """What one build call did, kept up to date as batches are written: a build that fails still says
    what it wrote (a resumed run skips what an earlier one wrote and must not count it again)."""

    embedded: int = 0
    copied: int = 0
    skipped: int = 0
    kept: int = 0  # held by the slot from the version it was taken from


class BuildDeps(StepDeps[BuildState], Protocol):
    """What a build takes: the slot's part of the state store, the Qdrant store, and the model a version was
    built with (`Deps.embedder_for`)."""

    def embedder_for(self, version: VersionRecord) -> Embedder: ...


def create_version(deps: BuildDeps, plan: Plan, *, run_id: str | None = None) -> CreatedVersion:
    """Create the collection of the version the plan snapshotted (`plan.version`): the plan step
    (`pipeline.plan_step`, `pipeline.plan_and_snapshot`) snapshots a plan that builds, before this."""
    if plan.version is None:  # not snapshotted
        raise KbError(f"this plan of {plan.alias} has no snapshot (planned with `plan.plan` alone?); plan and "
                      "snapshot it first (`pipeline.plan_and_snapshot`), or start a new run")
    live = deps.state.live_version(plan.alias)
    now = live.collection if live else None
    if now != plan.base_collection:
        raise KbError(
            f"the live version changed since this run planned (planned against {plan.base_collection or 'nothing'}, "
            f"now {now or 'nothing'}); start a new run"
        )
    version = deps.state.get_version(plan.alias, plan.version)
    if version is None:
        raise KbError(f"version {plan.version} of {plan.alias} does not exist")
    if not may_resume(version.status, version.failed_step):
        raise KbError(f"v{version.version} is {version.status}; its plan cannot be built (start a new run)")
    if deps.state.snapshot(version.id) is None:
        raise KbError(f"v{version.version} has no snapshot of its plan (its plan did not finish, or it was planned "
                      "before snapshots existed); start a new run")
    if version.status == FAILED or (run_id is not None and version.run_id != run_id):
        deps.state.transition_version(version.id, from_=BUILDABLE, to=BUILDING,
                                      run_id=version.run_id if run_id is None else run_id)

    try:
        # the slot it is built in, brought from the version it holds to where only this one's additions are
        # missing (kb_reindex.rules.slots); a resumed version keeps its slot and the base it took it from
        version = prepare_slot(deps, version)
    except Exception as exc:
        deps.state.mark_failed(version.id, step="create", error=str(exc) if isinstance(exc, KbError)
                               else f"{type(exc).__name__}: {exc}", from_=BUILDABLE)
        raise
    log.info(
        "kb_reindex: v%d -> collection %s (%d-d %s, %d points planned)",
        version.version, version.collection, version.embed_dim, version.distance, version.points_expected,
    )
    return CreatedVersion(version=version.version, collection=version.collection, resumed=plan.resumed,
                          embed_model=version.embed_model, embed_dim=version.embed_dim,
                          points_to_write=max(version.points_expected - version.points_written, 0))


def payload_for(chunk: Chunk, doc: DocumentInfo | Document, version: VersionRecord) -> models.Payload:
    """The point's payload in the version's layout (kb_reindex.services.layouts): the engine's fields always flat."""
    return shape_payload({
        "text": chunk.text,
        "knowledge_key": chunk.knowledge_key,
        "source": doc.source,
        "title": doc.title,
        "category": doc.category,
        "section": chunk.section,
        "tenant": doc.tenant,
        "chunk_index": chunk.chunk_index,
        "chunk_hash": chunk.chunk_hash,
        "content_hash": doc.content_hash,
        "embed_model": version.embed_model,
        "chunking_version": version.chunking_version,
        "version": version.version,
    }, version.payload_layout, point_id=chunk.point_id)


class Progress:
    """A build's or a restore's progress, logged (a terminal draws it as a bar: run.terminal)."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.started = self.reported = time.monotonic()

    def advance(self, count: int) -> None:
        """`count` more done; reported at most once every PROGRESS_EVERY_S."""
        self.done += count
        if time.monotonic() - self.reported >= PROGRESS_EVERY_S:
            self.report()

    def report(self) -> None:
        self.reported = time.monotonic()
        elapsed = max(self.reported - self.started, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate else 0.0
        # `kb_progress`: a terminal draws it as a bar (run.terminal); elsewhere it is this line
        log.info("kb_reindex: %s %d/%d points (%.0f%%), %.1f points/s, eta %.0fs",
                 self.label, self.done, self.total, 100.0 * self.done / max(self.total, 1), rate, eta,
                 extra={"kb_progress": (self.label, self.done, self.total)})


def build(deps: BuildDeps, version_number: int, *, run_id: str | None = None,
          window: tuple[int, int] | None = None, counts: BuildCounts | None = None,
          fence: Fence | None = None) -> BuildResult:
    """Fill the version's collection; `window` (offset, limit) into the manifest limits the work to one
    slice (read by range from the plan's snapshot), so mapped tasks each take a part and hand only two numbers
    through XCom. Nothing is read from the knowledge folder.

    What is written is added to `counts` (when given) and to run `run_id`'s record as it goes, so both
    say what this build did even when it fails; slices and retries each add their own.

    `fence`: the run's lock, checked before every write batch; a run that lost it stops at once
    (`FencedError`) and leaves the version, its status and progress to the run that holds the lock now."""
    counts = counts if counts is not None else BuildCounts()
    alias = deps.settings.alias
    version = deps.state.get_version(alias, version_number)
    if version is None:
        raise KbError(f"version {version_number} of {alias} does not exist")
    if version.status in (VersionStatus.READY, VersionStatus.LIVE, VersionStatus.RETIRED):
        log.info("kb_reindex: v%d is already %s; nothing to build", version.version, version.status)
        counts.skipped += version.points_expected
        return BuildResult(version=version.version, embedded=0, copied=0, skipped=version.points_expected)
    if version.status == FAILED and not may_resume(version.status, version.failed_step):
        raise KbError(f"v{version.version} failed at {version.failed_step} ({version.error}); it cannot be rebuilt")
    if version.status == VersionStatus.DELETED:
        raise KbError(f"v{version.version} was deleted; start a new run")
    if version.status == FAILED:
        deps.state.transition_version(version.id, from_=[FAILED], to=BUILDING)
    try:
        return _fill(deps, version, window, run_id, counts, fence)
    except FencedError:
        raise  # not this run's version any more: its record is not ours to mark
    except Exception as exc:
        deps.state.mark_failed(version.id, step="build", error=f"{type(exc).__name__}: {exc}", from_=BUILDABLE)
        raise


def _already_written(deps: BuildDeps, collection: str, point_ids: list[str]) -> set[str]:
    """Which of these points the collection holds: nothing to look up in a new, empty collection; else
    by ID in batches (a scroll over everything is quadratic in local mode and reads far more on a server)."""
    if not point_ids or deps.store.count(collection) == 0:
        return set()
    found: set[str] = set()
    for batch in batched(point_ids, deps.settings.copy_batch_size):
        found.update(str(r.id) for r in deps.store.retrieve(collection, batch, payload=False))
    return found


class SnapshotTexts:
    """The chunks to embed of a slice, with the texts the plan stored: read from the state DB a block of
    rows at a time, in the order they are asked for (thread-safe; a few blocks kept at most)."""

    BLOCK = 512

    def __init__(self, deps: BuildDeps, rows: list[ManifestChunk], *, version_label: str) -> None:
        self.state, self.rows, self.label = deps.state, rows, version_label
        self.position = {row.point_id: n for n, row in enumerate(rows)}
        self.loaded: dict[int, dict[str, tuple[str, str]]] = {}  # block number -> chunk_hash -> (section, text)
        self.lock = threading.Lock()

    def chunk(self, knowledge_key: str, point_id: str) -> Chunk:
        n = self.position.get(point_id)
        if n is None:
            raise KbError(f"chunk {point_id} ({knowledge_key}) is not one this build embeds; start a new run")
        row = self.rows[n]
        block = n // self.BLOCK
        with self.lock:
            texts = self.loaded.get(block)
            if texts is None:
                part = self.rows[block * self.BLOCK:(block + 1) * self.BLOCK]
                texts = self.state.texts(r.chunk_hash for r in part)
                if len(self.loaded) >= 4:
                    self.loaded.pop(min(self.loaded))
                self.loaded[block] = texts
        found = texts.get(row.chunk_hash)
        if found is None:
            raise KbError(f"the plan snapshot of {self.label} lacks the text of chunk {point_id} ({knowledge_key}); "
                          "start a new run")
        section, text = found
        return Chunk(knowledge_key=row.knowledge_key, chunk_index=row.chunk_index, section=section, text=text,
                     chunk_hash=row.chunk_hash, point_id=row.point_id)


def _source_point_id(row: ManifestChunk) -> str:
    """The live point a copied chunk's vector comes from (only rows with one are copied)."""
    if row.source_point_id is None:
        raise StoreError(f"manifest row for point {row.point_id} has no live point to copy from; "
                         "rebuild with `kb-reindex run --force-full`")
    return row.source_point_id


def _live_chunk(row: ManifestChunk, record: models.Record, live: str, layout: str) -> Chunk:
    """A copied chunk's text and section from live's payload, in live's layout: the same chunk hash is the
    same text."""
    payload = record.payload or {}
    text, section = payload_text(payload, layout), payload.get("section")
    if not isinstance(text, str) or not isinstance(section, str) or sha256_text(text) != row.chunk_hash:
        raise StoreError(f"live collection {live} point {row.source_point_id} has no text matching chunk hash "
                         f"{row.chunk_hash[:12]}; it drifted. Rebuild with `kb-reindex run --force-full`")
    return Chunk(knowledge_key=row.knowledge_key, chunk_index=row.chunk_index, section=section, text=text,
                 chunk_hash=row.chunk_hash, point_id=row.point_id)


def _slice_documents(deps: BuildDeps, version: VersionRecord, rows: list[ManifestChunk]) -> dict[str, DocumentInfo]:
    """The payload fields of the documents of the rows a slice writes, from the plan's manifest."""
    if not rows:
        return {}
    keys = {row.knowledge_key for row in rows}
    by_key = {r.knowledge_key: DocumentInfo(knowledge_key=r.knowledge_key, source=r.source, title=r.title,
                                            category=r.category, tenant=r.tenant, content_hash=r.content_hash)
              for r in deps.state.manifest_documents(version.id, keys)}
    lost = next((key for key in sorted(keys) if key not in by_key), None)
    if lost is not None:
        raise KbError(f"v{version.version}'s manifest lists chunks of {lost} but not the document; start a new run")
    return by_key


def _fill(deps: BuildDeps, version: VersionRecord, window: tuple[int, int] | None, run_id: str | None,
          counts: BuildCounts, fence: Fence | None = None) -> BuildResult:
    """Build from the plan's snapshot only: the slice's manifest rows by range, its documents' payload
    fields, the texts of what it embeds; copied chunks take text and section from live's payload."""
    snapshot = deps.state.snapshot(version.id)
    if snapshot is None:
        raise KbError(f"v{version.version} has no snapshot of its plan (planned before snapshots existed, or its "
                      "plan did not finish); start a new run")
    base = deps.state.get_version(version.alias, version.slot_base) if version.slot_base is not None else None
    if base is None:  # a slot new or emptied: every point is written, but those a rerun finds there
        fresh = deps.state.slice_rows(version.id, window)
        held = 0
        rewrite: list[ManifestChunk] = []
    else:  # the slot held `base` exactly: only what differs from it is written (and read here)
        diff = deps.state.slice_difference(version.id, base.id, window)
        fresh, held, rewrite = diff.added, diff.kept, diff.rewrite
    total = len(fresh) + held
    documents = _slice_documents(deps, version, [*fresh, *rewrite])
    existing = _already_written(deps, version.collection, [row.point_id for row in fresh])
    to_copy = [row for row in fresh if row.source_point_id and row.point_id not in existing]
    to_embed = [row for row in fresh if not row.source_point_id and row.point_id not in existing]
    skipped = len(fresh) - len(to_copy) - len(to_embed)
    counts.skipped += skipped
    counts.kept += held
    if skipped:
        log.info("kb_reindex: v%d resumes: %d points already written are skipped", version.version, skipped)
    if base is not None:
        log.info("kb_reindex: v%d from v%d's points in %s: %d kept (%d payload(s) rewritten), %d copied, %d to "
                 "embed", version.version, base.version, version.collection, held, len(rewrite), len(to_copy),
                 len(to_embed))
    progress = Progress(f"build v{version.version}", total)
    progress.done = skipped + held - len(rewrite)
    writer = _SliceWriter(deps, version, documents=documents,
                          texts=SnapshotTexts(deps, to_embed, version_label=f"v{version.version}"),
                          progress=progress, window=window, run_id=run_id, counts=counts, fence=fence)
    copy_s = 0.0
    taken = 0  # chunks live lacks, their vectors taken from another slot or the vault
    fenced = False
    try:
        if rewrite:
            _rewrite_payloads(deps, version, rewrite, writer)
        if to_copy:
            copy_s = _copy_from_live(deps, version, to_copy, writer)
        if to_embed and snapshot.reuse_kept:
            to_embed, taken = _take_kept(deps, version, to_embed, writer)
        if to_embed:
            _embed(deps, version, to_embed, writer)
    except FencedError:
        fenced = True
        raise
    finally:
        # what was written before a failure counts too: a retry skips those points and never adds them;
        # a fenced run's progress is the new holder's to record
        try:
            if not fenced:
                writer.record(0, final=True)
        except Exception as exc:  # progress is for display; the build's own error matters
            log.warning("kb_reindex: could not record build progress of v%d: %s", version.version,
                        one_line(str(exc)))

    written = deps.store.count(version.collection)
    if window is None:
        deps.state.update_version(version.id, points_written=written)
    # A slice adds only what it wrote: the collection's count also holds the writes of slices still running,
    # which they add themselves (set here, they were counted twice). Validation records the final count.
    return BuildResult(version=version.version, embedded=len(to_embed), copied=len(to_copy) + taken, skipped=skipped,
                       points=written, copy_s=round(copy_s, 4), kept=held, rewritten=len(rewrite))


class _SliceWriter:
    """Writes the points of one build call (checking the run's lock before every batch) and records its
    progress for the page and the log, at most once a second: absolute for a whole build, added up across
    mapped slices. The run's record adds what this call wrote."""

    def __init__(self, deps: BuildDeps, version: VersionRecord, *, documents: dict[str, DocumentInfo],
                 texts: SnapshotTexts, progress: Progress, window: tuple[int, int] | None, run_id: str | None,
                 counts: BuildCounts, fence: Fence | None) -> None:
        self.deps, self.version, self.documents, self.texts = deps, version, documents, texts
        self.progress, self.window, self.run_id, self.counts, self.fence = progress, window, run_id, counts, fence
        self.unrecorded = 0
        self.run_unrecorded = BuildCounts()  # embedded and copied, not yet added to the run's record
        self.last_recorded = time.monotonic()

    def point(self, row: ManifestChunk, vector: list[float], chunk: Chunk | None = None) -> models.PointStruct:
        # IDs are UUID strings, vectors checked lists of floats, payloads plain JSON values: built by us,
        # so pydantic's per-field validation (a tenth of the copy path's time) is skipped
        chunk = chunk or self.texts.chunk(row.knowledge_key, row.point_id)
        return models.PointStruct.model_construct(
            id=row.point_id, vector=vector,
            payload=payload_for(chunk, self.documents[chunk.knowledge_key], self.version))

    def write(self, points: list[models.PointStruct]) -> None:
        if self.fence is not None:
            self.fence.check(self.deps.state, before=f"writing {len(points)} point(s) into v{self.version.version}")
        self.deps.store.upsert(self.version.collection, points)

    def record(self, count: int, *, embedded: bool = False, final: bool = False) -> None:
        self.progress.done += count
        self.unrecorded += count
        if embedded:
            self.counts.embedded += count
            self.run_unrecorded.embedded += count
        else:
            self.counts.copied += count
            self.run_unrecorded.copied += count
        if not self.unrecorded or (not final and time.monotonic() - self.last_recorded < PROGRESS_EVERY_S):
            return
        self.progress.report()
        state, version = self.deps.state, self.version
        if self.window is None:
            state.update_version(version.id, points_written=self.progress.done)
        else:
            state.add_points_written(version.id, self.unrecorded)
        if self.run_id is not None:
            state.add_run_chunks(self.run_id, embedded=self.run_unrecorded.embedded,
                                 reused=self.run_unrecorded.copied)
            self.run_unrecorded.embedded = self.run_unrecorded.copied = 0
        self.unrecorded, self.last_recorded = 0, time.monotonic()


def _copy_from_live(deps: BuildDeps, version: VersionRecord, to_copy: list[ManifestChunk], writer: _SliceWriter) -> float:
    """Copy the reused chunks' vectors (and texts) from the live collection the version was planned against;
    the seconds it took."""
    base_collection = version.base_collection
    if not base_collection or not deps.store.exists(base_collection):
        raise StoreError(f"v{version.version} copies vectors from {base_collection}, which no longer exists")
    live_dim = deps.store.dimension(base_collection)
    if live_dim != version.embed_dim:
        raise StoreError(f"live collection {base_collection} holds {live_dim}-d vectors; "
                         f"v{version.version} needs {version.embed_dim}. Rebuild with `kb-reindex run --force-full`")
    base = deps.state.get_version(version.alias, version.base_version) if version.base_version else None
    base_layout = base.payload_layout if base is not None else "native"
    started = time.perf_counter()

    def read(batch: Sequence[ManifestChunk]) -> list[models.Record]:
        return deps.store.retrieve(base_collection, [_source_point_id(r) for r in batch],
                                   vectors=True, payload=["section", text_field(base_layout)])

    # Read the next batch while this one is written: against a Qdrant server the two round trips
    # overlap; in local mode they take turns, at the cost of one thread.
    batches = list(batched(to_copy, deps.settings.copy_batch_size))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kb-copy-read") as reader:
        pending = reader.submit(read, batches[0])
        for position, batch in enumerate(batches):
            sources = pending.result()
            if position + 1 < len(batches):
                pending = reader.submit(read, batches[position + 1])
            found = {str(record.id): record for record in sources}
            vectors = _copied_vectors(base_collection, batch, found)
            writer.write([writer.point(r, vectors[_source_point_id(r)],
                                       _live_chunk(r, found[_source_point_id(r)], base_collection, base_layout))
                          for r in batch])
            writer.record(len(batch))
    return time.perf_counter() - started


def _rewrite_payloads(deps: BuildDeps, version: VersionRecord, rows: list[ManifestChunk], writer: _SliceWriter) -> None:
    """The points the slot keeps of documents whose payload fields changed: their payloads written anew from
    the manifest (the text and section read back from the slot's own payload), vectors untouched."""
    base = deps.state.get_version(version.alias, version.slot_base) if version.slot_base is not None else None
    layout = base.payload_layout if base is not None else version.payload_layout
    for batch in batched(rows, deps.settings.copy_batch_size):
        found = {str(r.id): r for r in deps.store.retrieve(version.collection, [r.point_id for r in batch],
                                                           payload=["section", text_field(layout)])}
        missing = [r.point_id for r in batch if r.point_id not in found]
        if missing:
            raise StoreError(f"slot {version.collection} lacks {len(missing)} point(s) v{version.version} keeps from "
                             f"v{version.slot_base} (first: {missing[0]}); it drifted: start a new run")
        payloads = {}
        for row in batch:
            chunk = _live_chunk(row._replace(source_point_id=row.point_id), found[row.point_id], version.collection,
                                layout)
            payloads[row.point_id] = payload_for(chunk, writer.documents[row.knowledge_key], version)
        if writer.fence is not None:
            writer.fence.check(deps.state, before=f"rewriting {len(batch)} payload(s) of v{version.version}")
        deps.store.overwrite_payloads(version.collection, payloads)
        writer.progress.done += len(batch)
        writer.record(0)


def _copied_vectors(live: str, batch: Sequence[ManifestChunk], found: dict[str, models.Record]) -> dict[str, list[float]]:
    """The vectors of a batch's live points, by point ID; a point or vector missing means live drifted."""
    missing = [r.source_point_id for r in batch if r.source_point_id not in found]
    if missing:
        raise StoreError(
            f"live collection {live} lacks {len(missing)} point(s) its manifest lists "
            f"(first: {missing[0]}); it drifted. Rebuild with `kb-reindex run --force-full`"
        )
    # Vectors read back from a collection of the checked dimension were checked when first
    # embedded; Qdrant stores no NaN. Only a missing vector could still slip through.
    empty = [r.source_point_id for r in batch if not isinstance(found[_source_point_id(r)].vector, list)]
    if empty:
        raise StoreError(f"live collection {live} returned no vector for {empty[0]}; "
                         "rebuild with `kb-reindex run --force-full`")
    # checked just above: lists, of the collection's dimension
    return {key: cast(list[float], record.vector) for key, record in found.items()}


def _take_kept(deps: BuildDeps, version: VersionRecord, to_embed: list[ManifestChunk],
               writer: _SliceWriter) -> tuple[list[ManifestChunk], int]:
    """Write the chunks live lacks whose vectors the profile keeps elsewhere (another slot: a held or superseded
    version, the rollback target; the vault: an edit reverted) from there, as a restore would; the rows left to
    embed and how many were taken. Same profile, same chunk hash: the same vector the embedder would answer."""
    kept = KeptVectors(deps, version)
    if not kept.residents and kept.vault is None:
        return to_embed, 0
    rest: list[ManifestChunk] = []
    taken = 0
    for batch in batched(to_embed, deps.settings.copy_batch_size):
        found = kept.find([row.chunk_hash for row in batch])
        rows = [row for row in batch if row.chunk_hash in found]
        rest.extend(row for row in batch if row.chunk_hash not in found)
        if not rows:
            continue
        vectors = check_vectors([found[row.chunk_hash][0] for row in rows], expected=len(rows),
                                dim=version.embed_dim, source=f"the vectors {version.alias}'s profile keeps")
        writer.write([writer.point(row, vector) for row, vector in zip(rows, vectors, strict=True)])
        writer.record(len(rows))
        taken += len(rows)
    if taken:
        log.info("kb_reindex: v%d: %d chunk(s) live lacks taken from the vectors its profile keeps (other slots, the "
                 "vault), %d to embed", version.version, taken, len(rest))
    return rest, taken


def _embed(deps: BuildDeps, version: VersionRecord, to_embed: list[ManifestChunk], writer: _SliceWriter) -> None:
    """Embed the new chunks (texts from the plan's snapshot), up to KB_EMBED_CONCURRENCY requests in
    flight; answers come back in the batches' order."""
    embedder = deps.embedder_for(version)
    if embedder.dimension != version.embed_dim:
        raise EmbeddingError(
            f"embedder {embedder.model!r} answers {embedder.dimension}-d vectors; v{version.version} needs "
            f"{version.embed_dim}"
        )
    embed_batches, sent = itertools.tee(
        (batch, [writer.texts.chunk(r.knowledge_key, r.point_id) for r in batch])
        for batch in batched(to_embed, deps.settings.embed_batch_size))
    answers = embedder.embed_batches([c.text for c in batch_chunks] for _, batch_chunks in sent)
    for (batch, batch_chunks), answer in zip(embed_batches, answers, strict=True):
        embedded = check_vectors(answer, expected=len(batch), dim=version.embed_dim,
                                 source=f"embedder {embedder.model!r}")
        writer.write([writer.point(r, v, c) for r, v, c in zip(batch, embedded, batch_chunks, strict=True)])
        writer.record(len(batch), embedded=True)
