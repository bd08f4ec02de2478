"""Embedders: the offline hashing one, and Ollama over real HTTP against our Ollama-protocol server."""

from __future__ import annotations

import math
import socket
from collections.abc import Iterator

import numpy as np
import pytest
from kb_reindex.services.config import Settings
from kb_reindex.services.embedding import (
    HashingEmbedder,
    OllamaEmbedder,
    check_model_served,
    redact_url,
)
from kb_reindex.domain.errors import ConfigError, EmbeddingError, ModelNotServed
from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer
from kb_reindex.domain.vectors import check_vectors


def cosine(a: list[float], b: list[float]) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_hashing_embedder_is_deterministic_normalized_and_seeded_by_model() -> None:
    embedder = HashingEmbedder(model="hashing-ngram-v1", dim=256)
    first, again = embedder.embed(["签收后七天内可以退货"]), HashingEmbedder(model="hashing-ngram-v1", dim=256).embed(["签收后七天内可以退货"])
    assert first == again
    assert math.isclose(float(np.linalg.norm(first[0])), 1.0, rel_tol=1e-9)
    other_model = HashingEmbedder(model="hashing-ngram-v2", dim=256).embed(["签收后七天内可以退货"])
    assert cosine(first[0], other_model[0]) < 0.5


def test_hashing_embedder_ranks_chinese_paraphrases_above_unrelated_text() -> None:
    embedder = HashingEmbedder(dim=1024)
    query, related, unrelated = embedder.embed(["买的东西签收以后几天内能退货", "商品签收后7天内可申请无理由退货", "积分可以抵扣订单金额的百分之二十"])
    assert cosine(query, related) > cosine(query, unrelated) + 0.1


def test_check_vectors_rejects_wrong_size_nan_and_missing() -> None:
    with pytest.raises(EmbeddingError, match="size 3 .*expected 4"):
        check_vectors([[1.0, 0.0, 0.0]], expected=1, dim=4, source="x")
    with pytest.raises(EmbeddingError, match="NaN"):
        check_vectors([[1.0, float("nan"), 0.0, 0.0]], expected=1, dim=4, source="x")
    with pytest.raises(EmbeddingError, match="returned 1 vectors for 2 texts"):
        check_vectors([[1.0, 0.0, 0.0, 0.0]], expected=2, dim=4, source="x")
    with pytest.raises(EmbeddingError, match="all-zero"):
        check_vectors([[0.0] * 4], expected=1, dim=4, source="x")


def test_redact_url_drops_credentials() -> None:
    assert redact_url("http://user:s3cret@ollama:11434") == "http://ollama:11434"


@pytest.fixture
def server() -> Iterator[FakeOllamaServer]:
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=16)]) as fake:
        yield fake


def make(server: FakeOllamaServer, **kwargs: object) -> OllamaEmbedder:
    options = {"host": server.url, "model": "bge-m3", "backoff_s": 0.01, "timeout_s": 5.0}
    options.update(kwargs)
    return OllamaEmbedder(**options)  # type: ignore[arg-type]


def test_ollama_probes_dimension_and_batches(server: FakeOllamaServer) -> None:
    embedder = make(server, batch_size=4)
    vectors = embedder.embed([f"文本{i}" for i in range(10)])
    assert embedder.dimension == 16 and len(vectors) == 10
    assert server.embed_requests == 1 + 3  # one dimension probe, then batches of 4, 4, 2
    assert server.embedded_texts == 11


def test_ollama_missing_model_says_to_pull_it(server: FakeOllamaServer) -> None:
    with pytest.raises(EmbeddingError, match=r"run `ollama pull nomic-embed-text`"):
        make(server, model="nomic-embed-text").embed(["x"])


def test_ollama_retries_server_errors_with_backoff(server: FakeOllamaServer) -> None:
    embedder = make(server, dim=16, retries=3)
    server.faults.fail_next = 2
    assert len(embedder.embed(["a"])) == 1
    assert server.embed_requests == 3


def test_ollama_gives_up_after_retries_and_says_why(server: FakeOllamaServer) -> None:
    server.faults.fail_next = 10
    with pytest.raises(EmbeddingError, match="failed after 3 attempts: HTTP 500"):
        make(server, dim=16, retries=2).embed(["a"])


def test_ollama_timeout_is_retried_then_reported(server: FakeOllamaServer) -> None:
    server.faults.stall_next, server.faults.stall_s = 5, 1.0
    with pytest.raises(EmbeddingError, match="timed out"):
        make(server, dim=16, retries=1, timeout_s=0.2).embed(["a"])


def test_ollama_wrong_dimension_and_nan_are_never_returned(server: FakeOllamaServer) -> None:
    embedder = make(server, dim=16)
    server.faults.wrong_dim_next = 1
    with pytest.raises(EmbeddingError, match="size 17"):
        embedder.embed(["a"])
    server.faults.nan_next = 1
    with pytest.raises(EmbeddingError, match="NaN"):
        embedder.embed(["a"])


def test_ollama_connection_refused_names_the_host_without_credentials() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    embedder = OllamaEmbedder(host=f"http://kb:topsecret@127.0.0.1:{port}", model="bge-m3", dim=16, retries=1, backoff_s=0.01)
    with pytest.raises(EmbeddingError) as error:
        embedder.embed(["a"])
    assert f"127.0.0.1:{port}" in str(error.value) and "connection refused" in str(error.value)
    assert "topsecret" not in str(error.value)


def test_real_ollama_when_one_answers() -> None:
    """Opt-in: KB_TEST_OLLAMA_HOST=http://host:11434 (with bge-m3 pulled) runs this against a real server."""
    import os

    import httpx

    host = os.environ.get("KB_TEST_OLLAMA_HOST")
    if not host:
        pytest.skip("KB_TEST_OLLAMA_HOST not set (no Ollama server on this machine)")
    try:
        httpx.get(f"{host}/api/version", timeout=2).raise_for_status()
    except httpx.HTTPError as exc:
        pytest.skip(f"no Ollama answering at {host}: {type(exc).__name__}")
    embedder = OllamaEmbedder(host=host, model=os.environ.get("KB_TEST_OLLAMA_MODEL", "bge-m3"))
    query, related, unrelated = embedder.embed(["签收后几天可以退货", "商品签收后7天内可申请无理由退货", "积分有效期为一年"])
    assert embedder.dimension == len(query)
    assert cosine(query, related) > cosine(query, unrelated)


def test_a_model_the_embedder_cannot_serve_is_refused_as_a_usage_error(server: FakeOllamaServer) -> None:
    """A collection is named after its model: hashing vectors must never be labelled bge-m3."""
    settings = Settings.from_env({"OLLAMA_HOST": server.url})
    check_model_served(settings, embedder="hashing", model="hashing-ngram-v7")
    with pytest.raises(ModelNotServed, match=r"hashing embedder cannot serve model 'bge-m3'") as refused:
        check_model_served(settings, embedder="hashing", model="bge-m3")
    assert isinstance(refused.value, ConfigError)  # the CLI exits 2, the DAG fails without retrying

    check_model_served(settings, embedder="ollama", model="bge-m3")  # the server has it
    with pytest.raises(ModelNotServed, match=r"'nomic-embed-text' is not on the Ollama server"):
        check_model_served(settings, embedder="ollama", model="nomic-embed-text")
    check_model_served(settings, embedder="ollama", model="nomic-embed-text", ask_server=False)
