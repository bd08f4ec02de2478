"""The state DB: versions, their manifests, runs, alias events and locks (SQLAlchemy Core).

SQLite by default, MySQL/MariaDB through pymysql in production, or PostgreSQL through psycopg. The schema is
created on first use.
Qdrant holds vectors; this holds what they are supposed to be, so every check has something to compare.

One module per concern: `schema` (tables, upgrades), `versions`, `manifests` (+ the plan's snapshot and the
file hash cache), `runs`, `history` (alias events, pins, audits), `freezes` (the freeze of an alias),
`locks` (owner format, liveness, takeover), `clock` (the time every decision reads), `store` (`StateStore`, composed of them). Every name
callers used from `kb_reindex.state` is still importable from here.
"""

from __future__ import annotations

from kb_reindex.state.clock import Clock, ManualClock, SystemClock, utc_stamp, utcnow
from kb_reindex.state.freezes import Freeze, FreezeEvent
from kb_reindex.state.history import AliasEvent, AuditRecord, PinRecord
from kb_reindex.state.locks import (
    DAG_RUN_OWNER,
    LockEvent,
    LockRecord,
    default_lock_owner,
    describe_lock_holder,
    is_dag_run_owner,
    lock_owner_alive,
    parse_lock_owner,
    process_space,
)
from kb_reindex.state.manifests import FileHash, ManifestChunk, ManifestDocument, ManifestRef, PlanSnapshotRow
from kb_reindex.state.runs import RunCounterColumns, RunRecord
from kb_reindex.state.schema import (
    ADDED_COLUMNS,
    MYSQL_TABLE,
    LongText,
    Timestamp,
    alias_events,
    audits,
    chunk_texts,
    file_hashes,
    freezes,
    lock_events,
    locks,
    manifest_chunks,
    manifest_documents,
    metadata,
    pins,
    runs,
    snapshots,
    versions,
)
from kb_reindex.state.store import StateStore
from kb_reindex.state.versions import STATUSES, QdrantSnapshotRef, VersionColumns, VersionFields, VersionRecord

__all__ = [
    "ADDED_COLUMNS", "DAG_RUN_OWNER", "MYSQL_TABLE", "STATUSES", "Clock", "FileHash", "Freeze", "FreezeEvent", "LockEvent",
    "LockRecord", "LongText",
    "ManifestChunk", "ManifestDocument", "ManifestRef", "ManualClock", "PlanSnapshotRow", "QdrantSnapshotRef",
    "RunCounterColumns", "RunRecord", "StateStore", "SystemClock", "Timestamp", "VersionColumns", "VersionFields", "VersionRecord",
    "alias_events", "audits", "chunk_texts", "default_lock_owner", "describe_lock_holder", "file_hashes", "freezes",
    "is_dag_run_owner", "lock_events", "lock_owner_alive", "locks", "manifest_chunks", "manifest_documents",
    "metadata", "parse_lock_owner", "pins", "process_space", "runs", "snapshots", "utc_stamp", "utcnow", "versions",
    "AliasEvent", "AuditRecord", "PinRecord",
]
