"""Qdrant access: collections, points, and the alias that readers follow.

Local mode (`QdrantClient(path=...)`) by default, a Qdrant server in production; the same API either way.
In Airflow the client comes from the `qdrant_default` Connection through the provider's QdrantHook.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from qdrant_client import QdrantClient, models

from kb_reindex.config import Settings
from kb_reindex.errors import AliasMovedError, ConfigError, StoreError
from kb_reindex.embedding import redact_url

log = logging.getLogger(__name__)

DISTANCE = models.Distance.COSINE


@dataclass(frozen=True)
class CollectionShape:
    dim: int
    distance: str
    points: int


def make_client(settings: Settings, *, wait_s: float = 10.0, create: bool = True) -> QdrantClient:
    """`create=False` (read-only commands) never makes a local store: a wrong KB_QDRANT_PATH is named, not
    answered from a fresh empty folder."""
    if settings.qdrant_url:
        return QdrantClient(url=settings.qdrant_url, api_key=settings.qdrant_api_key, timeout=60)
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
        try:
            return QdrantClient(path=str(settings.qdrant_path))
        except RuntimeError as exc:
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"local Qdrant store {settings.qdrant_path} is in use by another process ({exc}); local mode "
                    "allows one client at a time: wait for it, or use a Qdrant server (KB_QDRANT_URL)"
                ) from None
            time.sleep(0.1)


def collection_name(alias: str, model: str, version: int) -> str:
    return f"{alias}__{model_slug(model)}__v{version}"


def model_slug(model: str) -> str:
    """`bge-m3:latest` -> `bge-m3`; anything but letters, digits and '-' becomes '-'."""
    base = model.split(":")[0] if model.endswith(":latest") else model
    slug = "".join(ch if ch.isascii() and (ch.isalnum() or ch == "-") else "-" for ch in base.lower())
    return "-".join(part for part in slug.split("-") if part) or "model"


class KnowledgeStore:
    """Thin, explicit operations over one client; every failure says which collection or alias."""

    def __init__(self, client: QdrantClient) -> None:
        self.client = client

    # --- collections ---------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        """A real collection of that name; `collection_exists` would also say yes for an alias."""
        return name in self.collection_names()

    def collection_names(self) -> set[str]:
        return {c.name for c in self.client.get_collections().collections}

    def shape(self, name: str) -> CollectionShape:
        info = self.client.get_collection(name)
        params = info.config.params.vectors
        if isinstance(params, dict):
            raise StoreError(f"collection {name} uses named vectors; kb-reindex writes one unnamed vector")
        return CollectionShape(
            dim=params.size,
            distance=str(params.distance.value if hasattr(params.distance, "value") else params.distance),
            points=self.count(name),
        )

    def dimension(self, name: str) -> int:
        """The collection's vector size, without counting its points."""
        params = self.client.get_collection(name).config.params.vectors
        if isinstance(params, dict):
            raise StoreError(f"collection {name} uses named vectors; kb-reindex writes one unnamed vector")
        return params.size

    def collection_metadata(self, name: str) -> dict[str, Any]:
        """What kb-reindex wrote on the collection at creation (model, embedder, chunking, version)."""
        return dict(self.client.get_collection(name).config.metadata or {})

    def iter_payloads(self, name: str, *, fields: list[str], page: int = 4096) -> Iterator[tuple[str, dict[str, Any]]]:
        offset: Any = None
        while True:
            records, offset = self.client.scroll(name, limit=page, offset=offset, with_vectors=False,
                                                 with_payload=models.PayloadSelectorInclude(include=fields))
            for record in records:
                yield str(record.id), record.payload or {}
            if offset is None:
                return

    def mark_served(self, name: str, *, at: str) -> None:
        """Record on the collection that it served behind the alias: a rebuilt state DB knows which
        versions a rollback may return to."""
        self.client.update_collection(name, metadata={"served": True, "last_served_at": at})

    def create_collection(self, name: str, *, dim: int, metadata: dict[str, Any] | None = None) -> None:
        """Create, or accept an existing one only if it has exactly the shape we need.

        `metadata` describes the version, so the state DB can be rebuilt from Qdrant alone."""
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
        self.client.create_collection(name, vectors_config=models.VectorParams(size=dim, distance=DISTANCE),
                                      metadata=metadata)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Payload indexes have no effect in the local Qdrant")
            self.client.create_payload_index(name, "knowledge_key", models.PayloadSchemaType.KEYWORD)
            self.client.create_payload_index(name, "tenant", models.PayloadSchemaType.KEYWORD)

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

    def retrieve(self, name: str, ids: Sequence[str], *, vectors: bool = False, payload: bool = True) -> list[models.Record]:
        return self.client.retrieve(name, ids=list(ids), with_vectors=vectors, with_payload=payload)

    def upsert(self, name: str, points: list[models.PointStruct]) -> None:
        if points:
            self.client.upsert(name, points=points, wait=True)

    def search(
        self, name: str, vector: Sequence[float], *, k: int, tenant: str | None = None
    ) -> list[models.ScoredPoint]:
        query_filter = None
        if tenant is not None:
            query_filter = models.Filter(
                must=[models.FieldCondition(key="tenant", match=models.MatchValue(value=tenant))]
            )
        return self.client.query_points(
            name, query=list(vector), limit=k, with_payload=True, query_filter=query_filter
        ).points

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
        log.info("kb_reindex: alias %s -> %s (was %s)", alias, to, current or "nothing")

    def close(self) -> None:
        self.client.close()


@contextmanager
def open_store(settings: Settings, *, client: QdrantClient | None = None, create: bool = True) -> Iterator[KnowledgeStore]:
    """A store for one step. A client we opened is closed after, which frees local mode's folder lock."""
    own = client is None
    store = KnowledgeStore(client or make_client(settings, create=create))
    try:
        store.client.get_collections()
    except Exception as exc:
        if own:
            store.close()
        where = redact_url(settings.qdrant_url) if settings.qdrant_url else str(settings.qdrant_path)
        raise StoreError(f"Qdrant at {where} is unreachable ({type(exc).__name__}); the live alias was not touched") from None
    try:
        yield store
    finally:
        if own:
            store.close()
