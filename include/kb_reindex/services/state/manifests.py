"""What a version is supposed to hold: its manifest, the plan's snapshot (chunk texts by hash) and the
file hash cache a plan trusts for files unchanged since.

A manifest is its document rows (`kb_manifest_documents`), each naming its document's *revision*: the chunk rows
of that document as chunked (`kb_doc_chunks`), stored once and shared by every version that holds the document
unchanged. An edit writes its changed documents' revisions and copies the document rows, not a row per chunk.
A chunk's manifest position is its document's `first_position` plus its ordinal in the revision; where a point
takes its vector from is recorded for the chunks a plan wrote (`kb_manifest_sources`), every other point being
its own source. Every read of chunk rows goes through the join below (docs/design.md, the version model)."""

from __future__ import annotations

import hashlib
import json
import logging
from bisect import bisect_right
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from itertools import groupby, islice
from operator import attrgetter
from typing import TYPE_CHECKING, Any, NamedTuple

import sqlalchemy as sa

from kb_reindex.domain.errors import KbError
from kb_reindex.services.state.schema import (chunk_texts, doc_chunks, file_hashes, legacy_manifest_chunks,
                                              manifest_documents, manifest_sources, slots, snapshots, versions)
from kb_reindex.domain.validation_model import FlaggedLine

if TYPE_CHECKING:
    from kb_reindex.services.state.clock import Clock

log = logging.getLogger(__name__)


class ManifestRef(NamedTuple):
    point_id: str
    knowledge_key: str
    source_point_id: str | None


class ManifestChunk(NamedTuple):
    """One chunk row of a manifest (a build slice reads its rows as these): a `ManifestRef` plus what the
    point's payload needs. `source_point_id`: the live point a reused chunk is copied from."""

    point_id: str
    knowledge_key: str
    source_point_id: str | None
    chunk_index: int
    chunk_hash: str


class ManifestDocument(NamedTuple):
    """One document row of a manifest: the payload fields of its points and how many chunks it has."""

    knowledge_key: str
    source: str
    title: str
    category: str
    tenant: str
    content_hash: str
    chunk_count: int


@dataclass(frozen=True)
class PlanSnapshotRow:
    """The plan's snapshot row of a version: its presence says the plan finished writing what later steps
    read. `flagged` the instruction-like lines of the planned files; `golden` the golden set file as the
    plan checked it (None: a plan from before it was recorded)."""

    version_id: int
    run_id: str | None
    planned_at: datetime
    chunks_to_embed: int
    flagged: list[FlaggedLine]
    golden: str | None
    reuse_kept: bool = False  # the build may take chunks live lacks from the profile's kept vectors


@dataclass(frozen=True)
class SliceDifference:
    """A slice of a version's manifest against the base version its slot holds exactly
    (`ManifestsMixin.slice_difference`): `added` the rows the base lacks, in manifest order; `kept` how many
    rows the base has (counted in SQL: an edit never reads the kept IDs, `kept_sample` looks some up);
    `rewrite` those kept rows whose document's payload fields changed."""

    added: list[ManifestChunk]
    kept: int
    rewrite: list[ManifestChunk]

    @property
    def total(self) -> int:
        return len(self.added) + self.kept


class CopiedRows(NamedTuple):
    """A run of documents whose chunk rows are the base manifest's as they are (documents unchanged since the
    base was planned, consecutive in both manifests): the base's rows at positions [start, start + size), all
    of keys first_key..last_key. `ManifestsMixin.write_manifest_from` copies them inside the database."""

    start: int
    size: int
    first_key: str
    last_key: str


#: a manifest in order, as `write_manifest_from` writes it: rows given, and runs of the base's rows copied
ManifestPart = list[ManifestChunk] | CopiedRows


class _NotWhereSaid(Exception):
    """A copied run's rows in the base are not all at the positions its documents put them."""


def _documents_within(conn: sa.Connection, version_id: int, window: tuple[int, int] | None) -> list[Any]:
    """Conditions on a version's document rows: those holding a position within `window` (none: all). The
    first is the one holding the window's first position, found by the position index."""
    if window is None:
        return []
    offset, limit = window
    first = conn.execute(sa.select(sa.func.max(_d.first_position)).where(
        _d.version_id == version_id, _d.first_position <= offset, _d.chunk_count > 0)).scalar()
    return [_d.first_position >= (first or 0), _d.first_position < offset + limit, _d.chunk_count > 0]


def _within(conn: sa.Connection, version_id: int, window: tuple[int, int] | None) -> list[Any]:
    """Conditions on a version's chunk rows: those at positions within `window` (none: all)."""
    if window is None:
        return []
    offset, limit = window
    return [*_documents_within(conn, version_id, window), _POSITION >= offset, _POSITION < offset + limit]


def _rows_within(conn: sa.Connection, version_id: int, window: tuple[int, int] | None) -> int:
    """How many chunk rows the version has at positions within `window`: from its documents' counts."""
    if window is None:
        return int(conn.execute(sa.select(sa.func.coalesce(sa.func.sum(_d.chunk_count), 0))
                                .where(_d.version_id == version_id)).scalar_one())
    offset, limit = window
    documents = conn.execute(sa.select(_d.first_position, _d.chunk_count).where(
        _d.version_id == version_id, *_documents_within(conn, version_id, window)))
    return sum(max(0, min(first + count, offset + limit) - max(first, offset)) for first, count in documents)

_d, _k, _s = manifest_documents.c, doc_chunks.c, manifest_sources.c
#: a chunk's vector source: what the plan that wrote the row said, or else the point itself (a document copied
#: unchanged from the base: its points are kept, or copied from live, where the same IDs are)
_SOURCE = sa.case((_s.point_id.is_(None), _k.point_id), else_=_s.source_point_id).label("source_point_id")
#: the columns of each row type, in its field order: a row is built from the tuple as it comes
_CHUNK_COLUMNS = (_k.point_id, _d.knowledge_key, _SOURCE, _k.chunk_index, _k.chunk_hash)
_DOCUMENT_COLUMNS = tuple(manifest_documents.c[name] for name in ManifestDocument._fields)
_POSITION = _d.first_position + _k.ordinal
#: a version's chunk rows: its documents, their revisions' rows, and the sources its plan recorded
_REVISIONS = manifest_documents.join(doc_chunks, _k.rev_id == _d.rev_id)
_ROWS = _REVISIONS.outerjoin(manifest_sources, sa.and_(_s.version_id == _d.version_id, _s.point_id == _k.point_id))
#: manifest order: by document key (code point order on every backend), then the chunk's place in it
_ORDER = (_d.knowledge_key, _k.ordinal)
#: the same order of rows read in parts, sorted in Python
_IN_MANIFEST_ORDER = attrgetter("knowledge_key", "chunk_index")


def _chunk_rows(version_id: int) -> sa.Select:
    return sa.select(*_CHUNK_COLUMNS).select_from(_ROWS).where(_d.version_id == version_id)


def _point_ids(version_id: int) -> sa.Select:
    return sa.select(_k.point_id).select_from(_REVISIONS).where(_d.version_id == version_id)


def _keys_holding(conn: sa.Connection, version_id: int, point_ids: Sequence[str]) -> list[str]:
    """The keys of the version's documents whose revisions hold any of these points: by the revisions' point
    index, then the documents' revision index (a join from the version's side would walk all its documents)."""
    return sorted(conn.execute(sa.select(_d.knowledge_key).where(
        _d.version_id == version_id, _d.rev_id.in_(sa.select(_k.rev_id).where(_k.point_id.in_(point_ids))))).scalars())


def _starts_near(conn: sa.Connection, version_id: int, wanted: Sequence[int]) -> list[tuple[int, str]]:
    """(first position, key) of the version's documents (with chunks) that may hold these sorted positions, by
    first position: a document holding position p starts within its largest document's chunk count before p,
    so those ranges are read by the position index (a sample costs its size, not the version's documents),
    unless together they span half the positions up to the last one wanted: then every document's start is read."""
    widest = int(conn.execute(sa.select(sa.func.coalesce(sa.func.max(_d.chunk_count), 0))
                              .where(_d.version_id == version_id)).scalar_one())
    ranges: list[list[int]] = []
    for p in wanted:  # [p - widest + 1, p], merged where they meet
        if ranges and p - widest + 1 <= ranges[-1][1] + 1:
            ranges[-1][1] = p
        else:
            ranges.append([p - widest + 1, p])
    if sum(hi - lo + 1 for lo, hi in ranges) * 2 >= wanted[-1] + 1:
        return [(first, key) for first, key in conn.execute(sa.select(_d.first_position, _d.knowledge_key).where(
            _d.version_id == version_id, _d.chunk_count > 0).order_by(_d.first_position))]
    found: list[tuple[int, str]] = []
    # each range a search of the position index (SQLite: a multi-index OR), written as plain SQL of integers: a
    # Core expression of hundreds of terms costs more to build and compile than the searches take
    table, version = manifest_documents.name, int(version_id)
    for batch in _batches(ranges, 400):
        terms = " OR ".join(f"(version_id = {version} AND first_position BETWEEN {int(lo)} AND {int(hi)})"
                            for lo, hi in batch)
        found += [(first, key) for first, key in conn.execute(sa.text(
            f"SELECT first_position, knowledge_key FROM {table} WHERE chunk_count > 0 AND ({terms})"))]
    return sorted(set(found))


def _batches(items: Sequence[Any], size: int = 500) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def revision_id(alias: str, knowledge_key: str, rows: Sequence[ManifestChunk]) -> str:
    """A document revision's ID: a digest of the alias, the key and its chunks (index, point ID, hash) in
    order. The same document chunked the same way has the same revision in every version of the alias."""
    digest = hashlib.sha256(f"{alias}\x1e{knowledge_key}".encode())
    for row in rows:
        digest.update(f"\x1e{row.chunk_index}\x1f{row.point_id}\x1f{row.chunk_hash}".encode())
    return digest.hexdigest()[:32]


def _by_document(rows: Iterable[ManifestChunk], where: str) -> Iterator[tuple[str, list[ManifestChunk]]]:
    """The rows of each document, in chunk order, as the rows come: in manifest order, a document's rows
    together (a document whose rows come apart stops the write: its revision would be split)."""
    seen: set[str] = set()
    for key, group in groupby(rows, key=attrgetter("knowledge_key")):
        if key in seen:
            raise KbError(f"{where}: the chunk rows of document {key!r} do not come together (manifest order is by "
                          "knowledge key, then chunk index); nothing was written")
        seen.add(key)
        yield key, sorted(group, key=attrgetter("chunk_index"))


class _RevisionWriter:
    """The revisions and sources a manifest write names, written a batch at a time in its transaction: a
    revision is inserted only where its ID is not stored yet (same ID, same rows)."""

    def __init__(self, conn: sa.Connection, version_id: int) -> None:
        self.conn, self.version_id = conn, version_id
        alias = conn.execute(sa.select(versions.c.alias).where(versions.c.id == version_id)).scalar_one_or_none()
        if alias is None:
            raise KbError(f"no version with id {version_id} in the state DB: its manifest cannot be written")
        self.alias: str = alias
        self.where = f"the manifest of {alias}'s version id {version_id}"
        self._revisions: dict[str, list[dict[str, Any]]] = {}
        self._sources: list[dict[str, Any]] = []
        self._pending = 0

    def document(self, doc: ManifestDocument | None, key: str, rows: list[ManifestChunk]) -> str:
        """The revision of this document's rows (queued), checked against its document row."""
        if doc is None:
            raise KbError(f"{self.where}: chunk rows of {key!r}, a document it does not list; nothing was written")
        if len(rows) != doc.chunk_count:
            raise KbError(f"{self.where}: {len(rows)} chunk rows of {key!r}, whose document counts {doc.chunk_count}; "
                          "nothing was written")
        rev = revision_id(self.alias, key, rows)
        if rows and rev not in self._revisions:
            self._revisions[rev] = [{"rev_id": rev, "ordinal": n, "chunk_index": r.chunk_index, "point_id": r.point_id,
                                     "chunk_hash": r.chunk_hash} for n, r in enumerate(rows)]
            self._pending += len(rows)
        self._sources += [{"version_id": self.version_id, "point_id": r.point_id, "chunk_hash": r.chunk_hash,
                           "source_point_id": r.source_point_id} for r in rows if r.source_point_id != r.point_id]
        if self._pending + len(self._sources) >= 5000:
            self.flush()
        return rev

    def flush(self) -> None:
        revs = sorted(self._revisions)
        stored: set[str] = set()
        for batch in _batches(revs):
            stored.update(self.conn.execute(sa.select(_k.rev_id).where(_k.rev_id.in_(batch), _k.ordinal == 0)).scalars())
        new = [row for rev in revs if rev not in stored for row in self._revisions[rev]]
        for batch in _batches(new, 5000):
            self.conn.execute(doc_chunks.insert(), list(batch))
        for batch in _batches(self._sources, 5000):
            self.conn.execute(manifest_sources.insert(), list(batch))
        self._revisions.clear()
        self._sources.clear()
        self._pending = 0


class _DocumentRow(NamedTuple):
    """A `kb_manifest_documents` row as written: the version's document, its revision and first position."""

    version_id: int
    document: ManifestDocument
    rev_id: str
    first_position: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"version_id": self.version_id, **self.document._asdict(), "rev_id": self.rev_id,
                "first_position": self.first_position}


def _document_row(version_id: int, doc: ManifestDocument, rev_id: str, first_position: int | None) -> _DocumentRow:
    return _DocumentRow(version_id, doc, rev_id, first_position)


def _clear_manifest(conn: sa.Connection, version_id: int) -> list[str]:
    """A manifest write's start: the version's snapshot, sources and document rows gone. The revisions its
    documents named (to drop those no version names once the new manifest is written)."""
    revs = list(conn.execute(sa.select(_d.rev_id).where(_d.version_id == version_id, _d.rev_id.is_not(None))).scalars())
    conn.execute(snapshots.delete().where(snapshots.c.version_id == version_id))
    conn.execute(manifest_sources.delete().where(_s.version_id == version_id))
    conn.execute(manifest_documents.delete().where(_d.version_id == version_id))
    return revs


def _drop_unnamed_revisions(conn: sa.Connection, revs: Iterable[str]) -> int:
    """Delete those of these revisions that no manifest names any more; their chunk rows deleted."""
    dropped = 0
    for batch in _batches(sorted(set(revs))):
        named = set(conn.execute(sa.select(_d.rev_id).distinct().where(_d.rev_id.in_(batch))).scalars())
        unnamed = [rev for rev in batch if rev not in named]
        if unnamed:
            dropped += conn.execute(doc_chunks.delete().where(_k.rev_id.in_(unnamed))).rowcount or 0
    return dropped


def delete_manifests(conn: sa.Connection, version_ids: Sequence[int]) -> tuple[int, int]:
    """Drop these versions' manifests (snapshot, sources, documents) and the revisions no other version names:
    (the chunk rows the manifests listed, the revision rows deleted)."""
    listed, revs = 0, set[str]()
    for batch in _batches(list(version_ids)):
        listed += int(conn.execute(sa.select(sa.func.coalesce(sa.func.sum(_d.chunk_count), 0))
                                   .where(_d.version_id.in_(batch))).scalar_one())
        revs.update(conn.execute(sa.select(_d.rev_id).distinct()
                                 .where(_d.version_id.in_(batch), _d.rev_id.is_not(None))).scalars())
        conn.execute(snapshots.delete().where(snapshots.c.version_id.in_(batch)))
        conn.execute(manifest_sources.delete().where(_s.version_id.in_(batch)))
        conn.execute(manifest_documents.delete().where(_d.version_id.in_(batch)))
    return listed, _drop_unnamed_revisions(conn, revs)


def convert_legacy_manifests(engine: sa.Engine) -> int:
    """A state DB made before revisions holds one row per chunk in `kb_manifest_chunks`: split each version's
    rows into its documents' revisions and sources once, a version per transaction, and empty that table
    (idempotent; a process converting the same version meanwhile is met by re-reading). A version whose rows
    disagree with its document rows stops the upgrade by name: no manifest is guessed. The versions converted."""
    if not sa.inspect(engine).has_table(legacy_manifest_chunks.name):
        return 0
    lc = legacy_manifest_chunks.c
    with engine.connect() as conn:
        ids = list(conn.execute(sa.select(lc.version_id).distinct().order_by(lc.version_id)).scalars())
    converted = 0
    for version_id in ids:
        try:
            with engine.begin() as conn:
                rows = [ManifestChunk(*row) for row in conn.execute(
                    sa.select(lc.point_id, lc.knowledge_key, lc.source_point_id, lc.chunk_index, lc.chunk_hash)
                    .where(lc.version_id == version_id).order_by(lc.knowledge_key, lc.chunk_index))]
                if not rows:
                    continue
                documents = [ManifestDocument(*row) for row in conn.execute(
                    sa.select(*_DOCUMENT_COLUMNS).where(_d.version_id == version_id).order_by(_d.knowledge_key))]
                _write_whole(conn, version_id, documents, rows)
                conn.execute(legacy_manifest_chunks.delete().where(lc.version_id == version_id))
        except sa.exc.IntegrityError:
            with engine.connect() as conn:  # converted meanwhile by another process?
                left = conn.execute(sa.select(sa.func.count()).select_from(legacy_manifest_chunks)
                                    .where(lc.version_id == version_id)).scalar_one()
            if left:
                raise
            continue
        converted += 1
    if converted:
        log.info("kb_reindex: state DB upgraded: the manifests of %d version(s) are stored by document revision",
                 converted)
    return converted


def _write_whole(conn: sa.Connection, version_id: int, documents: Sequence[ManifestDocument],
                 chunks: Iterable[ManifestChunk]) -> None:
    """Write a manifest whole in `conn`'s transaction: its documents, their revisions and sources."""
    old = _clear_manifest(conn, version_id)
    writer = _RevisionWriter(conn, version_id)
    by_key = {d.knowledge_key: d for d in documents}
    revs: dict[str, str] = {}
    for key, rows in _by_document(chunks, writer.where):
        revs[key] = writer.document(by_key.get(key), key, rows)
    writer.flush()
    position = 0
    out = []
    for key in sorted(by_key):  # code point order, as the database's keys compare
        doc = by_key[key]
        if key not in revs:
            revs[key] = writer.document(doc, key, [])
        out.append(_document_row(version_id, doc, revs[key], position))
        position += doc.chunk_count
    for batch in _batches(out, 5000):
        conn.execute(manifest_documents.insert(), [row.to_dict() for row in batch])
    _drop_unnamed_revisions(conn, old)


class FileHash(NamedTuple):
    size: int
    mtime_ns: int
    content_hash: str
    recorded_ns: int
    #: an object's ETag as listed (object storage); None for a file
    etag: str | None = None


#: the fields of a document row that its points' payloads carry: a document differs when one of them does
_PAYLOAD_COLUMNS = (_d.knowledge_key, _d.source, _d.title, _d.category, _d.tenant, _d.content_hash)


def _changed_keys(conn: sa.Connection, version_id: int, base_id: int) -> list[str]:
    """Keys of the version's documents whose payload fields differ from the base's (or that it lacks), sorted:
    on SQLite and PostgreSQL one `EXCEPT` of the two versions' rows (merged from two ordered scans), on MySQL
    an anti-join (`EXCEPT` only from MySQL 8.0.31 on)."""
    if conn.dialect.name in ("sqlite", "postgresql"):
        mine = sa.select(*_PAYLOAD_COLUMNS).where(_d.version_id == version_id)
        theirs = sa.select(*_PAYLOAD_COLUMNS).where(_d.version_id == base_id)
        return sorted({row[0] for row in conn.execute(sa.except_(mine, theirs))})
    base = manifest_documents.alias("base")
    same = sa.and_(base.c.source == _d.source, base.c.title == _d.title, base.c.category == _d.category,
                   base.c.tenant == _d.tenant, base.c.content_hash == _d.content_hash)
    query = (sa.select(_d.knowledge_key)
             .select_from(manifest_documents.outerjoin(base, sa.and_(base.c.version_id == base_id,
                                                                     base.c.knowledge_key == _d.knowledge_key)))
             .where(_d.version_id == version_id, sa.or_(base.c.knowledge_key.is_(None), sa.not_(same))))
    return sorted(set(conn.execute(query).scalars()))


class ManifestsMixin:
    """Manifest, snapshot and file hash rows of `StateStore`."""

    engine: sa.Engine
    clock: Clock
    #: differences of two manifests already asked within `sharing_differences` (None: outside one)
    _differences: dict[tuple[str, int, int], list[Any]] | None = None

    # --- manifest -------------------------------------------------------------------------------

    @contextmanager
    def sharing_differences(self) -> Iterator[None]:
        """Within this block the difference of two versions' manifests (the rows one lacks that the other has,
        the documents whose payload fields differ) is asked of the database once and then reused: a run's build
        and validation weigh the same version against the same base, and nothing writes either manifest
        meanwhile (the run holds the alias's lock; a manifest written or pruned by this store forgets what was
        kept). At 200k chunks each such question is a scan of both manifests' 40k documents (0.05-0.1 s)."""
        outer = self._differences
        if outer is None:
            self._differences = {}
        try:
            yield
        finally:
            if outer is None:
                self._differences = None

    def _remembered(self, kind: str, version_id: int, other_id: int, ask: Callable[[], list[Any]]) -> list[Any]:
        kept = self._differences
        if kept is None:
            return ask()
        key = (kind, version_id, other_id)
        if key not in kept:
            kept[key] = ask()
        return list(kept[key])

    def _forget_differences(self) -> None:
        if self._differences is not None:
            self._differences.clear()

    def write_manifest(self, version_id: int, documents: list[ManifestDocument],
                       chunks: Iterable[ManifestChunk]) -> None:
        """Replace the version's manifest in one transaction, so a retried step never doubles it. `chunks` in
        manifest order (by knowledge key, then chunk index), as many of each document as its row counts."""
        self._forget_differences()
        with self.engine.begin() as conn:
            _write_whole(conn, version_id, documents, chunks)

    def write_manifest_from(self, version_id: int, base_id: int, documents: list[ManifestDocument],
                            parts: Iterable[ManifestPart], copied_documents: Collection[str] = ()) -> bool:
        """`write_manifest` of a manifest most of whose documents are its base's as they are: the rows given
        are written (their documents' revisions), and each `CopiedRows` run's document rows are copied from the
        base inside the database (INSERT .. SELECT by key range, each naming the revision it names in the base,
        its position moved), positions counted through the parts in order. An edit of a large knowledge base
        writes its changed documents' rows and copies the document rows, not a row per chunk. False, and
        nothing written, when a run's documents are not where it said (their chunks counted first) or the copied
        documents are not `copied_documents`: the caller writes the manifest whole."""
        by_key = {d.knowledge_key: d for d in documents}
        self._forget_differences()
        try:
            with self.engine.begin() as conn:
                old = _clear_manifest(conn, version_id)
                writer = _RevisionWriter(conn, version_id)
                written: list[_DocumentRow] = []
                position = copied = 0
                for part in parts:
                    if isinstance(part, CopiedRows):
                        where = (_d.version_id == base_id, _d.knowledge_key >= part.first_key,
                                 _d.knowledge_key <= part.last_key)
                        count, chunks, first = conn.execute(sa.select(
                            sa.func.count(), sa.func.coalesce(sa.func.sum(_d.chunk_count), 0),
                            sa.func.min(_d.first_position)).where(*where, _d.rev_id.is_not(None))).one()
                        if int(chunks) != part.size or not count or first != part.start:
                            raise _NotWhereSaid(f"{count} documents of {chunks} chunks from position {first} in "
                                                f"{part.first_key}..{part.last_key}, said {part.size} from {part.start}")
                        # and their revisions hold those chunks (counted by the revisions' primary key, not read)
                        held = conn.execute(sa.select(sa.func.count()).select_from(_REVISIONS).where(*where)).scalar_one()
                        if held != part.size:
                            raise _NotWhereSaid(f"the revisions of {part.first_key}..{part.last_key} hold {held} chunk "
                                                f"rows, their documents count {part.size}")
                        conn.execute(manifest_documents.insert().from_select(
                            ["version_id", *ManifestDocument._fields, "rev_id", "first_position"],
                            sa.select(sa.literal(version_id), *_DOCUMENT_COLUMNS, _d.rev_id,
                                      _d.first_position + (position - part.start)).where(*where)))
                        copied += int(count)
                        position += part.size
                        continue
                    for key, rows in _by_document(part, writer.where):
                        rev = writer.document(by_key.get(key), key, rows)
                        written.append(_document_row(version_id, by_key[key], rev, position))
                        position += len(rows)
                # the version's rows so far are the copied ones: exactly the documents named, read back by key
                named = frozenset(copied_documents)
                found = set(conn.execute(sa.select(_d.knowledge_key).where(_d.version_id == version_id)).scalars())
                if copied != len(named) or found != named:
                    raise _NotWhereSaid(f"{copied} documents copied, {len(found & named)} of the {len(named)} named")
                done = {row.document.knowledge_key for row in written}
                written += [_document_row(version_id, doc, writer.document(doc, key, []), None)
                            for key, doc in by_key.items() if key not in done]  # no chunks: no position
                writer.flush()
                for batch in _batches(written, 5000):
                    conn.execute(manifest_documents.insert(), [row.to_dict() for row in batch])
                _drop_unnamed_revisions(conn, old)
        except _NotWhereSaid as exc:
            log.info("kb_reindex: the manifest of version id %d is written whole: its base's documents are not where "
                     "its plan put them (%s)", version_id, exc)
            return False
        return True

    def manifest_refs(self, version_id: int) -> list[ManifestRef]:
        """(point_id, knowledge_key, source_point_id) of every chunk, in manifest order: what a build needs."""
        return list(self.iter_manifest_refs(version_id))

    def iter_manifest_refs(self, version_id: int) -> Iterator[ManifestRef]:
        """`manifest_refs` a few thousand rows at a time (a server-side cursor on MySQL), for a caller that
        keeps less than every row as it came; consume it whole, it holds a connection until then."""
        query = (sa.select(_k.point_id, _d.knowledge_key, _SOURCE).select_from(_ROWS)
                 .where(_d.version_id == version_id).order_by(*_ORDER))
        with self.engine.connect() as conn:
            for row in conn.execution_options(yield_per=5000).execute(query):
                yield ManifestRef(*row)

    def manifest_size(self, version_id: int) -> int:
        """How many chunks (points) the version's manifest lists: its documents' counts summed in SQL."""
        with self.engine.connect() as conn:
            return _rows_within(conn, version_id, None)

    def manifest_at(self, version_id: int, positions: Iterable[int]) -> list[ManifestChunk]:
        """The manifest rows at these positions (0 .. size - 1, in manifest order): the first positions of the
        documents that may hold them are read (`_starts_near`), then the rows of the documents holding them, so
        a small random sample costs its size, not the documents or the chunks."""
        wanted = sorted(set(positions))
        if not wanted:
            return []
        with self.engine.connect() as conn:
            starts = _starts_near(conn, version_id, wanted)
            firsts = [first for first, _ in starts]
            keys = sorted({starts[i][1] for i in (bisect_right(firsts, p) - 1 for p in wanted) if i >= 0})
            rows: list[tuple[int, ManifestChunk]] = []
            for batch in _batches(keys):
                rows += [(position, ManifestChunk(*row)) for *row, position in conn.execute(
                    sa.select(*_CHUNK_COLUMNS, _POSITION).select_from(_ROWS)
                    .where(_d.version_id == version_id, _d.knowledge_key.in_(batch)))]
        at = set(wanted)
        return [row for position, row in sorted(rows, key=lambda pair: pair[0]) if position in at]

    def manifest_documents(self, version_id: int, keys: Iterable[str] | None = None) -> list[ManifestDocument]:
        """The version's documents (only those of `keys`, when given), by knowledge key."""
        query = sa.select(*_DOCUMENT_COLUMNS).where(_d.version_id == version_id)
        with self.engine.connect() as conn:
            if keys is None:  # a row per document of the corpus (a plan reads live's): made by position
                return list(map(ManifestDocument._make, conn.execute(query.order_by(_d.knowledge_key))))
            out = [ManifestDocument(*row) for batch in _batches(sorted(set(keys)))
                   for row in conn.execute(query.where(_d.knowledge_key.in_(batch)))]
            return sorted(out, key=lambda doc: doc.knowledge_key)

    def chunks_lost(self, version_id: int, base_id: int) -> tuple[int, int]:
        """(the base's chunks, the chunks the base's documents that the version keeps lost in it: each one's
        count down, summed), counted in SQL by the documents' key: what a content-loss check weighs."""
        new = manifest_documents.alias("new")
        total = sa.select(sa.func.coalesce(sa.func.sum(_d.chunk_count), 0)).where(_d.version_id == base_id)
        lost = (sa.select(sa.func.coalesce(sa.func.sum(_d.chunk_count - new.c.chunk_count), 0))
                .select_from(manifest_documents.join(new, sa.and_(new.c.version_id == version_id,
                                                                  new.c.knowledge_key == _d.knowledge_key)))
                .where(_d.version_id == base_id, _d.chunk_count > new.c.chunk_count))
        with self.engine.connect() as conn:
            return int(conn.execute(total).scalar_one()), int(conn.execute(lost).scalar_one())

    def manifest_document_hashes(self, version_id: int) -> dict[str, str]:
        """knowledge_key -> content_hash of the version's documents."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(_d.knowledge_key, _d.content_hash).where(_d.version_id == version_id))
            return {key: value for key, value in rows}

    def manifest_chunks(self, version_id: int, *, point_ids: list[str] | None = None) -> list[ManifestChunk]:
        """Every chunk row of the version, or only those of `point_ids`, in manifest order."""
        with self.engine.connect() as conn:
            if point_ids is None:
                # a tuple per row: a third of the time of a RowMapping per row
                return [ManifestChunk(*row) for row in conn.execute(_chunk_rows(version_id).order_by(*_ORDER))]
            rows: list[ManifestChunk] = []
            for batch in _batches(sorted(set(point_ids))):
                keys = _keys_holding(conn, version_id, batch)
                rows += [ManifestChunk(*row) for row in conn.execute(_chunk_rows(version_id).where(
                    _d.knowledge_key.in_(keys), _k.point_id.in_(batch)))] if keys else []
        return sorted(rows, key=_IN_MANIFEST_ORDER)

    def document_chunks(self, version_id: int, keys: Iterable[str]) -> list[ManifestChunk]:
        """The chunk rows of the version's documents `keys`, in manifest order."""
        with self.engine.connect() as conn:
            rows = [ManifestChunk(*row) for batch in _batches(sorted(set(keys)))
                    for row in conn.execute(_chunk_rows(version_id).where(_d.knowledge_key.in_(batch)).order_by(*_ORDER))]
        return sorted(rows, key=_IN_MANIFEST_ORDER)

    def shared_chunks(self, version_id: int, keys: Collection[str] | None = None) -> list[ManifestChunk]:
        """The version's chunks whose hash (text) appears in more than one of its documents: identical chunks
        across documents, in manifest order. `keys`: only the hashes of these documents' chunks are looked at (an
        edit's changed documents): those hashes are looked up in every revision by the hash index, and the
        version's documents naming those revisions by the revision index, so the look costs their chunks, not
        the manifest; None (or more than 500 keys), every hash, grouped in SQL."""
        with self.engine.connect() as conn:
            if keys is None or len(keys) > 500:
                grouped_d, grouped_k = manifest_documents.alias("grouped"), doc_chunks.alias("grouped_chunks")
                shared = (sa.select(grouped_k.c.chunk_hash)
                          .select_from(grouped_d.join(grouped_k, grouped_k.c.rev_id == grouped_d.c.rev_id))
                          .where(grouped_d.c.version_id == version_id).group_by(grouped_k.c.chunk_hash)
                          .having(sa.func.count(sa.distinct(grouped_d.c.knowledge_key)) > 1))
                query = _chunk_rows(version_id).where(_k.chunk_hash.in_(shared)).order_by(*_ORDER)
                return [ManifestChunk(*row) for row in conn.execute(query)]
            hashes = sorted({h for batch in _batches(sorted(keys)) for h in conn.execute(
                _point_ids(version_id).with_only_columns(_k.chunk_hash).where(_d.knowledge_key.in_(batch))).scalars()})
            holders: dict[str, set[str]] = {}  # hash -> keys of the version's documents holding it
            for batch in _batches(hashes):
                revisions: dict[str, set[str]] = {}
                for rev_id, chunk_hash in conn.execute(sa.select(_k.rev_id, _k.chunk_hash).where(_k.chunk_hash.in_(batch))):
                    revisions.setdefault(rev_id, set()).add(chunk_hash)
                for rev_batch in _batches(sorted(revisions)):
                    for key, rev_id in conn.execute(sa.select(_d.knowledge_key, _d.rev_id).where(
                            _d.rev_id.in_(rev_batch), _d.version_id == version_id)):
                        for chunk_hash in revisions[rev_id]:
                            holders.setdefault(chunk_hash, set()).add(key)
            shared_hashes = sorted(h for h, held in holders.items() if len(held) > 1)
            involved = sorted({key for h in shared_hashes for key in holders[h]})
            rows = [ManifestChunk(*row) for batch in _batches(involved) for row in conn.execute(
                _chunk_rows(version_id).where(_d.knowledge_key.in_(batch)))]
        wanted = set(shared_hashes)
        return sorted((row for row in rows if row.chunk_hash in wanted), key=_IN_MANIFEST_ORDER)

    def embedded_chunks(self, version_id: int, keys: Iterable[str] | None = None) -> list[ManifestChunk]:
        """The version's chunks embedded for it (no vector copied from live), of the documents `keys` (None: all):
        its rows whose recorded source is none, looked up by the documents' keys when given."""
        embedded = (_s.point_id.is_not(None), _s.source_point_id.is_(None))
        with self.engine.connect() as conn:
            if keys is None:
                return [ManifestChunk(*row) for row in conn.execute(
                    _chunk_rows(version_id).where(*embedded).order_by(*_ORDER))]
            rows = [ManifestChunk(*row) for batch in _batches(sorted(set(keys))) for row in conn.execute(
                _chunk_rows(version_id).where(_d.knowledge_key.in_(batch), *embedded))]
        return sorted(rows, key=_IN_MANIFEST_ORDER)

    def prune_manifests(self, alias: str) -> int:
        """Drop the manifests no step can read any more: of the alias's deleted versions that no slot holds
        and no kept version's slot was taken from (the difference of a build needs its base's manifest), with
        the revisions no other version names. The version rows stay (history, status). Without this the state
        DB gains the document rows of a manifest per edit. The number of chunk rows the dropped manifests listed."""
        v = versions.c
        self._forget_differences()
        with self.engine.begin() as conn:
            held = {row for row in conn.execute(sa.select(slots.c.holds).where(slots.c.holds.is_not(None))).scalars()}
            bases = set(conn.execute(sa.select(v.slot_base).where(v.alias == alias, v.status != "deleted",
                                                                   v.slot_base.is_not(None))).scalars())
            gone = [vid for vid, number in conn.execute(sa.select(v.id, v.version).where(v.alias == alias,
                                                                                         v.status == "deleted"))
                    if vid not in held and number not in bases]
            if not gone:
                return 0
            listed, revision_rows = delete_manifests(conn, gone)
        if listed:
            log.info("kb_reindex: the manifests of %d deleted version(s) no slot needs were dropped (%d chunks listed, "
                     "%d revision rows no kept version names)", len(gone), listed, revision_rows)
        return listed


    # --- the plan's snapshot -------------------------------------------------------------------

    def missing_texts(self, hashes: Iterable[str]) -> set[str]:
        """Which of these chunk hashes have no stored text yet."""
        wanted = set(hashes)
        if not wanted:
            return set()
        found: set[str] = set()
        ordered = sorted(wanted)
        with self.engine.connect() as conn:
            for start in range(0, len(ordered), 500):
                batch = ordered[start:start + 500]
                found.update(conn.execute(sa.select(chunk_texts.c.chunk_hash)
                                          .where(chunk_texts.c.chunk_hash.in_(batch))).scalars())
        return wanted - found

    def add_texts(self, rows: Iterable[dict[str, str]]) -> int:
        """Store chunk texts ({chunk_hash, section, text}) a batch at a time; a hash stored meanwhile by
        another plan is kept as it is (same hash, same text)."""
        added = 0
        items = iter(rows)
        while batch := list(islice(items, 500)):
            try:
                with self.engine.begin() as conn:
                    conn.execute(chunk_texts.insert(), batch)
                added += len(batch)
            except sa.exc.IntegrityError:
                missing = self.missing_texts(r["chunk_hash"] for r in batch)
                fresh = [r for r in batch if r["chunk_hash"] in missing]
                if fresh:
                    with self.engine.begin() as conn:
                        conn.execute(chunk_texts.insert(), fresh)
                added += len(fresh)
        return added

    def finish_snapshot(self, version_id: int, *, run_id: str | None, chunks_to_embed: int,
                        flagged: list[FlaggedLine], golden: str | None = None, reuse_kept: bool = False) -> None:
        """The last write of a plan's snapshot: from here on the version can be created and built."""
        with self.engine.begin() as conn:
            conn.execute(snapshots.delete().where(snapshots.c.version_id == version_id))
            conn.execute(snapshots.insert().values(version_id=version_id, run_id=run_id, planned_at=self.clock.now(),
                                                   chunks_to_embed=chunks_to_embed, golden=golden,
                                                   reuse_kept=reuse_kept, flagged=json.dumps(flagged, ensure_ascii=False)))

    def snapshot(self, version_id: int) -> PlanSnapshotRow | None:
        """The version's snapshot row (flagged lines decoded), or None when its plan never finished one."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(snapshots).where(snapshots.c.version_id == version_id)).mappings().first()
        if row is None:
            return None
        return PlanSnapshotRow(version_id=row["version_id"], run_id=row["run_id"], planned_at=row["planned_at"],
                               chunks_to_embed=row["chunks_to_embed"], flagged=json.loads(row["flagged"]),
                               golden=row["golden"], reuse_kept=bool(row["reuse_kept"]))

    def slice_rows(self, version_id: int, window: tuple[int, int] | None = None) -> list[ManifestChunk]:
        """A build slice's manifest rows, by range of position in SQL (all rows without a window), in
        manifest order: a slice costs its own documents' rows, not the whole manifest."""
        with self.engine.connect() as conn:
            query = _chunk_rows(version_id).where(*_within(conn, version_id, window))
            return [ManifestChunk(*row) for row in conn.execute(query.order_by(*_ORDER))]

    def slice_difference(self, version_id: int, base_id: int, window: tuple[int, int] | None = None
                         ) -> SliceDifference:
        """A slice's rows (as `slice_rows`) against the base version's manifest: the rows the base lacks, how
        many it has (same key, chunk index and hash: the same point ID), and of those the rows whose document's
        payload fields changed. The documents that differ are found in SQL (`_rows_missing_from`: their
        revisions differ), then their rows, so an edit reads the rows that differ and a count of the rest."""
        with self.engine.connect() as conn:
            added = self._rows_missing_from(conn, version_id, base_id, window)
            kept = _rows_within(conn, version_id, window) - len(added)
        changed = sorted(self.changed_documents(version_id, base_id)) if kept else []
        rewrite: list[ManifestChunk] = []
        with self.engine.connect() as conn:
            for batch in _batches(changed):
                theirs = set(conn.execute(_point_ids(base_id).where(_d.knowledge_key.in_(batch))).scalars())
                rewrite += [row for row in (ManifestChunk(*r) for r in conn.execute(
                    _chunk_rows(version_id).where(_d.knowledge_key.in_(batch), *_within(conn, version_id, window))))
                            if row.point_id in theirs]
        rewrite.sort(key=_IN_MANIFEST_ORDER)
        return SliceDifference(added=added, kept=kept, rewrite=rewrite)

    def kept_sample(self, version_id: int, base_id: int, positions: Iterable[int]) -> list[str]:
        """The point IDs, among the version's rows at these manifest positions, that the base version also
        has (kept from it), in manifest order: a sample of the kept points costs its size, not the manifest."""
        rows = self.manifest_at(version_id, positions)
        found: set[str] = set()
        with self.engine.connect() as conn:
            for batch in _batches(rows):  # a point ID's key is its row's: the base's rows of those keys
                found.update(conn.execute(_point_ids(base_id).where(
                    _d.knowledge_key.in_(sorted({row.knowledge_key for row in batch})),
                    _k.point_id.in_([row.point_id for row in batch]))).scalars())
        return [row.point_id for row in rows if row.point_id in found]

    def added_chunks(self, version_id: int, base_id: int) -> list[ManifestChunk]:
        """The version's rows whose point the base version's manifest lacks (`slice_difference`'s added rows,
        without the rewrites it also weighs): what a build by difference wrote, in manifest order."""
        with self.engine.connect() as conn:
            return self._rows_missing_from(conn, version_id, base_id)

    def dropped_chunks(self, version_id: int, base_id: int) -> list[ManifestChunk]:
        """The base version's rows whose point the version's manifest lacks: what a slot gives up moving from
        the base to the version (found in SQL, `_rows_missing_from`), in manifest order."""
        with self.engine.connect() as conn:
            return self._rows_missing_from(conn, base_id, version_id)

    def _rows_missing_from(self, conn: sa.Connection, version_id: int, other_id: int,
                           window: tuple[int, int] | None = None) -> list[ManifestChunk]:
        """`_ask_rows_missing_from`, remembered within `sharing_differences` (a whole manifest's, not a slice's)."""
        if window is not None:
            return self._ask_rows_missing_from(conn, version_id, other_id, window)
        return self._remembered("missing", version_id, other_id,
                                lambda: self._ask_rows_missing_from(conn, version_id, other_id, None))

    @staticmethod
    def _ask_rows_missing_from(conn: sa.Connection, version_id: int, other_id: int,
                               window: tuple[int, int] | None = None) -> list[ManifestChunk]:
        """The rows of the version's manifest (those at positions within `window`, when given) whose point the
        other version's manifest lacks, in manifest order. The documents whose revision differs first, by key:
        on SQLite and PostgreSQL one `EXCEPT` of the two manifests' (key, revision) lists, on MySQL an anti-join
        (`EXCEPT` only from MySQL 8.0.31 on); a point ID is a function of its key, so only those documents'
        rows can differ. Then their rows, against the other's rows of the same keys."""
        mine = sa.select(_d.knowledge_key, _d.rev_id).where(_d.version_id == version_id,
                                                            *_documents_within(conn, version_id, window))
        if conn.dialect.name in ("sqlite", "postgresql"):
            theirs = sa.select(_d.knowledge_key, _d.rev_id).where(_d.version_id == other_id)
            if window is not None:  # a slice: the other's documents of the slice's keys
                theirs = theirs.where(_d.knowledge_key.in_(mine.with_only_columns(_d.knowledge_key).subquery().select()))
            keys = sorted(set(conn.execute(sa.except_(mine, theirs)).scalars()))
        else:
            other = manifest_documents.alias("other")
            lacking = mine.outerjoin_from(manifest_documents, other, sa.and_(other.c.version_id == other_id,
                                                                             other.c.knowledge_key == _d.knowledge_key))
            keys = sorted(set(conn.execute(lacking.where(sa.or_(other.c.knowledge_key.is_(None),
                                                                other.c.rev_id != _d.rev_id))).scalars()))
        rows: list[ManifestChunk] = []
        for batch in _batches(keys):
            theirs_ids = set(conn.execute(_point_ids(other_id).where(_d.knowledge_key.in_(batch))).scalars())
            rows += [row for row in (ManifestChunk(*r) for r in conn.execute(_chunk_rows(version_id).where(
                _d.knowledge_key.in_(batch), *_within(conn, version_id, window)))) if row.point_id not in theirs_ids]
        return sorted(rows, key=_IN_MANIFEST_ORDER)

    def changed_documents(self, version_id: int, base_id: int) -> set[str]:
        """Keys of the version's documents whose payload fields differ from the base's (or that it lacks)."""
        with self.engine.connect() as conn:
            return set(self._remembered_changed_keys(conn, version_id, base_id))

    def _remembered_changed_keys(self, conn: sa.Connection, version_id: int, base_id: int) -> list[str]:
        """`_changed_keys`, remembered within `sharing_differences`."""
        return self._remembered("changed", version_id, base_id, lambda: _changed_keys(conn, version_id, base_id))

    def documents_changed(self, version_id: int, base_id: int
                          ) -> list[tuple[ManifestDocument, ManifestDocument | None]]:
        """The version's documents whose payload fields differ from the base's, each with the base's document of
        its key (None: the base lacks it), by key: what validation weighs of a run's changes, found in SQL
        (`_changed_keys`), not by reading both versions' documents."""
        with self.engine.connect() as conn:
            keys = self._remembered_changed_keys(conn, version_id, base_id)
            found: dict[tuple[int, str], ManifestDocument] = {}
            for batch in _batches(keys):
                found.update(((version, row[0]), ManifestDocument(*row)) for version, *row in conn.execute(
                    sa.select(_d.version_id, *_DOCUMENT_COLUMNS).where(_d.version_id.in_((version_id, base_id)),
                                                                       _d.knowledge_key.in_(batch))))
        return [(found[(version_id, key)], found.get((base_id, key))) for key in keys]

    def chunks_by_hash(self, version_ids: Iterable[int], hashes: Iterable[str]) -> dict[str, tuple[int, str]]:
        """chunk_hash -> (version id, point id) of a point holding it, among these versions' manifests."""
        ids, wanted = list(version_ids), sorted(set(hashes))
        out: dict[str, tuple[int, str]] = {}
        if not ids:
            return out
        with self.engine.connect() as conn:  # the revisions holding them by the hash index, then their versions
            for batch in _batches(wanted):
                found: dict[str, list[tuple[str, str]]] = {}
                for rev_id, point_id, chunk_hash in conn.execute(
                        sa.select(_k.rev_id, _k.point_id, _k.chunk_hash).where(_k.chunk_hash.in_(batch))):
                    found.setdefault(rev_id, []).append((point_id, chunk_hash))
                for rev_batch in _batches(sorted(found)):
                    for version_id, rev_id in conn.execute(sa.select(_d.version_id, _d.rev_id).where(
                            _d.rev_id.in_(rev_batch), _d.version_id.in_(ids)).order_by(_d.version_id, _d.rev_id)):
                        for point_id, chunk_hash in found[rev_id]:
                            out.setdefault(chunk_hash, (version_id, point_id))
        return out

    def referenced_hashes(self, version_ids: Iterable[int], hashes: Iterable[str]) -> set[str]:
        """Those of `hashes` that a manifest of these versions holds."""
        return set(self.chunks_by_hash(version_ids, hashes))

    def texts(self, hashes: Iterable[str]) -> dict[str, tuple[str, str]]:
        """chunk_hash -> (section, text) for those of these hashes that are stored."""
        ordered = sorted(set(hashes))
        out: dict[str, tuple[str, str]] = {}
        with self.engine.connect() as conn:
            for start in range(0, len(ordered), 500):
                rows = conn.execute(sa.select(chunk_texts.c.chunk_hash, chunk_texts.c.section, chunk_texts.c.text)
                                    .where(chunk_texts.c.chunk_hash.in_(ordered[start:start + 500])))
                out.update((h, (section, text)) for h, section, text in rows)
        return out


    def drop_unneeded_texts(self, versions_gone: Iterable[int] | None = None) -> int:
        """Delete the texts no kept version embeds any more (after retention, drop or forget): a version
        needs its texts until it is deleted. `versions_gone`: the versions just deleted, whose embedded texts
        are the only ones that can have become unneeded (a routine cleanup: what it looks at grows with those
        versions' embedded chunks, not with the knowledge base); None looks at every stored text (a drop, a
        forget, a retirement). One DELETE decided inside the database, each text looked up by the sources'
        (chunk_hash, version_id) index: when the first build's version goes (every chunk embedded), its texts
        are not read into Python and asked about 500 at a time (at 51k chunks 208 round trips and 1.9 s of one
        edit's cleanup)."""
        t = chunk_texts.c
        kept = sa.select(versions.c.id).where(versions.c.status != "deleted")
        still_embedded = sa.exists(sa.select(sa.literal(1)).select_from(manifest_sources).where(
            _s.version_id.in_(kept), _s.source_point_id.is_(None), _s.chunk_hash == t.chunk_hash))
        where = [~still_embedded]
        if versions_gone is not None:
            gone = sorted(set(versions_gone))
            if not gone:
                return 0
            where.append(t.chunk_hash.in_(sa.select(_s.chunk_hash).where(_s.version_id.in_(gone),
                                                                          _s.source_point_id.is_(None))))
        with self.engine.begin() as conn:
            deleted = conn.execute(chunk_texts.delete().where(*where)).rowcount or 0
        if deleted:
            log.info("kb_reindex: %d chunk text(s) no kept version needs were dropped", deleted)
        return deleted

    # --- the file hash cache ------------------------------------------------------------------

    def file_hashes(self, root: str) -> dict[str, FileHash]:
        """source -> what the last plan recorded of it; empty for a state DB from before this table."""
        try:
            with self.engine.connect() as conn:
                rows = conn.execute(sa.select(file_hashes.c.source, file_hashes.c.size, file_hashes.c.mtime_ns,
                                              file_hashes.c.content_hash, file_hashes.c.recorded_ns,
                                              file_hashes.c.etag)
                                    .where(file_hashes.c.root == root))
                return {source: FileHash(*rest) for source, *rest in rows}
        except (sa.exc.OperationalError, sa.exc.ProgrammingError) as exc:
            if "kb_file_hashes" in str(exc.orig):  # a read-only command on a state DB not yet upgraded
                return {}
            raise

    def record_file_hashes(self, root: str, entries: dict[str, FileHash], *, replace_all: bool,
                           forget: Iterable[str] = ()) -> None:
        """Record files as hashed by a plan: all of them (`replace_all`, after reading every file) or only
        these (after hashing a few again), the sources in `forget` (gone since) dropped."""
        rows = [{"root": root, "source": source, "size": e.size, "mtime_ns": e.mtime_ns,
                 "content_hash": e.content_hash, "recorded_ns": e.recorded_ns, "etag": e.etag}
                for source, e in entries.items()]
        with self.engine.begin() as conn:
            if replace_all:
                conn.execute(file_hashes.delete().where(file_hashes.c.root == root))
            else:
                sources = sorted({*entries, *forget})
                for start in range(0, len(sources), 500):
                    conn.execute(file_hashes.delete().where(file_hashes.c.root == root,
                                                            file_hashes.c.source.in_(sources[start:start + 500])))
            for start in range(0, len(rows), 5000):
                conn.execute(file_hashes.insert(), rows[start:start + 5000])
