"""The state DB's tables, and the upgrades that bring a state DB made by an older kb-reindex up to them.

SQLite by default, MySQL/MariaDB through pymysql in production, or PostgreSQL through psycopg. The schema is
created on first use.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql

from kb_reindex.domain.errors import first_line

log = logging.getLogger(__name__)

metadata = sa.MetaData()
# MySQL: exact (binary) comparison of keys, as Python compares them; 'café' and 'cafe' are two documents.
MYSQL_TABLE: dict[str, Any] = {"mysql_charset": "utf8mb4", "mysql_collate": "utf8mb4_bin", "mariadb_charset": "utf8mb4",
               "mariadb_collate": "utf8mb4_bin"}
Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
LongText = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")

versions = sa.Table(
    "kb_versions",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("alias", sa.String(64), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("collection", sa.String(255), nullable=False, unique=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False, server_default="reindex"),
    sa.Column("embedder", sa.String(16), nullable=False),
    sa.Column("embed_model", sa.String(128), nullable=False),
    sa.Column("embed_dim", sa.Integer, nullable=False),
    sa.Column("distance", sa.String(16), nullable=False),
    sa.Column("chunking_version", sa.String(128), nullable=False),
    sa.Column("corpus_fingerprint", sa.String(64), nullable=False),
    sa.Column("base_version", sa.Integer),
    sa.Column("base_collection", sa.String(255)),
    sa.Column("run_id", sa.String(255)),
    sa.Column("docs_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("points_expected", sa.Integer, nullable=False, server_default="0"),
    sa.Column("points_written", sa.Integer, nullable=False, server_default="0"),
    sa.Column("chunks_embedded", sa.Integer, nullable=False, server_default="0"),
    sa.Column("chunks_reused", sa.Integer, nullable=False, server_default="0"),
    sa.Column("validation", LongText),
    sa.Column("error", sa.Text),
    sa.Column("failed_step", sa.String(16)),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("updated_at", Timestamp, nullable=False),
    sa.Column("ready_at", Timestamp),
    # first put behind the alias; `live_since`: the latest move to live (a rollback or a roll forward too)
    sa.Column("promoted_at", Timestamp),
    sa.Column("live_since", Timestamp),
    sa.Column("retired_at", Timestamp),
    sa.Column("deleted_at", Timestamp),
    # how its payloads look (kb_reindex.services.layouts) and what made its vectors (the embedding profile)
    sa.Column("payload_layout", sa.String(64), nullable=False, server_default="native"),
    sa.Column("embed_profile", sa.String(128)),
    # the name of the Qdrant snapshot taken before its collection was dropped (KB_SNAPSHOT_BEFORE_DROP), and when
    sa.Column("qdrant_snapshot", sa.String(512)),
    sa.Column("qdrant_snapshot_at", Timestamp),
    # JSON {"docs": counts, "doc_keys": keys}: the documents its plan added, changed and removed against its base
    sa.Column("doc_changes", sa.Text),
    # the slot this version was brought into held exactly this version's points (its diff's base; NULL: the
    # slot was new or emptied first), and when its points were checked to be exactly its manifest
    sa.Column("slot_base", sa.Integer),
    sa.Column("synced_at", Timestamp),
    sa.UniqueConstraint("alias", "version", name="uq_kb_versions_alias_version"),
    **MYSQL_TABLE,
)

# A manifest is its documents, each naming its *revision*: the document's chunk rows, stored once
# (`kb_doc_chunks`) and shared by every version that holds the document unchanged, so an edit writes the rows of
# the documents it changed and copies the document rows, not a row per chunk (docs/design.md, the version model).
# A chunk's manifest position is its document's `first_position` plus its `ordinal` in the revision.
manifest_documents = sa.Table(
    "kb_manifest_documents",
    metadata,
    sa.Column("version_id", sa.Integer, sa.ForeignKey("kb_versions.id"), primary_key=True),
    sa.Column("knowledge_key", sa.String(255), primary_key=True),
    sa.Column("source", sa.String(512), nullable=False),
    sa.Column("title", sa.String(512), nullable=False),
    sa.Column("category", sa.String(128), nullable=False),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("content_hash", sa.String(64), nullable=False),
    sa.Column("chunk_count", sa.Integer, nullable=False),
    # NULL only in a state DB made before revisions, until `convert_legacy_manifests` splits its chunk rows
    sa.Column("rev_id", sa.String(32)),
    sa.Column("first_position", sa.Integer),
    sa.Index("ix_kb_manifest_documents_position", "version_id", "first_position"),
    sa.Index("ix_kb_manifest_documents_rev", "rev_id", "version_id"),
    **MYSQL_TABLE,
)

# A document revision's chunk rows: `rev_id` is a digest of the alias, the document's key and its chunks (point
# IDs and hashes, in order), so the same revision is written once and found again by its ID.
doc_chunks = sa.Table(
    "kb_doc_chunks",
    metadata,
    sa.Column("rev_id", sa.String(32), primary_key=True),
    sa.Column("ordinal", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("chunk_index", sa.Integer, nullable=False),
    sa.Column("point_id", sa.String(36), nullable=False),
    sa.Column("chunk_hash", sa.String(64), nullable=False),
    sa.Index("ix_kb_doc_chunks_point", "point_id"),
    sa.Index("ix_kb_doc_chunks_hash", "chunk_hash"),
    **MYSQL_TABLE,
)

# Where a version's point takes its vector from, for the chunks its plan wrote (not those of documents copied
# unchanged from its base, whose point is its own source): `source_point_id` the live point a reused chunk is
# copied from, NULL for a chunk embedded for this version.
manifest_sources = sa.Table(
    "kb_manifest_sources",
    metadata,
    sa.Column("version_id", sa.Integer, sa.ForeignKey("kb_versions.id"), primary_key=True),
    sa.Column("point_id", sa.String(36), primary_key=True),
    sa.Column("chunk_hash", sa.String(64), nullable=False),
    sa.Column("source_point_id", sa.String(36)),
    sa.Index("ix_kb_manifest_sources_hash", "chunk_hash", "version_id"),
    **MYSQL_TABLE,
)

# Before revisions a manifest held one row per chunk here. Not created any more (its own metadata): a state DB
# made before keeps the table, emptied by `convert_legacy_manifests` at its first open.
legacy_metadata = sa.MetaData()
legacy_manifest_chunks = sa.Table(
    "kb_manifest_chunks",
    legacy_metadata,
    sa.Column("version_id", sa.Integer, primary_key=True),
    sa.Column("point_id", sa.String(36), primary_key=True),
    sa.Column("knowledge_key", sa.String(255), nullable=False),
    sa.Column("chunk_index", sa.Integer, nullable=False),
    sa.Column("chunk_hash", sa.String(64), nullable=False),
    sa.Column("source_point_id", sa.String(36)),
    **MYSQL_TABLE,
)

# The physical collections of an alias's versions (kb_reindex.rules.slots): a few per embedding profile,
# reused in turn, each brought from the version it holds to the next by the difference; and per profile one
# vault of the vectors a slot gave up (by chunk hash), from which an older kept version is restored. `holds`:
# the version whose points a slot holds (NULL: none yet); `holds_exact`: when those points were checked to be
# exactly that version's manifest (NULL: unknown, e.g. a build that stopped half-way).
slots = sa.Table(
    "kb_slots",
    metadata,
    sa.Column("collection", sa.String(255), primary_key=True),
    sa.Column("alias", sa.String(64), nullable=False),
    sa.Column("embed_profile", sa.String(128), nullable=False),
    sa.Column("role", sa.String(16), nullable=False, server_default="slot"),
    sa.Column("holds", sa.Integer),
    sa.Column("holds_exact", Timestamp),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Index("ix_kb_slots_alias", "alias", "embed_profile"),
    **MYSQL_TABLE,
)

# The plan's snapshot: what every later step needs and nothing reads from the knowledge folder again.
# One row per version whose plan finished writing it (manifest, chunk texts, flagged lines): its presence
# is what create_version and the build check.
snapshots = sa.Table(
    "kb_snapshots",
    metadata,
    sa.Column("version_id", sa.Integer, sa.ForeignKey("kb_versions.id"), primary_key=True),
    sa.Column("run_id", sa.String(255)),
    sa.Column("planned_at", Timestamp, nullable=False),
    sa.Column("chunks_to_embed", sa.Integer, nullable=False),
    # JSON list of {source, line, text}: instruction-like lines of the planned files, for validation
    sa.Column("flagged", LongText, nullable=False),
    # the golden set file as the plan checked it: the build's validation scores with it, reading no file
    sa.Column("golden", LongText),
    # the build may take a chunk live lacks from the vectors its profile keeps (other slots, the vault) rather
    # than embed it again: false for a forced run (`--force-full` embeds everything anew); NULL before it was kept
    sa.Column("reuse_kept", sa.Boolean),
    **MYSQL_TABLE,
)

# The normalised text (and section) of every chunk a version embeds, by chunk hash: shared across versions,
# dropped with the last version that needs it (retention, drop, forget). Chunks copied from live take their
# text from live's payload, so only what is embedded is stored.
chunk_texts = sa.Table(
    "kb_chunk_texts",
    metadata,
    sa.Column("chunk_hash", sa.String(64), primary_key=True),
    sa.Column("section", sa.Text, nullable=False),
    sa.Column("text", LongText, nullable=False),
    **MYSQL_TABLE,
)

# (path, size, mtime_ns) -> content hash of every knowledge file at the last plan that read them all: a
# plan trusts it for a file unchanged since (and modified well before the recording), and reads no file.
file_hashes = sa.Table(
    "kb_file_hashes",
    metadata,
    sa.Column("root", sa.String(64), primary_key=True),  # SHA-256 of the folder's resolved path or the bucket URI
    sa.Column("source", sa.String(512), primary_key=True),
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("mtime_ns", sa.BigInteger, nullable=False),
    sa.Column("content_hash", sa.String(64), nullable=False),
    sa.Column("recorded_ns", sa.BigInteger, nullable=False),
    sa.Column("etag", sa.String(128), nullable=True),  # an object's ETag as listed; NULL for a file
    **MYSQL_TABLE,
)

# The instruction screen's classifier scores (kb_reindex.services.screen), by the classifier that scored them
# (model and weights digest) and the SHA-256 of the normalised text: a line judged once is looked up, not
# embedded again, by any later plan (a one-line edit embeds its new line only). Shared by every knowledge base
# of the state DB; the rows of weights no longer shipped are dead weight, not wrong answers.
screen_scores = sa.Table(
    "kb_screen_scores",
    metadata,
    sa.Column("classifier", sa.String(128), primary_key=True),
    sa.Column("text_sha256", sa.String(64), primary_key=True),
    sa.Column("score", sa.Float, nullable=False),
    **MYSQL_TABLE,
)

# Query vectors validation embedded (the golden probes), by embedding profile and the SHA-256 of the query text:
# a later validation of the same profile looks them up instead of loading the model and embedding every probe
# again (the model under one profile gives one vector to one text, the premise every reused document vector rests
# on too). float64, little-endian, as the embedder returned them: searches with a kept vector rank exactly as the
# first did. Shared by every knowledge base of the state DB.
query_vectors = sa.Table(
    "kb_query_vectors",
    metadata,
    sa.Column("embed_profile", sa.String(128), primary_key=True),
    sa.Column("text_sha256", sa.String(64), primary_key=True),
    sa.Column("vector", sa.LargeBinary().with_variant(mysql.MEDIUMBLOB(), "mysql", "mariadb"), nullable=False),
    **MYSQL_TABLE,
)

runs = sa.Table(
    "kb_runs",
    metadata,
    sa.Column("run_id", sa.String(255), primary_key=True),
    sa.Column("alias", sa.String(64), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("trigger", sa.String(16), nullable=False),
    sa.Column("outcome", sa.String(16), nullable=False),
    sa.Column("version", sa.Integer),
    sa.Column("docs_added", sa.Integer, nullable=False, server_default="0"),
    sa.Column("docs_changed", sa.Integer, nullable=False, server_default="0"),
    sa.Column("docs_unchanged", sa.Integer, nullable=False, server_default="0"),
    sa.Column("docs_removed", sa.Integer, nullable=False, server_default="0"),
    sa.Column("chunks_total", sa.Integer, nullable=False, server_default="0"),
    sa.Column("chunks_embedded", sa.Integer, nullable=False, server_default="0"),
    sa.Column("chunks_reused", sa.Integer, nullable=False, server_default="0"),
    sa.Column("duration_s", sa.Float),
    sa.Column("source_changed_at", Timestamp),
    sa.Column("error", sa.Text),
    sa.Column("started_at", Timestamp, nullable=False),
    sa.Column("finished_at", Timestamp),
    **MYSQL_TABLE,
)

alias_events = sa.Table(
    "kb_alias_events",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("alias", sa.String(64), nullable=False),
    sa.Column("action", sa.String(16), nullable=False),
    sa.Column("from_collection", sa.String(255)),
    sa.Column("to_collection", sa.String(255), nullable=False),
    sa.Column("from_version", sa.Integer),
    sa.Column("to_version", sa.Integer),
    sa.Column("run_id", sa.String(255)),
    sa.Column("reason", sa.Text),
    sa.Column("at", Timestamp, nullable=False),
    # who moved it: the signed-in Airflow user who triggered the DAG run, the login user of a CLI command;
    # NULL for a scheduled run's promotion (and rows written before it existed)
    sa.Column("moved_by", sa.String(255)),
    **MYSQL_TABLE,
)

lock_events = sa.Table(
    "kb_lock_events",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(128), nullable=False),
    sa.Column("action", sa.String(16), nullable=False),
    sa.Column("owner", sa.String(255), nullable=False),
    sa.Column("by", sa.String(255), nullable=False),
    sa.Column("reason", sa.Text),
    sa.Column("at", Timestamp, nullable=False),
    **MYSQL_TABLE,
)

locks = sa.Table(
    "kb_locks",
    metadata,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("owner", sa.String(255), nullable=False),
    sa.Column("acquired_at", Timestamp, nullable=False),
    sa.Column("expires_at", Timestamp, nullable=False),
    **MYSQL_TABLE,
)

# --- keep what matters: pinned versions and the audits of live against its manifest -----------------

pins = sa.Table(
    "kb_pins",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("alias", sa.String(64), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("pinned_by", sa.String(255), nullable=False),
    sa.Column("pinned_at", Timestamp, nullable=False),
    sa.Column("unpinned_by", sa.String(255)),
    sa.Column("unpinned_at", Timestamp),
    sa.Index("ix_kb_pins_alias_version", "alias", "version"),
    **MYSQL_TABLE,
)

audits = sa.Table(
    "kb_audits",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("alias", sa.String(64), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("collection", sa.String(255), nullable=False),
    sa.Column("run_id", sa.String(255)),
    sa.Column("expected", sa.Integer, nullable=False),
    sa.Column("points", sa.Integer, nullable=False),
    sa.Column("missing", sa.Integer, nullable=False),
    sa.Column("orphans", sa.Integer, nullable=False),
    sa.Column("at", Timestamp, nullable=False),
    sa.Index("ix_kb_audits_alias", "alias", "id"),
    **MYSQL_TABLE,
)


# --- the product's freeze: while one is in force, nothing moves the alias forward (rollbacks still run) ---

# One row per freeze: set (who, when, why) and, once lifted, by whom and when; the rows are its history.
# A state DB made before freezes gains the table at its next writing open (`create_all`); readers of an
# older DB see no freeze (`FreezesMixin.freeze_status`).
freezes = sa.Table(
    "kb_freezes",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("alias", sa.String(64), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("set_by", sa.String(255), nullable=False),
    sa.Column("set_at", Timestamp, nullable=False),
    sa.Column("lifted_by", sa.String(255)),
    sa.Column("lifted_at", Timestamp),
    sa.Index("ix_kb_freezes_alias", "alias", "id"),
    **MYSQL_TABLE,
)


# --- a knowledge base taken out of service (`kb-reindex retire`) ---------------------------------------

# One row per retirement: who retired the alias, when and why; when its collections were dropped (retire
# --drop-collections, NULL: kept, the alias still serves them); and, once undone (`retire --undo`), by whom and
# when. The rows are its history. A state DB made before retirements gains the table at its next writing open
# (`create_all`); readers of an older DB see no retirement (`RetirementsMixin.retirement`).
retirements = sa.Table(
    "kb_retirements",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("alias", sa.String(64), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("retired_by", sa.String(255), nullable=False),
    sa.Column("retired_at", Timestamp, nullable=False),
    sa.Column("dropped_by", sa.String(255)),
    sa.Column("dropped_at", Timestamp),
    sa.Column("undone_by", sa.String(255)),
    sa.Column("undone_at", Timestamp),
    sa.Index("ix_kb_retirements_alias", "alias", "id"),
    **MYSQL_TABLE,
)


def code_point_order(tables: Iterable[sa.Table]) -> None:
    """Keys compare and sort by code point on every backend, as Python sorts them (a build slice's documents
    are a range of keys): SQLite's BINARY and MySQL's utf8mb4_bin (MYSQL_TABLE) do; on PostgreSQL each string
    column is created COLLATE "C", whatever the database's default collation. Idempotent; called before
    the schema is created, so it covers every table of `metadata`, wherever defined."""
    for table in tables:
        for column in table.c:
            if type(column.type) is sa.String and not column.info.get("code_point_order"):
                column.type = column.type.with_variant(postgresql.VARCHAR(column.type.length, collation="C"),
                                                       "postgresql")
                column.info["code_point_order"] = True


@contextmanager
def _schema_guard(engine: sa.Engine) -> Iterator[None]:
    """Two processes creating one new SQLite file at once: SQLite answers one of them "database is
    locked" at once (no busy wait when a reader would have to become a writer), so they take turns on a
    file lock beside the database. The lock is taken before the first connection, whose WAL pragma
    already writes to a new file; held for the schema check (milliseconds once the schema exists).
    MySQL handles its own DDL races (see the retry in StateStore)."""
    database = engine.url.database if engine.url.get_backend_name() == "sqlite" else None
    if not database or database == ":memory:" or engine.url.query.get("uri"):
        yield
        return
    try:
        import fcntl

        # read-only is enough for flock, so users sharing a group-writable DB folder do not lock each other out
        handle = os.open(f"{database}.schema-lock", os.O_RDONLY | os.O_CREAT, 0o666)
    except (ImportError, OSError) as exc:
        log.warning("kb_reindex: no schema lock beside %s (%s); creating the schema without it", database, exc)
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock


#: columns added after their table first shipped: a state DB made by an older kb-reindex gains them at open
#: (nullable or with a default, so its rows stay valid), with the indexes that use them
ADDED_COLUMNS = ((versions, "payload_layout"), (versions, "embed_profile"), (versions, "qdrant_snapshot"),
                 (versions, "qdrant_snapshot_at"), (file_hashes, "etag"), (versions, "doc_changes"), (alias_events, "moved_by"),
                 (versions, "slot_base"), (versions, "synced_at"), (versions, "live_since"),
                 (manifest_documents, "rev_id"), (manifest_documents, "first_position"), (snapshots, "reuse_kept"))


def _upgrade_schema(engine: sa.Engine, *, tables: tuple[sa.Table, ...] | None = None) -> None:
    """Add the columns (and their indexes) of ADDED_COLUMNS an existing state DB lacks: `create_all` makes
    missing tables only. `tables`: only these (a read-only command upgrades what it reads). Idempotent;
    two processes racing here: the loser's ALTER fails and is re-checked."""
    def has_column(table: sa.Table, name: str) -> bool:
        return name in {c["name"] for c in sa.inspect(engine).get_columns(table.name)}

    for table, name in ADDED_COLUMNS:
        if tables is not None and table not in tables:
            continue
        if tables is not None and not sa.inspect(engine).has_table(table.name):
            continue  # read-only: a table this DB never had is not read from it
        if has_column(table, name):
            continue
        ddl = sa.schema.CreateColumn(table.c[name]).compile(dialect=engine.dialect)
        try:
            with engine.begin() as conn:
                conn.execute(sa.text(f"ALTER TABLE {table.name} ADD COLUMN {ddl}"))
        except sa.exc.DBAPIError:
            if not has_column(table, name):
                raise
        log.info("kb_reindex: state DB upgraded: %s.%s added", table.name, name)
        for index in table.indexes:
            if name in index.columns.keys():
                try:
                    index.create(engine, checkfirst=True)
                except sa.exc.DBAPIError:
                    if index.name not in {i["name"] for i in sa.inspect(engine).get_indexes(table.name)}:
                        raise


def ensure_table(engine: sa.Engine, table: sa.Table) -> None:
    """Create `table` in a state DB opened read-only (`create=False`) that predates it, for a command that
    writes only there (`kb-reindex freeze`): the DB exists, so a typo in KB_STATE_URL still makes nothing.
    Two processes racing here: the loser's CREATE fails and is re-checked."""
    try:
        table.create(engine, checkfirst=True)
    except sa.exc.DBAPIError:
        if not sa.inspect(engine).has_table(table.name):
            raise


def rows_unless_missing(engine: sa.Engine, query: sa.Select, table: sa.Table) -> list[sa.RowMapping] | None:
    """The rows of `query`, or None when `table` is not in the state DB yet (a read-only command on a state DB
    older than it: `_table_missing`)."""
    try:
        with engine.connect() as conn:
            return list(conn.execute(query).mappings().all())
    except sa.exc.DBAPIError as exc:
        if _table_missing(exc, table.name):
            return None
        raise


def _table_missing(exc: sa.exc.DBAPIError, table: str) -> bool:
    """SQLite: "no such table: t"; MySQL/MariaDB 1146: "Table 'db.t' doesn't exist"; PostgreSQL: 'relation "t"
    does not exist'. The schema gains a table at the next writing command (create_all); read-only commands never
    create one."""
    text = str(exc.orig)
    return table in text and ("no such table" in text or "doesn't exist" in text or "does not exist" in text)



_first_line = first_line  # the name the state modules import
