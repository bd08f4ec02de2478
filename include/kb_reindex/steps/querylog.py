"""The opt-in query log (`KB_QUERY_LOG=true`): what real users asked and what the alias answered.

Why: the golden set is a few dozen questions someone wrote; the log holds the questions customers
actually ask, so a candidate can be replayed on them before promotion (`kb_reindex.steps.replay`) and the
served version watched after it (`kb_reindex.run.watch`). Query text is personal data: the log is off by
default, keeps only the newest `KB_QUERY_LOG_KEEP` rows per alias, and lives in the state DB.

Writing it must never fail a user's query: `log_search` logs a warning instead of raising.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from kb_reindex.services.config import Settings
from kb_reindex.services.state.schema import MYSQL_TABLE, LongText, Timestamp, metadata
from kb_reindex.services.state.ports import OwnTable
from kb_reindex.services.state.store import StateStore
from kb_reindex.services.state.clock import utcnow

log = logging.getLogger(__name__)

query_log = sa.Table(
    "kb_query_log",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("alias", sa.String(64), nullable=False),
    sa.Column("tenant", sa.String(128)),
    sa.Column("query", sa.Text, nullable=False),
    sa.Column("k", sa.Integer, nullable=False),
    sa.Column("version", sa.Integer),
    # the knowledge_keys of the hits in rank order (JSON list); [] is an empty result
    sa.Column("result_keys", LongText, nullable=False),
    sa.Column("at", Timestamp, nullable=False),
    sa.Index("ix_kb_query_log_alias_id", "alias", "id"),
    **MYSQL_TABLE,
)



@dataclass(frozen=True)
class LoggedQuery:
    """One row of the log: what was asked (by which tenant, for how many hits), which version answered and
    the knowledge_keys it answered with, in rank order (empty: no result)."""

    id: int
    query: str
    tenant: str | None
    k: int
    version: int | None
    keys: tuple[str, ...]
    at: datetime

    @classmethod
    def from_row(cls, row: sa.RowMapping) -> LoggedQuery:
        return cls(id=row["id"], query=row["query"], tenant=row["tenant"], k=row["k"], version=row["version"],
                   keys=tuple(json.loads(row["result_keys"])), at=row["at"])


@dataclass(frozen=True)
class QueryLogView:
    """The log as status shows it: whether it is on, how many queries it holds for the alias, how many it keeps."""

    enabled: bool
    queries: int
    keep: int


_ready: weakref.WeakSet[sa.Engine] = weakref.WeakSet()
_stores: dict[str, StateStore] = {}
_guard = threading.Lock()


def ensure_table(state: OwnTable) -> None:
    """The table is created where it is first used: a state DB made before the log existed gains it then."""
    key = state.engine
    if key in _ready:
        return
    try:
        query_log.create(state.engine, checkfirst=True)
    except (sa.exc.OperationalError, sa.exc.ProgrammingError) as exc:
        if "already exists" not in str(exc):  # another process created it first
            raise
    _ready.add(key)


def _state_for(deps: Any) -> OwnTable:
    """The caller's state DB when it has one open; the reader has none (it must not need one to answer),
    so one engine per state URL is opened once per process and kept."""
    state = getattr(deps, "state", None)
    if state is not None:
        return state
    url = deps.settings.state_url
    with _guard:
        if url not in _stores:
            _stores[url] = StateStore(url, create=False)
        return _stores[url]


def record(state: OwnTable, *, alias: str, query: str, tenant: str | None, k: int, version: int | None,
           keys: list[str], keep: int, at: datetime | None = None) -> None:
    """One row, then the oldest rows beyond `keep` for this alias are deleted."""
    ensure_table(state)
    with state.engine.begin() as conn:
        conn.execute(query_log.insert().values(
            alias=alias, tenant=tenant, query=query, k=k, version=version,
            result_keys=json.dumps(keys, ensure_ascii=False), at=at or utcnow()))
        # the id of the oldest row to keep: a select first (MySQL refuses a DELETE reading its own table)
        boundary = conn.execute(
            sa.select(query_log.c.id).where(query_log.c.alias == alias)
            .order_by(query_log.c.id.desc()).offset(keep - 1).limit(1)
        ).scalar()
        if boundary is not None:
            conn.execute(query_log.delete().where(query_log.c.alias == alias, query_log.c.id < boundary))


def log_search(deps: Any, *, query: str, tenant: str | None, k: int, version: int | None, keys: list[str]) -> bool:
    """Record a search when `KB_QUERY_LOG` is on. Any failure is a warning: the user's answer matters more
    than the log. Returns whether a row was written."""
    settings: Settings = deps.settings
    if not settings.query_log:
        return False
    try:
        record(_state_for(deps), alias=settings.alias, query=query, tenant=tenant, k=k, version=version, keys=keys,
               keep=settings.query_log_keep)
        return True
    except Exception as exc:  # a logging failure must not fail the query; it is said, not hidden
        log.warning("kb_reindex: query log (KB_QUERY_LOG) not written, the query was answered: %s: %s",
                    type(exc).__name__, " ".join(str(exc).split())[:300])
        return False


def recent(state: OwnTable, alias: str, *, limit: int, version: int | None = None) -> list[LoggedQuery]:
    """The newest `limit` logged queries of this alias (answered by `version`, if given), newest first."""
    ensure_table(state)
    where = [query_log.c.alias == alias]
    if version is not None:
        where.append(query_log.c.version == version)
    with state.engine.connect() as conn:
        rows = conn.execute(sa.select(query_log).where(*where).order_by(query_log.c.id.desc()).limit(limit)).mappings().all()
    return [LoggedQuery.from_row(r) for r in rows]


def count(state: OwnTable, alias: str) -> int:
    """How many logged queries this alias's log holds: one COUNT, for `status` and the page. A state DB where
    the log never ran has no table yet: 0, and nothing is created (status only reads)."""
    if state.engine not in _ready:
        if not sa.inspect(state.engine).has_table(query_log.name):
            return 0
        _ready.add(state.engine)
    with state.engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(query_log)
                            .where(query_log.c.alias == alias)).scalar_one()


def summary(deps: Any) -> QueryLogView:
    """Whether the log is on (`KB_QUERY_LOG`), how many queries it holds for the alias (rows written while it
    was on stay until they are deleted), and how many it keeps."""
    settings: Settings = deps.settings
    return QueryLogView(enabled=settings.query_log, queries=count(deps.state, settings.alias),
                        keep=settings.query_log_keep)


def empty_rate(rows: list[LoggedQuery]) -> float | None:
    """Share of logged answers with no result at all; None without rows."""
    if not rows:
        return None
    return sum(1 for r in rows if not r.keys) / len(rows)


def reset_cache() -> None:
    """Forget the engines opened for readers (tests, or a process that changes KB_STATE_URL)."""
    with _guard:
        for state in _stores.values():
            state.dispose()
        _stores.clear()
        _ready.clear()
