"""The knowledge folder as one compact scan: what every step needs to know, without the texts.

A plan over 100k chunks must not hold 100k chunk texts: the scan keeps, per document, its facts (key,
source, title, category, tenant, content hash), its chunks' references (key, index, hash, point ID)
and its instruction-like lines. The build reads a document's text again when it writes that
document's points (`DocumentTexts`), and checks that the file still has the planned content hash.

One scan serves every step of a CLI run (through `plan.Prepared`); an Airflow task scans again in its own
process. Nothing is cached between runs: a CLI or task process runs once, and a cache would only hold
memory in the processes that run many (the benchmark's no-op would look faster than any real one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kb_reindex.chunking import Chunk, chunk_document, chunking_version
from kb_reindex.errors import KbError, SourceChangedError, SourceError
from kb_reindex.sources import Document, corpus_fingerprint, iter_corpus, parse_document, read_bytes

# Text in the knowledge base is data. Lines that read like instructions to an assistant are listed in the
# validation report so a person looks at them; they are never acted on.
INSTRUCTION_PATTERNS = [
    re.compile(p, re.IGNORECASE)
    for p in (
        r"ignore (all |any )?(previous|prior|above) (instructions|rules)",
        r"忽略(之前|以上|前面|上述)?的?(所有)?(规则|指令|指示|要求)",
        r"(call|invoke|use) the \w+ tool",
        r"调用.{0,6}(工具|tool)",
        r"(输出|提供|告诉|发送).{0,8}(手机号|电话号码|身份证|密码|银行卡)",
        r"(phone number|password|credit card number)s?\b.{0,20}(send|give|output|reveal)",
        r"system prompt|系统提示",
    )
]
# one pass over a whole document first: almost every document has no such line. Equivalent to the
# per-line scan because no pattern is anchored or crosses a line end.
ANY_INSTRUCTION = re.compile("|".join(f"(?:{p.pattern})" for p in INSTRUCTION_PATTERNS), re.IGNORECASE)


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

    def flagged_lines(self) -> list[dict[str, object]]:
        return [{"source": d.info.source, "line": number, "text": text}
                for d in self.documents for number, text in d.flagged]


def info_of(doc: Document) -> DocumentInfo:
    return DocumentInfo(knowledge_key=doc.knowledge_key, source=doc.source, title=doc.title,
                        category=doc.category, tenant=doc.tenant, content_hash=doc.content_hash)


def flag_instructions(body: str) -> tuple[tuple[int, str], ...]:
    if not ANY_INSTRUCTION.search(body):
        return ()
    return tuple((number, line.strip()[:200]) for number, line in enumerate(body.splitlines(), start=1)
                 if ANY_INSTRUCTION.search(line))


def _scan_document(doc: Document, *, chunk_size: int, overlap: int) -> ScannedDocument:
    chunks = tuple(ChunkRef(c.knowledge_key, c.chunk_index, c.chunk_hash, c.point_id)
                   for c in chunk_document(doc, chunk_size=chunk_size, overlap=overlap))
    return ScannedDocument(info=info_of(doc), chunks=chunks, flagged=flag_instructions(doc.body))


def scan_corpus(docs_dir: Path, *, max_bytes: int, chunk_size: int, overlap: int) -> CorpusScan:
    """Every document's facts and chunk references, sorted by key; each body is dropped once scanned.
    Errors as `sources.load_corpus` reports them."""
    scanned = [_scan_document(document, chunk_size=chunk_size, overlap=overlap)
               for document in iter_corpus(docs_dir, max_bytes=max_bytes)]
    scanned.sort(key=lambda d: d.info.knowledge_key)
    return CorpusScan(documents=scanned, fingerprint=corpus_fingerprint([d.info for d in scanned]),
                      chunking_version=chunking_version(chunk_size, overlap))


def instruction_lines(docs_dir: Path, *, max_bytes: int) -> list[dict[str, object]]:
    """The instruction-like lines of every document, as `CorpusScan.flagged_lines` lists them, without
    chunking anything: for a step that has no scan of its own (an Airflow validate task, a rollback)."""
    found = [(doc.knowledge_key, doc.source, flag_instructions(doc.body))
             for doc in iter_corpus(docs_dir, max_bytes=max_bytes)]
    found.sort(key=lambda item: item[0])
    return [{"source": source, "line": number, "text": text} for _, source, flagged in found for number, text in flagged]


class DocumentTexts:
    """The chunks (with texts) of one document at a time, read again from its file for the build.

    Callers ask in manifest order, so each document is read once per pass. A file whose content hash is
    no longer the planned one stops the build: the version would mix two states of the knowledge.
    """

    def __init__(self, docs_dir: Path, infos: dict[str, DocumentInfo], *, max_bytes: int, chunk_size: int,
                 overlap: int, version_label: str) -> None:
        self.docs_dir, self.infos = docs_dir, infos
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
        changed = SourceChangedError(f"{info.source} changed after {self.version_label} was planned; this version "
                                     "cannot be completed from the files as they are now. Start a new run")
        try:
            data = read_bytes(path, info.source, max_bytes=self.max_bytes)
        except (OSError, SourceError):
            raise changed from None
        document = parse_document(path, info.source, data)
        if document.content_hash != info.content_hash:
            raise changed
        self._key = knowledge_key
        self._chunks = {c.point_id: c for c in chunk_document(document, chunk_size=self.chunk_size, overlap=self.overlap)}
