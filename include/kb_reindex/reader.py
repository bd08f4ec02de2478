"""What a consumer (the shop assistant) imports to read the knowledge base through the alias.

The query is embedded with the live version's model, so queries and documents always share a vector
space; a caller that expects another model or dimension is refused instead of getting wrong neighbours.
The tenant filter comes from the caller's context (an argument the service sets), never from the text.
"""

from __future__ import annotations

from typing import Any

from kb_reindex.errors import ConfigError, KbError
from kb_reindex.runtime import Deps


def search_knowledge(
    deps: Deps,
    text: str,
    *,
    k: int = 4,
    tenant: str | None = None,
    expect_model: str | None = None,
    expect_dim: int | None = None,
) -> dict[str, Any]:
    if not text or not text.strip():
        raise ConfigError("query text is empty")
    if k < 1:
        raise ConfigError(f"k={k} must be at least 1")
    alias = deps.settings.alias
    live = deps.state.live_version(alias)
    if live is None or deps.store.alias_target(alias) is None:
        raise KbError(f"knowledge base {alias} has no live version yet; run `kb-reindex run` first")
    if expect_model is not None and expect_model != live.embed_model:
        raise ConfigError(f"caller embeds with {expect_model!r} but {alias} v{live.version} serves {live.embed_model!r}")
    if expect_dim is not None and expect_dim != live.embed_dim:
        raise ConfigError(f"caller expects {expect_dim}-d vectors but {alias} v{live.version} is {live.embed_dim}-d")
    vector = deps.embedder_for(live).embed([text])[0]
    hits = deps.store.search(alias, vector, k=k, tenant=tenant)
    return {
        "alias": alias,
        "version": live.version,
        "embed_model": live.embed_model,
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
