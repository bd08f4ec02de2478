"""A Qdrant-protocol test double: Qdrant's REST API over one local-mode client, for tests over the wire.

Why: no real Qdrant server runs on this machine, and local mode (``QdrantClient(path=DIR)``) admits one
process per folder and hides every race, every HTTP status and every dropped connection. This server
lets many processes use the *remote* client (``QdrantClient(url=..., api_key=...)``, REST) at once.

What it is, exactly:

* the part of Qdrant's REST API that qdrant-client's remote client uses for kb-reindex's calls
  (collections, aliases, points upsert/retrieve/scroll/count/query/delete, payload indexes, ``GET /``),
  parsed and answered with qdrant-client's own REST models, so answers have the shapes a real server's do;
* backed by ONE ``QdrantClient(path=DIR)``: data survives a restart of the server on the same folder;
  ``path=":memory:"`` keeps it in memory instead (gone with the process), for measurements: local mode
  on a folder commits every point to SQLite on its own, so writes there time that commit, not the API;
* every access to that client is serialised by one lock: concurrent clients are served safely, but
  nothing runs in parallel, so this measures no server's throughput;
* none of a real server's indexing (HNSW, payload indexes, optimizers: accepted and recorded only),
  sharding, replication, write-ahead log, or persistence/consistency guarantees; ``wait=false``
  writes are done before the answer anyway. Collection status is "green" with every point indexed
  (``indexed_vectors_count`` = points), unless :meth:`FakeQdrantServer.hold_indexing` makes the next N
  ``get_collection`` answers "yellow" with nothing indexed, as a server still building its index would;
  ``get_collection`` reports the HNSW, optimizer, quantization, shard and replication settings the
  collection was created or PATCHed with (local mode itself ignores them);
* ``POST /collections/{name}/snapshots`` answers a snapshot description with a fresh name, but stores
  nothing: there is nothing to download or recover.

Test hooks: an API key (401 like Qdrant when missing or wrong), fault injection per operation or
per ``METHOD /path-glob`` (HTTP status, delay, dropped connection; next N requests or persistent),
and a log of every request. Both are reachable from Python (:class:`FakeQdrantServer`) and over HTTP
(``GET/POST/DELETE /__faults``, ``GET/DELETE /__requests``, ``POST /__indexing``; these admin paths need
no key). Standard
library plus qdrant-client.

Run standalone::

    python -m kb_reindex.testing.qdrant_server --port 6333 --path .kb/qdrant-server [--api-key KEY]

:func:`start_process` starts it as a separate process and waits until it answers.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import hmac
import importlib.metadata
import itertools
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pydantic
from kb_reindex.services.qdrant import QdrantClient, models

from kb_reindex.testing.http_server import ConnectionTrackingServer, HttpError

__all__ = [
    "FaultRule",
    "FaultPlan",
    "FakeQdrantServer",
    "QdrantServerProcess",
    "RequestRecord",
    "main",
    "server_version",
    "start_process",
]

_MAX_BODY = 256 * 1024 * 1024
_LOG_LIMIT = 20_000
_OPEN_PATHS = {"/", "/healthz", "/livez", "/readyz"}  # Qdrant answers these without an API key


def server_version() -> str:
    """The installed qdrant-client's major.minor: the client's compatibility check passes without a warning."""
    major, minor, *_ = importlib.metadata.version("qdrant-client").split(".")
    return f"{major}.{minor}.0"


# --- faults and the request log ----------------------------------------------------------------------


@dataclass
class FaultRule:
    """One injected fault. ``match`` is an operation name (see ``_ROUTES``: "upsert", "query", "aliases",
    "update_aliases", ...), "*" for every operation, or "METHOD /path-glob" (method may be "*").

    A matching request first waits ``delay_s``; then it is dropped (socket closed, no answer) if
    ``drop``, answered ``status`` if set, answered success without being applied if ``ignore`` (a write
    that does not take, e.g. an alias move lost by a proxy or an uncommitted cluster change), or served
    normally. The first ``after`` matching requests
    pass untouched; then the rule fires ``count`` times (None: until cleared)."""

    match: str
    status: int | None = None
    delay_s: float = 0.0
    drop: bool = False
    count: int | None = 1
    after: int = 0
    ignore: bool = False
    id: int = 0
    seen: int = 0
    fired: int = 0

    def matches(self, method: str, path: str, op: str) -> bool:
        if " " in self.match:
            want_method, pattern = self.match.split(" ", 1)
            return want_method in ("*", method) and fnmatch.fnmatchcase(path, pattern.strip())
        return self.match in ("*", op)


class FaultPlan:
    """Thread-safe list of :class:`FaultRule`; the first due rule that matches a request fires."""

    def __init__(self) -> None:
        self._rules: list[FaultRule] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def add(self, match: str, *, status: int | None = None, delay_s: float = 0.0, drop: bool = False,
            count: int | None = 1, after: int = 0, ignore: bool = False) -> FaultRule:
        if status is None and not drop and not ignore and delay_s <= 0:
            raise ValueError("a fault needs a status, a delay, drop or ignore")
        if status is not None and not 400 <= status <= 599:
            raise ValueError(f"status {status} is not an HTTP error status")
        rule = FaultRule(match=match, status=status, delay_s=float(delay_s), drop=drop, count=count, after=after,
                         ignore=bool(ignore))
        with self._lock:
            rule.id = next(self._ids)
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def rules(self) -> list[FaultRule]:
        with self._lock:
            return [FaultRule(**asdict(r)) for r in self._rules]

    def take(self, method: str, path: str, op: str) -> FaultRule | None:
        """The rule that fires for this request, if any; exhausted rules are removed."""
        with self._lock:
            for rule in self._rules:
                if not rule.matches(method, path, op):
                    continue
                rule.seen += 1
                if rule.seen <= rule.after:
                    continue
                rule.fired += 1
                if rule.count is not None and rule.fired >= rule.count:
                    self._rules.remove(rule)
                return FaultRule(**asdict(rule))
        return None


@dataclass
class RequestRecord:
    """One request as the server saw it; ``status`` is 0 for a dropped connection.

    Timings, so a benchmark can tell the store's time from the wire's: ``handle_s`` from the request's
    first line read to its answer written (reading and decoding the body, the operation, encoding and
    sending the answer; None until answered), ``store_s`` the part of it spent inside the local-mode
    client's own calls (not the REST models' validation), ``lock_wait_s`` the part spent waiting for
    another request to be served (one at a time)."""

    method: str
    path: str
    op: str
    collection: str | None
    query: dict[str, str]
    body: Any
    status: int = 0
    at: float = field(default_factory=time.time)
    handle_s: float | None = None
    store_s: float | None = None
    lock_wait_s: float | None = None


def _summarise(value: Any, depth: int = 0) -> Any:
    """A short picture of a body: lists become their length, long strings are cut."""
    if isinstance(value, dict):
        if depth >= 2:
            return "{" + ",".join(sorted(map(str, value))) + "}"
        return {str(k): _summarise(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return f"list[{len(value)}]"
    if isinstance(value, str) and len(value) > 80:
        return value[:77] + "..."
    return value


# --- routing -----------------------------------------------------------------------------------------


class _HttpError(HttpError):
    """Answer with Qdrant's error envelope ``{"status": {"error": ...}, "time": ...}``."""


_NAME = r"(?P<name>[^/]+)"
# (method, path regex, operation name); order matters where patterns overlap
_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    (method, re.compile(f"^{pattern}$"), op)
    for method, pattern, op in [
        ("GET", r"/", "version"),
        ("GET", r"/(?:healthz|livez|readyz)", "health"),
        ("GET", r"/collections", "collections"),
        ("GET", r"/aliases", "aliases"),
        ("POST", r"/collections/aliases", "update_aliases"),
        ("GET", f"/collections/{_NAME}", "get_collection"),
        ("PUT", f"/collections/{_NAME}", "create_collection"),
        ("PATCH", f"/collections/{_NAME}", "update_collection"),
        ("DELETE", f"/collections/{_NAME}", "delete_collection"),
        ("GET", f"/collections/{_NAME}/exists", "collection_exists"),
        ("GET", f"/collections/{_NAME}/aliases", "aliases"),
        ("PUT", f"/collections/{_NAME}/points", "upsert"),
        ("POST", f"/collections/{_NAME}/points", "retrieve"),
        ("GET", f"/collections/{_NAME}/points/(?P<point_id>[^/]+)", "get_point"),
        ("POST", f"/collections/{_NAME}/points/scroll", "scroll"),
        ("POST", f"/collections/{_NAME}/points/count", "count"),
        ("POST", f"/collections/{_NAME}/points/query", "query"),
        ("POST", f"/collections/{_NAME}/points/query/batch", "query_batch"),
        ("POST", f"/collections/{_NAME}/points/delete", "delete_points"),
        ("POST", f"/collections/{_NAME}/points/batch", "batch_update"),
        ("PUT", f"/collections/{_NAME}/index", "create_index"),
        ("POST", f"/collections/{_NAME}/snapshots", "create_snapshot"),
        ("DELETE", f"/collections/{_NAME}/index/(?P<field_name>[^/]+)", "delete_index"),
    ]
]


def _route(method: str, path: str) -> tuple[str, dict[str, str]] | None:
    for want, pattern, op in _ROUTES:
        if want == method and (m := pattern.match(path)):
            return op, {k: urllib.parse.unquote(v) for k, v in m.groupdict().items()}
    return None


def _jsonable(value: Any) -> Any:
    """REST models as Qdrant serialises them (None fields left out); containers recursively."""
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _parse(model: Any, body: Any) -> Any:
    """Validate a body with qdrant-client's REST model; a bad body is Qdrant's 400 format error."""
    try:
        return pydantic.TypeAdapter(model).validate_python(body if body is not None else {})
    except pydantic.ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {"msg": str(exc), "loc": ()}
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise _HttpError(400, f"Format error in JSON body: {where}: {first.get('msg')}") from None


def _flag(query: dict[str, str], name: str, default: bool) -> bool:
    raw = query.get(name)
    return default if raw is None else raw.lower() in ("true", "1", "yes")


class _TimedClient:
    """The local-mode client, adding the time of every method call to the backend's ``store_s`` (under the
    backend's lock, so one request at a time)."""

    def __init__(self, client: QdrantClient, backend: _Backend) -> None:
        self._client = client
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute
        backend = self._backend

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return attribute(*args, **kwargs)
            finally:
                backend.store_s += time.perf_counter() - started

        return timed


class _Backend:
    """The local-mode client behind one lock, and the operations the routes map to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.collection_updates: dict[str, dict[str, Any]] = {}  # PATCH settings local mode ignores
        self.indexing_held = 0  # get_collection answers still to report `indexing_status` (hold_indexing)
        self.indexing_status = models.CollectionStatus.YELLOW
        self.snapshots_taken = 0
        # vectors sent to the server (upserts) and sent back (retrieve, scroll with vectors): what a build
        # moves over the wire, counted where it arrives (GET/DELETE /__vectors)
        self.vectors_written = 0
        self.vectors_read = 0
        self.store_s = 0.0  # time inside the local-mode client for the request being served
        if str(path) == ":memory:":
            local = QdrantClient(":memory:")
        else:
            path.mkdir(parents=True, exist_ok=True)
            local = QdrantClient(path=str(path))
            _stored_as_float32(local)
        self.client: Any = _TimedClient(local, self)

    def close(self) -> None:
        with self.lock:
            self.client.close()

    def call(self, op: str, params: dict[str, str], query: dict[str, str], body: Any,
             record: RequestRecord | None = None) -> Any:
        """Serve one operation under the lock; ``record.store_s`` gets the local-mode client's share."""
        handler: Callable[[dict[str, str], dict[str, str], Any], Any] = getattr(self, f"_op_{op}")
        waiting = time.perf_counter()
        with self.lock:
            if record is not None:
                record.lock_wait_s = time.perf_counter() - waiting
            self.store_s = 0.0
            try:
                return handler(params, query, body)
            except _HttpError:
                raise
            except ValueError as exc:
                raise _translate(exc, params.get("name")) from None
            finally:
                if record is not None:
                    record.store_s = self.store_s

    # -- service & collections --

    def _op_version(self, _p: dict[str, str], _q: dict[str, str], _b: Any) -> Any:
        return {"title": "qdrant - vector search engine (kb-reindex test double)", "version": server_version()}

    def _op_health(self, _p: dict[str, str], _q: dict[str, str], _b: Any) -> Any:
        return "healthz check passed"

    def _op_collections(self, _p: dict[str, str], _q: dict[str, str], _b: Any) -> Any:
        return self.client.get_collections()

    def _op_get_collection(self, p: dict[str, str], _q: dict[str, str], _b: Any) -> Any:
        """Local mode's answer, with what a server would report instead: the settings the collection was
        created or patched with, every point indexed, and green unless :meth:`hold_indexing` says otherwise."""
        info = self.client.get_collection(p["name"])
        status, indexed = models.CollectionStatus.GREEN, info.points_count or 0
        if self.indexing_held > 0:
            self.indexing_held -= 1
            status, indexed = self.indexing_status, 0
        info = info.model_copy(update={"status": status, "optimizer_status": models.OptimizersStatusOneOf.OK,
                                       "indexed_vectors_count": indexed})
        real_name = self._resolve(p["name"])
        recorded = self.collection_updates.get(real_name, {})
        config_updates: dict[str, Any] = {}
        for key, attr in (("optimizers_config", "optimizer_config"), ("hnsw_config", "hnsw_config")):
            if key in recorded and getattr(info.config, attr, None) is not None:
                current = getattr(info.config, attr)
                config_updates[attr] = current.model_copy(update=recorded[key])
        if "quantization_config" in recorded:
            config_updates["quantization_config"] = pydantic.TypeAdapter(models.QuantizationConfig).validate_python(
                recorded["quantization_config"])
        params = {key: recorded[key] for key in ("shard_number", "replication_factor", "write_consistency_factor",
                                                 "on_disk_payload") if key in recorded}
        if params:
            config_updates["params"] = info.config.params.model_copy(update=params)
        if config_updates:
            info = info.model_copy(update={"config": info.config.model_copy(update=config_updates)})
        return info

    def _op_collection_exists(self, p: dict[str, str], _q: dict[str, str], _b: Any) -> Any:
        return models.CollectionExistence(exists=self.client.collection_exists(p["name"]))

    def _op_create_collection(self, p: dict[str, str], _q: dict[str, str], body: Any) -> Any:
        request = _parse(models.CreateCollection, body)
        name = p["name"]
        if name in self._collection_names():
            raise _HttpError(409, f"Wrong input: Collection `{name}` already exists!")
        if name in self._aliases():
            raise _HttpError(409, f"Wrong input: Alias `{name}` already exists!")
        created = self.client.create_collection(
            name, vectors_config=request.vectors, sparse_vectors_config=request.sparse_vectors,
            metadata=request.metadata,
        )
        ignored = request.model_dump(exclude_none=True, exclude={"vectors", "sparse_vectors", "metadata"})
        self.collection_updates.pop(name, None)
        if ignored:
            self.collection_updates[name] = ignored
        return created

    def _op_update_collection(self, p: dict[str, str], _q: dict[str, str], body: Any) -> Any:
        request = _parse(models.UpdateCollection, body)
        name = self._resolve(p["name"])
        if name not in self._collection_names():
            raise _not_found(p["name"])
        if request.vectors is not None or request.sparse_vectors is not None or request.metadata is not None:
            self.client.update_collection(name, vectors_config=request.vectors,
                                          sparse_vectors_config=request.sparse_vectors, metadata=request.metadata)
        recorded = self.collection_updates.setdefault(name, {})
        for key, value in request.model_dump(exclude_none=True, exclude={"vectors", "sparse_vectors", "metadata"}).items():
            recorded[key] = {**recorded.get(key, {}), **value} if isinstance(value, dict) else value
        return True

    def _op_create_snapshot(self, p: dict[str, str], _q: dict[str, str], _b: Any) -> Any:
        """A snapshot's description, as Qdrant answers; nothing is stored (local mode has no snapshots), so
        tests check that one was asked for and named, not that it restores."""
        name = self._resolve(p["name"])
        if name not in self._collection_names():
            raise _not_found(p["name"])
        self.snapshots_taken += 1
        stamp = time.strftime("%Y-%m-%d-%H-%M-%S", time.gmtime())
        return models.SnapshotDescription(name=f"{name}-{self.snapshots_taken}-{stamp}.snapshot",
                                          creation_time=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()), size=0)

    def _op_delete_collection(self, p: dict[str, str], _q: dict[str, str], _b: Any) -> Any:
        self.collection_updates.pop(p["name"], None)
        return self.client.delete_collection(p["name"])

    # -- aliases --

    def _op_aliases(self, p: dict[str, str], _q: dict[str, str], _b: Any) -> Any:
        if "name" in p:
            if not self.client.collection_exists(p["name"]):
                raise _not_found(p["name"])
            return self.client.get_collection_aliases(p["name"])
        return self.client.get_aliases()

    def _op_update_aliases(self, _p: dict[str, str], _q: dict[str, str], body: Any) -> Any:
        request = _parse(models.ChangeAliasesOperation, body)
        names = self._collection_names()
        for action in request.actions:  # validate all first: Qdrant applies the list or none of it
            target = getattr(getattr(action, "create_alias", None), "collection_name", None)
            if target is not None and target not in names:
                raise _not_found(target)
        return self.client.update_collection_aliases(change_aliases_operations=request.actions)

    # -- points --

    def _op_upsert(self, p: dict[str, str], q: dict[str, str], body: Any) -> Any:
        request = _parse(models.PointInsertOperations, body)
        if isinstance(request, models.PointsBatch):
            self.vectors_written += len(request.batch.ids)
            result = self.client.upsert(p["name"], points=request.batch, update_filter=request.update_filter)
        else:
            self.vectors_written += len(request.points)
            result = self.client.upsert(p["name"], points=request.points, update_filter=request.update_filter)
        return self._update_answer(result, q)

    def _op_batch_update(self, p: dict[str, str], q: dict[str, str], body: Any) -> Any:
        request = _parse(models.UpdateOperations, body)
        for operation in request.operations:
            if isinstance(operation, models.UpsertOperation):
                upsert = operation.upsert
                self.vectors_written += len(upsert.batch.ids) if isinstance(upsert, models.PointsBatch) else len(upsert.points)
        results = self.client.batch_update_points(p["name"], update_operations=request.operations)
        return [self._update_answer(result, q) for result in results]

    def _op_retrieve(self, p: dict[str, str], _q: dict[str, str], body: Any) -> Any:
        request = _parse(models.PointRequest, body)
        records = self.client.retrieve(
            p["name"], ids=request.ids,
            with_payload=True if request.with_payload is None else request.with_payload,
            with_vectors=False if request.with_vector is None else request.with_vector,
        )
        self.vectors_read += sum(1 for r in records if r.vector is not None)
        return records

    def _op_get_point(self, p: dict[str, str], _q: dict[str, str], _b: Any) -> Any:
        raw = p["point_id"]
        point_id: int | str = int(raw) if raw.isdigit() else raw
        records = self.client.retrieve(p["name"], ids=[point_id], with_payload=True, with_vectors=True)
        if not records:
            raise _HttpError(404, f"Not found: No point with id {raw} found")
        return records[0]

    def _op_scroll(self, p: dict[str, str], _q: dict[str, str], body: Any) -> Any:
        request = _parse(models.ScrollRequest, body)
        points, next_offset = self.client.scroll(
            p["name"], scroll_filter=request.filter, limit=request.limit or 10, order_by=request.order_by,
            offset=request.offset,
            with_payload=True if request.with_payload is None else request.with_payload,
            with_vectors=False if request.with_vector is None else request.with_vector,
        )
        self.vectors_read += sum(1 for r in points if r.vector is not None)
        return models.ScrollResult(points=points, next_page_offset=next_offset)

    def _op_count(self, p: dict[str, str], _q: dict[str, str], body: Any) -> Any:
        request = _parse(models.CountRequest, body)
        return self.client.count(p["name"], count_filter=request.filter,
                                 exact=True if request.exact is None else request.exact)

    def _op_query(self, p: dict[str, str], _q: dict[str, str], body: Any) -> Any:
        request = _parse(models.QueryRequest, body)
        return self.client.query_points(
            p["name"], query=request.query, using=request.using, prefetch=request.prefetch,
            query_filter=request.filter, search_params=request.params, limit=request.limit or 10,
            offset=request.offset,
            with_payload=False if request.with_payload is None else request.with_payload,
            with_vectors=False if request.with_vector is None else request.with_vector,
            score_threshold=request.score_threshold, lookup_from=request.lookup_from,
        )

    def _op_query_batch(self, p: dict[str, str], _q: dict[str, str], body: Any) -> Any:
        request = _parse(models.QueryRequestBatch, body)
        # the batch's dense query vectors, for `search_as_qdrant_does` to score against the points in one pass
        _BATCH.queries = [vector for vector in (r.query.nearest if isinstance(r.query, models.NearestQuery) else r.query
                                                for r in request.searches)
                          if isinstance(vector, list) and vector and isinstance(vector[0], float | int)]
        _BATCH.scores = {}
        try:
            return self.client.query_batch_points(p["name"], requests=request.searches)
        finally:
            _BATCH.queries, _BATCH.scores = [], {}

    def _op_delete_points(self, p: dict[str, str], q: dict[str, str], body: Any) -> Any:
        selector = _parse(models.PointsSelector, body)
        return self._update_answer(self.client.delete(p["name"], points_selector=selector), q)

    def _op_create_index(self, p: dict[str, str], q: dict[str, str], body: Any) -> Any:
        request = _parse(models.CreateFieldIndex, body)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Payload indexes have no effect in the local Qdrant")
            result = self.client.create_payload_index(p["name"], request.field_name, request.field_schema)
        return self._update_answer(result, q)

    def _op_delete_index(self, p: dict[str, str], q: dict[str, str], _b: Any) -> Any:
        return self._update_answer(self.client.delete_payload_index(p["name"], p["field_name"]), q)

    # -- helpers --

    def _collection_names(self) -> set[str]:
        return {c.name for c in self.client.get_collections().collections}

    def _aliases(self) -> dict[str, str]:
        return {a.alias_name: a.collection_name for a in self.client.get_aliases().aliases}

    def _resolve(self, name: str) -> str:
        return self._aliases().get(name, name)

    @staticmethod
    def _update_answer(result: Any, query: dict[str, str]) -> Any:
        """Local mode has applied the write already; ``wait=false`` is answered as Qdrant does."""
        if isinstance(result, models.UpdateResult) and not _flag(query, "wait", False):
            return result.model_copy(update={"status": models.UpdateStatus.ACKNOWLEDGED})
        return result


def _stored_as_float32(local: Any) -> None:
    """The dense vectors of the collections local mode loaded from its folder, in float32 as Qdrant stores them
    and as local mode keeps what it is sent. It loads them as float64, so the first upsert into a loaded 51k-point
    collection doubled an array of 800 MB (3 s), and every product with it was twice the work."""
    import numpy as np

    for collection in getattr(getattr(local, "_client", None), "collections", {}).values():
        for name, vectors in list(getattr(collection, "vectors", {}).items()):
            if vectors.dtype != np.float32:
                collection.vectors[name] = vectors.astype(np.float32)


def _not_found(name: str) -> _HttpError:
    return _HttpError(404, f"Not found: Collection `{name}` doesn't exist!")


def _translate(exc: ValueError, name: str | None) -> _HttpError:
    """Local mode raises ValueError for what Qdrant answers 404/409/400."""
    message = str(exc)
    missing = re.fullmatch(r"Collection (.+) not found", message)
    if missing:
        return _not_found(missing.group(1))
    if "already exists" in message:
        return _HttpError(409, f"Wrong input: {message}")
    return _HttpError(400, f"Bad request: {message}")


# --- HTTP --------------------------------------------------------------------------------------------


class _Server(ConnectionTrackingServer):
    def __init__(self, address: tuple[str, int], fake: FakeQdrantServer, stopping: threading.Event) -> None:
        super().__init__(address, _Handler, fake, stopping)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "qdrant-test-double"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # stdlib signature
        """Silence per-request logging; the request log is in memory."""

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def do_PUT(self) -> None:
        self._serve()

    def do_PATCH(self) -> None:
        self._serve()

    def do_DELETE(self) -> None:
        self._serve()

    # -- plumbing --

    def _send_json(self, status: int, obj: Any) -> None:
        body = json.dumps(obj).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_text(self, status: int, text: str) -> None:
        body = text.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _read_body(self) -> Any:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline(65537).split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline(65537)
            raw = b"".join(chunks)
        else:
            length = int(self.headers.get("Content-Length") or 0)
            if length > _MAX_BODY:
                self.close_connection = True
                raise _HttpError(413, "Payload too large")
            raw = self.rfile.read(length) if length > 0 else b""
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _HttpError(400, f"Format error in JSON body: {exc}") from None

    def _sleep(self, seconds: float) -> None:
        if seconds > 0 and self.server.stopping.wait(seconds):
            raise ConnectionAbortedError("server stopped during an injected delay")

    def _authorised(self) -> str | None:
        """None if the request may pass, else Qdrant's 401 text."""
        key = self.server.fake.api_key
        if key is None:
            return None
        given = self.headers.get("api-key")
        if given is None:
            auth = self.headers.get("Authorization", "")
            if auth[:7].lower() == "bearer ":
                given = auth[7:].strip()
        if given is None:
            return "Must provide an API key or an Authorization bearer token"
        if not hmac.compare_digest(given.encode("utf-8"), key.encode("utf-8")):
            return "Invalid API key or JWT"
        return None

    # -- one request --

    def _serve(self) -> None:
        started = time.perf_counter()
        split = urllib.parse.urlsplit(self.path)
        path = split.path.rstrip("/") or "/"
        query = dict(urllib.parse.parse_qsl(split.query))
        fake = self.server.fake
        if path.startswith("/__"):
            self._admin(path)
            return
        routed = _route(self.command, path)
        op, params = routed if routed else ("unknown", {})
        record = RequestRecord(method=self.command, path=path, op=op, collection=params.get("name"),
                               query=query, body=None)
        fake._log(record)
        try:
            body = self._read_body()
            record.body = _summarise(body)
            fault = fake.faults.take(self.command, path, op)
            if fault is not None:
                self._sleep(fault.delay_s)
                if fault.drop:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault.status is not None:
                    kind = "Service internal error" if fault.status >= 500 else "Bad request"
                    raise _HttpError(fault.status, f"{kind}: injected fault #{fault.id} on {op}")
                if fault.ignore:
                    record.status = 200
                    self._send_json(200, {"result": True, "status": "ok", "time": time.perf_counter() - started})
                    return
            if path not in _OPEN_PATHS and (refused := self._authorised()) is not None:
                record.status = 401
                self._send_text(401, refused)
                return
            if routed is None:
                raise _HttpError(404, f"Not found: {self.command} {path}")
            result = fake._backend_call(op, params, query, body, record)
            record.status = 200
            if op == "health":
                self._send_text(200, result)
            elif op == "version":
                self._send_json(200, result)
            else:
                self._send_json(200, {"result": _jsonable(result), "status": "ok",
                                      "time": time.perf_counter() - started})
        except _HttpError as exc:
            record.status = exc.status
            self._send_json(exc.status, {"status": {"error": exc.message}, "time": time.perf_counter() - started})
        except (ConnectionError, TimeoutError, OSError):
            self.close_connection = True  # the client left, or stop() aborted a delay: no answer
        except Exception as exc:  # answer like Qdrant's internal error, never hang
            record.status = 500
            self._send_json(500, {"status": {"error": f"Service internal error: {type(exc).__name__}: {exc}"},
                                  "time": time.perf_counter() - started})
        finally:
            if record.status:  # answered (a dropped connection keeps None)
                record.handle_s = time.perf_counter() - started

    def _admin(self, path: str) -> None:
        """Test controls: /__faults (GET list, POST add, DELETE clear), /__requests (GET, DELETE)."""
        fake = self.server.fake
        try:
            body = self._read_body()
            if path == "/__faults" and self.command == "GET":
                self._send_json(200, [asdict(r) for r in fake.faults.rules()])
            elif path == "/__faults" and self.command == "POST":
                if not isinstance(body, dict) or not isinstance(body.get("match"), str):
                    raise _HttpError(400, 'a fault needs {"match": "<operation> | METHOD /path-glob", ...}')
                allowed = {"match", "status", "delay_s", "drop", "count", "after", "ignore"}
                if unknown := set(body) - allowed:
                    raise _HttpError(400, f"unknown fault fields: {sorted(unknown)}")
                try:
                    rule = fake.faults.add(body.pop("match"), **body)
                except (TypeError, ValueError) as exc:
                    raise _HttpError(400, str(exc)) from None
                self._send_json(200, asdict(rule))
            elif path == "/__faults" and self.command == "DELETE":
                fake.faults.clear()
                self._send_json(200, True)
            elif path == "/__indexing" and self.command == "POST":
                if not isinstance(body, dict) or set(body) - {"calls", "status"} or not isinstance(body.get("calls"), int):
                    raise _HttpError(400, 'hold indexing with {"calls": N, "status": "yellow"}')
                try:
                    fake.hold_indexing(body["calls"], status=body.get("status", "yellow"))
                except ValueError as exc:
                    raise _HttpError(400, str(exc)) from None
                self._send_json(200, True)
            elif path == "/__vectors" and self.command == "GET":
                self._send_json(200, fake.vector_counts())
            elif path == "/__vectors" and self.command == "DELETE":
                fake.vector_counts(reset=True)
                self._send_json(200, True)
            elif path == "/__requests" and self.command == "GET":
                self._send_json(200, [asdict(r) for r in fake.requests()])
            elif path == "/__requests" and self.command == "DELETE":
                fake.clear_requests()
                self._send_json(200, True)
            else:
                raise _HttpError(404, f"Not found: {self.command} {path}")
        except _HttpError as exc:
            self._send_json(exc.status, {"status": {"error": exc.message}})


class FakeQdrantServer:
    """The test double, served from a daemon thread; use as a context manager or start()/stop().

    The port is bound in ``__init__`` so ``url`` is known before ``start()``; ``stop()`` closes the
    local-mode client (freeing the folder) and ``start()`` reopens both on the same port and folder.
    """

    def __init__(self, path: str | Path, *, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None) -> None:
        self.path = Path(path)
        self.api_key = api_key or None
        self.faults = FaultPlan()
        self._host = host
        self._log_lock = threading.Lock()
        self._requests: deque[RequestRecord] = deque(maxlen=_LOG_LIMIT)
        self._backend: _Backend | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._httpd: _Server | None = _Server((host, port), self, self._stopping)
        self._port: int = self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    def requests(self) -> list[RequestRecord]:
        """Every request since the last clear (admin paths excluded), oldest first."""
        with self._log_lock:
            return list(self._requests)

    def clear_requests(self) -> None:
        with self._log_lock:
            self._requests.clear()

    def hold_indexing(self, calls: int, *, status: str = "yellow") -> None:
        """The next `calls` get_collection answers report `status` and no indexed vector: a server still
        indexing (yellow) or stuck (grey, red). 0 releases it."""
        backend = self._backend
        if backend is None:
            raise RuntimeError("the server is not started")
        if calls < 0:
            raise ValueError(f"calls={calls} must be at least 0")
        with backend.lock:
            backend.indexing_status = models.CollectionStatus(status)
            backend.indexing_held = calls

    def start(self) -> FakeQdrantServer:
        if self._thread is not None:
            return self
        if self._httpd is None:
            self._stopping = threading.Event()
            self._httpd = _Server((self._host, self._port), self, self._stopping)
        self._backend = _Backend(self.path)
        httpd = self._httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"fake-qdrant-{self._port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        httpd, thread, backend = self._httpd, self._thread, self._backend
        self._httpd, self._thread, self._backend = None, None, None
        if httpd is None:
            return
        self._stopping.set()
        if thread is not None:
            httpd.shutdown()
            thread.join(timeout=5)
        httpd.server_close()
        httpd.drop_connections()
        if backend is not None:
            backend.close()

    def __enter__(self) -> FakeQdrantServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"FakeQdrantServer({self.url}, path={self.path})"

    def vector_counts(self, *, reset: bool = False) -> dict[str, int]:
        """{"written": vectors sent to the server, "read": vectors it sent back} since the start or the last
        reset (`reset=True` answers the counts and starts again)."""
        backend = self._backend
        if backend is None:
            return {"written": 0, "read": 0}
        with backend.lock:
            counts = {"written": backend.vectors_written, "read": backend.vectors_read}
            if reset:
                backend.vectors_written = backend.vectors_read = 0
        return counts

    def _log(self, record: RequestRecord) -> None:
        with self._log_lock:
            self._requests.append(record)

    def _backend_call(self, op: str, params: dict[str, str], query: dict[str, str], body: Any,
                      record: RequestRecord | None = None) -> Any:
        backend = self._backend
        if backend is None:
            raise ConnectionAbortedError("server is stopping")
        return backend.call(op, params, query, body, record)


# --- as a separate process ---------------------------------------------------------------------------


class QdrantServerProcess:
    """The server as a child process, controlled over its admin endpoints; restartable on the same port."""

    def __init__(self, path: Path, *, api_key: str | None, host: str, port: int, startup_timeout_s: float) -> None:
        self.path = Path(path)
        self.api_key = api_key
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self._stderr_path = Path(tempfile.mkstemp(prefix="qdrant-test-server-", suffix=".log")[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> QdrantServerProcess:
        """Start the child and wait until it prints its URL and answers ``GET /``."""
        if self.process is not None and self.process.poll() is None:
            return self
        command = [sys.executable, "-m", "kb_reindex.testing.qdrant_server", "--host", self.host,
                   "--port", str(self.port), "--path", str(self.path)]
        env = dict(os.environ)
        if self.api_key:
            env["KB_TEST_QDRANT_API_KEY"] = self.api_key  # not on the command line, where ps shows it
        with open(self._stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, env=env)
        deadline = time.monotonic() + self.startup_timeout_s
        assert self.process.stdout is not None
        line = b""
        while time.monotonic() < deadline and not line.endswith(b"\n"):
            if self.process.poll() is not None:
                break
            ready, _, _ = select.select([self.process.stdout], [], [], 0.1)
            if ready:
                chunk = os.read(self.process.stdout.fileno(), 4096)
                if not chunk:
                    break
                line += chunk
        match = re.search(rb"http://[^\s]+:(\d+)", line)
        if match is None:
            self.kill()
            raise RuntimeError(f"qdrant test server did not start: {self.stderr()[-2000:]}")
        self.port = int(match.group(1))
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/", timeout=1) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"qdrant test server at {self.url} did not answer: {self.stderr()[-2000:]}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM: the server closes the local-mode client and exits."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close_pipes()
        self._stderr_path.unlink(missing_ok=True)  # start() writes it again

    def kill(self) -> None:
        """SIGKILL, as a crash: no cleanup in the server."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._close_pipes()

    def restart(self) -> QdrantServerProcess:
        """Stop if running, then start on the same port and folder."""
        self.stop()
        return self.start()

    def stderr(self) -> str:
        return self._stderr_path.read_text(encoding="utf-8", errors="replace")

    def _close_pipes(self) -> None:
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()

    # -- admin endpoints --

    def _admin(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode("utf-8") if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{method} {path}: {exc.code} {exc.read().decode('utf-8', 'replace')}") from None

    def add_fault(self, match: str, *, status: int | None = None, delay_s: float = 0.0, drop: bool = False,
                  count: int | None = 1, after: int = 0, ignore: bool = False) -> dict[str, Any]:
        return self._admin("POST", "/__faults", {"match": match, "status": status, "delay_s": delay_s,
                                                 "drop": drop, "count": count, "after": after, "ignore": ignore})

    def faults(self) -> list[dict[str, Any]]:
        return self._admin("GET", "/__faults")

    def clear_faults(self) -> None:
        self._admin("DELETE", "/__faults")

    def requests(self) -> list[dict[str, Any]]:
        return self._admin("GET", "/__requests")

    def hold_indexing(self, calls: int, *, status: str = "yellow") -> None:
        self._admin("POST", "/__indexing", {"calls": calls, "status": status})

    def clear_requests(self) -> None:
        self._admin("DELETE", "/__requests")

    def vector_counts(self, *, reset: bool = False) -> dict[str, int]:
        counts: dict[str, int] = self._admin("GET", "/__vectors")
        if reset:
            self._admin("DELETE", "/__vectors")
        return counts

    def __enter__(self) -> QdrantServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_process(path: str | Path, *, api_key: str | None = None, host: str = "127.0.0.1", port: int = 0,
                  startup_timeout_s: float = 30.0) -> QdrantServerProcess:
    """Start ``python -m kb_reindex.testing.qdrant_server`` and return once it answers."""
    return QdrantServerProcess(Path(path), api_key=api_key, host=host, port=port,
                               startup_timeout_s=startup_timeout_s).start()


#: the dense query vectors of the batch request being served (`_op_query_batch`), and their scores against a
#: collection's points, computed once per (points array, shape) by `search_as_qdrant_does`
_BATCH = threading.local()


def search_as_qdrant_does() -> None:
    """Cosine search as Qdrant does it: stored vectors are unit vectors (normalized on upsert, by Qdrant and by
    local mode alike), so a query is one product with the normalized query. Local mode divides every stored
    vector by its norm again on each query (0.4 s a query at 50k points x 1024-d here, 80% of it those norms), a
    cost no Qdrant server has; this process's search skips it. Ranks are those of local mode (the same unit
    vectors, the same product). Set in the server's own process (`main`), not in a process that imports it.

    A batch request (`query_batch`: the golden probes, the duplicate screen) is scored in one matrix product
    over the points, not one pass over every point per query: local mode searches exhaustively, so a batch of
    20 probes read a 50k x 1024 array 20 times (0.8 s idle, 4 s under load: most of what a 50k edit's
    validation waited for), where a Qdrant server walks its HNSW graph, per query a cost that hardly grows with
    the collection. The scores are the same products (up to the last bits of a float: a matrix product sums in
    another order); masks, limits and payloads stay local mode's.

    Products are taken in float32, the stored vectors' type, as Qdrant's are. The query arrives as float64 (JSON
    floats), and a float32 matrix times a float64 query makes numpy convert every stored vector first: 0.34 s a
    query at 51k x 1024-d against 0.015 s in float32 (measured 2026-12-04), which was most of a 50k edit's
    validation (two batches, 1.0 s at the server) until then."""
    import numpy as np
    from qdrant_client.local import distances, local_collection

    original = distances.calculate_distance

    def batched(query: Any, vectors: Any) -> Any | None:
        pending = getattr(_BATCH, "queries", None)
        if not pending or len(vectors.shape) != 2:
            return None
        key = (vectors.__array_interface__["data"][0], vectors.shape)
        scores = _BATCH.scores.get(key)
        if scores is None:
            rows = [np.array(q) for q in pending if len(q) == vectors.shape[1]]
            if not rows:
                return None
            product = calculate_distance(np.stack(rows), vectors, models.Distance.COSINE)  # the 2-d query's product
            scores = _BATCH.scores[key] = {row.tobytes(): product[n] for n, row in enumerate(rows)}
        return scores.get(query.tobytes())

    def calculate_distance(query: Any, vectors: Any, distance_type: models.Distance) -> Any:
        if distance_type != models.Distance.COSINE:
            return original(query, vectors, distance_type)
        if np.isnan(query).any():
            raise ValueError("Query vector must not contain NaN")
        if len(query.shape) == 1 and (scores := batched(query, vectors)) is not None:
            return _best_first(scores)
        query = query.astype(vectors.dtype, copy=False)  # as stored: a float64 query made numpy copy every point
        if len(query.shape) == 1:
            norm = np.linalg.norm(query)
            return _best_first(np.dot(vectors, query / (norm if norm != 0.0 else distances.EPSILON)))
        norms = np.linalg.norm(query, axis=-1)[:, np.newaxis]
        return np.dot(query / np.where(norms != 0.0, norms, distances.EPSILON), vectors.T)

    local_collection.calculate_distance = calculate_distance


#: below this many points a full sort costs nothing worth saving
_FULL_SORT_BELOW = 4096
#: the best points sorted first; more are sorted only when a filter or threshold passes over all of them
_FIRST_BEST = 256


def _best_first(scores: Any) -> Any:
    """One query's scores, whose ``argsort`` (local mode's ``np.argsort(scores)[::-1]``, then a walk until the
    limit is filled) sorts the best points alone (`_BestFirst`). Local mode sorts every point's score for each
    query, 0.3 s of 20 probes at 200k points (measured 2026-12-07), a cost that grows with the collection where a
    Qdrant server's HNSW walk hardly does; which points are answered, and in what order, is unchanged."""
    import numpy as np

    if getattr(scores, "ndim", 0) != 1 or len(scores) < _FULL_SORT_BELOW:
        return scores
    return np.asarray(scores).view(_scores_class())


@functools.cache
def _scores_class() -> type:
    """An ndarray whose plain ``argsort()`` (as local mode's ``np.argsort(scores)`` calls it) is `_BestFirst`;
    made once, on first use, as numpy is imported late in this module."""
    import numpy as np

    class Scores(np.ndarray):
        def argsort(self, *args: Any, **kwargs: Any) -> Any:  # np.argsort passes axis=-1, kind/order/stable None
            plain = np.asarray(self)
            if args or kwargs.get("axis", -1) != -1 or any(value is not None for name, value in kwargs.items()
                                                          if name != "axis"):
                return plain.argsort(*args, **kwargs)
            return _BestFirst(plain)

    return Scores


class _BestFirst:
    """The ascending order of a score vector, computed lazily: reversed (``[::-1]``) it yields the best
    `_FIRST_BEST` points sorted (one ``argpartition``), and only if the walk goes past them the rest, from one full
    sort (points already yielded skipped, so equal scores at the partition's edge are neither lost nor repeated).
    Any other use (iteration, a slice, an index) is the full ``argsort``."""

    def __init__(self, scores: Any) -> None:
        self._scores = scores
        self._full: Any = None

    def _sorted(self) -> Any:
        if self._full is None:
            self._full = self._scores.argsort()
        return self._full

    def __len__(self) -> int:
        return len(self._scores)

    def __iter__(self) -> Any:
        return iter(self._sorted())

    def __getitem__(self, key: Any) -> Any:
        if key == slice(None, None, -1):
            return self._descending()
        return self._sorted()[key]

    def _descending(self) -> Any:
        import numpy as np

        scores, n = self._scores, len(self._scores)
        if n <= _FIRST_BEST:
            yield from self._sorted()[::-1]
            return
        best = np.argpartition(scores, n - _FIRST_BEST)[n - _FIRST_BEST:]
        best = best[np.argsort(scores[best])[::-1]]
        yield from best
        given = set(best.tolist())
        yield from (index for index in self._sorted()[::-1] if index not in given)


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM or Ctrl-C; the first stdout line names the URL (tests read the port from it)."""
    parser = argparse.ArgumentParser(
        prog="python -m kb_reindex.testing.qdrant_server",
        description="Qdrant REST test double over one local-mode client (loopback only by default).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=6333, help="port, 0 = any free port (default: 6333)")
    parser.add_argument("--path", required=True, help="local-mode folder holding the data (:memory:: none, in memory)")
    parser.add_argument("--api-key", default=None,
                        help="require this API key (default: $KB_TEST_QDRANT_API_KEY, else none)")
    args = parser.parse_args(argv)
    api_key = args.api_key or os.environ.get("KB_TEST_QDRANT_API_KEY") or None

    search_as_qdrant_does()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = FakeQdrantServer(args.path, host=args.host, port=args.port, api_key=api_key)
    with server:
        print(f"qdrant test double at {server.url} (data in {server.path})", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
