"""The knowledge folder as one compact scan: what every step needs to know, without the texts.

A plan over 100k chunks must not hold 100k chunk texts: the scan keeps, per document, its facts (key,
source, title, category, tenant, content hash), its chunks' references (key, index, hash, point ID)
and its instruction-like lines. The build reads a document's text again when it writes that
document's points (`DocumentTexts`), and checks that the file still has the planned content hash.

Only the plan reads the folder: it writes what later steps need (manifest, texts of the chunks to embed,
flagged lines) into the state DB as its snapshot (`kb_reindex.steps.snapshot`). Between plans the state DB keeps
each file's (size, mtime_ns) -> content hash (`quick_fingerprint`), so a plan over unchanged files reads none.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kb_reindex.services.chunking import Chunk, chunk_document, chunking_version
from kb_reindex.domain.errors import KbError, SourceChangedError, SourceError
from kb_reindex.services.sources import (
    DEFAULT_TENANT,
    Document,
    corpus_fingerprint,
    discover,
    iter_corpus,
    knowledge_key_for,
    parse_document,
    read_bytes,
)
from kb_reindex.services.state.manifests import FileHash
from kb_reindex.domain.instructions import flag_instructions
from kb_reindex.domain.validation_model import FlaggedLine

# A recorded hash is trusted for a file only if its mtime is older than the recording by this margin: a
# write within the same mtime tick as the recording (coarse filesystems: 1-2 s) may not change the mtime.
MTIME_MARGIN_NS = 2_000_000_000

@dataclass(frozen=True, slots=True)
class DocumentInfo:
    """A document without its body: what the manifest and every payload need."""

    knowledge_key: str
    source: str
    title: str
    category: str
    tenant: str
    content_hash: str


class ChunkRef(NamedTuple):
    knowledge_key: str
    chunk_index: int
    chunk_hash: str
    point_id: str


@dataclass(frozen=True, slots=True)
class ScannedDocument:
    info: DocumentInfo
    chunks: tuple[ChunkRef, ...]
    flagged: tuple[tuple[int, str], ...]  # (line number, text) of instruction-like lines


@dataclass(frozen=True)
class CorpusScan:
    documents: list[ScannedDocument]  # sorted by knowledge_key
    fingerprint: str
    chunking_version: str

    @property
    def infos(self) -> list[DocumentInfo]:
        return [d.info for d in self.documents]

    def chunk_refs(self) -> list[ChunkRef]:
        return [c for d in self.documents for c in d.chunks]

    def flagged_lines(self) -> list[FlaggedLine]:
        return [{"knowledge_key": d.info.knowledge_key, "source": d.info.source, "line": number, "text": text}
                for d in self.documents for number, text in d.flagged]


def info_of(doc: Document) -> DocumentInfo:
    return DocumentInfo(knowledge_key=doc.knowledge_key, source=doc.source, title=doc.title,
                        category=doc.category, tenant=doc.tenant, content_hash=doc.content_hash)


def _scan_document(doc: Document, *, chunk_size: int, overlap: int) -> ScannedDocument:
    chunks = tuple(ChunkRef(c.knowledge_key, c.chunk_index, c.chunk_hash, c.point_id)
                   for c in chunk_document(doc, chunk_size=chunk_size, overlap=overlap))
    return ScannedDocument(info=info_of(doc), chunks=chunks,
                           flagged=flag_instructions(doc.body, first_line=doc.body_line))


def scan_corpus(docs_dir: Path, *, max_bytes: int, chunk_size: int, overlap: int,
                hashes: dict[str, FileHash] | None = None, default_tenant: str = DEFAULT_TENANT) -> CorpusScan:
    """Every document's facts and chunk references, sorted by key; each body is dropped once scanned.
    Errors as `sources.load_corpus` reports them. `hashes` receives what a plan records of every file."""
    started_ns = time.time_ns()
    stats: dict[str, os.stat_result] | None = {} if hashes is not None else None
    scanned = [_scan_document(document, chunk_size=chunk_size, overlap=overlap)
               for document in iter_corpus(docs_dir, max_bytes=max_bytes, stats=stats, default_tenant=default_tenant)]
    scanned.sort(key=lambda d: d.info.knowledge_key)
    if hashes is not None and stats is not None:
        for d in scanned:
            st = stats[d.info.source]
            hashes[d.info.source] = FileHash(st.st_size, st.st_mtime_ns, d.info.content_hash, started_ns)
    return CorpusScan(documents=scanned, fingerprint=corpus_fingerprint([d.info for d in scanned]),
                      chunking_version=chunking_version(chunk_size, overlap))


def cache_root(docs_dir: Path, default_tenant: str = DEFAULT_TENANT) -> str:
    """The key of a knowledge folder's recorded file hashes: its resolved path (and the default tenant its
    documents inherit, when not `default`: another default hashes them anew), hashed to a fixed size."""
    key = str(docs_dir.resolve()) + ("" if default_tenant == DEFAULT_TENANT else f"\x00tenant:{default_tenant}")
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class QuickScan(NamedTuple):
    fingerprint: str
    keys: list[str]
    rehashed: dict[str, FileHash]  # files read again (changed, new, or too recent to trust): record them


class _KeyHash(NamedTuple):
    knowledge_key: str
    content_hash: str


def quick_fingerprint(docs_dir: Path, recorded: dict[str, FileHash], *, max_bytes: int,
                      default_tenant: str = DEFAULT_TENANT) -> QuickScan | None:
    """The corpus fingerprint from the recorded hashes of files whose (size, mtime_ns) did not change since,
    reading only the others; None when anything is off (a bad or colliding file): the full scan says what."""
    started_ns = time.time_ns()
    paths, problems = discover(docs_dir)
    if problems or not paths:
        return None
    pairs: list[_KeyHash] = []
    rehashed: dict[str, FileHash] = {}
    for path in paths:
        source = path.relative_to(docs_dir).as_posix()
        try:
            st = path.stat()
        except OSError:
            return None
        entry = recorded.get(source)
        if (entry is not None and entry.size == st.st_size and entry.mtime_ns == st.st_mtime_ns
                and st.st_mtime_ns < entry.recorded_ns - MTIME_MARGIN_NS and st.st_size <= max_bytes):
            pairs.append(_KeyHash(knowledge_key_for(source), entry.content_hash))
            continue
        try:
            document = parse_document(path, source, read_bytes(path, source, max_bytes=max_bytes),
                                      default_tenant=default_tenant)
        except (OSError, SourceError):
            return None
        pairs.append(_KeyHash(document.knowledge_key, document.content_hash))
        rehashed[source] = FileHash(st.st_size, st.st_mtime_ns, document.content_hash, started_ns)
    if len({p.knowledge_key.casefold() for p in pairs}) != len(pairs):
        return None
    return QuickScan(fingerprint=corpus_fingerprint(pairs), keys=[p.knowledge_key for p in pairs], rehashed=rehashed)


def instruction_lines(docs_dir: Path, *, max_bytes: int) -> list[FlaggedLine]:
    """The instruction-like lines of every document, as `CorpusScan.flagged_lines` lists them, without
    chunking anything: for a step that has no scan of its own (an Airflow validate task, a rollback)."""
    found = [(doc.knowledge_key, doc.source, flag_instructions(doc.body, first_line=doc.body_line))
             for doc in iter_corpus(docs_dir, max_bytes=max_bytes)]
    found.sort(key=lambda item: item[0])
    return [{"knowledge_key": key, "source": source, "line": number, "text": text}
            for key, source, flagged in found for number, text in flagged]


class DocumentTexts:
    """The chunks (with texts) of one document at a time, read again from its file by the plan's snapshot
    (the scan keeps no texts).

    Callers ask in manifest order, so each document is read once per pass. A file whose content hash is
    no longer the scanned one stops the plan: the snapshot would mix two states of the knowledge.
    """

    def __init__(self, docs_dir: Path, infos: dict[str, DocumentInfo], *, max_bytes: int, chunk_size: int,
                 overlap: int, version_label: str, default_tenant: str = DEFAULT_TENANT) -> None:
        self.docs_dir, self.infos, self.default_tenant = docs_dir, infos, default_tenant
        self.max_bytes, self.chunk_size, self.overlap = max_bytes, chunk_size, overlap
        self.version_label = version_label
        self._key: str | None = None
        self._chunks: dict[str, Chunk] = {}

    def chunk(self, knowledge_key: str, point_id: str) -> Chunk:
        if knowledge_key != self._key:
            self._load(knowledge_key)
        try:
            return self._chunks[point_id]
        except KeyError:
            raise KbError(f"{self.infos[knowledge_key].source} no longer yields chunk {point_id} of "
                          f"{self.version_label}; start a new run") from None

    def _load(self, knowledge_key: str) -> None:
        info = self.infos[knowledge_key]
        path = self.docs_dir / info.source
        changed = SourceChangedError(f"{info.source} changed while {self.version_label} read the files; "
                                     "start a new run (it plans from the files as they are then)")
        try:
            data = read_bytes(path, info.source, max_bytes=self.max_bytes)
        except (OSError, SourceError):
            raise changed from None
        document = parse_document(path, info.source, data, default_tenant=self.default_tenant)
        if document.content_hash != info.content_hash:
            raise changed
        self._key = knowledge_key
        self._chunks = {c.point_id: c for c in chunk_document(document, chunk_size=self.chunk_size, overlap=self.overlap)}
