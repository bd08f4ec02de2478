"""What a consumer (the shop assistant) imports to read the knowledge base through the alias.

The query is embedded with the live version's model, so queries and documents always share a vector
space; a caller that expects another model or dimension is refused instead of getting wrong neighbours.
The tenant filter comes from the caller's context (an argument the service sets), never from the text.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from kb_reindex.config import Settings
from kb_reindex.embedding import make_embedder
from kb_reindex.errors import ConfigError, KbError
from kb_reindex.store import KnowledgeStore


class ReaderDeps(Protocol):
    """What reading needs: a `runtime.Deps`, or `runtime.ReaderDeps` when the state DB is not opened."""

    settings: Settings
    store: KnowledgeStore
    ollama_headers: dict[str, str] | None


def serving_model(store: KnowledgeStore, alias: str) -> dict[str, Any]:
    """What the alias serves and how its vectors were made, from Qdrant alone: the collection's metadata,
    or (for collections made before it was written) its dimension and a point's payload."""
    collection = store.alias_target(alias)
    if collection is None:
        raise KbError(f"knowledge base {alias} has no live version yet: the alias does not exist; run `kb-reindex run` first")
    meta = store.collection_metadata(collection)
    model = meta.get("embed_model")
    if model is None:
        sample = next(store.iter_payloads(collection, fields=["embed_model"], page=1), None)
        model = (sample[1].get("embed_model") if sample else None)
    if model is None:
        raise KbError(f"{alias} serves {collection}, which names no embedding model (no metadata, no points); "
                      "it cannot be queried safely")
    embedder = meta.get("embedder") or ("hashing" if model.startswith("hashing") else "ollama")
    match = re.search(r"__v(\d+)$", collection)
    return {"collection": collection, "embedder": embedder, "embed_model": model, "embed_dim": store.dimension(collection),
            "version": meta.get("kb_version") or (int(match.group(1)) if match else None)}


def search_knowledge(
    deps: ReaderDeps,
    text: str,
    *,
    k: int = 4,
    tenant: str | None = None,
    expect_model: str | None = None,
    expect_dim: int | None = None,
) -> dict[str, Any]:
    """Search through the alias. Needs only Qdrant and the embedder: the assistant keeps answering while the
    state DB is lost, locked or down."""
    if not text or not text.strip():
        raise ConfigError("query text is empty")
    if k < 1:
        raise ConfigError(f"k={k} must be at least 1")
    alias = deps.settings.alias
    live = serving_model(deps.store, alias)
    if expect_model is not None and expect_model != live["embed_model"]:
        raise ConfigError(f"caller embeds with {expect_model!r} but {alias} v{live['version']} serves {live['embed_model']!r}")
    if expect_dim is not None and expect_dim != live["embed_dim"]:
        raise ConfigError(f"caller expects {expect_dim}-d vectors but {alias} v{live['version']} is {live['embed_dim']}-d")
    embedder = make_embedder(
        deps.settings.with_embedder(embedder=live["embedder"], model=live["embed_model"], dim=live["embed_dim"]),
        headers=deps.ollama_headers,
    )
    vector = embedder.embed([text])[0]
    # the collection the model was read from, not the alias again: a promotion in between must not pair
    # this query vector with another model's collection (the previous collection is kept, so it still answers)
    hits = deps.store.search(live["collection"], vector, k=k, tenant=tenant)
    if deps.settings.query_log:
        from kb_reindex.querylog import log_search

        log_search(deps, query=text, tenant=tenant, k=k, version=live["version"],
                   keys=[str((h.payload or {}).get("knowledge_key")) for h in hits])
    return {
        "alias": alias,
        "version": live["version"],
        "embed_model": live["embed_model"],
        "results": [
            {
                "knowledge_key": (h.payload or {}).get("knowledge_key"),
                "title": (h.payload or {}).get("title"),
                "section": (h.payload or {}).get("section"),
                "score": round(float(h.score), 4),
                "text": (h.payload or {}).get("text"),
            }
            for h in hits
        ],
    }
