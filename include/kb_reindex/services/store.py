"""Qdrant access: collections, points, and the alias that readers follow.

Local mode (`QdrantClient(path=...)`) by default, a Qdrant server in production; the same API either way.
In Airflow the `qdrant_default` Connection sets the same settings (kb_reindex.airflow.connections).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NotRequired, TypedDict, cast

from kb_reindex.services.qdrant import QdrantClient, models

from kb_reindex.services.collection_config import CollectionConfig
from kb_reindex.services.config import Settings
from kb_reindex.domain.errors import (
    AliasMovedError,
    AliasReadBackError,
    ConfigError,
    KbError,
    StoreError,
    StoreUnreachable,
    classify,
    connect_failure,
    refused_credentials,
)
from kb_reindex.services.embedding import redact_url
from kb_reindex.domain.waiting import Look, Sleeping, Waiter

log = logging.getLogger(__name__)

DISTANCE = models.Distance.COSINE


class CollectionMetadata(TypedDict):
    """What kb-reindex writes on a version's collection when creating it (Qdrant's collection metadata, a
    JSON object): enough to rebuild the version's record from Qdrant alone. Read back, a collection's
    metadata is whatever Qdrant holds (`models.Payload`): collections made before it was written have none."""

    kb_alias: str
    kb_version: int
    kind: str
    embedder: str
    embed_model: str
    embed_dim: int
    chunking_version: str
    corpus_fingerprint: str
    payload_layout: str
    embed_profile: str
    embed_recipe: str
    distance: str
    created_at: str  # ISO, UTC, `Z`
    collection_config: NotRequired[dict[str, Any]]  # CollectionConfig.to_dict(): the settings it was made with


@dataclass(frozen=True)
class CollectionShape:
    dim: int
    distance: str
    points: int


def make_client(settings: Settings, *, wait_s: float = 10.0, create: bool = True) -> QdrantClient:
    """The one place a client is built: the CLI's settings come from the environment, an Airflow task's
    from the `qdrant_default` Connection (kb_reindex.airflow.connections.qdrant_overrides) or the same environment.

    `create=False` (read-only commands) never makes a local store: a wrong KB_QDRANT_PATH is named, not
    answered from a fresh empty folder."""
    if settings.qdrant_remote:
        return QdrantClient(
            url=settings.qdrant_url, host=None if settings.qdrant_url else settings.qdrant_host,
            port=settings.qdrant_port, api_key=settings.qdrant_api_key, https=settings.qdrant_https,
            prefix=settings.qdrant_prefix, prefer_grpc=settings.qdrant_prefer_grpc,
            grpc_port=settings.qdrant_grpc_port, timeout=settings.qdrant_timeout_s,
        )
    assert settings.qdrant_path is not None
    if not create and not (settings.qdrant_path / "meta.json").is_file():
        raise ConfigError(
            f"no Qdrant store at {settings.qdrant_path} (KB_QDRANT_PATH): nothing has been built with this "
            "configuration yet, or the path is wrong; `kb-reindex run` creates it"
        )
    settings.qdrant_path.mkdir(parents=True, exist_ok=True)
    # Local mode admits one client per folder; another step's client is usually about to close.
    deadline = time.monotonic() + wait_s
    while True:
        before = folder_fingerprint(settings.qdrant_path)
        try:
            client = QdrantClient(path=str(settings.qdrant_path))
        except RuntimeError as exc:
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"local Qdrant store {settings.qdrant_path} is in use by another process ({exc}); local mode "
                    "allows one client at a time: wait for it, or use a Qdrant server (KB_QDRANT_URL)"
                ) from None
            time.sleep(0.1)
            continue
        # The client reads the folder (aliases, collections, points) before it takes the folder's lock: a
        # process that wrote and closed in between leaves this one a stale copy, whose alias map status would
        # report as drift, and whose next write would put that stale map back. Under the lock nothing
        # changes any more, so a folder unchanged since before the read was read whole.
        if folder_fingerprint(settings.qdrant_path) == before:
            return client
        client.close()
        if time.monotonic() >= deadline:
            raise StoreError(f"local Qdrant store {settings.qdrant_path} kept changing while it was opened: another "
                             "process writes it without kb-reindex's lock; stop it, or use a Qdrant server")


def has_store(settings: Settings) -> bool:
    """A store to open without creating one: a server always; local mode once something made its folder."""
    return settings.qdrant_remote or (settings.qdrant_path is not None and (settings.qdrant_path / "meta.json").is_file())


def folder_fingerprint(path: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file of a local-mode store but its lock file: what changes with any write."""
    found: dict[str, tuple[int, int]] = {}
    for file in path.rglob("*"):
        if file.name == ".lock":
            continue
        try:
            stat = file.stat()
        except FileNotFoundError:  # a temporary file replaced meanwhile: the next fingerprint differs anyway
            continue
        if not file.is_dir():
            found[str(file.relative_to(path))] = (stat.st_size, stat.st_mtime_ns)
    return found


INDEX_POLL_S = 0.5
PAYLOAD_INDEXES = ("knowledge_key", "tenant", "category")  # keyword: the reader filters on them


class _OneCallAtATime:
    """A local-mode client whose calls run one at a time.

    Local mode keeps collections in Python dicts and is not safe across threads: a search beside an upsert
    fails with "dictionary changed size during iteration". A server orders concurrent requests itself; here
    every method call takes one lock (re-entrant, so a call that calls another does not wait on itself)."""

    def __init__(self, client: QdrantClient) -> None:
        self._client = client
        self._lock = threading.RLock()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute
        lock = self._lock

        def one_at_a_time(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return attribute(*args, **kwargs)

        return one_at_a_time


class KnowledgeStore:
    """Thin, explicit operations over one client; every failure says which collection or alias.

    `local`: local mode (no server), detected from the client unless given; a proxy that hides its client
    (the benchmark's sidecar) says so explicitly. A local-mode client is used one call at a time, so threads
    that share the store (readers during a run, the page's requests) never see it mid-change."""

    def __init__(self, client: QdrantClient, *, local: bool | None = None) -> None:
        from qdrant_client.local.qdrant_local import QdrantLocal

        in_process = isinstance(getattr(client, "_client", None), QdrantLocal)
        self.client = cast(QdrantClient, _OneCallAtATime(client)) if in_process else client
        self.is_local = in_process if local is None else local

    # --- collections ---------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        """A real collection of that name; `collection_exists` would also say yes for an alias."""
        return name in self.collection_names()

    def collection_names(self) -> set[str]:
        return {c.name for c in self.client.get_collections().collections}

    def shape(self, name: str) -> CollectionShape:
        info = self.client.get_collection(name)
        params = _single_vector_params(name, info.config.params.vectors)
        return CollectionShape(
            dim=params.size,
            distance=str(params.distance.value if hasattr(params.distance, "value") else params.distance),
            points=self.count(name),
        )

    def dimension(self, name: str) -> int:
        """The collection's vector size, without counting its points."""
        return _single_vector_params(name, self.client.get_collection(name).config.params.vectors).size

    def collection_metadata(self, name: str) -> models.Payload:
        """What kb-reindex wrote on the collection at creation (model, embedder, chunking, version)."""
        return dict(self.client.get_collection(name).config.metadata or {})

    def iter_payloads(self, name: str, *, fields: list[str], page: int = 4096) -> Iterator[tuple[str, models.Payload]]:
        offset: Any = None
        while True:
            records, offset = self.client.scroll(name, limit=page, offset=offset, with_vectors=False,
                                                 with_payload=models.PayloadSelectorInclude(include=fields))
            for record in records:
                yield str(record.id), record.payload or {}
            if offset is None:
                return

    def annotate(self, name: str, notes: dict[str, Any]) -> None:
        """Merge `notes` into the collection's metadata: what a version went through (validated, served), so a
        state DB rebuilt from Qdrant knows which versions are whole and which a rollback may return to."""
        self.client.update_collection(name, metadata=notes)

    def collection_info(self, name: str) -> models.CollectionInfo:
        return self.client.get_collection(name)

    def create_collection(self, name: str, *, dim: int, metadata: CollectionMetadata | None = None,
                          config: CollectionConfig | None = None) -> None:
        """Create, or accept an existing one only if it has exactly the shape we need.

        `metadata` describes the version, so the state DB can be rebuilt from Qdrant alone; `config` holds
        its settings (kb_reindex.services.collection_config). On a server the HNSW graph is deferred (`m=0`) for the
        bulk load; `restore_indexing` turns it on. Local mode ignores all of it: it builds no index."""
        if self.exists(name):
            shape = self.shape(name)
            if shape.dim != dim or shape.distance != DISTANCE.value:
                raise StoreError(
                    f"collection {name} already exists with dimension {shape.dim} and distance {shape.distance}; "
                    f"this version needs {dim} and {DISTANCE.value}. Refusing to reuse it"
                )
            return
        if self.alias_target(name) is not None:
            raise StoreError(f"{name} is already an alias name; a collection cannot take it")
        arguments = (config or CollectionConfig()).create_arguments(dim=dim, distance=DISTANCE,
                                                                    defer_indexing=not self.is_local)
        self.client.create_collection(name, metadata=None if metadata is None else dict(metadata), **arguments)
        # payload indexes before the points, as Qdrant advises: each point is indexed as it arrives
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Payload indexes have no effect in the local Qdrant")
            for field_name in PAYLOAD_INDEXES:
                self.client.create_payload_index(name, field_name, models.PayloadSchemaType.KEYWORD)

    def restore_indexing(self, name: str, *, m: int) -> bool:
        """Give a bulk-loaded collection its HNSW graph degree back; True if a PATCH was needed. Idempotent,
        so a resumed build or a second validation restores it too."""
        current = self.collection_info(name).config.hnsw_config
        if current is not None and current.m == m:
            return False
        self.client.update_collection(name, hnsw_config=models.HnswConfigDiff(m=m))
        log.info("kb_reindex: %s: HNSW m=%d restored after the bulk load; Qdrant builds the index now", name, m)
        return True

    def wait_until_indexed(self, name: str, *, wait_s: float, m: int | None,
                           waiter: Waiter | None = None) -> None:
        """Until Qdrant reports the collection green with its optimizers ok and, where it builds an index
        at all, the index covering every point; a StoreError naming the collection and the wait otherwise.
        `waiter`: how the time between looks passes (sleeping here by default; a DAG task's gives its slot back)."""
        def look() -> Look:
            ready, state = index_state(self.collection_info(name), m=m)
            return Look(ready, state)

        last = (waiter or Sleeping()).until(look, budget_s=wait_s, poll_s=INDEX_POLL_S,
                                            what=f"Qdrant to index {name}")
        if not last.ready:
            raise StoreError(
                f"collection {name} is not ready for queries after {wait_s:g} s (KB_INDEX_WAIT_S): {last.state}; "
                "it stays unvalidated and the alias was not moved: run again to keep waiting, or raise "
                "KB_INDEX_WAIT_S"
            )

    def snapshot(self, name: str) -> str:
        """A server-side snapshot of the collection (Qdrant's snapshots folder); its name."""
        description = self.client.create_snapshot(name, wait=True)
        if description is None or not description.name:
            raise StoreError(f"Qdrant created no snapshot of {name}; it is not dropped")
        return description.name

    def delete_collection(self, name: str) -> bool:
        if not self.exists(name):
            return False
        self.client.delete_collection(name)
        return True

    def count(self, name: str) -> int:
        return self.client.count(name, exact=True).count

    # --- points --------------------------------------------------------------------------------

    def iter_ids(self, name: str, *, page: int = 1024) -> Iterator[str]:
        offset: Any = None
        while True:
            records, offset = self.client.scroll(
                name, limit=page, offset=offset, with_payload=False, with_vectors=False
            )
            for record in records:
                yield str(record.id)
            if offset is None:
                return

    def existing_ids(self, name: str) -> set[str]:
        return set(self.iter_ids(name))

    def id_differences(self, name: str, expected: Sequence[str], *, points: int, batch: int = 1024) -> tuple[set[str], set[str]]:
        """IDs of `expected` the collection lacks, and IDs it holds beyond them; `points` is its count.

        Looked up by ID in batches: with as many points as IDs found, nothing is extra. Only then is the
        whole collection listed, to name what is extra (local mode's scroll re-sorts every ID for each
        page, so it stays off the path every healthy version takes)."""
        found: set[str] = set()
        for start in range(0, len(expected), batch):
            found.update(str(r.id) for r in self.retrieve(name, expected[start:start + batch], payload=False))
        missing = set(expected) - found
        if points == len(found):
            return missing, set()
        return missing, self.existing_ids(name) - set(expected)

    def retrieve(self, name: str, ids: Sequence[str], *, vectors: bool = False,
                 payload: bool | list[str] = True) -> list[models.Record]:
        return self.client.retrieve(name, ids=list(ids), with_vectors=vectors, with_payload=payload)

    def upsert(self, name: str, points: list[models.PointStruct]) -> None:
        if points:
            self.client.upsert(name, points=points, wait=True)

    def delete_points(self, name: str, ids: Sequence[str]) -> None:
        """Delete these points (absent ones are no error: a rerun deletes again)."""
        if ids:
            self.client.delete(name, points_selector=models.PointIdsList(points=list(ids)), wait=True)

    def overwrite_payloads(self, name: str, payloads: dict[str, models.Payload]) -> None:
        """Replace the payload of each point, vectors untouched, in one request (a document whose title or
        content hash changed keeps the vectors of its unchanged chunks)."""
        if payloads:
            self.client.batch_update_points(name, wait=True, update_operations=[
                models.OverwritePayloadOperation(overwrite_payload=models.SetPayload(payload=payload,
                                                                                           points=[point_id]))
                for point_id, payload in payloads.items()])

    def search(
        self, name: str, vector: Sequence[float], *, k: int, tenant: str | None = None
    ) -> list[models.ScoredPoint]:
        return self.client.query_points(
            name, query=list(vector), limit=k, with_payload=True, query_filter=_tenant_filter(tenant)
        ).points

    def search_many(self, name: str, queries: Sequence[tuple[Sequence[float], str | None]], *, k: int
                    ) -> list[list[models.ScoredPoint]]:
        """`search` for each (vector, tenant), in one batch request: one round trip for a golden set."""
        if not queries:
            return []
        requests = [models.QueryRequest(query=list(vector), limit=k, with_payload=True, filter=_tenant_filter(tenant))
                    for vector, tenant in queries]
        return [answer.points for answer in self.client.query_batch_points(name, requests=requests)]

    def nearest(self, name: str, vectors: Sequence[Sequence[float]], *, limit: int,
                score_threshold: float) -> list[list[models.ScoredPoint]]:
        """For each vector, its `limit` nearest points scoring at least `score_threshold` (the cosine, for this
        engine's collections), with their knowledge_key and chunk_index, in one batch request. Unfiltered (the
        caller drops what it does not want): in local mode a `must_not` filter made the searches 1.6 times slower
        (2,000 of 10k points: 562 s against 344 s at load 6; local mode recomputes every point's norm per query)."""
        if not vectors:
            return []
        requests = [models.QueryRequest(query=list(vector), limit=limit, score_threshold=score_threshold,
                                        with_payload=["knowledge_key", "chunk_index"]) for vector in vectors]
        return [answer.points for answer in self.client.query_batch_points(name, requests=requests)]

    # --- alias ---------------------------------------------------------------------------------

    def alias_target(self, alias: str) -> str | None:
        for description in self.client.get_aliases().aliases:
            if description.alias_name == alias:
                return description.collection_name
        return None

    def swap_alias(self, alias: str, *, to: str, expected_from: str | None) -> None:
        """Compare-and-swap, then one atomic request: delete + create in a single alias update."""
        current = self.alias_target(alias)
        if current != expected_from:
            raise AliasMovedError(
                f"alias moved by another run: {alias} points to {current or 'nothing'}, "
                f"but this run planned against {expected_from or 'nothing'}; nothing was switched"
            )
        if self.exists(alias):
            raise StoreError(f"{alias} is the name of a collection, so it cannot be used as the alias; rename one")
        if not self.exists(to):
            raise StoreError(f"collection {to} does not exist; cannot point {alias} at it")
        operations: list[Any] = []
        if current is not None:
            operations.append(models.DeleteAliasOperation(delete_alias=models.DeleteAlias(alias_name=alias)))
        operations.append(
            models.CreateAliasOperation(create_alias=models.CreateAlias(collection_name=to, alias_name=alias))
        )
        self.client.update_collection_aliases(change_aliases_operations=operations)
        self.check_alias(alias, to=to, was=current)
        log.info("kb_reindex: alias %s -> %s (was %s)", alias, to, current or "nothing")

    def delete_alias(self, alias: str) -> str | None:
        """Remove the alias (readers then find nothing under that name); the collection it pointed to, None
        when there was no such alias."""
        current = self.alias_target(alias)
        if current is None:
            return None
        self.client.update_collection_aliases(change_aliases_operations=[
            models.DeleteAliasOperation(delete_alias=models.DeleteAlias(alias_name=alias))])
        log.info("kb_reindex: alias %s deleted (was %s)", alias, current)
        return current

    def check_alias(self, alias: str, *, to: str, was: str | None, reads: int = 3, pause_s: float = 0.2) -> None:
        """Read the alias back after a move: an answer of success is not proof that readers follow the new
        collection (a proxy that swallowed the request, a cluster that did not commit it). A few reads a moment
        apart allow a change still being applied; then the mismatch is raised, before the state DB records it."""
        seen = None
        for attempt in range(reads):
            seen = self.alias_target(alias)
            if seen == to:
                return
            if attempt < reads - 1:
                time.sleep(pause_s * (attempt + 1))
        raise AliasReadBackError(
            f"alias {alias} was moved to {to} (Qdrant answered success) but reads back as {seen or 'nothing'} "
            f"(was {was or 'nothing'}): the move did not take. The state DB was not changed; readers follow "
            f"{seen or 'nothing'}. Check Qdrant, then `kb-reindex status`; `kb-reindex reconcile` records it "
            "if the move shows up later"
        )

    def close(self) -> None:
        self.client.close()


def index_state(info: models.CollectionInfo, *, m: int | None) -> tuple[bool, str]:
    """(ready for validation's queries, a one-line account of why not).

    Qdrant builds a segment's HNSW index only once its vectors pass `indexing_threshold` (KB); a small
    collection stays on full scan, green and complete without any indexed vector. Full coverage is waited
    for only when the segments are, on average, past that size, so the wait never expects an index Qdrant
    will not build (vectors counted as float32)."""
    points = info.points_count or 0
    indexed = info.indexed_vectors_count or 0
    optimizer = info.optimizer_status
    optimizer_ok = optimizer == models.OptimizersStatusOneOf.OK
    green = info.status == models.CollectionStatus.GREEN
    threshold_kb = info.config.optimizer_config.indexing_threshold if info.config.optimizer_config else None
    vectors = info.config.params.vectors
    dim = vectors.size if isinstance(vectors, models.VectorParams) else 0
    per_segment_kb = points * dim * 4 / 1024 / max(info.segments_count or 1, 1)
    index_expected = bool(m) and bool(threshold_kb) and per_segment_kb >= float(threshold_kb or 0)
    covered = indexed >= points
    optimizer_text = "ok" if optimizer_ok else getattr(optimizer, "error", str(optimizer))
    state = (f"status {getattr(info.status, 'value', info.status)}, optimizer {optimizer_text}, {indexed} of {points} "
             f"vectors indexed" + ("" if index_expected else " (below the indexing threshold: none expected)"))
    return green and optimizer_ok and (covered or not index_expected), state


# The remote client checks the server version in a background thread and warns when it cannot; open_store
# probes the server itself right after and reports that in one line, so that warning is only noise. Its
# warning about a key sent over plain http becomes one log line instead of a multi-line warning.
_VERSION_CHECK_WARNING = "Failed to obtain server version"
_INSECURE_KEY_WARNING = "Api key is used with an insecure connection"


@contextmanager
def open_store(settings: Settings, *, client: QdrantClient | None = None, create: bool = True) -> Iterator[KnowledgeStore]:
    """A store for one step. A client we opened is closed after, which frees local mode's folder lock.

    A server that refuses the connection or the API key is a configuration error (the CLI exits 2); one that
    answers too slowly or fails otherwise is a StoreError. Messages name the URL, never the key."""
    own = client is None
    if own:
        warnings.filterwarnings("ignore", message=_VERSION_CHECK_WARNING, category=UserWarning)
        plain_url = settings.qdrant_url is not None and settings.qdrant_url.lower().startswith("http://")
        plain_host = bool(settings.qdrant_host) and not settings.qdrant_url and settings.qdrant_https is False
        if settings.qdrant_api_key and (plain_url or plain_host):
            warnings.filterwarnings("ignore", message=_INSECURE_KEY_WARNING, category=UserWarning)
            log.warning("kb_reindex: the Qdrant API key is sent unencrypted to %s (plain http)",
                        _where(settings, None))
        client = make_client(settings, create=create)
    assert client is not None
    store = KnowledgeStore(client)
    if settings.snapshot_before_drop and store.is_local:
        if own:
            store.close()
        raise ConfigError("KB_SNAPSHOT_BEFORE_DROP needs a Qdrant server (KB_QDRANT_URL); local mode has no snapshots")
    try:
        store.client.get_collections()
    except Exception as exc:
        if own:
            store.close()
        raise _open_error(exc, settings, client) from None
    try:
        yield store
    finally:
        if own:
            store.close()


def _where(settings: Settings, client: QdrantClient | None) -> str:
    """The server for messages: the URL without credentials, host:port, or the local-mode folder."""
    url = settings.qdrant_url or (client.init_options.get("url") if client is not None else None)
    if url:
        return redact_url(url)
    if settings.qdrant_host:
        return f"{settings.qdrant_host}:{settings.qdrant_port}"
    return str(settings.qdrant_path)


def _open_error(exc: Exception, settings: Settings, client: QdrantClient) -> KbError:
    """A store that cannot be used, as errors.classify sees the failure: a refused or missing API key is a
    ConfigError, a server the request never reached StoreUnreachable, anything else a StoreError; one line each,
    naming the server, never the key."""
    failure = classify(exc, qdrant=lambda e: describe_qdrant_failure(e, settings, client))
    said = failure.message if failure.expected else f"Qdrant at {_where(settings, client)} failed: {failure.message}"
    message = f"{said}; the live alias was not touched"
    if failure.kind == "config":
        return ConfigError(message)
    return StoreError(message) if failure.reached else StoreUnreachable(message)


def describe_qdrant_failure(exc: BaseException, settings: Settings, client: QdrantClient | None = None) -> str | None:
    """One line naming the server for a failure of the remote client's HTTP call, or None for anything else.

    The client's own messages are several lines of raw response, or just the transport's words, without
    saying which server; a failed run records this instead."""
    import httpx
    from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

    where = _where(settings, client)
    if isinstance(exc, UnexpectedResponse) and refused_credentials(exc):
        if settings.qdrant_api_key or (client is not None and client.init_options.get("api_key")):
            return f"Qdrant at {where} refused the API key (HTTP {exc.status_code}): check KB_QDRANT_API_KEY"
        return f"Qdrant at {where} requires an API key (HTTP {exc.status_code}): set KB_QDRANT_API_KEY"
    if isinstance(exc, UnexpectedResponse):
        try:
            detail = str(exc.structured()["status"]["error"])
        except Exception:  # not Qdrant's error envelope: show the start of the raw answer
            detail = exc.content[:200].decode("utf-8", "replace")
        detail = " ".join(detail.split())
        return f"Qdrant at {where} answered HTTP {exc.status_code} {exc.reason_phrase}" + (f": {detail}" if detail else "")
    cause = exc.source if isinstance(exc, ResponseHandlingException) else exc
    if isinstance(cause, httpx.TimeoutException):
        return (f"Qdrant at {where} is unreachable: no answer in time ({type(cause).__name__}); check that the "
                "server runs and is not overloaded (KB_QDRANT_TIMEOUT)")
    if isinstance(cause, httpx.TransportError):
        what = connect_failure(cause) or f"{type(cause).__name__}: {' '.join(str(cause).split()) or 'no details'}"
        return f"Qdrant at {where} is unreachable ({what}); check KB_QDRANT_URL and that the server runs"
    if isinstance(exc, ResponseHandlingException):
        return f"Qdrant at {where} sent an answer the client could not read: {type(cause).__name__}: {cause}"
    return None


def _single_vector_params(name: str, params: models.VectorParams | dict[str, models.VectorParams] | None,
                          ) -> models.VectorParams:
    """The one unnamed vector's parameters: named vectors, or none, are not a collection kb-reindex wrote."""
    if isinstance(params, dict):
        raise StoreError(f"collection {name} uses named vectors; kb-reindex writes one unnamed vector")
    if params is None:
        raise StoreError(f"collection {name} has no vector parameters; kb-reindex writes one unnamed vector")
    return params


def _tenant_filter(tenant: str | None) -> models.Filter | None:
    """Exactly as the reader filters: the tenant's points only (None: all)."""
    if tenant is None:
        return None
    return models.Filter(must=[models.FieldCondition(key="tenant", match=models.MatchValue(value=tenant))])
