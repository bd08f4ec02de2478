"""The state DB: versions, their manifests, runs, alias events and locks (SQLAlchemy Core).

SQLite by default, MySQL/MariaDB through pymysql in production. The schema is created on first use.
Qdrant holds vectors; this holds what they are supposed to be, so every check has something to compare.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime, timedelta
from itertools import islice
from pathlib import Path
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import make_url

from kb_reindex.errors import ConfigError, KbError, LockHeldError

log = logging.getLogger(__name__)

STATUSES = ("building", "ready", "live", "retired", "failed", "deleted")

metadata = sa.MetaData()
# MySQL: exact (binary) comparison of keys, as Python compares them; 'café' and 'cafe' are two documents.
MYSQL_TABLE = {"mysql_charset": "utf8mb4", "mysql_collate": "utf8mb4_bin", "mariadb_charset": "utf8mb4",
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
    sa.Column("promoted_at", Timestamp),
    sa.Column("retired_at", Timestamp),
    sa.Column("deleted_at", Timestamp),
    # how its payloads look (kb_reindex.layouts) and what made its vectors (the embedding profile)
    sa.Column("payload_layout", sa.String(64), nullable=False, server_default="native"),
    sa.Column("embed_profile", sa.String(128)),
    sa.UniqueConstraint("alias", "version", name="uq_kb_versions_alias_version"),
    **MYSQL_TABLE,
)

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
    **MYSQL_TABLE,
)

manifest_chunks = sa.Table(
    "kb_manifest_chunks",
    metadata,
    sa.Column("version_id", sa.Integer, sa.ForeignKey("kb_versions.id"), primary_key=True),
    sa.Column("point_id", sa.String(36), primary_key=True),
    sa.Column("knowledge_key", sa.String(255), nullable=False),
    sa.Column("chunk_index", sa.Integer, nullable=False),
    sa.Column("chunk_hash", sa.String(64), nullable=False),
    sa.Column("source_point_id", sa.String(36)),
    # the row's place in manifest order (0..N-1): a build slice reads its rows by range, not the whole
    # manifest. NULL in rows written before it existed (added by `_upgrade_schema`)
    sa.Column("position", sa.Integer),
    sa.Index("ix_kb_manifest_chunks_hash", "version_id", "chunk_hash"),
    sa.Index("ix_kb_manifest_chunks_position", "version_id", "position"),
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
    sa.Column("root", sa.String(64), primary_key=True),  # SHA-256 of the knowledge folder's resolved path
    sa.Column("source", sa.String(512), primary_key=True),
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("mtime_ns", sa.BigInteger, nullable=False),
    sa.Column("content_hash", sa.String(64), nullable=False),
    sa.Column("recorded_ns", sa.BigInteger, nullable=False),
    **MYSQL_TABLE,
)

# columns added after a table first shipped: (table, column) created on an existing state DB at open
UPGRADES = ((manifest_chunks, "position", "ix_kb_manifest_chunks_position"),)

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


def utcnow() -> datetime:
    """Naive UTC: SQLite and MySQL DATETIME both store it without surprises."""
    return datetime.now(UTC).replace(tzinfo=None)


def process_space() -> str:
    """Which PID namespace of which boot this process lives in: two containers (or cloned VMs) can share a
    hostname while their PIDs mean different processes, so only an owner of this same space is judged by PID."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return "unknown"
    return hashlib.sha1(f"{boot}:{namespace}".encode()).hexdigest()[:10]


#: what follows the run id in a DAG run's lock owner (kb_reindex.dag_lock), in place of `host:pid:nonce:space`:
#: the run spans many task processes, so it is alive while its tasks renew the lock, not while a PID lives
DAG_RUN_OWNER = "airflow-dag-run"


def is_dag_run_owner(owner: str) -> bool:
    return owner.endswith(f"@{DAG_RUN_OWNER}")


def default_lock_owner(run_id: str | None = None, *, pid: int | None = None) -> str:
    """Unique per acquisition: two threads of one process are two owners. A run's own lock starts with
    its run id, so others can tell that run is still alive while its heartbeat renews the lock; the rest
    (`host:pid:nonce:space`) lets this host tell whether the owner process still lives."""
    owner = f"{socket.gethostname()}:{os.getpid() if pid is None else pid}:{uuid.uuid4().hex[:8]}:{process_space()}"
    return f"{run_id[:254 - len(owner)]}@{owner}" if run_id else owner


@dataclass
class VersionRecord:
    id: int
    alias: str
    version: int
    collection: str
    status: str
    kind: str
    embedder: str
    embed_model: str
    embed_dim: int
    distance: str
    chunking_version: str
    corpus_fingerprint: str
    base_version: int | None
    base_collection: str | None
    run_id: str | None
    docs_count: int
    points_expected: int
    points_written: int
    chunks_embedded: int
    chunks_reused: int
    validation: dict[str, Any] | None
    error: str | None
    failed_step: str | None
    created_at: datetime
    updated_at: datetime
    ready_at: datetime | None
    promoted_at: datetime | None
    retired_at: datetime | None
    deleted_at: datetime | None
    payload_layout: str = "native"
    embed_profile: str | None = None

    @classmethod
    def from_row(cls, row: sa.RowMapping) -> VersionRecord:
        data = {f.name: row[f.name] for f in fields(cls)}
        data["validation"] = json.loads(data["validation"]) if data["validation"] else None
        return cls(**data)

    def summary(self) -> dict[str, Any]:
        """The JSON-able view the CLI and XCom carry (no validation detail)."""
        out = asdict(self)
        out.pop("validation")
        for key, value in out.items():
            if isinstance(value, datetime):
                out[key] = value.isoformat(timespec="seconds") + "Z"
        return out


class ManifestRef(NamedTuple):
    point_id: str
    knowledge_key: str
    source_point_id: str | None


class SliceRow(NamedTuple):
    """One manifest row of a build slice: a `ManifestRef` plus what the point's payload needs."""

    point_id: str
    knowledge_key: str
    source_point_id: str | None
    chunk_index: int
    chunk_hash: str


class FileHash(NamedTuple):
    size: int
    mtime_ns: int
    content_hash: str
    recorded_ns: int


def _upgrade_schema(engine: sa.Engine) -> None:
    """Add the columns (and their indexes) a newer release added to existing tables: `create_all` makes
    missing tables only. Idempotent; a concurrent upgrader's "duplicate column" is taken as done."""
    inspector = sa.inspect(engine)
    for table, column_name, index_name in UPGRADES:
        present = {c["name"] for c in inspector.get_columns(table.name)}
        if column_name in present:
            continue
        column = table.c[column_name]
        ddl_type = column.type.compile(dialect=engine.dialect)
        try:
            with engine.begin() as conn:
                conn.execute(sa.text(f"ALTER TABLE {table.name} ADD COLUMN {column_name} {ddl_type}"))
        except (sa.exc.OperationalError, sa.exc.ProgrammingError) as exc:
            if "duplicate" not in str(exc.orig).lower():
                raise
        log.info("kb_reindex: state DB upgraded: %s.%s added", table.name, column_name)
        index = next(i for i in table.indexes if i.name == index_name)
        try:
            index.create(engine, checkfirst=True)
        except (sa.exc.OperationalError, sa.exc.ProgrammingError) as exc:
            if "duplicate" not in str(exc.orig).lower() and "already exists" not in str(exc.orig).lower():
                raise


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


#: columns added after a table was first created: (table, column DDL) added to a state DB that lacks them
ADDED_COLUMNS = (
    (versions, "payload_layout", "VARCHAR(64) NOT NULL DEFAULT 'native'"),
    (versions, "embed_profile", "VARCHAR(128)"),
)


def _add_missing_columns(engine: sa.Engine) -> None:
    """Upgrade a state DB made by an older kb-reindex in place: add the columns it lacks (nullable or with
    a default, so its rows stay valid). Two processes racing here: the loser's ALTER fails and is re-checked."""
    inspector = sa.inspect(engine)
    for table, column, ddl in ADDED_COLUMNS:
        if column in {c["name"] for c in inspector.get_columns(table.name)}:
            continue
        try:
            with engine.begin() as conn:
                conn.execute(sa.text(f"ALTER TABLE {table.name} ADD COLUMN {column} {ddl}"))
        except sa.exc.DBAPIError:
            if column not in {c["name"] for c in sa.inspect(engine).get_columns(table.name)}:
                raise
        inspector = sa.inspect(engine)


class StateStore:
    """All reads and writes of the state DB. Short transactions; nothing held across embedding calls."""

    def __init__(self, url: str, *, engine: sa.Engine | None = None, create: bool = True) -> None:
        """`create=False` (read-only commands) never makes a database: a missing one, or one without our
        tables, is an error naming it, so a typo in KB_STATE_URL is not answered from a fresh empty DB."""
        self.url = url
        self.engine = engine or self._make_engine(url, create=create)
        self.display_url = self.engine.url.render_as_string(hide_password=True)
        try:
            if not create:
                self._require_schema()
                return
            with _schema_guard(self.engine):
                metadata.create_all(self.engine, checkfirst=True)
                _add_missing_columns(self.engine)
                _upgrade_schema(self.engine)
        except sa.exc.OperationalError as exc:
            if "already exists" in str(exc.orig):  # MySQL 1050: another process created a table first
                metadata.create_all(self.engine, checkfirst=True)
                _add_missing_columns(self.engine)
                _upgrade_schema(self.engine)
                return
            self.engine.dispose()
            raise ConfigError(
                f"state DB at {self.display_url} is unreachable or refused the schema (KB_STATE_URL): "
                f"{_first_line(exc.orig)}"
            ) from None
        except (sa.exc.IntegrityError, sa.exc.ProgrammingError):
            metadata.create_all(self.engine, checkfirst=True)  # another process created it first
            _add_missing_columns(self.engine)
            _upgrade_schema(self.engine)
        except sa.exc.DatabaseError as exc:  # SQLite: "file is not a database" (truncated or overwritten)
            self.engine.dispose()
            raise ConfigError(
                f"state DB at {self.display_url} is not a usable database ({_first_line(exc.orig)}). Nothing was "
                "changed. Restore it from a backup, or move it aside and rebuild it from Qdrant: "
                "`kb-reindex reconcile --rebuild-state`"
            ) from None

    def _require_schema(self) -> None:
        present = set(sa.inspect(self.engine).get_table_names())
        missing = sorted({versions.name, alias_events.name} - present)
        if missing:
            self.engine.dispose()
            raise ConfigError(
                f"no kb-reindex state in the state DB at {self.display_url} (tables {', '.join(missing)} missing): "
                "check KB_STATE_URL; if the state DB was lost, rebuild it from Qdrant with "
                "`kb-reindex reconcile --rebuild-state`"
            )
        _add_missing_columns(self.engine)  # an existing DB of an older kb-reindex: readable after the upgrade

    @staticmethod
    def _make_engine(url: str, *, create: bool = True) -> sa.Engine:
        try:
            parsed = make_url(url)
        except sa.exc.ArgumentError:
            raise ConfigError("KB_STATE_URL is not a SQLAlchemy URL (sqlite:///path or mysql+pymysql://...)") from None
        if parsed.get_backend_name() == "sqlite":
            if parsed.database and parsed.database != ":memory:":
                if not create and not Path(parsed.database).is_file():
                    raise ConfigError(
                        f"no state DB at {parsed.database} (KB_STATE_URL); nothing has been built with this "
                        "configuration yet, or the path is wrong. `kb-reindex run` creates it; if it was lost "
                        "while Qdrant still holds the versions: `kb-reindex reconcile --rebuild-state`"
                    )
                Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
            engine = sa.create_engine(parsed, connect_args={"timeout": 30})

            @sa.event.listens_for(engine, "connect")
            def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
                cursor = dbapi_conn.cursor()
                cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute("PRAGMA busy_timeout=30000")
                cursor.close()

            return engine
        if parsed.get_backend_name() in ("mysql", "mariadb"):
            return sa.create_engine(
                parsed, pool_pre_ping=True, pool_recycle=3600, connect_args={"connect_timeout": 10, "charset": "utf8mb4"}
            )
        raise ConfigError(f"KB_STATE_URL backend {parsed.get_backend_name()!r} is not supported; use sqlite or mysql+pymysql")

    def dispose(self) -> None:
        self.engine.dispose()

    # --- versions -----------------------------------------------------------------------------

    def allocate_version(self, *, alias: str, collection_for: Any, **columns: Any) -> VersionRecord:
        """Take the next N for this alias. The unique (alias, version) key makes a race lose, then retry."""
        for _attempt in range(20):
            with self.engine.begin() as conn:
                current = conn.execute(sa.select(sa.func.max(versions.c.version)).where(versions.c.alias == alias)).scalar()
                number = (current or 0) + 1
                now = utcnow()
                try:
                    result = conn.execute(
                        versions.insert().values(
                            alias=alias,
                            version=number,
                            collection=collection_for(number),
                            status="building",
                            created_at=now,
                            updated_at=now,
                            **columns,
                        )
                    )
                except sa.exc.IntegrityError:
                    continue
                return self.version_by_id(result.inserted_primary_key[0], conn=conn)
        raise KbError(f"could not allocate a version number for alias {alias!r} after 20 attempts")

    def insert_version(self, *, alias: str, version: int, **columns: Any) -> VersionRecord:
        """A version with a known number (rebuilt from Qdrant), not allocated."""
        now = utcnow()
        with self.engine.begin() as conn:
            result = conn.execute(versions.insert().values(alias=alias, version=version, created_at=now,
                                                           updated_at=now, **columns))
            return self.version_by_id(result.inserted_primary_key[0], conn=conn)

    def forget_versions(self, alias: str) -> None:
        """Drop this alias's version rows and manifests (a state being replaced); history and runs stay."""
        with self.engine.begin() as conn:
            ids = sa.select(versions.c.id).where(versions.c.alias == alias).scalar_subquery()
            conn.execute(snapshots.delete().where(snapshots.c.version_id.in_(ids)))
            conn.execute(manifest_chunks.delete().where(manifest_chunks.c.version_id.in_(ids)))
            conn.execute(manifest_documents.delete().where(manifest_documents.c.version_id.in_(ids)))
            conn.execute(versions.delete().where(versions.c.alias == alias))
        self.drop_unneeded_texts()

    def version_by_id(self, version_id: int, *, conn: sa.Connection | None = None) -> VersionRecord:
        query = sa.select(versions).where(versions.c.id == version_id)
        if conn is not None:
            return VersionRecord.from_row(conn.execute(query).mappings().one())
        with self.engine.connect() as own:
            return VersionRecord.from_row(own.execute(query).mappings().one())

    def get_version(self, alias: str, number: int) -> VersionRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(versions).where(versions.c.alias == alias, versions.c.version == number)
            ).mappings().first()
        return VersionRecord.from_row(row) if row else None

    def list_versions(self, alias: str, *, statuses: Iterable[str] | None = None) -> list[VersionRecord]:
        query = sa.select(versions).where(versions.c.alias == alias)
        if statuses is not None:
            query = query.where(versions.c.status.in_(list(statuses)))
        with self.engine.connect() as conn:
            rows = conn.execute(query.order_by(versions.c.version.desc())).mappings().all()
        return [VersionRecord.from_row(row) for row in rows]

    def live_version(self, alias: str) -> VersionRecord | None:
        live = self.list_versions(alias, statuses=["live"])
        if len(live) > 1:
            raise KbError(
                f"state DB marks {len(live)} versions of {alias!r} live "
                f"({', '.join(str(v.version) for v in live)}); run `kb-reindex status` and reconcile"
            )
        return live[0] if live else None

    def update_version(self, version_id: int, **columns: Any) -> None:
        if "validation" in columns and columns["validation"] is not None:
            columns["validation"] = json.dumps(columns["validation"], ensure_ascii=False)
        if "status" in columns and columns["status"] not in STATUSES:
            raise ValueError(f"unknown status {columns['status']!r}")
        columns["updated_at"] = utcnow()
        with self.engine.begin() as conn:
            conn.execute(versions.update().where(versions.c.id == version_id).values(**columns))

    def add_points_written(self, version_id: int, count: int) -> None:
        with self.engine.begin() as conn:
            conn.execute(versions.update().where(versions.c.id == version_id)
                         .values(points_written=versions.c.points_written + count, updated_at=utcnow()))

    def mark_failed(self, version_id: int, *, step: str, error: str) -> None:
        self.update_version(version_id, status="failed", failed_step=step, error=error[:4000])

    # --- manifest -------------------------------------------------------------------------------

    def write_manifest(self, version_id: int, documents: list[dict[str, Any]], chunks: Iterable[dict[str, Any]]) -> None:
        """Replace the version's manifest in one transaction, so a retried step never doubles it."""
        rows = enumerate(chunks)  # in manifest order: (knowledge_key, chunk_index)
        with self.engine.begin() as conn:
            conn.execute(snapshots.delete().where(snapshots.c.version_id == version_id))
            conn.execute(manifest_chunks.delete().where(manifest_chunks.c.version_id == version_id))
            conn.execute(manifest_documents.delete().where(manifest_documents.c.version_id == version_id))
            if documents:
                conn.execute(manifest_documents.insert(), [{"version_id": version_id, **d} for d in documents])
            while batch := [{"version_id": version_id, "position": n, **c} for n, c in islice(rows, 5000)]:
                conn.execute(manifest_chunks.insert(), batch)

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

    def manifest_documents(self, version_id: int) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(manifest_documents).where(manifest_documents.c.version_id == version_id)
                .order_by(manifest_documents.c.knowledge_key)
            ).mappings().all()
        return [dict(row) for row in rows]

    def manifest_document_hashes(self, version_id: int) -> dict[str, str]:
        """knowledge_key -> content_hash of the version's documents."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(manifest_documents.c.knowledge_key, manifest_documents.c.content_hash)
                                .where(manifest_documents.c.version_id == version_id))
            return {key: value for key, value in rows}

    def manifest_reuse_map(self, version_id: int) -> dict[str, str]:
        """chunk_hash -> point_id of the version's chunks: which vectors a new version can copy."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(manifest_chunks.c.chunk_hash, manifest_chunks.c.point_id)
                                .where(manifest_chunks.c.version_id == version_id)
                                .order_by(manifest_chunks.c.knowledge_key, manifest_chunks.c.chunk_index))
            return {key: value for key, value in rows}

    def manifest_chunks(self, version_id: int, *, point_ids: list[str] | None = None) -> list[dict[str, Any]]:
        """Every chunk row of the version, or only those of `point_ids`."""
        columns = [c for c in manifest_chunks.c if c.name != "position"]  # a build detail, not the manifest's
        query = sa.select(*columns).where(manifest_chunks.c.version_id == version_id)
        if point_ids is not None:
            query = query.where(manifest_chunks.c.point_id.in_(point_ids))
        with self.engine.connect() as conn:
            result = conn.execute(query.order_by(manifest_chunks.c.knowledge_key, manifest_chunks.c.chunk_index))
            keys = list(result.keys())
            # rows zipped with the column names: a third of the time of a RowMapping per row
            return [dict(zip(keys, row)) for row in result]

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
                        flagged: list[dict[str, Any]], golden: str | None = None) -> None:
        """The last write of a plan's snapshot: from here on the version can be created and built."""
        with self.engine.begin() as conn:
            conn.execute(snapshots.delete().where(snapshots.c.version_id == version_id))
            conn.execute(snapshots.insert().values(version_id=version_id, run_id=run_id, planned_at=utcnow(),
                                                   chunks_to_embed=chunks_to_embed, golden=golden,
                                                   flagged=json.dumps(flagged, ensure_ascii=False)))

    def snapshot(self, version_id: int) -> dict[str, Any] | None:
        """The version's snapshot row (flagged lines decoded), or None when its plan never finished one."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(snapshots).where(snapshots.c.version_id == version_id)).mappings().first()
        if row is None:
            return None
        return {**dict(row), "flagged": json.loads(row["flagged"])}

    def slice_rows(self, version_id: int, window: tuple[int, int] | None = None) -> list[SliceRow]:
        """A build slice's manifest rows, by range of position in SQL (all rows without a window), in
        manifest order: a slice costs its own rows, not the whole manifest."""
        query = (sa.select(manifest_chunks.c.point_id, manifest_chunks.c.knowledge_key,
                           manifest_chunks.c.source_point_id, manifest_chunks.c.chunk_index,
                           manifest_chunks.c.chunk_hash)
                 .where(manifest_chunks.c.version_id == version_id))
        if window is not None:
            offset, limit = window
            query = query.where(manifest_chunks.c.position >= offset, manifest_chunks.c.position < offset + limit)
        with self.engine.connect() as conn:
            rows = conn.execute(query.order_by(manifest_chunks.c.position))
            return [SliceRow(*row) for row in rows]

    def slice_documents(self, version_id: int, first_key: str, last_key: str) -> list[dict[str, Any]]:
        """The manifest documents whose keys lie in [first_key, last_key]: those a slice's rows belong to."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(manifest_documents).where(manifest_documents.c.version_id == version_id,
                                                    manifest_documents.c.knowledge_key >= first_key,
                                                    manifest_documents.c.knowledge_key <= last_key)
            ).mappings().all()
        return [dict(row) for row in rows]

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

    def drop_unneeded_texts(self) -> int:
        """Delete the texts no kept version embeds any more (after retention, drop or forget): a version
        needs its texts until it is deleted. Reads the needed hashes version by version (by index)."""
        with self.engine.connect() as conn:
            kept = conn.execute(sa.select(versions.c.id).where(versions.c.status != "deleted")).scalars().all()
            needed: set[str] = set()
            for version_id in kept:
                needed.update(conn.execute(
                    sa.select(manifest_chunks.c.chunk_hash).where(manifest_chunks.c.version_id == version_id,
                                                                  manifest_chunks.c.source_point_id.is_(None))
                ).scalars())
            stored = conn.execute(sa.select(chunk_texts.c.chunk_hash)).scalars().all()
        unneeded = [h for h in stored if h not in needed]
        for start in range(0, len(unneeded), 500):
            with self.engine.begin() as conn:
                conn.execute(chunk_texts.delete().where(chunk_texts.c.chunk_hash.in_(unneeded[start:start + 500])))
        if unneeded:
            log.info("kb_reindex: %d chunk text(s) no kept version needs were dropped", len(unneeded))
        return len(unneeded)

    # --- the file hash cache ------------------------------------------------------------------

    def file_hashes(self, root: str) -> dict[str, FileHash]:
        """source -> what the last plan recorded of it; empty for a state DB from before this table."""
        try:
            with self.engine.connect() as conn:
                rows = conn.execute(sa.select(file_hashes.c.source, file_hashes.c.size, file_hashes.c.mtime_ns,
                                              file_hashes.c.content_hash, file_hashes.c.recorded_ns)
                                    .where(file_hashes.c.root == root))
                return {source: FileHash(*rest) for source, *rest in rows}
        except (sa.exc.OperationalError, sa.exc.ProgrammingError) as exc:
            if "kb_file_hashes" in str(exc.orig):  # a read-only command on a state DB not yet upgraded
                return {}
            raise

    def record_file_hashes(self, root: str, entries: dict[str, FileHash], *, replace_all: bool) -> None:
        """Record files as hashed by a plan: all of them (`replace_all`, after reading every file) or only
        these (after hashing a few again)."""
        rows = [{"root": root, "source": source, "size": e.size, "mtime_ns": e.mtime_ns,
                 "content_hash": e.content_hash, "recorded_ns": e.recorded_ns} for source, e in entries.items()]
        with self.engine.begin() as conn:
            if replace_all:
                conn.execute(file_hashes.delete().where(file_hashes.c.root == root))
            else:
                sources = list(entries)
                for start in range(0, len(sources), 500):
                    conn.execute(file_hashes.delete().where(file_hashes.c.root == root,
                                                            file_hashes.c.source.in_(sources[start:start + 500])))
            for start in range(0, len(rows), 5000):
                conn.execute(file_hashes.insert(), rows[start:start + 5000])

    # --- runs -----------------------------------------------------------------------------------

    def start_run(self, *, run_id: str, alias: str, kind: str, trigger: str) -> None:
        """Idempotent: a retried plan task or a rerun with the same id restarts the record."""
        now = utcnow()
        with self.engine.begin() as conn:
            exists = conn.execute(sa.select(runs.c.run_id).where(runs.c.run_id == run_id)).first()
            values = {"alias": alias, "kind": kind, "trigger": trigger, "outcome": "running", "started_at": now,
                      "finished_at": None, "error": None, "chunks_embedded": 0, "chunks_reused": 0}
            if exists:
                conn.execute(runs.update().where(runs.c.run_id == run_id).values(**values))
            else:
                conn.execute(runs.insert().values(run_id=run_id, **values))

    def update_run(self, run_id: str, **columns: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(runs.update().where(runs.c.run_id == run_id).values(**columns))

    def add_run_chunks(self, run_id: str, *, embedded: int, reused: int) -> None:
        """Count what a build of this run wrote: `chunks_embedded` embedded, `chunks_reused` copied from live.
        Added, not set: mapped build slices and retried tasks each add what they wrote."""
        with self.engine.begin() as conn:
            conn.execute(runs.update().where(runs.c.run_id == run_id).values(
                chunks_embedded=runs.c.chunks_embedded + embedded, chunks_reused=runs.c.chunks_reused + reused))

    def finish_run(self, run_id: str, *, outcome: str, error: str | None = None, **counters: Any) -> None:
        now = utcnow()
        with self.engine.begin() as conn:
            started = conn.execute(sa.select(runs.c.started_at).where(runs.c.run_id == run_id)).scalar()
            duration = (now - started).total_seconds() if started else None
            conn.execute(
                runs.update().where(runs.c.run_id == run_id).values(
                    outcome=outcome, error=error[:4000] if error else None, finished_at=now, duration_s=duration, **counters
                )
            )
            alias = conn.execute(sa.select(runs.c.alias).where(runs.c.run_id == run_id)).scalar()
        if alias is not None:
            from kb_reindex import metrics

            metrics.run_finished(alias=alias, outcome=outcome, duration_s=duration,
                                 embedded=counters.get("chunks_embedded", 0), reused=counters.get("chunks_reused", 0))

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(runs).where(runs.c.run_id == run_id)).mappings().first()
        return dict(row) if row else None

    def list_runs(self, alias: str, *, limit: int = 50) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(runs).where(runs.c.alias == alias).order_by(runs.c.started_at.desc()).limit(limit)
            ).mappings().all()
        return [dict(row) for row in rows]

    # --- alias events ---------------------------------------------------------------------------

    def record_switch(
        self,
        *,
        alias: str,
        action: str,
        to: VersionRecord,
        previous: VersionRecord | None,
        run_id: str | None,
        reason: str | None = None,
        previous_status: str = "retired",
    ) -> None:
        """The state side of an alias move, in one transaction: event, new live, previous retired."""
        now = utcnow()
        with self.engine.begin() as conn:
            conn.execute(
                alias_events.insert().values(
                    alias=alias,
                    action=action,
                    from_collection=previous.collection if previous else None,
                    to_collection=to.collection,
                    from_version=previous.version if previous else None,
                    to_version=to.version,
                    run_id=run_id,
                    reason=reason,
                    at=now,
                )
            )
            conn.execute(
                versions.update().where(versions.c.alias == alias, versions.c.status == "live", versions.c.id != to.id)
                .values(status=previous_status, retired_at=now, updated_at=now)
            )
            conn.execute(
                versions.update().where(versions.c.id == to.id)
                .values(status="live", promoted_at=now, updated_at=now, error=None, failed_step=None)
            )

    def add_alias_event(self, *, alias: str, action: str, to: VersionRecord, previous: VersionRecord | None,
                        run_id: str | None, reason: str | None = None) -> None:
        with self.engine.begin() as conn:
            conn.execute(alias_events.insert().values(
                alias=alias, action=action, from_collection=previous.collection if previous else None,
                to_collection=to.collection, from_version=previous.version if previous else None,
                to_version=to.version, run_id=run_id, reason=reason, at=utcnow()))

    def alias_events(self, alias: str) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(alias_events).where(alias_events.c.alias == alias).order_by(alias_events.c.id)
            ).mappings().all()
        return [dict(row) for row in rows]

    # --- locks ----------------------------------------------------------------------------------

    def acquire_lock(self, name: str, *, owner: str, ttl_s: float, wait_s: float = 0.0) -> None:
        """A lock row with owner and expiry: works the same on SQLite and MySQL, survives no crash forever.

        Taken over at once when its owner process is gone from this host (kill -9 leaves a row behind), after
        its TTL when held from another host; otherwise waited for up to `wait_s`, then refused by name."""
        deadline = time.monotonic() + wait_s
        while True:
            holder = self._try_lock(name, owner=owner, ttl_s=ttl_s)
            if holder is None:
                return
            if time.monotonic() >= deadline:
                raise LockHeldError(describe_lock_holder(name, holder))
            time.sleep(min(0.25, max(deadline - time.monotonic(), 0.01)))

    def _try_lock(self, name: str, *, owner: str, ttl_s: float) -> dict[str, Any] | None:
        """Take the lock if free, expired, ours, or left by a dead process; else the holder's row."""
        now = utcnow()
        expires = now + timedelta(seconds=ttl_s)
        with self.engine.begin() as conn:
            try:
                conn.execute(locks.insert().values(name=name, owner=owner, acquired_at=now, expires_at=expires))
                return None
            except sa.exc.IntegrityError:
                pass
        with self.engine.begin() as conn:
            taken = conn.execute(
                locks.update()
                .where(locks.c.name == name, sa.or_(locks.c.expires_at < now, locks.c.owner == owner))
                .values(owner=owner, acquired_at=now, expires_at=expires)
            ).rowcount
            if taken == 1:
                return None
            holder = conn.execute(sa.select(locks).where(locks.c.name == name)).mappings().first()
        if holder is None:
            return self._try_lock(name, owner=owner, ttl_s=ttl_s)
        holder = dict(holder)
        if lock_owner_alive(holder["owner"], since=holder["acquired_at"]) is False:
            with self.engine.begin() as conn:
                taken = conn.execute(
                    locks.update().where(locks.c.name == name, locks.c.owner == holder["owner"])
                    .values(owner=owner, acquired_at=now, expires_at=expires)
                ).rowcount
                if taken == 1:
                    conn.execute(lock_events.insert().values(
                        name=name, action="takeover", owner=holder["owner"], by=owner, at=now,
                        reason=f"owner process is gone (held since {holder['acquired_at']:%Y-%m-%d %H:%M:%S} UTC)"))
                    dead_run, _, _ = holder["owner"].rpartition("@")
                    if dead_run:  # its run record would say "running" forever
                        conn.execute(runs.update().where(runs.c.run_id == dead_run, runs.c.outcome == "running")
                                     .values(outcome="failed", finished_at=now,
                                             error=f"its process ended without finishing (lock taken over by {owner})"))
            if taken == 1:
                log.warning("kb_reindex: lock %r was held by %s, whose process is gone; taken over by %s",
                            name, holder["owner"], owner)
                return None
            return self._try_lock(name, owner=owner, ttl_s=ttl_s)
        return holder

    def lock_held_by(self, name: str) -> str | None:
        """The owner of an unexpired lock of that name, or None."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(locks.c.owner).where(locks.c.name == name, locks.c.expires_at >= utcnow())).first()
        return row[0] if row else None

    def holds_lock(self, name: str, *, owner: str) -> bool:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(locks.c.owner).where(locks.c.name == name, locks.c.owner == owner)).first() is not None

    def list_locks(self, *, subject: str | None = None) -> list[dict[str, Any]]:
        """Every lock row (for `status`), with whether its owner still lives, as far as this host can tell."""
        with self.engine.connect() as conn:
            rows = [dict(r) for r in conn.execute(sa.select(locks).order_by(locks.c.name)).mappings()]
        if subject is not None:
            rows = [r for r in rows if r["name"].split(":", 1)[-1] == subject]
        now = utcnow()
        for row in rows:
            row["expired"] = row["expires_at"] < now
            row["owner_alive"] = lock_owner_alive(row["owner"], since=row["acquired_at"])
        return rows

    def break_lock(self, name: str, *, by: str, reason: str) -> dict[str, Any] | None:
        """On-call's way out: delete the lock whoever holds it, and record who broke it and why."""
        now = utcnow()
        with self.engine.begin() as conn:
            holder = conn.execute(sa.select(locks).where(locks.c.name == name)).mappings().first()
            if holder is None:
                return None
            conn.execute(locks.delete().where(locks.c.name == name, locks.c.owner == holder["owner"]))
            conn.execute(lock_events.insert().values(name=name, action="unlock", owner=holder["owner"], by=by,
                                                     reason=reason, at=now))
        return dict(holder)

    def lock_events(self, *, names: Iterable[str]) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(lock_events).where(lock_events.c.name.in_(list(names)))
                                .order_by(lock_events.c.id)).mappings().all()
        return [dict(row) for row in rows]

    def release_lock(self, name: str, *, owner: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(locks.delete().where(locks.c.name == name, locks.c.owner == owner))

    def renew_lock(self, name: str, *, owner: str, ttl_s: float) -> bool:
        """Push the expiry out again; False if the lock is no longer ours (it expired and was taken)."""
        with self.engine.begin() as conn:
            return conn.execute(
                locks.update().where(locks.c.name == name, locks.c.owner == owner)
                .values(expires_at=utcnow() + timedelta(seconds=ttl_s))
            ).rowcount == 1

    @contextmanager
    def lock(self, name: str, *, owner: str | None = None, ttl_s: float = 3600, wait_s: float = 0.0) -> Iterator[str]:
        """Held for the whole block, however long: a heartbeat renews it every third of the TTL, so only a
        holder that died (and stopped renewing) loses it to the next run."""
        owner = owner or default_lock_owner()
        self.acquire_lock(name, owner=owner, ttl_s=ttl_s, wait_s=wait_s)
        stop = threading.Event()

        def heartbeat() -> None:
            while not stop.wait(ttl_s / 3):
                try:
                    if not self.renew_lock(name, owner=owner, ttl_s=ttl_s):
                        log.error("kb_reindex: lock %r was lost (expired and taken, or broken by on-call)", name)
                        return
                except Exception as exc:  # noqa: BLE001 - the next beat tries again; the TTL is the backstop
                    log.warning("kb_reindex: renewing lock %r failed: %s", name, _first_line(exc))

        beat = threading.Thread(target=heartbeat, name=f"lock-heartbeat:{name}", daemon=True)
        beat.start()
        try:
            yield owner
        finally:
            stop.set()
            beat.join()
            self.release_lock(name, owner=owner)

    # --- pins and audits ------------------------------------------------------------------------

    def pin_version(self, *, alias: str, version: int, reason: str, by: str) -> dict[str, Any]:
        """Pin (idempotent: an existing pin is returned as it is, its reason kept)."""
        with self.engine.begin() as conn:
            current = self._active_pin(conn, alias, version)
            if current is not None:
                return current
            conn.execute(pins.insert().values(alias=alias, version=version, reason=reason, pinned_by=by,
                                              pinned_at=utcnow()))
            return self._active_pin(conn, alias, version)  # type: ignore[return-value]

    def unpin_version(self, *, alias: str, version: int, by: str) -> dict[str, Any] | None:
        """End the pin (kept as a record, who and when); None when the version was not pinned."""
        with self.engine.begin() as conn:
            current = self._active_pin(conn, alias, version)
            if current is None:
                return None
            now = utcnow()
            conn.execute(pins.update().where(pins.c.id == current["id"]).values(unpinned_by=by, unpinned_at=now))
            return {**current, "unpinned_by": by, "unpinned_at": now}

    @staticmethod
    def _active_pin(conn: sa.Connection, alias: str, version: int) -> dict[str, Any] | None:
        row = conn.execute(sa.select(pins).where(pins.c.alias == alias, pins.c.version == version,
                                                 pins.c.unpinned_at.is_(None)).order_by(pins.c.id)).mappings().first()
        return dict(row) if row else None

    def active_pins(self, alias: str) -> dict[int, dict[str, Any]]:
        """Version number -> its pin (reason, pinned_by, pinned_at)."""
        try:
            with self.engine.connect() as conn:
                rows = conn.execute(sa.select(pins).where(pins.c.alias == alias, pins.c.unpinned_at.is_(None))
                                    .order_by(pins.c.id)).mappings().all()
        except sa.exc.DBAPIError as exc:
            if _table_missing(exc, pins.name):  # a read-only command on a state DB older than pins
                return {}
            raise
        return {row["version"]: dict(row) for row in rows}

    def record_audit(self, *, alias: str, version: int, collection: str, run_id: str | None, expected: int,
                     points: int, missing: int, orphans: int) -> None:
        with self.engine.begin() as conn:
            conn.execute(audits.insert().values(alias=alias, version=version, collection=collection, run_id=run_id,
                                                expected=expected, points=points, missing=missing, orphans=orphans,
                                                at=utcnow()))

    def last_audit(self, alias: str) -> dict[str, Any] | None:
        try:
            with self.engine.connect() as conn:
                row = conn.execute(sa.select(audits).where(audits.c.alias == alias).order_by(audits.c.id.desc())
                                   .limit(1)).mappings().first()
        except sa.exc.DBAPIError as exc:
            if _table_missing(exc, audits.name):  # a read-only command on a state DB older than audits
                return None
            raise
        return dict(row) if row else None


def _table_missing(exc: sa.exc.DBAPIError, table: str) -> bool:
    """SQLite: "no such table: t"; MySQL/MariaDB 1146: "Table 'db.t' doesn't exist". The schema gains a
    table at the next writing command (create_all); read-only commands never create one."""
    text = str(exc.orig)
    return table in text and ("no such table" in text or "doesn't exist" in text)


def parse_lock_owner(owner: str) -> tuple[str | None, int | None, str | None]:
    """(host, pid, space) from an owner made by `default_lock_owner`: `[run_id@]host:pid:nonce:space`."""
    _, _, tail = owner.rpartition("@")
    parts = tail.split(":")
    if len(parts) != 4 or not parts[1].isdigit():
        return None, None, None
    return parts[0], int(parts[1]), parts[3]


def _process_started_at(pid: int) -> datetime | None:
    """A process's start time from /proc (Linux), to tell a reused PID from the lock's owner."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return datetime.fromtimestamp(boot + ticks / os.sysconf("SC_CLK_TCK"), UTC).replace(tzinfo=None)
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def lock_owner_alive(owner: str, *, since: datetime | None = None) -> bool | None:
    """True/False when this host can tell (the owner ran here, in this PID namespace), None for another host,
    container or an unknown owner (then only the TTL frees its lock).

    A PID that lives but started after the lock was taken is another process that reused the number."""
    host, pid, space = parse_lock_owner(owner)
    if host is None or pid is None or host != socket.gethostname() or space != process_space() or space == "unknown":
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another user
    started = _process_started_at(pid)
    if since is not None and started is not None and started > since + timedelta(seconds=2):
        return False
    return True


def describe_lock_holder(name: str, holder: dict[str, Any]) -> str:
    subject = name.split(":", 1)[-1]
    alive = lock_owner_alive(holder["owner"], since=holder["acquired_at"])
    host, _, _ = parse_lock_owner(holder["owner"])
    where = {True: "its process is alive on this host", False: "its process is gone"}.get(
        alive, f"held from host {host}" if host else "held by an owner of unknown host")
    if is_dag_run_owner(holder["owner"]):
        where = ("an Airflow DAG run: its tasks renew it while the run lives; if the run died, the lock expires "
                 "after KB_LOCK_TTL")
    return (f"another run is working on {subject}: {holder['owner']}, since {holder['acquired_at']:%Y-%m-%d %H:%M:%S} "
            f"UTC (lock {name!r}, expires {holder['expires_at']:%Y-%m-%d %H:%M:%S} UTC; {where}). Wait for it; if it "
            f"is stuck, stop that process, or break the lock: `kb-reindex unlock --reason ... --yes`")


def _first_line(exc: BaseException | None) -> str:
    return str(exc).splitlines()[0] if exc is not None and str(exc) else type(exc).__name__
