"""Payload layouts read back by their own consumers through the alias, and embedding profiles.

LangChain (`langchain-qdrant`) and LlamaIndex (`llama-index-vector-stores-qdrant`) are the real readers,
test extras of the dev install; LangChain4j (Java) is checked against the payload its QdrantEmbeddingStore
reads (text under `payloadTextKey`, every other key flat metadata of non-null scalars).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa


from kb_reindex.run.pipeline import run_reindex

from kb_reindex.run.runs import run_rollback
from kb_reindex.services.config import Settings
from kb_reindex.services.embedding import HashingEmbedder
from kb_reindex.domain.errors import ConfigError, KbError
from kb_reindex.services.layouts import embedding_profile, layout_spec, payload_text, version_profile
from kb_reindex.reader import search_knowledge, serving_model
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.manifests import ManifestDocument
from kb_reindex.services.state.store import StateStore
from kb_reindex.run.status import status_view

from conftest import settings_for

ALIAS = "mall_knowledge"
QUESTION = "优惠券过期了还能恢复吗"
EMBEDDER = HashingEmbedder(model="hashing-ngram-v1", dim=1024)  # what the engine builds with by default


@pytest.fixture
def local_deps(settings: Settings) -> Any:
    """Local-mode Qdrant only: for what does not depend on how Qdrant is reached (the suite's time)."""
    from qdrant_client import QdrantClient

    from kb_reindex.services.store import KnowledgeStore

    client = QdrantClient(":memory:")
    state = StateStore(settings.state_url)
    yield Deps(settings=settings, state=state, store=KnowledgeStore(client))
    state.dispose()
    client.close()


def with_layout(deps: Deps, layout: str, text_key: str = "") -> Deps:
    env = {"KB_PAYLOAD_LAYOUT": layout, **({"KB_PAYLOAD_TEXT_KEY": text_key} if text_key else {})}
    layout_setting = Settings.from_env({"KB_PROJECT_ROOT": str(deps.settings.root), **env}).payload_layout
    return replace(deps, settings=replace(deps.settings, payload_layout=layout_setting))


def manifest_of(deps: Deps) -> dict[str, ManifestDocument]:
    live = deps.state.live_version(ALIAS)
    return {d.knowledge_key: d for d in deps.state.manifest_documents(live.id)}


def chunk_hashes(deps: Deps) -> set[str]:
    live = deps.state.live_version(ALIAS)
    return {row.chunk_hash for row in deps.state.manifest_chunks(live.id)}


def sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --- each consumer reads the alias with its own reader -------------------------------------------------


def test_langchain_reads_text_and_sources_through_the_alias(deps: Deps) -> None:
    from langchain_core.embeddings import Embeddings
    from langchain_qdrant import QdrantVectorStore

    class HashingEmbeddings(Embeddings):
        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return EMBEDDER.embed(list(texts))

        def embed_query(self, text: str) -> list[float]:
            return EMBEDDER.embed([text])[0]

    deps = with_layout(deps, "langchain")
    assert run_reindex(deps).outcome == "promoted"
    # LangChain's defaults: `page_content` and a nested `metadata`, the alias as the collection name
    store = QdrantVectorStore(client=deps.store.client, collection_name=ALIAS, embedding=HashingEmbeddings())
    found = store.similarity_search(QUESTION, k=3)
    documents, hashes = manifest_of(deps), chunk_hashes(deps)
    assert found and found[0].metadata["knowledge_key"] == "coupon-rules"
    for doc in found:
        assert sha256(doc.page_content) in hashes, "the text is the chunk's own"
        meta = doc.metadata
        expected = documents[meta["knowledge_key"]]
        assert (meta["title"], meta["source"], meta["category"], meta["content_hash"]) == (
            expected.title, expected.source, expected.category, expected.content_hash)
        assert isinstance(meta["chunk_index"], int)


def test_llamaindex_reads_text_and_sources_through_the_alias(deps: Deps) -> None:
    from llama_index.core import VectorStoreIndex
    from llama_index.core.embeddings import BaseEmbedding
    from llama_index.vector_stores.qdrant import QdrantVectorStore

    class HashingEmbedding(BaseEmbedding):
        def _get_query_embedding(self, query: str) -> list[float]:
            return EMBEDDER.embed([query])[0]

        def _get_text_embedding(self, text: str) -> list[float]:
            return EMBEDDER.embed([text])[0]

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._get_query_embedding(query)

    deps = with_layout(deps, "llamaindex")
    assert run_reindex(deps).outcome == "promoted"
    store = QdrantVectorStore(client=deps.store.client, collection_name=ALIAS)
    # the retriever an assistant uses, over the alias as an existing vector store
    index = VectorStoreIndex.from_vector_store(store, embed_model=HashingEmbedding())
    found = [hit.node for hit in index.as_retriever(similarity_top_k=3).retrieve(QUESTION)]
    documents, hashes = manifest_of(deps), chunk_hashes(deps)
    assert found and found[0].metadata["knowledge_key"] == "coupon-rules"
    for node in found:
        assert sha256(node.get_content()) in hashes, "the node's text is the chunk's own (from _node_content)"
        meta = node.metadata
        expected = documents[meta["knowledge_key"]]
        assert (meta["title"], meta["source"], meta["category"]) == (expected.title, expected.source, expected.category)
        assert node.ref_doc_id == meta["knowledge_key"], "the source document is the node's ref_doc_id"


def test_langchain4j_payload_contract_with_a_custom_text_key(deps: Deps) -> None:
    """What LangChain4j's QdrantEmbeddingStore does with a hit: the `payloadTextKey` value becomes the
    TextSegment's text and every other key its Metadata, which takes only String/UUID/Integer/Long/Float/
    Double values and never null. The Spring assistant cites from knowledgeKey, title, source, category,
    contentHash and chunkIndex."""
    deps = with_layout(deps, "langchain4j", text_key="content")
    assert deps.settings.payload_layout == "langchain4j:content"
    assert run_reindex(deps).outcome == "promoted"
    hits = deps.store.client.query_points(ALIAS, query=EMBEDDER.embed([QUESTION])[0], limit=4,
                                          with_payload=True).points
    documents, hashes = manifest_of(deps), chunk_hashes(deps)
    assert hits and hits[0].payload["knowledgeKey"] == "coupon-rules"
    for hit in hits:
        payload = dict(hit.payload)
        text = payload.pop("content")
        assert isinstance(text, str) and sha256(text) in hashes
        assert "text" not in payload, "the text lives only under the configured key"
        odd = {k: v for k, v in payload.items() if v is None or isinstance(v, bool) or not isinstance(v, (str, int, float))}
        assert not odd, f"LangChain4j Metadata would refuse {odd}"
        expected = documents[payload["knowledgeKey"]]
        assert (payload["title"], payload["source"], payload["category"], payload["contentHash"]) == (
            expected.title, expected.source, expected.category, expected.content_hash)
        assert isinstance(payload["chunkIndex"], int)
        # the citation line the reference assistant prints before handing the hit to the model
        assert f"来源：{payload['title']}（{payload['source']}）" == f"来源：{expected.title}（{expected.source}）"


@pytest.mark.parametrize("layout", ["langchain4j", "langchain", "llamaindex"])
def test_our_reader_and_validation_read_every_layout(local_deps: Deps, layout: str) -> None:
    deps = with_layout(local_deps, layout)
    result = run_reindex(deps)
    assert result.outcome == "promoted", result.error
    payload_check = next(c for c in deps.state.live_version(ALIAS).validation["checks"] if c["check"] == "payload sample")
    assert payload_check["passed"], payload_check
    found = search_knowledge(deps, QUESTION, k=2)
    assert found.payload_layout == layout and found.results[0].knowledge_key == "coupon-rules"
    assert all(r.text and r.source for r in found.results)


def test_validation_fails_a_layout_its_consumer_could_not_read(local_deps: Deps) -> None:
    deps = local_deps
    from kb_reindex.steps.validate import validate

    deps = with_layout(deps, "langchain")
    assert run_reindex(deps).outcome == "promoted"
    live = deps.state.live_version(ALIAS)
    from qdrant_client import models

    records = deps.store.retrieve(live.collection, [r.point_id for r in deps.state.manifest_chunks(live.id)],
                                  vectors=True)
    deps.store.upsert(live.collection, [models.PointStruct(id=r.id, vector=r.vector, payload={
        k: v for k, v in r.payload.items() if k != "metadata"}) for r in records])
    checked = validate(deps, live.version, raise_on_failure=False, record=False)
    assert not checked.passed
    assert any("metadata lacks" in f and "langchain" in f for f in checked.failures), checked.failures


# --- a layout change is a gated version with a rollback behind it ------------------------------------------


def test_layout_change_is_a_new_gated_version_and_rollback_returns_native(deps: Deps) -> None:
    first = run_reindex(deps)
    assert first.outcome == "promoted"
    # a layout change on a live alias is explicit (KB_PAYLOAD_LAYOUT is not obeyed once a version serves)
    second = run_reindex(deps, layout="langchain")
    assert (second.outcome, second.version) == ("promoted", 2), second.error
    assert second.validation.passed
    # the text and the embedding do not change: every vector is copied from v1, none embedded
    assert second.chunks.copied == second.chunks.total and second.chunks.embedded == 0
    v1, v2 = deps.state.get_version(ALIAS, 1), deps.state.get_version(ALIAS, 2)
    assert (v1.payload_layout, v2.payload_layout) == ("native", "langchain")
    assert v1.embed_profile == v2.embed_profile, "the layout is not part of the embedding profile"
    assert deps.store.collection_metadata(v2.collection)["payload_layout"] == "langchain"
    status = {v["version"]: v for v in status_view(deps).to_dict()["versions"]}
    assert (status[1]["payload_layout"], status[2]["payload_layout"]) == ("native", "langchain")
    assert run_reindex(deps).outcome == "no_change", "the next reindex keeps live's layout"
    text = search_knowledge(deps, QUESTION, k=1).results[0].text
    assert search_knowledge(deps, QUESTION, k=1).payload_layout == "langchain"

    back = run_rollback(deps, reason="the assistant still reads native payloads")
    assert back.to_version == 1
    assert deps.store.alias_target(ALIAS) == v1.collection
    again = search_knowledge(deps, QUESTION, k=1)
    assert (again.payload_layout, again.results[0].text) == ("native", text)
    hit = deps.store.client.query_points(ALIAS, query=EMBEDDER.embed([QUESTION])[0], limit=1, with_payload=True).points[0]
    assert "text" in hit.payload and "page_content" not in hit.payload


@pytest.mark.parametrize("route", [("langchain", "llamaindex"), ("llamaindex", "langchain4j:content")])
def test_a_layout_change_away_from_a_non_native_live_copies_texts_from_lives_layout(deps: Deps,
                                                                                     route: tuple[str, str]) -> None:
    """A copied point takes its text from live's payload, where live's layout keeps it (not `text`)."""
    source, target = route
    assert run_reindex(with_layout(deps, source)).outcome == "promoted"
    moved = run_reindex(deps, layout=target)
    assert (moved.outcome, moved.chunks.embedded) == ("promoted", 0), moved.error
    v1, v2 = deps.state.get_version(ALIAS, 1), deps.state.get_version(ALIAS, 2)
    before = {str(p.id): p.payload for p in deps.store.client.scroll(v1.collection, limit=1000, with_payload=True)[0]}
    after = {str(p.id): p.payload for p in deps.store.client.scroll(v2.collection, limit=1000, with_payload=True)[0]}
    assert before.keys() == after.keys()
    assert all(payload_text(after[i], v2.payload_layout) == payload_text(before[i], v1.payload_layout) for i in before)


def test_cli_status_and_plan_show_the_layout(project: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from kb_reindex.cli import main

    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    monkeypatch.setenv("KB_PAYLOAD_LAYOUT", "llamaindex")
    assert main(["run", "--json"]) == 0
    capsys.readouterr()
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "payload_layout" in out and "llamaindex" in out
    assert main(["status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["live"]["payload_layout"] == "llamaindex" and status["live"]["embed_profile"]
    monkeypatch.setenv("KB_PAYLOAD_LAYOUT", "native")
    assert main(["plan", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # live's layout is kept; the differing setting is reported, not obeyed
    assert (plan["no_change"], plan["payload_layout"]) == (True, "llamaindex")
    assert "KB_PAYLOAD_LAYOUT=native differs" in plan["notes"][0]
    assert main(["plan"]) == 0
    assert "note: KB_PAYLOAD_LAYOUT=native differs" in capsys.readouterr().out


def test_migration_records_the_layout_it_was_given(local_deps: Deps) -> None:
    deps = local_deps
    assert run_reindex(deps).outcome == "promoted"
    result = run_reindex(deps, kind="migration", embedder="hashing", model="hashing-layout-v2",
                                layout="langchain4j")
    assert result.outcome == "promoted", result.error
    migrated = deps.state.get_version(ALIAS, result.version)
    assert migrated.payload_layout == "langchain4j"
    assert result.chunks.copied == 0, "no vector crosses profiles"
    assert migrated.embed_profile != deps.state.get_version(ALIAS, 1).embed_profile


# --- embedding profiles -------------------------------------------------------------------------------------


def test_migration_to_the_live_profile_is_refused_as_a_no_op(local_deps: Deps) -> None:
    deps = local_deps
    assert run_reindex(deps).outcome == "promoted"
    live = deps.state.live_version(ALIAS)
    result = run_reindex(deps, kind="migration", embedder="hashing", model=None)
    assert result.outcome == "failed" and result.error_kind == "config"
    assert f"already serves embedding profile {version_profile(live)}" in result.error
    assert "kb-reindex run --layout" in result.error
    assert [v.version for v in deps.state.list_versions(ALIAS)] == [1], "nothing was built"


def test_no_vector_is_copied_across_profiles(local_deps: Deps) -> None:
    deps = local_deps
    """Same model and chunking, but live recorded under another profile (e.g. another text recipe): the
    next reindex embeds everything instead of copying live's vectors."""
    from kb_reindex.steps.plan import prepare

    assert run_reindex(deps).outcome == "promoted"
    live = deps.state.live_version(ALIAS)
    path = deps.settings.knowledge_dir / "coupon-rules.md"
    path.write_text(path.read_text(encoding="utf-8") + "\n\n补充：优惠券不可兑换现金。\n", encoding="utf-8")
    assert prepare(deps, force_full=False).reuse, "same profile: unchanged chunks are copied"
    other = embedding_profile(embedder=live.embedder, model=live.embed_model, dim=live.embed_dim,
                              distance=live.distance, chunking_version=live.chunking_version, recipe="chunk-text-v0")
    deps.state.update_version(live.id, embed_profile=other)
    prepared = prepare(deps, force_full=False)
    assert prepared.reuse == {} and prepared.plan.chunks.reused == 0


def test_reader_refuses_a_profile_mismatch(local_deps: Deps) -> None:
    deps = local_deps
    assert run_reindex(deps).outcome == "promoted"
    live = deps.state.live_version(ALIAS)
    served = serving_model(deps.store, ALIAS)
    assert served.embed_profile == live.embed_profile == version_profile(live)
    assert search_knowledge(deps, QUESTION, k=1, expect_profile=live.embed_profile).results
    with pytest.raises(ConfigError, match="expects embedding profile 'bge-m3-1024-.*' but mall_knowledge v1 serves"):
        search_knowledge(deps, QUESTION, expect_profile=embedding_profile(
            embedder="ollama", model="bge-m3", dim=1024, distance=live.distance, chunking_version=live.chunking_version))
    # a collection whose recorded profile is not what its recorded parts and this reader's recipe give
    deps.store.annotate(live.collection, {"embed_recipe": "chunk-text-with-summary-v9"})
    with pytest.raises(KbError, match="refusing to query it"):
        search_knowledge(deps, QUESTION)


def test_rebuilt_state_keeps_each_versions_layout_and_profile(local_deps: Deps) -> None:
    deps = local_deps
    from kb_reindex.steps.reconcile import rebuild_state

    assert run_reindex(deps).outcome == "promoted"
    assert run_reindex(deps, layout="llamaindex").outcome == "promoted"
    before = {v.version: (v.payload_layout, v.embed_profile) for v in deps.state.list_versions(ALIAS)}
    rebuild_state(deps, replace=True)
    after = {v.version: (v.payload_layout, v.embed_profile) for v in deps.state.list_versions(ALIAS)}
    assert after == before == {1: ("native", before[1][1]), 2: ("llamaindex", before[1][1])}


# --- settings and the state DB ----------------------------------------------------------------------------


@pytest.mark.parametrize("env, message", [
    ({"KB_PAYLOAD_LAYOUT": "haystack"}, "KB_PAYLOAD_LAYOUT='haystack' is unknown"),
    ({"KB_PAYLOAD_LAYOUT": "langchain", "KB_PAYLOAD_TEXT_KEY": "body"}, "applies only to KB_PAYLOAD_LAYOUT=langchain4j"),
    ({"KB_PAYLOAD_LAYOUT": "langchain4j", "KB_PAYLOAD_TEXT_KEY": "knowledgeKey"}, "cannot hold the text"),
    ({"KB_PAYLOAD_LAYOUT": "langchain4j", "KB_PAYLOAD_TEXT_KEY": "a.b"}, "cannot hold the text"),
])
def test_bad_layout_settings_are_named(project: Path, env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        settings_for(project, **env)


def test_layout_settings_parse() -> None:
    assert layout_spec("LangChain4j", "text") == "langchain4j"
    assert layout_spec("langchain4j", "content") == layout_spec("langchain4j:content") == "langchain4j:content"
    assert layout_spec("llamaindex") == "llamaindex"
    assert layout_spec("native", "text") == "native", "the default text key goes with any layout (the compose default)"


def _drop_new_columns(url: str) -> None:
    engine_ = sa.create_engine(url)
    with engine_.begin() as conn:
        for column in ("payload_layout", "embed_profile"):
            conn.execute(sa.text(f"ALTER TABLE kb_versions DROP COLUMN {column}"))
    engine_.dispose()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("mysql", marks=pytest.mark.mysql)])
def test_a_state_db_of_an_older_version_gains_the_columns(settings: Settings, backend: str,
                                                          request: pytest.FixtureRequest) -> None:
    url = settings.state_url if backend == "sqlite" else request.getfixturevalue("mysql_url")
    state = StateStore(url)
    state.insert_version(alias=ALIAS, version=1, collection="mall_knowledge__m__v1", status="live", embedder="hashing",
                         embed_model="m", embed_dim=8, distance="Cosine", chunking_version="c", corpus_fingerprint="f")
    state.dispose()
    _drop_new_columns(url)
    reader = StateStore(url, create=False)  # a read-only command (status) on the old DB
    version = reader.get_version(ALIAS, 1)
    assert (version.payload_layout, version.embed_profile) == ("native", None)
    assert version_profile(version) == embedding_profile(embedder="hashing", model="m", dim=8, distance="Cosine",
                                                         chunking_version="c")
    reader.dispose()
