"""`StateStore`: the one object every caller holds, composed of one mixin per concern of the state DB."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from kb_reindex.domain.errors import ConfigError, StateEmpty, StateMissing, StateUnreachable, connect_failure
from kb_reindex.services.state.clock import Clock, SystemClock
from kb_reindex.services.state.entries import EntriesMixin
from kb_reindex.services.state.freezes import FreezesMixin
from kb_reindex.services.state.history import HistoryMixin
from kb_reindex.services.state.locks import LocksMixin
from kb_reindex.services.state.manifests import ManifestsMixin, convert_legacy_manifests
from kb_reindex.services.state.runs import RunsMixin
from kb_reindex.services.state.query_vectors import QueryVectorsMixin
from kb_reindex.services.state.retirements import RetirementsMixin
from kb_reindex.services.state.screen_scores import ScreenScoresMixin
from kb_reindex.services.state.schema import (
    _first_line,
    _schema_guard,
    _upgrade_schema,
    ensure_table,
    alias_events,
    code_point_order,
    doc_chunks,
    manifest_documents,
    snapshots,
    manifest_sources,
    metadata,
    versions,
)
from kb_reindex.services.state.slots import SlotsMixin
from kb_reindex.services.state.versions import VersionsMixin


_PARTIAL_SCHEMA_LOOKS = 10  # half a second apart: a schema's creation takes milliseconds


class StateStore(VersionsMixin, ManifestsMixin, RunsMixin, HistoryMixin, LocksMixin, FreezesMixin, SlotsMixin,
                 ScreenScoresMixin, QueryVectorsMixin, EntriesMixin, RetirementsMixin):
    """All reads and writes of the state DB. Short transactions; nothing held across embedding calls."""

    def __init__(self, url: str, *, engine: sa.Engine | None = None, create: bool = True,
                 clock: Clock | None = None) -> None:
        """`create=False` (read-only commands) never makes a database: a missing one, or one without our
        tables, is an error naming it, so a typo in KB_STATE_URL is not answered from a fresh empty DB.

        `clock`: where every timestamp it writes and every lock expiry it judges comes from (the real time
        unless a test moves it)."""
        self.url = url
        self.clock: Clock = clock or SystemClock()
        self.engine = engine or self._make_engine(url, create=create)
        self.display_url = self.engine.url.render_as_string(hide_password=True)
        code_point_order(metadata.tables.values())
        try:
            if not create:
                self._require_schema()
                return
            with _schema_guard(self.engine):
                metadata.create_all(self.engine, checkfirst=True)
                _upgrade_schema(self.engine)
                convert_legacy_manifests(self.engine)
        except sa.exc.OperationalError as exc:
            if "already exists" in str(exc.orig):  # MySQL 1050: another process created a table first
                metadata.create_all(self.engine, checkfirst=True)
                _upgrade_schema(self.engine)
                convert_legacy_manifests(self.engine)
                return
            self.engine.dispose()
            what = connect_failure(exc)
            if what:  # a server not answering: unavailable, not a setting to change (exit 3; a task retries)
                raise StateUnreachable(f"state DB at {self.display_url} is unreachable ({what}); check KB_STATE_URL "
                                       f"and that the server runs: {_first_line(exc.orig)}") from None
            raise ConfigError(
                f"state DB at {self.display_url} is "
                + (f"unreachable ({what}); check KB_STATE_URL and that the server runs: " if what else
                   "unreachable or refused the schema (KB_STATE_URL): ")
                + _first_line(exc.orig)
            ) from None
        except (sa.exc.IntegrityError, sa.exc.ProgrammingError):
            metadata.create_all(self.engine, checkfirst=True)  # another process created it first
            _upgrade_schema(self.engine)
            convert_legacy_manifests(self.engine)
        except sa.exc.DatabaseError as exc:  # SQLite: "file is not a database" (truncated or overwritten)
            self.engine.dispose()
            raise ConfigError(
                f"state DB at {self.display_url} is not a usable database ({_first_line(exc.orig)}). Nothing was "
                "changed. Restore it from a backup, or move it aside and rebuild it from Qdrant: "
                "`kb-reindex reconcile --rebuild-state`"
            ) from None

    def _require_schema(self) -> None:
        missing = self._missing_tables()
        # one of the two: a writer may be creating the schema this moment (two first runs at once; MySQL's DDL
        # is not transactional and a SQLite reader does not take the writer's schema lock), so look again
        # before calling the DB broken
        for _ in range(_PARTIAL_SCHEMA_LOOKS):
            if len(missing) != 1:
                break
            time.sleep(0.5)
            missing = self._missing_tables()
        if len(missing) == 2:
            self.engine.dispose()
            raise StateEmpty(
                f"the state DB at {self.display_url} holds no kb-reindex state yet (KB_STATE_URL): `kb-reindex run` "
                "creates it and builds the first version (`kb-reindex plan` previews that run); if the state was "
                "lost while Qdrant still holds the versions, rebuild it with `kb-reindex reconcile --rebuild-state`"
            )
        if missing:
            self.engine.dispose()
            raise ConfigError(
                f"no kb-reindex state in the state DB at {self.display_url} (tables {', '.join(missing)} missing): "
                "check KB_STATE_URL; if the state DB was lost, rebuild it from Qdrant with "
                "`kb-reindex reconcile --rebuild-state`"
            )
        _upgrade_schema(self.engine, tables=(versions, alias_events, manifest_documents, snapshots))  # an older one's DB
        if sa.inspect(self.engine).has_table("kb_manifest_chunks"):  # made before revisions: readable once converted
            with _schema_guard(self.engine):
                for table in (doc_chunks, manifest_sources):
                    ensure_table(self.engine, table)
                convert_legacy_manifests(self.engine)

    def _missing_tables(self) -> list[str]:
        present = set(sa.inspect(self.engine).get_table_names())
        return sorted({versions.name, alias_events.name} - present)

    @staticmethod
    def _make_engine(url: str, *, create: bool = True) -> sa.Engine:
        try:
            parsed = make_url(url)
        except sa.exc.ArgumentError:
            raise ConfigError("KB_STATE_URL is not a SQLAlchemy URL (sqlite:///path, mysql+pymysql://... or "
                              "postgresql+psycopg://...)") from None
        if parsed.get_backend_name() == "sqlite":
            if parsed.database and parsed.database != ":memory:":
                if not create and not Path(parsed.database).is_file():
                    raise StateMissing(
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
                # up to 64 MiB of page cache (SQLite's default is 2 MiB; pages are taken as used): an edit's
                # manifest copies its base's rows into three B-trees in random key order, which spilled pages at
                # 2 MiB (copied 50k rows: 0.37 s -> 0.21 s at 16 MiB; 205k: 2.45 s, 1.36 s at 16 MiB, 1.10 s;
                # bench/README P15)
                cursor.execute("PRAGMA cache_size=-65536")
                cursor.close()

            return engine
        if parsed.get_backend_name() in ("mysql", "mariadb"):
            return sa.create_engine(
                parsed, pool_pre_ping=True, pool_recycle=3600, connect_args={"connect_timeout": 10, "charset": "utf8mb4"}
            )
        if parsed.get_backend_name() == "postgresql":
            return sa.create_engine(parsed, pool_pre_ping=True, pool_recycle=3600, connect_args={"connect_timeout": 10})
        raise ConfigError(f"KB_STATE_URL backend {parsed.get_backend_name()!r} is not supported; use sqlite, "
                          "mysql+pymysql or postgresql+psycopg")

    def dispose(self) -> None:
        self.engine.dispose()
