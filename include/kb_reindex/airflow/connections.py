"""Airflow Connections as Settings: `kb_state` (the state DB), `ollama_default` (the embedder's servers) and
`qdrant_default` (Qdrant) override the settings of the knowledge base a task acts on field by field (a registry
entry may name Connections of its own for its Qdrant and its Ollama; the state DB is shared), so a task builds its stores
exactly as the CLI does (`runtime.open_deps`, `store.make_client`). Without a Connection, the environment
decides. Airflow is imported only when a Connection is looked up: the mapping is tested without it.

An `s3://` source is read through Airflow's `ObjectStoragePath` with the knowledge base's `aws_conn_id`
(default `aws_default`): the Amazon provider's s3fs filesystem is handed down to the steps, which list and read
it as they do a local folder (`sources.KnowledgeSource`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NotRequired, TypedDict

from sqlalchemy.engine import URL

from kb_reindex.services.collection_config import CollectionConfig, load_collection_config
from kb_reindex.services.config import Settings, project_root, split_ollama_hosts, state_url_from_env
from kb_reindex.domain.errors import ConfigError
from kb_reindex.services.object_store import BucketAccess
from kb_reindex.services.registry import (
    AWS_CONN_ID,
    OLLAMA_CONN_ID,
    QDRANT_CONN_ID,
    KnowledgeBase,
    select_knowledge_base,
)
from kb_reindex.services.runtime import Deps, open_deps

log = logging.getLogger(__name__)
STATE_CONN_ID = "kb_state"


class QdrantOverrides(TypedDict):
    """The Settings fields `qdrant_default` sets (keyword arguments of `Settings.from_env`): where Qdrant is,
    how the client talks to it, and the collection settings when its extra names them."""

    qdrant_url: str | None
    qdrant_host: str | None
    qdrant_port: int
    qdrant_path: None  # a Connection is always a server: never the embedded local mode
    qdrant_api_key: str | None
    qdrant_https: bool | None
    qdrant_prefix: str | None
    qdrant_prefer_grpc: bool
    qdrant_grpc_port: int
    qdrant_timeout_s: int
    collection_config: NotRequired[CollectionConfig]


def _connection(conn_id: str) -> Any | None:
    """The Airflow Connection `conn_id`, or None when it is not defined."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        return None


def state_url_from_connection(conn: Any) -> str:
    """`kb_state` as a SQLAlchemy URL: MySQL through pymysql, PostgreSQL through psycopg, or a SQLite file
    named by host/schema."""
    if conn.conn_type in ("mysql", "mariadb"):
        return URL.create(
            "mysql+pymysql", username=conn.login or None, password=conn.password or None,
            host=conn.host or "127.0.0.1", port=conn.port or 3306, database=conn.schema or None,
            query={"charset": "utf8mb4"},
        ).render_as_string(hide_password=False)
    if conn.conn_type in ("postgres", "postgresql"):
        return URL.create(
            "postgresql+psycopg", username=conn.login or None, password=conn.password or None,
            host=conn.host or "127.0.0.1", port=conn.port or 5432, database=conn.schema or None,
        ).render_as_string(hide_password=False)
    if conn.conn_type == "sqlite":
        if not (conn.host or conn.schema):
            raise ConfigError(f"connection {STATE_CONN_ID} (sqlite) names no database file: set its host to the path")
        return f"sqlite:///{conn.host or conn.schema}"
    raise ConfigError(f"connection {STATE_CONN_ID} has type {conn.conn_type!r}; use mysql, postgres or sqlite")


def ollama_from_connection(conn: Any, conn_id: str = OLLAMA_CONN_ID) -> tuple[str, dict[str, str] | None]:
    """`ollama_default` as OLLAMA_HOST and headers. Its host may list several servers, comma-separated
    (`ollama-a,ollama-b:11435,https://ollama-c`): an entry without a scheme gets the Connection's schema
    (http), one without a port the Connection's port (11434); the password goes to every server."""
    hosts = []
    for entry in (part.strip() for part in (conn.host or "127.0.0.1").split(",")):
        if entry and "://" not in entry:
            has_port = re.fullmatch(r"[^:\[\]]+:\d+|\[[^\]]+\]:\d+", entry) is not None
            entry = f"{conn.schema or 'http'}://{entry}" + ("" if has_port else f":{conn.port or 11434}")
        hosts.append(entry)
    host = ",".join(hosts)
    split_ollama_hosts(host, source=f"connection {conn_id}: host")
    headers = {"Authorization": f"Bearer {conn.password}"} if conn.password else None
    return host, headers


def qdrant_overrides(conn: Any, *, root: Any, conn_id: str = QDRANT_CONN_ID) -> QdrantOverrides:
    """`qdrant_default` as Settings fields, so `store.make_client` builds the client as for the CLI.

    The fields the Qdrant provider's `QdrantHook.get_conn` reads (host, port, password as API key; extras url,
    grpc_port, prefer_gprc, https, prefix), plus what it cannot express: `timeout` (its client waits the
    client's 5 s default, too short for a bulk upsert or a snapshot), the correctly spelt `prefer_grpc`, and
    `collection_config`. The hook is not used (nor its provider installed): its client could not be given the
    timeout, and a client built outside `store.make_client` would make the tasks and the CLI differ."""
    extra = conn.extra_dejson or {}
    where = f"connection {conn_id}"

    def flag(*names: str) -> bool | None:
        for name in names:
            value = extra.get(name)
            if value is None or value == "":
                continue
            if isinstance(value, bool):
                return value
            if str(value).strip().lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).strip().lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{where}: extra {name}={value!r} is not a boolean (true/false)")
        return None

    def whole(name: str, default: int, *, minimum: int, maximum: int | None = None) -> int:
        value = extra.get(name)
        if value is None or value == "":
            return default
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: extra {name}={value!r} is not an integer") from None
        if number < minimum or (maximum is not None and number > maximum):
            raise ConfigError(f"{where}: extra {name}={number} must be between {minimum} and {maximum or 'any'}")
        return number

    url = str(extra.get("url") or "").strip() or None
    overrides: QdrantOverrides = {
        "qdrant_url": url,
        "qdrant_host": None if url else (conn.host or "localhost"),
        "qdrant_port": conn.port or 6333,
        "qdrant_path": None,
        "qdrant_api_key": conn.password or None,
        "qdrant_https": flag("https"),
        "qdrant_prefix": str(extra.get("prefix") or "").strip().strip("/") or None,
        "qdrant_prefer_grpc": bool(flag("prefer_grpc", "prefer_gprc")),
        "qdrant_grpc_port": whole("grpc_port", 6334, minimum=1, maximum=65535),
        "qdrant_timeout_s": whole("timeout", 60, minimum=1),
    }
    if extra.get("collection_config") not in (None, ""):
        overrides["collection_config"] = load_collection_config(
            extra["collection_config"], source=f"{where}: extra collection_config", root=root)
    return overrides


def _entry_connection(kb: KnowledgeBase, conn_id: str, default: str) -> Any | None:
    """A Connection the knowledge base uses: a default one may be absent (the environment decides), one its
    registry entry names must exist."""
    conn = _connection(conn_id)
    if conn is None and conn_id != default:
        raise ConfigError(f"{kb.registry}: knowledge base {kb.alias!r} names the Connection {conn_id!r}, which "
                          "Airflow does not have; create it (airflow connections add) or drop the key")
    return conn


def task_base(kb: str | None = None, *, on_call: bool = False) -> KnowledgeBase:
    """The knowledge base a task acts on. `on_call` (the rollback): when its entry no longer loads, a stand-in
    from its last entry that loaded (recorded in the state DB) or its alias alone (`run.bases.on_call_base`)."""
    if not on_call:
        return select_knowledge_base(kb)
    from kb_reindex.run.bases import on_call_base
    from kb_reindex.services.registry import load_registry

    return on_call_base(load_registry(), kb, state_url())


def task_settings(kb: str | None = None, *, on_call: bool = False) -> tuple[Settings, dict[str, str] | None]:
    """The settings of the knowledge base `kb` (None: the environment's, or a registry's only one), overridden
    by the Connections that are defined; Ollama's headers. Checked once the Connections apply: `qdrant_default`
    may be what makes Qdrant a server. `on_call`: see `task_base`."""
    base = task_base(kb, on_call=on_call)
    overrides: dict[str, Any] = {}
    headers = None
    if (state_conn := _connection(STATE_CONN_ID)) is not None:
        overrides["state_url"] = state_url_from_connection(state_conn)
    if (ollama_conn := _entry_connection(base, base.ollama_conn_id, OLLAMA_CONN_ID)) is not None:
        overrides["ollama_host"], headers = ollama_from_connection(ollama_conn, base.ollama_conn_id)
    if (qdrant_conn := _entry_connection(base, base.qdrant_conn_id, QDRANT_CONN_ID)) is not None:
        overrides.update(qdrant_overrides(qdrant_conn, root=project_root(os.environ), conn_id=base.qdrant_conn_id))
    settings = base.settings(on_call=on_call, **overrides)
    for problem in settings.ignored_problems:
        log.warning("kb_reindex: %s", problem)
    return settings, headers


@contextmanager
def task_deps(kb: str | None = None, *, on_call: bool = False) -> Iterator[Deps]:
    """The stores a task of knowledge base `kb` works with, opened from `task_settings` (Ollama's headers set)."""
    settings, headers = task_settings(kb, on_call=on_call)
    with open_deps(settings) as deps:
        deps.ollama_headers = headers
        if settings.knowledge_remote and not on_call:
            deps.bucket_access = object_storage(select_knowledge_base(kb))
        yield deps


def object_storage(kb: KnowledgeBase) -> BucketAccess:
    """How a task reads a bucket source: the filesystem of Airflow's `ObjectStoragePath` with the knowledge
    base's aws Connection (the Amazon provider's s3fs), made when the plan first lists it; and the words a
    refusal names the credentials by. A Connection the registry entry names must exist; `aws_default` may be
    absent, and the provider then takes boto3's chain (the worker's AWS environment or instance role)."""
    conn_id = kb.aws_conn_id

    def filesystem(uri: str) -> Any:
        _entry_connection(kb, conn_id, AWS_CONN_ID)
        from airflow.sdk import ObjectStoragePath

        return ObjectStoragePath(uri, conn_id=conn_id).fs

    return BucketAccess(filesystem, f"the Airflow Connection {conn_id}")


def state_url() -> str:
    """The state DB alone, as `task_settings` finds it: other settings may be what failed."""
    if (state_conn := _connection(STATE_CONN_ID)) is not None:
        return state_url_from_connection(state_conn)
    return state_url_from_env()
