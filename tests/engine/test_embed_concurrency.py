"""Concurrent embedding over several Ollama servers: the real `ollama` client over HTTP against our
Ollama-protocol test servers. Overlap is proven with barriers inside the servers (a request that never meets
its partner fails the test), never with timings."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from qdrant_client import QdrantClient


from kb_reindex.run.pipeline import run_reindex
from kb_reindex.airflow.connections import ollama_from_connection
from kb_reindex.services.config import Settings, split_ollama_hosts
from kb_reindex.services.embedding import HashingEmbedder, OllamaEmbedder, check_model_served, make_embedder
from kb_reindex.domain.errors import ConfigError, EmbeddingError, ModelNotServed
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.store import StateStore
from kb_reindex.services.store import KnowledgeStore
from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer, deterministic_embedding
from conftest import PATTERNS_SCREEN, settings_for

DIM = 16


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def texts_in_batches(batches: int, size: int = 3) -> list[list[str]]:
    return [[f"b{b}-t{i}" for i in range(size)] for b in range(batches)]


def expected(texts: list[str], model: str = "bge-m3") -> list[list[float]]:
    return [deterministic_embedding(model, t, DIM) for t in texts]


def embedder(*servers: FakeOllamaServer, **options: object) -> OllamaEmbedder:
    settings = {"host": ",".join(s.url for s in servers), "model": "bge-m3", "dim": DIM, "backoff_s": 0.01,
                "timeout_s": 10.0, "batch_size": 3}
    settings.update(options)
    return OllamaEmbedder(**settings)  # type: ignore[arg-type]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server() -> Iterator[FakeOllamaServer]:
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=DIM)]) as fake:
        yield fake


# --- order and overlap ---------------------------------------------------------------------------


def test_vectors_keep_the_input_order_when_a_later_batch_finishes_first() -> None:
    """Batch 0 is held inside the server until batch 1 has been answered: the answers arrive out of order,
    the vectors come back in order."""
    batch1_done = threading.Event()
    finished: list[int] = []

    def embed(model: str, text: str) -> list[float]:
        if text == "b0-t0":
            assert batch1_done.wait(10), "batch 1 was never in flight beside batch 0"
        vector = deterministic_embedding(model, text, DIM)
        if text.endswith("-t2"):
            finished.append(int(text[1 : text.index("-")]))
            if text == "b1-t2":
                batch1_done.set()
        return vector

    batches = texts_in_batches(6)
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=DIM, embed=embed)]) as fake:
        answers = list(embedder(fake, concurrency=3).embed_batches(batches))
    assert finished.index(1) < finished.index(0), finished  # really out of order on the server
    assert answers == [expected(batch) for batch in batches]


def test_requests_really_overlap_up_to_the_concurrency() -> None:
    """Four requests must be inside the server at once to pass its barrier; a client that sent fewer at a
    time would leave the barrier broken and get errors."""
    barrier = threading.Barrier(4, timeout=10)
    met: list[str] = []

    def embed(model: str, text: str) -> list[float]:
        if text.endswith("-t0") and int(text[1 : text.index("-")]) < 4:
            barrier.wait()
            met.append(text)
        return deterministic_embedding(model, text, DIM)

    batches = texts_in_batches(10)
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=DIM, embed=embed)]) as fake:
        answers = list(embedder(fake, concurrency=4, retries=0).embed_batches(batches))
        assert fake.max_in_flight == 4
    assert len(met) == 4
    assert answers == [expected(batch) for batch in batches]


def test_the_server_processes_at_most_parallel_requests_the_rest_wait() -> None:
    """`parallel=2` as OLLAMA_NUM_PARALLEL: a client with 4 in flight still meets at most 2 being processed."""
    barrier = threading.Barrier(2, timeout=10)

    def embed(model: str, text: str) -> list[float]:
        if text in ("b0-t0", "b1-t0"):
            barrier.wait()  # two at once are possible
        return deterministic_embedding(model, text, DIM)

    batches = texts_in_batches(12)
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=DIM, embed=embed)], parallel=2) as fake:
        fake.faults.delay_per_text_s = 0.002
        answers = list(embedder(fake, concurrency=4).embed_batches(batches))
        assert fake.max_in_flight == 2
        assert fake.embed_requests == 12
    assert answers == [expected(batch) for batch in batches]


def test_embed_is_the_same_serial_and_concurrent(server: FakeOllamaServer) -> None:
    texts = [f"text {i}" for i in range(20)]
    assert embedder(server, concurrency=4).embed(texts) == embedder(server).embed(texts) == expected(texts)
    assert embedder(server, concurrency=4).embed([]) == []


def test_a_bad_answer_stops_the_batches_without_sending_the_rest() -> None:
    """The first batch's answer is wrong: the error surfaces, and only the requests already in flight were sent."""
    def embed(model: str, text: str) -> list[float]:
        return deterministic_embedding(model, text, DIM + (text == "b0-t0"))

    with FakeOllamaServer([FakeModel(name="bge-m3", dim=DIM, embed=embed)]) as fake:
        with pytest.raises(EmbeddingError, match=r"size 17"):
            list(embedder(fake, concurrency=4).embed_batches(texts_in_batches(20)))
        assert fake.embed_requests <= 4


# --- several servers -----------------------------------------------------------------------------


def test_requests_are_spread_over_two_servers_at_once() -> None:
    """Each server holds its first request until the other server has one too."""
    barrier = threading.Barrier(2, timeout=10)
    first: dict[str, bool] = {}
    lock = threading.Lock()

    def model(name: str) -> FakeModel:
        def embed(model_name: str, text: str) -> list[float]:
            with lock:
                wait = name not in first
                first[name] = True
            if wait:
                barrier.wait()
            return deterministic_embedding(model_name, text, DIM)

        return FakeModel(name="bge-m3", dim=DIM, embed=embed)

    batches = texts_in_batches(8)
    with FakeOllamaServer([model("a")]) as a, FakeOllamaServer([model("b")]) as b:
        answers = list(embedder(a, b, concurrency=2, retries=0).embed_batches(batches))
        assert a.embedded_texts > 0 and b.embedded_texts > 0
        assert a.embedded_texts + b.embedded_texts == 8 * 3
    assert answers == [expected(batch) for batch in batches]


def test_a_failing_server_is_passed_over_then_tried_again_after_its_cooldown() -> None:
    clock = FakeClock()
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=DIM)]) as a, \
            FakeOllamaServer([FakeModel(name="bge-m3", dim=DIM)]) as b:
        a.faults.fail_next, a.faults.fail_status = 1000, 503
        client = embedder(a, b, cooldown_s=30, clock=clock)
        batches = texts_in_batches(6)
        assert list(client.embed_batches(batches)) == [expected(batch) for batch in batches]
        assert a.embed_requests == 1, "a failed once, then was passed over while cooling down"
        assert b.embedded_texts == 18

        clock.now += 29  # still cooling down: not asked
        assert client.embed(["x", "y"]) == expected(["x", "y"])
        assert a.embed_requests == 1

        a.faults.fail_next = 0  # a recovered; after its cool-down it is asked again and serves
        clock.now += 2
        assert list(client.embed_batches(batches)) == [expected(batch) for batch in batches]
        assert a.embedded_texts > 0 and a.embed_requests > 1


def test_a_server_that_refuses_connections_is_left_out_until_it_is_back() -> None:
    clock = FakeClock()
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=DIM)]) as a, \
            FakeOllamaServer([FakeModel(name="bge-m3", dim=DIM)]) as b:
        a.stop()  # the port refuses connections
        client = embedder(a, b, cooldown_s=30, clock=clock, concurrency=2)
        batches = texts_in_batches(6)
        assert list(client.embed_batches(batches)) == [expected(batch) for batch in batches]
        assert b.embedded_texts == 18
        a.start()  # back on the same port
        clock.now += 31
        assert list(client.embed_batches(batches)) == [expected(batch) for batch in batches]
        assert a.embedded_texts > 0


def test_all_servers_down_is_one_error_naming_every_server_without_credentials() -> None:
    ports = [free_port(), free_port()]
    client = OllamaEmbedder(host=",".join(f"http://kb:topsecret@127.0.0.1:{p}" for p in ports), model="bge-m3",
                            dim=DIM, retries=1, backoff_s=0.01, concurrency=2)
    with pytest.raises(EmbeddingError) as error:
        list(client.embed_batches(texts_in_batches(3)))
    message = str(error.value)
    assert "all 2 Ollama servers failed" in message
    for port in ports:
        assert f"http://127.0.0.1:{port} (connection refused)" in message
    assert "topsecret" not in message


def test_a_bad_vector_from_one_server_names_that_server() -> None:
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=DIM)]) as a, \
            FakeOllamaServer([FakeModel(name="bge-m3", dim=DIM)]) as b:
        b.faults.nan_next = 1
        with pytest.raises(EmbeddingError, match=rf"at {b.url} returned a vector with NaN"):
            embedder(a, b).embed([f"t{i}" for i in range(12)])


# --- the probe and check_model_served with several servers ----------------------------------------


def test_every_server_must_serve_the_model_and_the_one_that_does_not_is_named() -> None:
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=DIM)]) as a, \
            FakeOllamaServer([FakeModel(name="nomic-embed-text", dim=DIM)]) as b:
        settings = Settings.from_env({"OLLAMA_HOST": f"{a.url},{b.url}"})
        with pytest.raises(ModelNotServed, match=rf"'bge-m3' is not on the Ollama server at {b.url} \(one of the 2"):
            check_model_served(settings, embedder="ollama", model="bge-m3")
        with pytest.raises(ModelNotServed, match=rf"at {a.url} \(one of the 2"):
            embedder(a, b, dim=None, model="nomic-embed-text").dimension  # noqa: B018 (reading the property runs the probe under test)


def test_the_dimension_probe_asks_every_server_and_they_must_agree() -> None:
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=DIM)]) as a, \
            FakeOllamaServer([FakeModel(name="bge-m3", dim=DIM * 2)]) as b:
        with pytest.raises(EmbeddingError, match=rf"disagree .*{a.url} {DIM}-d, {b.url} {DIM * 2}-d"):
            embedder(a, b, dim=None).dimension  # noqa: B018 (reading the property runs the probe under test)


def test_the_probe_passes_over_a_server_that_is_down(server: FakeOllamaServer) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    client = OllamaEmbedder(host=f"{down},{server.url}", model="bge-m3", backoff_s=0.01)
    assert client.dimension == DIM
    assert client.hosts == [down, server.url]
    settings = Settings.from_env({"OLLAMA_HOST": f"{down},{server.url}"})
    check_model_served(settings, embedder="ollama", model="bge-m3")  # one answers and serves it


# --- settings --------------------------------------------------------------------------------------


def test_embed_concurrency_setting() -> None:
    assert Settings.from_env({}).embed_concurrency == 1
    assert Settings.from_env({"KB_EMBED_CONCURRENCY": "4"}).embed_concurrency == 4
    with pytest.raises(ConfigError, match=r"KB_EMBED_CONCURRENCY=0 must be at least 1"):
        Settings.from_env({"KB_EMBED_CONCURRENCY": "0"})
    with pytest.raises(ConfigError, match=r"KB_EMBED_CONCURRENCY='four' is not an integer"):
        Settings.from_env({"KB_EMBED_CONCURRENCY": "four"})
    settings = Settings.from_env({"KB_EMBEDDER": "ollama", "KB_EMBED_CONCURRENCY": "3", "KB_EMBED_DIM": "16",
                                  "OLLAMA_HOST": "http://a:11434, http://b:11434"})
    built = make_embedder(settings)
    assert isinstance(built, OllamaEmbedder) and built._concurrency == 3
    assert built.hosts == ["http://a:11434", "http://b:11434"]


def test_a_bad_ollama_host_list_is_refused_naming_the_entry_not_its_password() -> None:
    with pytest.raises(ConfigError, match=r"OLLAMA_HOST entry 2 of 3 is empty"):
        Settings.from_env({"OLLAMA_HOST": "http://a:11434,,http://b:11434"})
    with pytest.raises(ConfigError, match=r"OLLAMA_HOST entry 2 of 2 .*must be host:port or an http") as error:
        Settings.from_env({"OLLAMA_HOST": "http://a:11434,ftp://kb:topsecret@b"})
    assert "topsecret" not in str(error.value)
    with pytest.raises(ConfigError, match=r"entry 2 of 2 repeats a:11434"):
        split_ollama_hosts("http://a:11434,http://a:11434")
    with pytest.raises(ConfigError, match=r"entry 1 of 1 .*not a host"):
        split_ollama_hosts("http://a:port")
    assert split_ollama_hosts("a:11434, https://b") == ["a:11434", "https://b"]


def test_the_ollama_connection_may_list_several_servers() -> None:
    conn = SimpleNamespace(host="ollama-a, ollama-b:11435,https://ollama-c", port=11434, schema="", password="t0ken")
    host, headers = ollama_from_connection(conn)
    assert host == "http://ollama-a:11434,http://ollama-b:11435,https://ollama-c"
    assert headers == {"Authorization": "Bearer t0ken"}
    assert ollama_from_connection(SimpleNamespace(host="127.0.0.1", port=9, schema="", password=None)) == (
        "http://127.0.0.1:9", None)
    with pytest.raises(ConfigError, match=r"connection ollama_default: host entry 2 of 2 is empty"):
        ollama_from_connection(SimpleNamespace(host="a,", port=None, schema="", password=None))


def test_the_hashing_embedder_serves_batches_in_order() -> None:
    hashing = HashingEmbedder(dim=64)
    batches = texts_in_batches(3)
    assert list(hashing.embed_batches(batches)) == [hashing.embed(batch) for batch in batches]


# --- the build ---------------------------------------------------------------------------------------


def test_a_build_over_two_servers_with_concurrency_equals_the_serial_build(project: Path) -> None:
    """The same corpus built twice, once serially over one server and once with 4 in flight over two
    servers of 2 slots each: the same points with the same vectors."""
    # 1024-d: the golden set's MRR floor (0.8, calibrated for e5) is met by hashing vectors at that size, not at 256
    hashing = HashingEmbedder(model="bge-m3", dim=1024)

    def fake(parallel: int) -> FakeOllamaServer:
        return FakeOllamaServer([FakeModel(name="bge-m3", dim=1024, embed=lambda _m, t: hashing.embed_one(t))],
                                parallel=parallel)

    def build(alias: str, hosts: str, concurrency: int) -> dict[str, list[float]]:
        settings = settings_for(project, KB_EMBEDDER="ollama", OLLAMA_HOST=hosts, KB_EMBED_BATCH_SIZE="4",
                                KB_EMBED_CONCURRENCY=str(concurrency), KB_ALIAS=alias, **PATTERNS_SCREEN)
        client = QdrantClient(":memory:")
        deps = Deps(settings=settings, state=StateStore(settings.state_url), store=KnowledgeStore(client))
        try:
            assert run_reindex(deps).outcome == "promoted"
            target = deps.store.alias_target(alias)
            records, _ = client.scroll(target, limit=10_000, with_vectors=True)
            return {str(r.id): r.vector for r in records}  # type: ignore[misc]
        finally:
            deps.state.dispose()
            client.close()

    with fake(1) as single:
        serial = build("serial", single.url, 1)
    with fake(2) as a, fake(2) as b:
        concurrent = build("spread", f"{a.url},{b.url}", 4)
        assert a.embedded_texts > 0 and b.embedded_texts > 0
        assert a.max_in_flight <= 2 and b.max_in_flight <= 2
    assert len(serial) > 10
    assert concurrent == serial


def test_the_standalone_server_takes_parallel(tmp_path: Path) -> None:
    """`python -m kb_reindex.testing.ollama_server --parallel 2`: a real process; its exit line reports the
    most requests it processed at once."""
    import signal

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kb_reindex.testing.ollama_server", "--port", str(port),
                             "--dim", str(DIM), "--parallel", "2", "--delay-ms", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert "2 slot(s)" in proc.stdout.readline()
        client = OllamaEmbedder(host=f"http://127.0.0.1:{port}", model="bge-m3", dim=DIM, concurrency=4, batch_size=2)
        texts = [f"t{i}" for i in range(16)]
        assert client.embed(texts) == expected(texts)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)  # a loaded machine (two workers) is slow, not wrong
    assert "8 embed requests" in out and "at most 2 at once" in out
