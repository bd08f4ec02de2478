"""The knowledge folder as one compact scan: what every step needs to know, without the texts.

A plan over 100k chunks must not hold 100k chunk texts: the scan keeps, per document, its facts (key,
source, title, category, tenant, content hash), its chunks' references (key, index, hash, point ID)
and its instruction-like lines. The build reads a document's text again when it writes that
document's points (`DocumentTexts`), and checks that the file still has the planned content hash.

Only the plan reads the folder: it writes what later steps need (manifest, texts of the chunks to embed,
flagged lines) into the state DB as its snapshot (`kb_reindex.steps.snapshot`). Between plans the state DB keeps
each file's (size, mtime_ns, ETag) -> content hash (`quick_fingerprint`), so a plan over unchanged files reads
none: a folder is stat-ed, a bucket listed once, and no document fetched.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from kb_reindex.services.chunking import Chunk, chunk_document, chunking_version
from kb_reindex.domain.errors import KbError, SourceChangedError, SourceError, SourceRefused
from kb_reindex.services.sources import (
    DEFAULT_TENANT,
    Document,
    KnowledgeSource,
    ListedFile,
    SourceListing,
    as_source,
    corpus_fingerprint,
    iter_corpus,
    knowledge_key_for,
    list_named,
    list_source,
    parse_document,
    read_bytes,
)
from kb_reindex.domain.freshness import stat_key
from kb_reindex.services.state.manifests import FileHash
from kb_reindex.domain.validation_model import FlaggedLine
from kb_reindex.domain.screen_text import Passage, passages
from kb_reindex.services.screen import Flag, ScoreMemory, Screen, patterns_screen

log = logging.getLogger(__name__)

#: knowledge key -> (content hash, flagged lines) of live's documents, as live's plan judged them with the same
#: screen: a document whose content hash is still that is not judged again
Carried = Mapping[str, tuple[str, tuple[Flag, ...]]]

# A recorded hash is trusted for a file only if its mtime is older than the recording by this margin: a
# write within the same mtime tick as the recording (coarse filesystems: 1-2 s) may not change the mtime.
# An object's ETag changes with every write of other content, so one whose ETag is unchanged needs no margin.
MTIME_MARGIN_NS = 2_000_000_000

class DocumentInfo(NamedTuple):
    """A document without its body: what the manifest and every payload need. A named tuple (made once per
    document of the corpus by every plan): its fields are the first six of `ManifestDocument`, in order."""

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
    """A document the scan read: its chunks' references as chunking them gave."""

    info: DocumentInfo
    chunks: tuple[ChunkRef, ...]
    flagged: tuple[Flag, ...]  # (line number, text, why) of instruction-like lines

    @property
    def chunk_count(self) -> int:
        return len(self.chunks)


class KnownDocument(NamedTuple):
    """A document the scan took unread from live (`KnownFiles`): its chunks are live's manifest rows for its
    key, `chunk_count` of them, each reusing live's vector. Their references are not read: an edit's plan reads
    live's documents, not its whole manifest; the manifest copies those rows inside the database."""

    info: DocumentInfo
    chunk_count: int
    flagged: tuple[Flag, ...]


@dataclass(frozen=True)
class CorpusScan:
    documents: list[ScannedDocument | KnownDocument]  # sorted by knowledge_key
    fingerprint: str
    chunking_version: str
    #: source -> its mtime (ns) as the listing showed it before it was read
    mtimes: dict[str, int] = field(default_factory=dict)
    #: how many documents were read (the others were known unchanged: `KnownFiles`)
    read: int = 0
    #: the keys of the documents taken unread from `KnownFiles` (`KnownDocument`): their chunks are live's
    #: manifest rows as they are
    known: frozenset[str] = frozenset()

    @property
    def infos(self) -> list[DocumentInfo]:
        return [d.info for d in self.documents]

    @property
    def chunk_total(self) -> int:
        """Every chunk of the corpus, the known documents' counted, not read."""
        return sum(d.chunk_count for d in self.documents)

    @property
    def known_chunks(self) -> int:
        """The chunks of the known documents: live's rows, each reusing live's vector."""
        return sum(d.chunk_count for d in self.documents if isinstance(d, KnownDocument))

    def reused_chunks(self, reuse: Mapping[str, str]) -> int:
        """The chunks whose vector comes from live: every known document's, and the read ones whose hash `reuse`
        maps to a point of live."""
        return self.known_chunks + sum(1 for c in self.read_chunks() if c.chunk_hash in reuse)

    def read_documents(self) -> list[ScannedDocument]:
        """The documents read and chunked (not `known`), in key order."""
        return [d for d in self.documents if isinstance(d, ScannedDocument)]

    def read_chunks(self) -> list[ChunkRef]:
        """The chunk references of the documents read, in manifest order."""
        return [c for d in self.read_documents() for c in d.chunks]

    def flagged_lines(self) -> list[FlaggedLine]:
        return [{"knowledge_key": d.info.knowledge_key, "source": d.info.source, "line": f.line, "text": f.text,
                 "why": f.why} for d in self.documents for f in d.flagged]


def info_of(doc: Document) -> DocumentInfo:
    return DocumentInfo(knowledge_key=doc.knowledge_key, source=doc.source, title=doc.title,
                        category=doc.category, tenant=doc.tenant, content_hash=doc.content_hash)


def carried_flags(doc: Document, carried: Carried | None) -> tuple[Flag, ...] | None:
    """The document's flagged lines as live's plan found them, when the document is live's unchanged (same
    content hash) and was judged by the same screen (`carried`); None: it must be judged now."""
    if carried is not None and (was := carried.get(doc.knowledge_key)) is not None and was[0] == doc.content_hash:
        return was[1]
    return None


#: passages a scan collects from the documents it must judge before the screen scores them in one call
JUDGE_BATCH = 4096


@dataclass(frozen=True)
class KnownFiles:
    """Documents a scan need not read: live's, each as its manifest's documents hold it (facts, chunk count) with the lines
    live's plan flagged, by source, and the file hashes recorded when live's files were read. A file is taken
    as known when its listing is trusted against its recorded hash (`trusted`) and that hash is the content
    hash live's manifest holds for it: its bytes are those live was built from, so it chunks (same chunking)
    and flags (same screen) as it did then."""

    documents: Mapping[str, KnownDocument]
    recorded: Mapping[str, FileHash]

    def holds(self, file: ListedFile, max_bytes: int) -> KnownDocument | None:
        entry, known = self.recorded.get(file.source), self.documents.get(file.source)
        if entry is None or known is None or file.size > max_bytes or not trusted(entry, file):
            return None
        return known if known.info.content_hash == entry.content_hash else None


def scan_corpus(docs: KnowledgeSource | Path, *, max_bytes: int, chunk_size: int, overlap: int,
                hashes: dict[str, FileHash] | None = None, default_tenant: str = DEFAULT_TENANT,
                screen: Screen | None = None, carried: Carried | None = None,
                memory: ScoreMemory | None = None, known: KnownFiles | None = None,
                files: SourceListing | None = None, again: LookAgain | None = None) -> CorpusScan:
    """Every document's facts and chunk references, sorted by key; each body is dropped once scanned.
    Errors as `sources.load_corpus` reports them. `hashes` receives what a plan records of every file.
    `screen` judges the instruction-like lines (default: the patterns alone) of each document `carried` does
    not already hold unchanged, the passages of many documents at once (`JUDGE_BATCH`); `memory`: the
    classifier's scores kept by earlier plans (a line judged before is looked up, not embedded).
    `known`: live's documents whose files did not change since they were read (`KnownFiles`): listed, not
    read, taken as live holds them; a routine edit reads the files it touched, not the folder.
    `files`: the source's listing as the caller took it (`sources.list_source`, or a change feed's
    `feed_listing`, whose documents taken from the record `again` looks at before they are read)."""
    started_ns = time.time_ns()
    listed: dict[str, ListedFile] = {}
    held: list[KnownDocument] = []

    def is_known(file: ListedFile) -> str | None:
        document = known.holds(file, max_bytes) if known is not None else None
        if document is None:
            return None
        held.append(document)
        return document.info.knowledge_key
    screen = screen or patterns_screen()
    scanned: list[ScannedDocument | KnownDocument] = []
    waiting: list[tuple[DocumentInfo, tuple[ChunkRef, ...], list[Passage]]] = []

    embedded_before = screen.classifier.embedded if screen.classifier else 0
    progress = {"documents": 0, "passages": 0}

    def judge_waiting(*, last: bool = False) -> None:
        judged = screen.flag_pages([found for _, _, found in waiting], memory=memory)
        scanned.extend(ScannedDocument(info=info, chunks=chunks, flagged=flagged)
                       for (info, chunks, _), flagged in zip(waiting, judged, strict=True))
        progress["documents"] += len(waiting)
        progress["passages"] += sum(len(found) for _, _, found in waiting)
        waiting.clear()
        embedded = (screen.classifier.embedded if screen.classifier else 0) - embedded_before
        if not last and embedded:
            # a first build judges every line by e5, about a minute per batch here: said as it goes, not only at
            # the end (the plan's summary), so a long first build is not silent
            log.info("kb_reindex: the instruction screen has judged %d document(s) so far (%d passages, %d embedded "
                     "by e5) in %.0f s; the scan goes on", progress["documents"], progress["passages"], embedded,
                     (time.time_ns() - started_ns) / 1e9)

    pending = 0
    for doc in iter_corpus(docs, max_bytes=max_bytes, listed=listed, default_tenant=default_tenant,
                           known=is_known if known is not None else None, files=files, again=again):
        chunks = tuple(ChunkRef(c.knowledge_key, c.chunk_index, c.chunk_hash, c.point_id)
                       for c in chunk_document(doc, chunk_size=chunk_size, overlap=overlap))
        flagged = carried_flags(doc, carried)
        if flagged is not None:
            scanned.append(ScannedDocument(info=info_of(doc), chunks=chunks, flagged=flagged))
            continue
        found = passages(doc.body, first_line=doc.body_line)
        waiting.append((info_of(doc), chunks, found))
        pending += len(found)
        if pending >= JUDGE_BATCH:
            judge_waiting()
            pending = 0
    judge_waiting(last=True)
    if hashes is not None:
        for d in scanned:
            f = listed[d.info.source]
            hashes[d.info.source] = FileHash(f.size, f.mtime_ns, d.info.content_hash, started_ns, f.etag)
        if known is not None:  # recorded as they were when read (the trust margin counts from that reading)
            hashes.update((d.info.source, known.recorded[d.info.source]) for d in held)
    read = len(scanned)
    scanned.extend(held)
    scanned.sort(key=lambda d: d.info.knowledge_key)
    return CorpusScan(documents=scanned, fingerprint=corpus_fingerprint([d.info for d in scanned]),
                      chunking_version=chunking_version(chunk_size, overlap),
                      mtimes={source: f.mtime_ns for source, f in listed.items()}, read=read,
                      known=frozenset(d.info.knowledge_key for d in held))


def cache_root(docs: KnowledgeSource | Path, default_tenant: str = DEFAULT_TENANT) -> str:
    """The key of a knowledge source's recorded file hashes: a folder's resolved path or a bucket's URI (and
    the default tenant its documents inherit, when not `default`: another default hashes them anew), hashed
    to a fixed size."""
    knowledge = as_source(docs)
    where = str(Path(knowledge.root).resolve()) if knowledge.local else knowledge.uri
    key = where + ("" if default_tenant == DEFAULT_TENANT else f"\x00tenant:{default_tenant}")
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def trusted(entry: FileHash, file: ListedFile) -> bool:
    """A recorded hash still holds for a listed document: same size, mtime and ETag, and (a file, whose mtime
    is all there is) modified well before the recording."""
    return (stat_key(entry.size, entry.mtime_ns, entry.etag) == stat_key(file.size, file.mtime_ns, file.etag)
            and (file.etag is not None or file.mtime_ns < entry.recorded_ns - MTIME_MARGIN_NS))


def feed_listing(docs: KnowledgeSource | Path, recorded: Mapping[str, FileHash],
                 changed: Iterable[str]) -> SourceListing | None:
    """The listing a change feed gives (the names a watcher saw change since the last plan read the source):
    the named documents looked at now (`sources.list_named`), every other one as the last plan recorded it,
    in a listing's order. None, so the caller lists everything: nothing recorded, a name that cannot be judged
    alone, or a document named that is neither there nor recorded (a name misspelt, or given from another
    folder, must not pass for a change looked at). A file changed and not named stays as recorded until a feed
    names it or a plan lists the source in full (the watcher compares its every listing with what plans
    recorded, and fires again)."""
    knowledge = as_source(docs)
    if not recorded:
        return None
    names = set(changed)
    named = list_named(knowledge, names)
    if named is None or any(name not in recorded for name in named.absent):
        return None
    if _feed_unclear(names, named.found, recorded):
        return None
    files = [ListedFile(source, h.size, h.mtime_ns, h.etag) for source, h in recorded.items() if source not in names]
    files.extend(named.found)
    # a folder is walked folder by folder in name order, a bucket listed by key
    files.sort(key=(lambda f: f.source.split("/")) if knowledge.local else (lambda f: f.source))
    return files, []


#: a document of a change feed's listing taken from the record, looked at again before it is read: its entry now,
#: or None when it is gone
LookAgain = Callable[[ListedFile], ListedFile | None]


def looked_again(docs: KnowledgeSource | Path, named: set[str]) -> LookAgain:
    """For a scan over a change feed's listing (`feed_listing`): a document taken from the record that must be
    read after all (modified within the trust margin of its recording, or not live's content) is looked at
    again first, so what the plan records pairs its content with the stat taken before reading it, never the
    record's older one (a later plan would trust that pairing if the file came back to its old stat). The
    named documents were looked at already."""
    knowledge = as_source(docs)

    def again(file: ListedFile) -> ListedFile | None:
        if file.source in named:
            return file
        now = list_named(knowledge, [file.source])
        if now is None:  # a link now, say: read as recorded; the watcher's next listing names it
            return file
        return now.found[0] if now.found else None

    return again


def _feed_unclear(names: set[str], found: list[ListedFile], recorded: Mapping[str, FileHash]) -> bool:
    """A feed only a listing can settle: a name recorded documents sit under (a folder, removed since: its
    documents are no longer there), or a new name spelled as a recorded one folds to (a rename of case or Unicode
    form, which a case-insensitive filesystem finds under both spellings)."""
    folders = tuple(name.rstrip("/") + "/" for name in names if not name.lower().endswith(".md"))
    if folders and any(source.startswith(folders) for source in recorded):
        return True
    new = {knowledge_key_for(f.source).casefold() for f in found if f.source not in recorded}
    return bool(new) and any(knowledge_key_for(source).casefold() in new for source in recorded)


class QuickScan(NamedTuple):
    fingerprint: str
    keys: list[str]
    rehashed: dict[str, FileHash]  # files read again (touched, or too recent to trust) and found as recorded


class _KeyHash(NamedTuple):
    knowledge_key: str
    content_hash: str


def quick_fingerprint(docs: KnowledgeSource | Path, recorded: Mapping[str, FileHash], *, max_bytes: int,
                      default_tenant: str = DEFAULT_TENANT,
                      listed: SourceListing | None = None) -> QuickScan | None:
    """The corpus fingerprint from the recorded hashes of documents whose listing (size, mtime, ETag) did not
    change since, reading only the others; None when anything is off (a bad or colliding file: the full
    scan says what) or a file read holds other content than recorded, or none was recorded (an edit: the scan
    plans it, and still finds an unchanged corpus one, e.g. an edit undone after a failed run). A routine
    edit's look stops at the first such file. `listed`: the source's `list_source`, when the caller took it."""
    started_ns = time.time_ns()
    knowledge = as_source(docs)
    files, problems = listed if listed is not None else list_source(knowledge)
    if problems or not files:
        return None
    rehashed: dict[str, FileHash] = {}
    read: dict[str, str] = {}  # source -> knowledge key of the files read again
    for file in files:
        entry = recorded.get(file.source)
        if entry is not None and file.size <= max_bytes and trusted(entry, file):
            continue
        try:
            document = parse_document(PurePosixPath(file.source), file.source,
                                      read_bytes(knowledge, file.source, max_bytes=max_bytes, size=file.size),
                                      default_tenant=default_tenant)
        except (OSError, SourceError):
            return None
        if entry is None or entry.content_hash != document.content_hash:
            return None  # new or changed since the last plan recorded it: most likely an edit, which the scan plans
        read[file.source] = document.knowledge_key
        rehashed[file.source] = FileHash(file.size, file.mtime_ns, document.content_hash, started_ns, file.etag)
    pairs = [_KeyHash(read.get(f.source) or knowledge_key_for(f.source), recorded[f.source].content_hash)
             for f in files]  # every file's hash is the one recorded (those read again hashed the same)
    if len({p.knowledge_key.casefold() for p in pairs}) != len(pairs):
        return None
    return QuickScan(fingerprint=corpus_fingerprint(pairs), keys=[p.knowledge_key for p in pairs], rehashed=rehashed)


def instruction_lines(docs: KnowledgeSource | Path, *, max_bytes: int, screen: Screen | None = None) -> list[FlaggedLine]:
    """The instruction-like lines of every document, as `CorpusScan.flagged_lines` lists them, without
    chunking anything: for a step that has no scan of its own (an Airflow validate task, a rollback)."""
    screen = screen or patterns_screen()
    found = [(doc.knowledge_key, doc.source, screen.flag(doc.body, first_line=doc.body_line))
             for doc in iter_corpus(docs, max_bytes=max_bytes)]
    found.sort(key=lambda item: item[0])
    return [{"knowledge_key": key, "source": source, "line": f.line, "text": f.text, "why": f.why}
            for key, source, flagged in found for f in flagged]


class DocumentTexts:
    """The chunks (with texts) of one document at a time, read again from its file by the plan's snapshot
    (the scan keeps no texts).

    Callers ask in manifest order, so each document is read once per pass. A file whose content hash is
    no longer the scanned one stops the plan: the snapshot would mix two states of the knowledge.
    """

    def __init__(self, docs: KnowledgeSource | Path, infos: dict[str, DocumentInfo], *, max_bytes: int,
                 chunk_size: int, overlap: int, version_label: str, default_tenant: str = DEFAULT_TENANT) -> None:
        self.knowledge, self.infos, self.default_tenant = as_source(docs), infos, default_tenant
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
        changed = SourceChangedError(f"{info.source} changed while {self.version_label} read the files; "
                                     "start a new run (it plans from the files as they are then)")
        try:
            data = read_bytes(self.knowledge, info.source, max_bytes=self.max_bytes)
        except SourceRefused:  # the bucket refused, not the document changed: the one line that says so
            raise
        except (OSError, SourceError):
            raise changed from None
        document = parse_document(PurePosixPath(info.source), info.source, data, default_tenant=self.default_tenant)
        if document.content_hash != info.content_hash:
            raise changed
        self._key = knowledge_key
        self._chunks = {c.point_id: c for c in chunk_document(document, chunk_size=self.chunk_size, overlap=self.overlap)}
