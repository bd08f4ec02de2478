"""What a version is supposed to hold: its manifest, the plan's snapshot (chunk texts by hash) and the
file hash cache a plan trusts for files unchanged since."""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from itertools import islice
from typing import TYPE_CHECKING, NamedTuple

import sqlalchemy as sa

from kb_reindex.services.state.schema import (chunk_texts, file_hashes, manifest_chunks, manifest_documents, slots,
                                              snapshots, versions)
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


class _PositionedChunk(NamedTuple):
    """A `ManifestChunk` with its manifest position (None in rows written before positions were)."""

    point_id: str
    knowledge_key: str
    source_point_id: str | None
    chunk_index: int
    chunk_hash: str
    position: int | None


def _in_manifest_order(row: _PositionedChunk) -> tuple[int, str, int]:
    """Manifest order: by position, which follows (knowledge key, chunk index), also where it is unknown."""
    return (-1 if row.position is None else row.position, row.knowledge_key, row.chunk_index)


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


#: the columns of each row type, in its field order: a row is built from the tuple as it comes
_CHUNK_COLUMNS = tuple(manifest_chunks.c[name] for name in ManifestChunk._fields)
_DOCUMENT_COLUMNS = tuple(manifest_documents.c[name] for name in ManifestDocument._fields)


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


def _replace_documents(conn: sa.Connection, version_id: int, documents: list[ManifestDocument]) -> None:
    """A manifest write's start: the version's snapshot and manifest rows gone, its documents written."""
    conn.execute(snapshots.delete().where(snapshots.c.version_id == version_id))
    conn.execute(manifest_chunks.delete().where(manifest_chunks.c.version_id == version_id))
    conn.execute(manifest_documents.delete().where(manifest_documents.c.version_id == version_id))
    if documents:
        conn.execute(manifest_documents.insert(), [{"version_id": version_id, **d._asdict()} for d in documents])


class FileHash(NamedTuple):
    size: int
    mtime_ns: int
    content_hash: str
    recorded_ns: int
    #: an object's ETag as listed (object storage); None for a file
    etag: str | None = None


class ManifestsMixin:
    """Manifest, snapshot and file hash rows of `StateStore`."""

    engine: sa.Engine
    clock: Clock

    # --- manifest -------------------------------------------------------------------------------

    def write_manifest(self, version_id: int, documents: list[ManifestDocument],
                       chunks: Iterable[ManifestChunk]) -> None:
        """Replace the version's manifest in one transaction, so a retried step never doubles it."""
        rows = enumerate(chunks)  # in manifest order: (knowledge_key, chunk_index)
        with self.engine.begin() as conn:
            _replace_documents(conn, version_id, documents)
            while batch := [{"version_id": version_id, "position": n, **c._asdict()} for n, c in islice(rows, 5000)]:
                conn.execute(manifest_chunks.insert(), batch)

    def write_manifest_from(self, version_id: int, base_id: int, documents: list[ManifestDocument],
                            parts: Iterable[ManifestPart], copied_documents: Collection[str] = ()) -> bool:
        """`write_manifest` of a manifest most of whose rows are its base's: the rows given are inserted, each
        `CopiedRows` run is copied from the base inside the database (INSERT .. SELECT by the position index,
        its point as the source of its vector), positions counted through the parts in order; the documents
        given are inserted, and those of `copied_documents` (keys whose row is the base's as it is) copied
        from the base the same way. An edit of a large knowledge base sends the database its changed
        documents' rows, not every row. False, and nothing written, when a run's rows are not where its
        documents said (a base written before positions, or in another order) or a copied document is not in
        the base: the caller writes the manifest whole."""
        c = manifest_chunks.c
        d = manifest_documents.c
        try:
            with self.engine.begin() as conn:
                _replace_documents(conn, version_id, documents)
                keys = sorted(copied_documents)
                for start in range(0, len(keys), 500):
                    batch = keys[start:start + 500]
                    of_base = (d.version_id == base_id, d.knowledge_key.in_(batch))
                    found = conn.execute(sa.select(sa.func.count()).select_from(manifest_documents)
                                         .where(*of_base)).scalar_one()
                    if found != len(batch):
                        raise _NotWhereSaid(f"{found} of {len(batch)} documents from {batch[0]}")
                    conn.execute(manifest_documents.insert().from_select(
                        ["version_id", *ManifestDocument._fields],
                        sa.select(sa.literal(version_id), *_DOCUMENT_COLUMNS).where(*of_base)))
                position = 0
                for part in parts:
                    if isinstance(part, CopiedRows):
                        where = (c.version_id == base_id, c.position >= part.start,
                                 c.position < part.start + part.size, c.knowledge_key >= part.first_key,
                                 c.knowledge_key <= part.last_key)
                        # counted first: a driver need not report an INSERT .. SELECT's rows (psycopg: -1)
                        found = conn.execute(sa.select(sa.func.count()).select_from(manifest_chunks)
                                             .where(*where)).scalar_one()
                        if found != part.size:
                            raise _NotWhereSaid(f"{found} of {part.size} rows of {part.first_key}..{part.last_key}")
                        conn.execute(manifest_chunks.insert().from_select(
                            ["version_id", "point_id", "knowledge_key", "chunk_index", "chunk_hash",
                             "source_point_id", "position"],
                            sa.select(sa.literal(version_id), c.point_id, c.knowledge_key, c.chunk_index,
                                      c.chunk_hash, c.point_id, c.position + (position - part.start)).where(*where)))
                        position += part.size
                        continue
                    for start in range(0, len(part), 5000):
                        conn.execute(manifest_chunks.insert(), [
                            {"version_id": version_id, "position": position + start + n, **row._asdict()}
                            for n, row in enumerate(part[start:start + 5000])])
                    position += len(part)
        except _NotWhereSaid as exc:
            log.info("kb_reindex: the manifest of version id %d is written whole: its base's rows are not where its "
                     "documents put them (%s)", version_id, exc)
            return False
        return True

    def manifest_refs(self, version_id: int) -> list[ManifestRef]:
        """(point_id, knowledge_key, source_point_id) of every chunk, in manifest order: what a build needs."""
        return list(self.iter_manifest_refs(version_id))

    def iter_manifest_refs(self, version_id: int) -> Iterator[ManifestRef]:
        """`manifest_refs` a few thousand rows at a time (a server-side cursor on MySQL), for a caller that
        keeps less than every row as it came; consume it whole, it holds a connection until then."""
        query = (sa.select(manifest_chunks.c.point_id, manifest_chunks.c.knowledge_key, manifest_chunks.c.source_point_id)
                 .where(manifest_chunks.c.version_id == version_id)
                 .order_by(manifest_chunks.c.knowledge_key, manifest_chunks.c.chunk_index))
        with self.engine.connect() as conn:
            for row in conn.execution_options(yield_per=5000).execute(query):
                yield ManifestRef(*row)

    def manifest_size(self, version_id: int) -> int:
        """How many chunks (points) the version's manifest lists, counted in SQL."""
        with self.engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(manifest_chunks)
                                    .where(manifest_chunks.c.version_id == version_id)).scalar_one())

    def manifest_at(self, version_id: int, positions: Iterable[int]) -> list[ManifestChunk]:
        """The manifest rows at these positions (0 .. size - 1, in manifest order), by the position index: a
        random sample costs its size. A manifest written before positions were (NULL): by manifest order,
        every row read."""
        wanted = sorted(set(positions))
        c = manifest_chunks.c
        out: list[ManifestChunk] = []
        with self.engine.connect() as conn:
            for start in range(0, len(wanted), 500):
                out += [ManifestChunk(*row) for row in conn.execute(
                    sa.select(*_CHUNK_COLUMNS).where(c.version_id == version_id,
                                                     c.position.in_(wanted[start:start + 500])).order_by(c.position))]
        if len(out) < len(wanted):
            rows = self.manifest_chunks(version_id)
            out = [rows[n] for n in wanted if n < len(rows)]
        return out

    def manifest_documents(self, version_id: int, keys: Iterable[str] | None = None) -> list[ManifestDocument]:
        """The version's documents (only those of `keys`, when given), by knowledge key."""
        d = manifest_documents.c
        query = sa.select(*_DOCUMENT_COLUMNS).where(d.version_id == version_id)
        with self.engine.connect() as conn:
            if keys is None:
                return [ManifestDocument(*row) for row in conn.execute(query.order_by(d.knowledge_key))]
            wanted = sorted(set(keys))
            out = [ManifestDocument(*row) for start in range(0, len(wanted), 500)
                   for row in conn.execute(query.where(d.knowledge_key.in_(wanted[start:start + 500])))]
            return sorted(out, key=lambda doc: doc.knowledge_key)

    def chunks_lost(self, version_id: int, base_id: int) -> tuple[int, int]:
        """(the base's chunks, the chunks the base's documents that the version keeps lost in it: each one's
        count down, summed), counted in SQL by the documents' key: what a content-loss check weighs."""
        d = manifest_documents.c
        new = manifest_documents.alias("new")
        total = sa.select(sa.func.coalesce(sa.func.sum(d.chunk_count), 0)).where(d.version_id == base_id)
        lost = (sa.select(sa.func.coalesce(sa.func.sum(d.chunk_count - new.c.chunk_count), 0))
                .select_from(manifest_documents.join(new, sa.and_(new.c.version_id == version_id,
                                                                  new.c.knowledge_key == d.knowledge_key)))
                .where(d.version_id == base_id, d.chunk_count > new.c.chunk_count))
        with self.engine.connect() as conn:
            return int(conn.execute(total).scalar_one()), int(conn.execute(lost).scalar_one())

    def manifest_document_hashes(self, version_id: int) -> dict[str, str]:
        """knowledge_key -> content_hash of the version's documents."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(manifest_documents.c.knowledge_key, manifest_documents.c.content_hash)
                                .where(manifest_documents.c.version_id == version_id))
            return {key: value for key, value in rows}

    def manifest_chunks(self, version_id: int, *, point_ids: list[str] | None = None) -> list[ManifestChunk]:
        """Every chunk row of the version, or only those of `point_ids`, in manifest order."""
        query = sa.select(*_CHUNK_COLUMNS).where(manifest_chunks.c.version_id == version_id)
        if point_ids is not None:
            query = query.where(manifest_chunks.c.point_id.in_(point_ids))
        with self.engine.connect() as conn:
            rows = conn.execute(query.order_by(manifest_chunks.c.knowledge_key, manifest_chunks.c.chunk_index))
            # a tuple per row: a third of the time of a RowMapping per row
            return [ManifestChunk(*row) for row in rows]

    def document_chunks(self, version_id: int, keys: Iterable[str]) -> list[ManifestChunk]:
        """The chunk rows of the version's documents `keys`, in manifest order."""
        wanted = sorted(set(keys))
        if not wanted:
            return []
        c = manifest_chunks.c
        query = sa.select(*_CHUNK_COLUMNS).where(c.version_id == version_id, c.knowledge_key.in_(wanted))
        with self.engine.connect() as conn:
            return [ManifestChunk(*row) for row in conn.execute(query.order_by(c.knowledge_key, c.chunk_index))]

    def shared_chunks(self, version_id: int, keys: Collection[str] | None = None) -> list[ManifestChunk]:
        """The version's chunks whose hash (text) appears in more than one of its documents: identical chunks
        across documents, found in SQL by the (version_id, chunk_hash) index, in manifest order. `keys`: only
        the hashes of these documents' chunks are looked at (an edit's changed documents: the grouping then
        costs their chunks, not the manifest); None (or more than 500 keys), every hash."""
        c = manifest_chunks.c
        of_version = [c.version_id == version_id]
        if keys is not None and len(keys) <= 500:
            of_version.append(c.chunk_hash.in_(sa.select(c.chunk_hash).where(
                c.version_id == version_id, c.knowledge_key.in_(sorted(keys)))))
        shared = (sa.select(c.chunk_hash).where(*of_version).group_by(c.chunk_hash)
                  .having(sa.func.count(sa.distinct(c.knowledge_key)) > 1))
        query = sa.select(*_CHUNK_COLUMNS).where(c.version_id == version_id, c.chunk_hash.in_(shared))
        with self.engine.connect() as conn:
            return [ManifestChunk(*row) for row in conn.execute(query.order_by(c.knowledge_key, c.chunk_index))]

    def embedded_chunks(self, version_id: int, keys: Iterable[str] | None = None) -> list[ManifestChunk]:
        """The version's chunks embedded for it (no vector copied from live), of the documents `keys` (None: all)."""
        c = manifest_chunks.c
        query = sa.select(*_CHUNK_COLUMNS).where(c.version_id == version_id, c.source_point_id.is_(None))
        wanted = None if keys is None else set(keys)
        with self.engine.connect() as conn:
            rows = conn.execute(query.order_by(c.knowledge_key, c.chunk_index))
            return [chunk for chunk in (ManifestChunk(*row) for row in rows)
                    if wanted is None or chunk.knowledge_key in wanted]

    def prune_manifests(self, alias: str) -> int:
        """Drop the manifests no step can read any more: of the alias's deleted versions that no slot holds
        and no kept version's slot was taken from (the difference of a build needs its base's manifest). The
        version rows stay (history, status). Without this the state DB gains a whole manifest per edit. The
        number of chunk rows dropped."""
        v = versions.c
        with self.engine.begin() as conn:
            held = {row for row in conn.execute(sa.select(slots.c.holds).where(slots.c.holds.is_not(None))).scalars()}
            bases = set(conn.execute(sa.select(v.slot_base).where(v.alias == alias, v.status != "deleted",
                                                                   v.slot_base.is_not(None))).scalars())
            gone = [vid for vid, number in conn.execute(sa.select(v.id, v.version).where(v.alias == alias,
                                                                                         v.status == "deleted"))
                    if vid not in held and number not in bases]
            if not gone:
                return 0
            dropped = 0
            for start in range(0, len(gone), 500):
                part = gone[start:start + 500]
                conn.execute(snapshots.delete().where(snapshots.c.version_id.in_(part)))
                dropped += conn.execute(manifest_chunks.delete().where(manifest_chunks.c.version_id.in_(part))).rowcount or 0
                conn.execute(manifest_documents.delete().where(manifest_documents.c.version_id.in_(part)))
        if dropped:
            log.info("kb_reindex: the manifests of %d deleted version(s) no slot needs were dropped (%d rows)",
                     len(gone), dropped)
        return dropped

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
                        flagged: list[FlaggedLine], golden: str | None = None) -> None:
        """The last write of a plan's snapshot: from here on the version can be created and built."""
        with self.engine.begin() as conn:
            conn.execute(snapshots.delete().where(snapshots.c.version_id == version_id))
            conn.execute(snapshots.insert().values(version_id=version_id, run_id=run_id, planned_at=self.clock.now(),
                                                   chunks_to_embed=chunks_to_embed, golden=golden,
                                                   flagged=json.dumps(flagged, ensure_ascii=False)))

    def snapshot(self, version_id: int) -> PlanSnapshotRow | None:
        """The version's snapshot row (flagged lines decoded), or None when its plan never finished one."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(snapshots).where(snapshots.c.version_id == version_id)).mappings().first()
        if row is None:
            return None
        return PlanSnapshotRow(version_id=row["version_id"], run_id=row["run_id"], planned_at=row["planned_at"],
                               chunks_to_embed=row["chunks_to_embed"], flagged=json.loads(row["flagged"]),
                               golden=row["golden"])

    def slice_rows(self, version_id: int, window: tuple[int, int] | None = None) -> list[ManifestChunk]:
        """A build slice's manifest rows, by range of position in SQL (all rows without a window), in
        manifest order: a slice costs its own rows, not the whole manifest."""
        query = sa.select(*_CHUNK_COLUMNS).where(manifest_chunks.c.version_id == version_id)
        if window is not None:
            offset, limit = window
            query = query.where(manifest_chunks.c.position >= offset, manifest_chunks.c.position < offset + limit)
        with self.engine.connect() as conn:
            rows = conn.execute(query.order_by(manifest_chunks.c.position))
            return [ManifestChunk(*row) for row in rows]

    def slice_difference(self, version_id: int, base_id: int, window: tuple[int, int] | None = None
                         ) -> SliceDifference:
        """A slice's rows (as `slice_rows`) against the base version's manifest: the rows the base lacks, how
        many it has (same key, chunk index and hash: the same point ID), and of those the rows whose document's
        payload fields changed. The rows that differ are found in SQL (`_rows_missing_from`), so an edit reads the
        rows that differ and a count of the rest, not one row (or ID) per kept point."""
        c = manifest_chunks.c
        base = manifest_chunks.alias("base")
        on_base = sa.and_(base.c.version_id == base_id, base.c.point_id == c.point_id)

        def within(query: sa.Select) -> sa.Select:
            if window is None:
                return query
            offset, limit = window
            return query.where(c.position >= offset, c.position < offset + limit)

        # a point ID is the row's key in both manifests: what is not added is kept, so the rest is counted by
        # the position index, not looked up
        rows_q = within(sa.select(sa.func.count()).select_from(manifest_chunks).where(c.version_id == version_id))
        with self.engine.connect() as conn:
            added = self._rows_missing_from(conn, version_id, base_id, window)
            kept = int(conn.execute(rows_q).scalar_one()) - len(added)
        changed = sorted(self.changed_documents(version_id, base_id)) if kept else []
        rewrite: list[ManifestChunk] = []
        with self.engine.connect() as conn:
            for start in range(0, len(changed), 500):
                query = within(sa.select(*_CHUNK_COLUMNS).select_from(manifest_chunks.join(base, on_base))
                               .where(c.version_id == version_id, c.knowledge_key.in_(changed[start:start + 500])))
                rewrite += [ManifestChunk(*row) for row in conn.execute(query.order_by(c.position))]
        rewrite.sort(key=lambda row: (row.knowledge_key, row.chunk_index))
        return SliceDifference(added=added, kept=kept, rewrite=rewrite)

    def kept_sample(self, version_id: int, base_id: int, positions: Iterable[int]) -> list[str]:
        """The point IDs, among the version's rows at these manifest positions, that the base version also
        has (kept from it), in manifest order: a sample of the kept points costs its size, not the manifest."""
        rows = self.manifest_at(version_id, positions)
        ids = [row.point_id for row in rows]
        c = manifest_chunks.c
        found: set[str] = set()
        with self.engine.connect() as conn:
            for start in range(0, len(ids), 500):
                found.update(conn.execute(sa.select(c.point_id).where(
                    c.version_id == base_id, c.point_id.in_(ids[start:start + 500]))).scalars())
        return [point for point in ids if point in found]

    def dropped_chunks(self, version_id: int, base_id: int) -> list[ManifestChunk]:
        """The base version's rows whose point the version's manifest lacks: what a slot gives up moving from
        the base to the version (found in SQL, `_rows_missing_from`), in manifest order."""
        with self.engine.connect() as conn:
            return self._rows_missing_from(conn, base_id, version_id)

    @staticmethod
    def _rows_missing_from(conn: sa.Connection, version_id: int, other_id: int,
                           window: tuple[int, int] | None = None) -> list[ManifestChunk]:
        """The rows of the version's manifest (those at positions within `window`, when given) whose point the
        other version's manifest lacks, in manifest order. Their IDs first: on SQLite and PostgreSQL by `EXCEPT`
        of the two ID lists, which SQLite merges from two ordered scans of the primary key (205k rows, one chunk
        changed: 0.04 s, where the anti-join looked each row up in the other manifest: 0.19 s, 0.5 s cold;
        bench/README P15); on MySQL by that anti-join (`EXCEPT` only from MySQL 8.0.31 on). Then the rows of
        those IDs, by the primary key."""
        c = manifest_chunks.c
        mine = sa.select(c.point_id).where(c.version_id == version_id)
        if window is not None:
            offset, limit = window
            mine = mine.where(c.position >= offset, c.position < offset + limit)
        if conn.dialect.name in ("sqlite", "postgresql"):
            theirs = sa.select(c.point_id).where(c.version_id == other_id)
            ids = list(conn.execute(sa.except_(mine, theirs).order_by(sa.literal_column("point_id"))).scalars())
        else:
            other = manifest_chunks.alias("other")
            lacking = mine.outerjoin_from(manifest_chunks, other, sa.and_(other.c.version_id == other_id,
                                                                          other.c.point_id == c.point_id))
            ids = list(conn.execute(lacking.where(other.c.point_id.is_(None))).scalars())
        rows: list[_PositionedChunk] = []
        for start in range(0, len(ids), 500):
            rows += [_PositionedChunk._make(row) for row in conn.execute(sa.select(*_CHUNK_COLUMNS, c.position).where(
                c.version_id == version_id, c.point_id.in_(ids[start:start + 500])))]
        return [ManifestChunk(*row[:-1]) for row in sorted(rows, key=_in_manifest_order)]

    def changed_documents(self, version_id: int, base_id: int) -> set[str]:
        """Keys of the version's documents whose payload fields differ from the base's (or that it lacks)."""
        d = manifest_documents.c
        base = manifest_documents.alias("base")
        same = sa.and_(base.c.source == d.source, base.c.title == d.title, base.c.category == d.category,
                       base.c.tenant == d.tenant, base.c.content_hash == d.content_hash)
        query = (sa.select(d.knowledge_key)
                 .select_from(manifest_documents.outerjoin(base, sa.and_(base.c.version_id == base_id,
                                                                         base.c.knowledge_key == d.knowledge_key)))
                 .where(d.version_id == version_id, sa.or_(base.c.knowledge_key.is_(None), sa.not_(same))))
        with self.engine.connect() as conn:
            return set(conn.execute(query).scalars())

    def chunks_by_hash(self, version_ids: Iterable[int], hashes: Iterable[str]) -> dict[str, tuple[int, str]]:
        """chunk_hash -> (version id, point id) of a point holding it, among these versions' manifests."""
        ids, wanted = list(version_ids), sorted(set(hashes))
        out: dict[str, tuple[int, str]] = {}
        if not ids:
            return out
        c = manifest_chunks.c
        with self.engine.connect() as conn:
            for start in range(0, len(wanted), 500):
                part = wanted[start:start + 500]
                for version_id, point_id, chunk_hash in conn.execute(
                        sa.select(c.version_id, c.point_id, c.chunk_hash)
                        .where(c.version_id.in_(ids), c.chunk_hash.in_(part))):
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
        forget, a retirement). One DELETE decided inside the database, each text looked up by the
        (version_id, chunk_hash) index of the kept versions' rows: when the first build's version goes (every
        chunk embedded), its texts are not read into Python and asked about 500 at a time (at 51k chunks 208
        round trips and 1.9 s of one edit's cleanup)."""
        c, t = manifest_chunks.c, chunk_texts.c
        kept = sa.select(versions.c.id).where(versions.c.status != "deleted")
        still_embedded = sa.exists(sa.select(sa.literal(1)).select_from(manifest_chunks).where(
            c.version_id.in_(kept), c.source_point_id.is_(None), c.chunk_hash == t.chunk_hash))
        where = [~still_embedded]
        if versions_gone is not None:
            gone = sorted(set(versions_gone))
            if not gone:
                return 0
            where.append(t.chunk_hash.in_(sa.select(c.chunk_hash).where(c.version_id.in_(gone),
                                                                         c.source_point_id.is_(None))))
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
