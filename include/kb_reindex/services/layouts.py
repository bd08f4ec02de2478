"""Payload layouts and embedding profiles: how a point's payload looks to the assistant that reads it, and
what made its vector.

A layout only rearranges the payload for a consumer (LangChain4j, LangChain, LlamaIndex); the engine's own
fields (knowledge_key, source, title, category, section, tenant, chunk_index, chunk_hash, content_hash,
embed_model, chunking_version, version) stay flat at the top of every layout, so filters, payload
indexes, validation and a state rebuilt from Qdrant read every layout the same way. Only the text moves.

An embedding profile is the fingerprint of what made a vector: embedder, model, dimension, distance,
chunking and the recipe that turns a chunk into the text sent to the embedder. Two versions may share a
vector only when they share a profile; the layout is not part of it (the same text gets the same vector).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kb_reindex.domain.errors import ConfigError

if TYPE_CHECKING:  # the type only: qdrant-client is not imported where a DAG is parsed
    from qdrant_client import models

LAYOUTS = ("native", "langchain4j", "langchain", "llamaindex")
DEFAULT_TEXT_KEY = "text"
#: how a chunk becomes the embedder's input: the chunk's text as cut (it starts with "title > section")
EMBED_RECIPE = "chunk-text-v1"


@dataclass(frozen=True)
class EmbedRecipe:
    """How a chunk and a query become the text a model embeds. Part of the embedding profile: vectors made
    with one recipe are never reused or searched with another's."""

    name: str
    passage_prefix: str = ""
    query_prefix: str = ""

    def passages(self, texts: Sequence[str]) -> list[str]:
        return [self.passage_prefix + text for text in texts]

    def queries(self, texts: Sequence[str]) -> list[str]:
        return [self.query_prefix + text for text in texts]


CHUNK_TEXT = EmbedRecipe(EMBED_RECIPE)
#: the e5 family's own recipe (intfloat's model cards): documents as `passage: …`, questions as `query: …`;
#: without the prefixes an e5 model's retrieval quality drops
E5_RECIPE = EmbedRecipe("e5-passage-query-v1", passage_prefix="passage: ", query_prefix="query: ")
#: e5-small/base/large (v2, multilingual), under any namespace or tag; not the -instruct or mistral variants,
#: whose recipe differs
_E5_FAMILY = re.compile(r"(?:^|[/_\-])(?:multilingual-)?e5-(?:small|base|large)(?:-v2)?(?:$|[:@])")


def embed_recipe(embedder: str, model: str) -> EmbedRecipe:
    """The recipe of a model: e5's for the in-process e5 embedder and for an e5-family model served by Ollama
    (the server embeds what it is sent, so the client adds the prefixes), the chunk text as is otherwise."""
    if embedder == "e5" or (embedder == "ollama" and _E5_FAMILY.search(model.strip().lower())):
        return E5_RECIPE
    return CHUNK_TEXT

#: flat in every layout: what the engine filters, indexes, checks and rebuilds its state from
ENGINE_FIELDS = ("knowledge_key", "source", "title", "category", "section", "tenant", "chunk_index", "chunk_hash",
                 "content_hash", "embed_model", "chunking_version", "version")
#: LangChain4j's flat metadata, as the Spring assistant this grew from cites its sources
LANGCHAIN4J_KEYS = {"knowledgeKey": "knowledge_key", "contentHash": "content_hash", "chunkIndex": "chunk_index"}
#: what an assistant cites from, nested under LangChain's `metadata` and in LlamaIndex's node metadata
CITATION_FIELDS = ("knowledge_key", "title", "source", "category", "section", "tenant", "chunk_index", "content_hash")
LLAMA_NODE_FIELDS = ("_node_content", "_node_type", "document_id", "doc_id", "ref_doc_id")


def parse_layout(spec: str | None, *, where: str = "KB_PAYLOAD_LAYOUT") -> tuple[str, str]:
    """(layout, text key) of a recorded or configured spec: `langchain4j` or `langchain4j:<text key>`."""
    raw = (spec or "native").strip()
    name, _, key = raw.partition(":")
    name = name.strip().lower()
    if name not in LAYOUTS:
        raise ConfigError(f"{where}={raw!r} is unknown; choose one of {', '.join(LAYOUTS)}")
    if key and name != "langchain4j":
        raise ConfigError(f"{where}={raw!r}: only the langchain4j layout takes a text key")
    return name, (key.strip() or DEFAULT_TEXT_KEY) if name == "langchain4j" else DEFAULT_TEXT_KEY


def layout_spec(layout: str, text_key: str | None = None, *, where: str = "KB_PAYLOAD_TEXT_KEY",
                layout_where: str = "KB_PAYLOAD_LAYOUT") -> str:
    """The one string recorded per version: the layout, and for langchain4j a text key other than `text`.
    `layout_where` names where `layout` came from in an error (a DAG's Param is not the environment)."""
    name, spec_key = parse_layout(layout, where=layout_where)
    key = (text_key or "").strip()
    if key and key != DEFAULT_TEXT_KEY and name != "langchain4j":
        raise ConfigError(f"{where}={key!r} applies only to KB_PAYLOAD_LAYOUT=langchain4j (the layout is {name})")
    key = key or spec_key
    if name != "langchain4j" or not key or key == DEFAULT_TEXT_KEY:
        return name
    taken = set(ENGINE_FIELDS) | set(LANGCHAIN4J_KEYS)
    if key in taken or not key.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"{where}={key!r} cannot hold the text: use a plain name that is none of "
                          f"{', '.join(sorted(taken))}")
    return f"{name}:{key}"


def describe_layout(spec: str | None) -> str:
    name, key = parse_layout(spec, where="payload layout")
    return f"{name} (text under {key!r})" if name == "langchain4j" else name


def shape_payload(native: models.Payload, spec: str | None, *, point_id: str) -> models.Payload:
    """The payload in `spec`'s layout, from today's (native) payload: engine fields flat, the text where the
    consumer reads it. Values are plain JSON; LangChain4j's flat metadata takes only scalars, never null."""
    name, text_key = parse_layout(spec, where="payload layout")
    if name == "native":
        return native
    engine = {k: native[k] for k in ENGINE_FIELDS}
    text = native["text"]
    if name == "langchain4j":
        payload = {k: ("" if v is None else v) for k, v in engine.items()}
        payload.update({camel: payload[snake] for camel, snake in LANGCHAIN4J_KEYS.items()})
        payload[text_key] = text
        return payload
    cited = {k: native[k] for k in CITATION_FIELDS}
    if name == "langchain":
        return {**engine, "page_content": text, "metadata": cited}
    # llamaindex: what its QdrantVectorStore writes and reads back (node_to_metadata_dict / metadata_dict_to_node)
    node = {
        "id_": point_id, "embedding": None, "metadata": cited,
        "excluded_embed_metadata_keys": [], "excluded_llm_metadata_keys": ["content_hash", "chunk_index", "tenant"],
        "relationships": {"1": {"node_id": native["knowledge_key"], "node_type": "4", "metadata": {},
                                "hash": native["content_hash"], "class_name": "RelatedNodeInfo"}},
        "metadata_template": "{key}: {value}", "metadata_separator": "\n", "text": text, "mimetype": "text/plain",
        "start_char_idx": None, "end_char_idx": None, "text_template": "{metadata_str}\n\n{content}",
        "class_name": "TextNode",
    }
    return {**engine, "_node_content": json.dumps(node, ensure_ascii=False), "_node_type": "TextNode",
            "document_id": native["knowledge_key"], "doc_id": native["knowledge_key"],
            "ref_doc_id": native["knowledge_key"]}


def text_field(spec: str | None) -> str:
    """The top-level payload key under which `spec` keeps the text (a JSON document for llamaindex)."""
    name, text_key = parse_layout(spec, where="payload layout")
    return {"langchain": "page_content", "llamaindex": "_node_content"}.get(name, text_key)


def payload_text(payload: Mapping[str, Any], spec: str | None) -> str | None:
    """The chunk's text, wherever `spec` puts it (None when it is not there)."""
    name, text_key = parse_layout(spec, where="payload layout")
    if name == "langchain":
        return payload.get("page_content")
    if name == "llamaindex":
        try:
            node = json.loads(payload.get("_node_content") or "null")
        except (TypeError, ValueError):
            return None
        return node.get("text") if isinstance(node, dict) else None
    return payload.get(text_key)


@dataclass(frozen=True)
class SearchHit:
    """One search result, its text read from wherever the version's payload layout keeps it: what the reader
    (`kb_reindex.reader`) answers through the alias, and a try-out of one version (`kb_reindex.steps.tryout`)."""

    knowledge_key: str | None
    title: str | None
    source: str | None
    section: str | None
    score: float
    text: str | None

    @classmethod
    def of(cls, payload: Mapping[str, Any], score: float, layout: str) -> SearchHit:
        return cls(knowledge_key=payload.get("knowledge_key"), title=payload.get("title"), source=payload.get("source"),
                   section=payload.get("section"), score=round(float(score), 4), text=payload_text(payload, layout))


def payload_problems(payload: Mapping[str, Any], spec: str | None) -> list[str]:
    """What a consumer of this layout would miss in the payload: the engine's fields, the text, and the
    fields the consumer cites from. Empty when well-formed."""
    name, text_key = parse_layout(spec, where="payload layout")
    problems = []
    absent = [f for f in ENGINE_FIELDS if f not in payload]
    if absent:
        problems.append(f"payload lacks {', '.join(absent)}")
    if payload_text(payload, spec) is None:
        problems.append(f"payload has no text where the {name} layout keeps it")
    if name == "langchain4j":
        absent = [k for k in (text_key, *LANGCHAIN4J_KEYS, "title", "source", "category") if k not in payload]
        odd = sorted(k for k, v in payload.items() if v is None or not isinstance(v, (str, int, float)))
        if absent:
            problems.append(f"langchain4j payload lacks {', '.join(absent)}")
        if odd:
            problems.append(f"langchain4j metadata takes only non-null scalars; {', '.join(odd)} are not")
    elif name == "langchain":
        metadata = payload.get("metadata")
        absent = [k for k in CITATION_FIELDS if not isinstance(metadata, dict) or k not in metadata]
        if absent:
            problems.append(f"langchain payload's metadata lacks {', '.join(absent)}")
    elif name == "llamaindex":
        absent = [k for k in LLAMA_NODE_FIELDS if k not in payload]
        if absent:
            problems.append(f"llamaindex payload lacks {', '.join(absent)}")
    return problems


def embedding_profile(*, embedder: str, model: str, dim: int, distance: str, chunking_version: str,
                      recipe: str | None = None) -> str:
    """Fingerprint of what makes a vector: equal profiles, interchangeable vectors; never the layout.
    `recipe`: the one recorded; by default the model's own (`embed_recipe`)."""
    parts = {"embedder": embedder, "model": model, "dim": int(dim), "distance": distance,
             "chunking": chunking_version, "recipe": recipe or embed_recipe(embedder, model).name}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()[:16]
    return f"{model_tag(model)}-{int(dim)}-{digest}"


def model_tag(model: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "-" for c in model)[:40]


def version_profile(version: Any) -> str:
    """A version's profile: recorded, or computed for versions made before profiles were (embedded as cut:
    no recipe but the chunk text existed then)."""
    recorded = getattr(version, "embed_profile", None)
    if recorded:
        return recorded
    return embedding_profile(embedder=version.embedder, model=version.embed_model, dim=version.embed_dim,
                             distance=version.distance, chunking_version=version.chunking_version,
                             recipe=EMBED_RECIPE)
