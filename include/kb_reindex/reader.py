"""What a consumer (the shop assistant) imports to read the knowledge base through the alias.

The query is embedded with the live version's model, so queries and documents always share a vector
space; a caller that expects another model or dimension is refused instead of getting wrong neighbours.
The tenant filter comes from the caller's context (an argument the service sets), never from the text.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from kb_reindex.services.config import Settings
from kb_reindex.services.embedding import make_embedder
from kb_reindex.domain.errors import ConfigError, KbError
from kb_reindex.services.layouts import EMBED_RECIPE, SearchHit, embed_recipe, embedding_profile
from kb_reindex.services.store import KnowledgeStore


class ReaderDeps(Protocol):
    """What reading needs: a `runtime.Deps`, or `runtime.ReaderDeps` when the state DB is not opened."""

    settings: Settings
    store: KnowledgeStore
    ollama_headers: dict[str, str] | None


@dataclass(frozen=True)
class ServingModel:
    """What the alias serves and how its vectors were made: the model the reader embeds queries with."""

    collection: str
    embedder: str
    embed_model: str
    embed_dim: int
    version: int | None
    embed_profile: str | None
    payload_layout: str


@dataclass(frozen=True)
class SearchAnswer:
    """What a search answered, and from which version; `to_dict()` is the JSON `kb-reindex query --json` prints
    and the assistant reads."""

    alias: str
    version: int | None
    embed_model: str
    embed_profile: str | None
    payload_layout: str
    results: tuple[SearchHit, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"alias": self.alias, "version": self.version, "embed_model": self.embed_model,
                "embed_profile": self.embed_profile, "payload_layout": self.payload_layout,
                "results": [asdict(hit) for hit in self.results]}


def serving_model(store: KnowledgeStore, alias: str) -> ServingModel:
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
    dim = store.dimension(collection)
    version = meta.get("kb_version") or (int(match.group(1)) if match else None)
    distance = meta.get("distance") or store.shape(collection).distance
    chunking = meta.get("chunking_version")
    profile = meta.get("embed_profile")
    if profile is not None:
        # the recorded fingerprint must be the one of the recorded parts and of this reader's recipe for the
        # model: else the vectors were made some other way than this reader would embed, and neighbours would
        # be wrong (collections made before the recipe was recorded embedded the chunk text as cut)
        recorded_recipe = meta.get("embed_recipe") or EMBED_RECIPE
        ours = embed_recipe(embedder, model).name
        expected = embedding_profile(embedder=embedder, model=model, dim=dim, distance=distance,
                                     chunking_version=chunking or "", recipe=recorded_recipe)
        if profile != expected or recorded_recipe != ours:
            raise KbError(f"{alias} v{version} ({collection}) records embedding profile {profile}, but its "
                          f"metadata ({embedder}/{model}, {dim}-d {distance}, {chunking}, recipe "
                          f"{meta.get('embed_recipe')!r}) gives {expected} and this reader embeds with recipe "
                          f"{ours!r}: refusing to query it")
    elif chunking is not None:
        profile = embedding_profile(embedder=embedder, model=model, dim=dim, distance=distance, chunking_version=chunking)
    return ServingModel(collection=collection, embedder=embedder, embed_model=model, embed_dim=dim, version=version,
                        embed_profile=profile, payload_layout=meta.get("payload_layout") or "native")


def search_knowledge(
    deps: ReaderDeps,
    text: str,
    *,
    k: int = 4,
    tenant: str | None = None,
    expect_model: str | None = None,
    expect_dim: int | None = None,
    expect_profile: str | None = None,
) -> SearchAnswer:
    """Search through the alias. Needs only Qdrant and the embedder: the assistant keeps answering while the
    state DB is lost, locked or down. `expect_*`: what the caller embeds with (an assistant that embeds its
    own queries); a mismatch with the alias's embedding profile is refused, never answered with wrong
    neighbours. The text is read from wherever the version's payload layout keeps it."""
    if not text or not text.strip():
        raise ConfigError("query text is empty")
    if k < 1:
        raise ConfigError(f"k={k} must be at least 1")
    alias = deps.settings.alias
    live = serving_model(deps.store, alias)
    if expect_model is not None and expect_model != live.embed_model:
        raise ConfigError(f"caller embeds with {expect_model!r} but {alias} v{live.version} serves {live.embed_model!r}")
    if expect_dim is not None and expect_dim != live.embed_dim:
        raise ConfigError(f"caller expects {expect_dim}-d vectors but {alias} v{live.version} is {live.embed_dim}-d")
    if expect_profile is not None and expect_profile != live.embed_profile:
        raise ConfigError(f"caller expects embedding profile {expect_profile!r} but {alias} v{live.version} serves "
                          f"{live.embed_profile!r} ({live.embedder}/{live.embed_model}, {live.embed_dim}-d)")
    embedder = make_embedder(
        deps.settings.with_embedder(embedder=live.embedder, model=live.embed_model, dim=live.embed_dim),
        headers=deps.ollama_headers,
    )
    vector = embedder.embed_queries([text])[0]
    if len(vector) != live.embed_dim:
        raise KbError(f"embedder {live.embed_model!r} answered a {len(vector)}-d vector; {alias} v{live.version} "
                      f"(profile {live.embed_profile}) holds {live.embed_dim}-d vectors")
    # the collection the model was read from, not the alias again: a promotion in between must not pair
    # this query vector with another model's collection (the previous collection is kept, so it still answers)
    hits = deps.store.search(live.collection, vector, k=k, tenant=tenant)
    if deps.settings.query_log:
        from kb_reindex.steps.querylog import log_search

        log_search(deps, query=text, tenant=tenant, k=k, version=live.version,
                   keys=[str((h.payload or {}).get("knowledge_key")) for h in hits])
    return SearchAnswer(alias=alias, version=live.version, embed_model=live.embed_model,
                        embed_profile=live.embed_profile, payload_layout=live.payload_layout,
                        results=tuple(SearchHit.of(h.payload or {}, h.score, live.payload_layout) for h in hits))
