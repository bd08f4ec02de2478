"""The last registry entry of each knowledge base that loaded, as the runs used it: what on-call's commands,
page and rollback DAG act from when the entry no longer loads (a typo) or was removed from the registry. A
rollback needs no source or golden set: the alias, its Qdrant (folder or Connection) and the state DB."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kb_reindex.services.state.clock import utc_stamp
from kb_reindex.services.state.schema import (MYSQL_TABLE, Timestamp, _table_missing, ensure_table, metadata,
                                              retirements)

if TYPE_CHECKING:
    from kb_reindex.services.state.clock import Clock

registry_entries = sa.Table(
    "kb_registry_entries",
    metadata,
    sa.Column("alias", sa.String(64), primary_key=True),
    sa.Column("registry", sa.String(1024), nullable=False),
    sa.Column("schedule", sa.String(255)),
    sa.Column("qdrant_conn_id", sa.String(255), nullable=False),
    sa.Column("ollama_conn_id", sa.String(255), nullable=False),
    sa.Column("aws_conn_id", sa.String(255), nullable=False),
    # JSON: the KB_* settings the entry set, as Settings.from_env reads them
    sa.Column("env", sa.Text, nullable=False),
    sa.Column("recorded_at", Timestamp, nullable=False),
    **MYSQL_TABLE,
)


@dataclass(frozen=True)
class RecordedEntry:
    """A registry entry as it last loaded (kb_reindex.services.registry.KnowledgeBase's fields)."""

    alias: str
    registry: str
    schedule: str | None
    qdrant_conn_id: str
    ollama_conn_id: str
    aws_conn_id: str
    env: Mapping[str, str] = field(default_factory=dict)
    recorded_at: datetime | None = None

    @property
    def since(self) -> str:
        return utc_stamp(self.recorded_at) if self.recorded_at else "-"


class EntriesMixin:
    """Recorded registry entries of `StateStore`."""

    engine: sa.Engine
    clock: Clock

    def record_entry(self, entry: RecordedEntry) -> bool:
        """Keep `entry` as its alias's last entry that loaded; True when it changed (written)."""
        ensure_table(self.engine, registry_entries)  # a state DB older than the table
        values: dict[str, Any] = {"registry": entry.registry, "schedule": entry.schedule,
                                  "qdrant_conn_id": entry.qdrant_conn_id, "ollama_conn_id": entry.ollama_conn_id,
                                  "aws_conn_id": entry.aws_conn_id, "env": json.dumps(dict(entry.env), sort_keys=True)}
        with self.engine.begin() as conn:
            row = conn.execute(sa.select(registry_entries).where(registry_entries.c.alias == entry.alias)).mappings().first()
            if row is not None and all(row[key] == value for key, value in values.items()):
                return False
            values["recorded_at"] = self.clock.now()
            if row is None:
                conn.execute(registry_entries.insert().values(alias=entry.alias, **values))
            else:
                conn.execute(registry_entries.update().where(registry_entries.c.alias == entry.alias).values(**values))
        return True

    def recorded_entries(self) -> list[RecordedEntry]:
        """Every recorded entry, by alias (none on a state DB older than the table)."""
        return _read_entries(self.engine)

    def recorded_entry(self, alias: str) -> RecordedEntry | None:
        return next((e for e in self.recorded_entries() if e.alias == alias), None)

    def recorded_unretired(self) -> list[RecordedEntry]:
        """The recorded entries whose knowledge base no retirement in force took out of service (what a removed
        entry's stand-in is made from)."""
        return _read_entries(self.engine, unretired=True)


def _read_entries(engine: sa.Engine, *, unretired: bool = False) -> list[RecordedEntry]:
    """Every recorded entry, by alias (none on a state DB older than the table); `unretired`: only those of a
    knowledge base no retirement in force took out of service."""
    query = sa.select(registry_entries).order_by(registry_entries.c.alias)
    try:
        with engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
            retired: set[str] = set()
            if unretired and rows:
                try:
                    retired = set(conn.execute(sa.select(retirements.c.alias)
                                               .where(retirements.c.undone_at.is_(None))).scalars())
                except sa.exc.DBAPIError as exc:
                    if not _table_missing(exc, retirements.name):
                        raise
                    conn.rollback()  # PostgreSQL: the failed statement ended the transaction
    except sa.exc.DBAPIError as exc:
        if _table_missing(exc, registry_entries.name):
            return []
        raise
    return [RecordedEntry(alias=r["alias"], registry=r["registry"], schedule=r["schedule"],
                          qdrant_conn_id=r["qdrant_conn_id"], ollama_conn_id=r["ollama_conn_id"],
                          aws_conn_id=r["aws_conn_id"], env=json.loads(r["env"]), recorded_at=r["recorded_at"])
            for r in rows if r["alias"] not in retired]


#: how long a DAG file's parse may wait for the state DB before it goes on without the removed entries
PARSE_CONNECT_TIMEOUT_S = 5


def unretired_entries(url: str, *, timeout_s: int = PARSE_CONNECT_TIMEOUT_S) -> list[RecordedEntry]:
    """The recorded entries of the state DB at `url` whose knowledge base is not retired, read over one short
    connection of its own (connect and lock waits bounded by `timeout_s`), never creating a database: what a
    DAG file's parse may read (`kb_reindex.airflow.factory.on_call_bases`), so an entry removed from the registry
    but never retired keeps on-call's rollback DAG. A state DB not made yet: none."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if not parsed.database or parsed.database == ":memory:" or not Path(parsed.database).is_file():
            return []
        args: dict[str, Any] = {"timeout": timeout_s}
    elif backend in ("mysql", "mariadb"):
        args = {"connect_timeout": timeout_s, "read_timeout": timeout_s, "charset": "utf8mb4"}
    else:
        args = {"connect_timeout": timeout_s}
    engine = sa.create_engine(parsed, poolclass=NullPool, connect_args=args)
    try:
        return _read_entries(engine, unretired=True)
    finally:
        engine.dispose()
