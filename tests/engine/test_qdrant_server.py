"""kb-reindex over the wire: the real remote QdrantClient (REST) against the Qdrant-protocol test double.

The double runs as a separate process (``python -m kb_reindex.testing.qdrant_server``) on one local-mode
folder, so several kb-reindex processes can share it, and it can be killed and restarted on the same port.
What it cannot show: a real server's indexing, sharding or durability; every request is serialised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from qdrant_client import QdrantClient, models
from qdrant_client.http.exceptions import UnexpectedResponse


from kb_reindex.run.pipeline import run_reindex

from kb_reindex.run.runs import run_rollback
from kb_reindex.services.config import Settings
from kb_reindex.domain.errors import ConfigError, StoreError
from kb_reindex.reader import search_knowledge
from kb_reindex.services.runtime import open_deps
from kb_reindex.services.store import open_store
from kb_reindex.testing.qdrant_server import FakeQdrantServer, QdrantServerProcess, server_version, start_process
from kb_reindex.run.status import status_view

from conftest import settings_for

ALIAS = "mall_knowledge"
API_KEY = "kb-test-secret-4711"
CLI = Path(sys.executable).with_name("kb-reindex")
# the double speaks plain http on loopback; the client's warning about the key is expected here
pytestmark = pytest.mark.filterwarnings("ignore:Api key is used with an insecure connection")


# --- fixture -------------------------------------------------------------------------------------------


@pytest.fixture
def qdrant_server(tmp_path: Path) -> Iterator[QdrantServerProcess]:
    """The test double as its own process with an API key: ``.url``, ``.path``, ``add_fault()``,
    ``requests()``, ``kill()``/``stop()``/``restart()`` (same port, same folder)."""
    server = start_process(tmp_path / "qdrant-server", api_key=API_KEY)
    try:
        yield server
    finally:
        server.stop()


def server_settings(project: Path, server: QdrantServerProcess, **env: str) -> Settings:
    return settings_for(project, KB_QDRANT_URL=server.url, KB_QDRANT_API_KEY=API_KEY, **env)


def cli_env(project: Path, server: QdrantServerProcess | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_") or k.startswith("KB_TEST_")}
    env.update(KB_PROJECT_ROOT=str(project), KB_EMBEDDER="hashing")
    if server is not None:
        env.update(KB_QDRANT_URL=server.url, KB_QDRANT_API_KEY=API_KEY)
    env.update(extra)
    return env


def append_to(project: Path, key: str, text: str) -> None:
    path = project / "knowledge" / "docs" / f"{key}.md"
    path.write_text(path.read_text(encoding="utf-8") + f"\n\n{text}\n", encoding="utf-8")


def ops(server: QdrantServerProcess) -> list[str]:
    return [r["op"] for r in server.requests()]


# --- the double itself ---------------------------------------------------------------------------------


def test_the_double_answers_like_qdrant_for_our_calls(tmp_path: Path) -> None:
    """Errors, alias resolution, the version check and the admin hooks, in-process."""
    with FakeQdrantServer(tmp_path / "q") as server:
        client = QdrantClient(url=server.url, timeout=5)
        assert client.info().version == server_version()
        client.create_collection("c1", vectors_config=models.VectorParams(size=4, distance=models.Distance.COSINE))
        with pytest.raises(UnexpectedResponse) as duplicate:
            client.create_collection("c1", vectors_config=models.VectorParams(size=4, distance=models.Distance.COSINE))
        assert duplicate.value.status_code == 409
        with pytest.raises(UnexpectedResponse) as missing:
            client.count("nope")
        assert missing.value.status_code == 404
        assert missing.value.structured()["status"]["error"] == "Not found: Collection `nope` doesn't exist!"

        client.upsert("c1", points=[models.PointStruct(id=n, vector=[1.0, n, 0.0, 0.0], payload={"n": n})
                                    for n in range(1, 4)], wait=True)
        client.update_collection_aliases(change_aliases_operations=[
            models.CreateAliasOperation(create_alias=models.CreateAlias(collection_name="c1", alias_name="live"))])
        assert client.count("live").count == 3
        assert [p.id for p in client.query_points("live", query=[1.0, 1.0, 0.0, 0.0], limit=1).points] == [1]
        assert client.retrieve("live", ids=[2])[0].payload == {"n": 2}
        client.update_collection("c1", optimizers_config=models.OptimizersConfigDiff(indexing_threshold=0))
        info = client.get_collection("live")
        assert info.status == models.CollectionStatus.GREEN and info.config.optimizer_config.indexing_threshold == 0

        server.faults.add("count", status=503, count=1)
        with pytest.raises(UnexpectedResponse) as injected:
            client.count("live")
        assert injected.value.status_code == 503
        assert client.count("live").count == 3, "the fault fired once"
        server.faults.add("POST /collections/*/points/query", drop=True, count=1)
        with pytest.raises(Exception, match="disconnected|closed|reset|ResponseHandling"):
            client.query_points("live", query=[1.0, 0.0, 0.0, 0.0], limit=1)
        logged = [(r.op, r.status) for r in server.requests()]
        assert ("create_collection", 409) in logged and ("count", 503) in logged and ("query", 0) in logged
        client.close()


# --- the whole cycle -----------------------------------------------------------------------------------


def test_reindex_cycle_through_the_server(project: Path, qdrant_server: QdrantServerProcess) -> None:
    settings = server_settings(project, qdrant_server)
    with open_deps(settings) as deps:
        first = run_reindex(deps)
        assert first.outcome == "promoted" and first.version == 1, first.error
        assert run_reindex(deps).outcome == "no_change"

        append_to(project, "payment-guide", "补充：支持先用后付，账单日后 30 天内还款。")
        qdrant_server.clear_requests()
        second = run_reindex(deps)
        assert second.outcome == "promoted" and second.version == 2, second.error
        assert second.docs.changed == 1 and second.docs.added == 0
        new_ids = deps.store.existing_ids(second.collection) - deps.store.existing_ids(first.collection)
        assert second.build.embedded == second.chunks.embedded == len(new_ids) > 0
        assert {r.payload["knowledge_key"] for r in deps.store.retrieve(second.collection, sorted(new_ids))} == {
            "payment-guide"}, "only the edited doc's chunks are embedded"
        assert second.build.copied == deps.store.count(second.collection) - len(new_ids)
        seen = ops(qdrant_server)
        assert {"upsert", "retrieve", "query", "count", "update_aliases", "create_collection", "create_index"} <= set(seen)

        assert deps.store.alias_target(ALIAS) == second.collection
        assert status_view(deps).to_dict()["problems"] == []
        answer = search_knowledge(deps, "怎么先用后付", k=3)
        assert answer.version == 2 and answer.results
        assert answer.results[0].knowledge_key == "payment-guide"

        rolled = run_rollback(deps, reason="x")
        assert rolled.to_version == 1
        assert deps.store.alias_target(ALIAS) == first.collection
        assert status_view(deps).to_dict()["problems"] == []


# --- refused key, refused connection, timeout ------------------------------------------------------------


def test_wrong_or_missing_api_key_is_a_config_error_naming_the_url(project: Path,
                                                                    qdrant_server: QdrantServerProcess) -> None:
    with pytest.raises(UnexpectedResponse, match="401") as raw:
        QdrantClient(url=qdrant_server.url, api_key="wrong-key", timeout=5).get_collections()
    assert b"Invalid API key" in raw.value.content

    wrong = settings_for(project, KB_QDRANT_URL=qdrant_server.url, KB_QDRANT_API_KEY="wrong-key-123")
    with pytest.raises(ConfigError) as refused:
        with open_deps(wrong):
            pass
    message = str(refused.value)
    assert qdrant_server.url in message and "refused the API key" in message and "HTTP 401" in message
    assert "wrong-key-123" not in message and "\n" not in message

    with pytest.raises(ConfigError, match="requires an API key"):
        with open_deps(settings_for(project, KB_QDRANT_URL=qdrant_server.url)):
            pass


def test_a_server_too_slow_to_answer_at_open_is_a_store_error(project: Path, qdrant_server: QdrantServerProcess) -> None:
    """make_client's timeout is 60 s; a client with a 1 s timeout shows the same mapping quickly."""
    settings = server_settings(project, qdrant_server)
    qdrant_server.add_fault("collections", delay_s=3, count=1)
    client = QdrantClient(url=qdrant_server.url, api_key=API_KEY, timeout=1)
    started = time.monotonic()
    with pytest.raises(StoreError, match="no answer in time") as slow:
        with open_store(settings, client=client):
            pass
    assert time.monotonic() - started < 2.9
    assert qdrant_server.url in str(slow.value) and API_KEY not in str(slow.value)
    client.close()


def test_cli_exit_codes_and_one_line_errors_for_refused_key_and_connection(
    project: Path, qdrant_server: QdrantServerProcess
) -> None:
    nowhere = "http://127.0.0.1:9"
    wrong_key = subprocess.Popen(
        [str(CLI), "run", "-q"], env=cli_env(project, qdrant_server, KB_QDRANT_API_KEY="wrong-key-123"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    refused = subprocess.Popen([str(CLI), "run", "-q"], env=cli_env(project, None, KB_QDRANT_URL=nowhere),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, key_err = wrong_key.communicate(timeout=120)
    _, refused_err = refused.communicate(timeout=120)

    assert wrong_key.returncode == 2, key_err
    error_lines = [line for line in key_err.splitlines() if line.startswith("kb-reindex: error:")]
    assert len(error_lines) == 1 and error_lines[0] == key_err.splitlines()[-1]
    assert qdrant_server.url in error_lines[0] and "refused the API key" in error_lines[0]
    assert "wrong-key-123" not in key_err
    # the only other line allowed is the one-line warning that the key travels over plain http
    assert all("sent unencrypted" in line for line in key_err.splitlines()[:-1]), key_err

    assert refused.returncode == 3, refused_err  # nothing answers: unavailable, not a setting
    assert len(refused_err.splitlines()) == 1, refused_err
    assert nowhere in refused_err and "unreachable" in refused_err


# --- concurrency, crashes, faults -------------------------------------------------------------------


def test_two_cli_runs_at_once_promote_exactly_once(project: Path, qdrant_server: QdrantServerProcess) -> None:
    """`kb-reindex run` as two fresh processes started together (env only: project root, server URL, key);
    a slow first upsert keeps the winner building while the other arrives."""
    qdrant_server.add_fault("upsert", delay_s=6, count=1)  # margin for a process that starts late on a loaded machine
    env = cli_env(project, qdrant_server, KB_LOCK_WAIT="0")  # the loser stops at once instead of waiting
    runs = [subprocess.Popen([str(CLI), "run", "--json", "-q"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    answers = [run.communicate(timeout=120) for run in runs]
    qdrant_server.clear_faults()
    results = [json.loads(out) for out, _ in answers]
    outcomes = sorted(r["outcome"] for r in results)
    assert outcomes == ["failed", "promoted"], [r.get("error") for r in results]
    loser = next(r for r in results if r["outcome"] == "failed")
    assert "another run is working on mall_knowledge" in loser["error"] or "alias moved" in loser["error"]
    assert sorted(run.returncode for run in runs) == [0, 1]
    assert all(API_KEY not in err for _, err in answers)
    assert [r["status"] for r in qdrant_server.requests() if r["op"] == "update_aliases"] == [200]

    with open_deps(server_settings(project, qdrant_server)) as deps:
        live = deps.state.live_version(ALIAS)
        assert live is not None and live.version == 1
        assert deps.store.alias_target(ALIAS) == live.collection
        assert deps.store.count(live.collection) == live.points_expected
        assert status_view(deps).to_dict()["problems"] == []


def test_server_killed_mid_build_leaves_the_alias_and_a_rerun_resumes(
    project: Path, qdrant_server: QdrantServerProcess
) -> None:
    settings = server_settings(project, qdrant_server, KB_EMBED_BATCH_SIZE="2", KB_COPY_BATCH_SIZE="4")
    with open_deps(settings) as deps:
        first = run_reindex(deps)
        assert first.outcome == "promoted", first.error
    for key in ("payment-guide", "member-rules"):
        append_to(project, key, "补充：周末双倍积分，先用后付可用。")

    qdrant_server.clear_requests()
    qdrant_server.add_fault("upsert", delay_s=60, after=2, count=1)  # the third write hangs
    outcome: dict[str, Any] = {}

    def run() -> None:
        with open_deps(settings) as running:
            outcome.update(run_reindex(running).to_dict())

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    deadline = time.monotonic() + 30
    while ops(qdrant_server).count("upsert") < 3:
        assert time.monotonic() < deadline and runner.is_alive(), outcome
        time.sleep(0.05)
    qdrant_server.kill()
    runner.join(timeout=30)
    assert not runner.is_alive()
    assert outcome["outcome"] == "failed"
    error = outcome["error"]
    assert "\n" not in error and "Qdrant" in error and qdrant_server.url in error, error

    qdrant_server.start()  # same port, same folder
    with open_deps(settings) as deps:
        assert deps.store.alias_target(ALIAS) == first.collection, "the alias is untouched"
        assert deps.state.live_version(ALIAS).version == 1
        again = run_reindex(deps)
        assert again.outcome == "promoted" and again.version == 2, again.error
        assert again.build.skipped >= 2 * 2, "points written before the crash are not written again"
        assert status_view(deps).to_dict()["problems"] == []


def test_a_503_on_one_upsert_fails_the_run_cleanly_and_a_rerun_completes(
    project: Path, qdrant_server: QdrantServerProcess
) -> None:
    settings = server_settings(project, qdrant_server, KB_EMBED_BATCH_SIZE="2", KB_COPY_BATCH_SIZE="4")
    with open_deps(settings) as deps:
        first = run_reindex(deps)
        assert first.outcome == "promoted", first.error
        append_to(project, "member-rules", "补充：生日当月双倍积分。")
        qdrant_server.clear_requests()
        qdrant_server.add_fault("upsert", status=503, after=1, count=1)
        failed = run_reindex(deps)
        assert failed.outcome == "failed"
        assert "503" in failed.error and "\n" not in failed.error, failed.error
        assert deps.store.alias_target(ALIAS) == first.collection
        assert [(r["op"], r["status"]) for r in qdrant_server.requests() if r["op"] == "upsert"][1] == ("upsert", 503)

        again = run_reindex(deps)
        assert again.outcome == "promoted" and again.version == 2, again.error
        assert deps.store.alias_target(ALIAS) == again.collection
        assert status_view(deps).to_dict()["problems"] == []


def test_the_cli_prints_no_http_request_lines_unless_verbose(qdrant_server: QdrantServerProcess, project: Path) -> None:
    env = cli_env(project, qdrant_server)
    assert subprocess.run([str(CLI), "run", "-q"], env=env, capture_output=True, timeout=180).returncode == 0
    quiet = subprocess.run([str(CLI), "status"], env=env, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and "alias mall_knowledge -> v1" in quiet.stdout
    assert "HTTP Request" not in quiet.stderr, quiet.stderr
    verbose = subprocess.run([str(CLI), "status", "-v"], env=env, capture_output=True, text=True, timeout=120)
    assert "HTTP Request: GET http://" in verbose.stderr


def test_the_servers_cosine_search_ranks_as_local_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server process's search skips local mode's per-query renormalization of stored unit vectors: the same
    ranks and scores (to float rounding) as local mode's own cosine, for single and batched queries."""
    import numpy as np
    from qdrant_client import models as qm
    from qdrant_client.local import distances, local_collection

    from kb_reindex.testing.qdrant_server import search_as_qdrant_does

    monkeypatch.setattr(local_collection, "calculate_distance", local_collection.calculate_distance)
    search_as_qdrant_does()
    rng = np.random.default_rng(7)
    stored = rng.normal(size=(2000, 64)).astype(np.float32)
    stored /= np.linalg.norm(stored, axis=-1)[:, np.newaxis]  # as upsert leaves them
    for query in (rng.normal(size=64).astype(np.float32), rng.normal(size=(5, 64)).astype(np.float32)):
        fast = local_collection.calculate_distance(query, stored.copy(), qm.Distance.COSINE)
        slow = distances.calculate_distance(query, stored.copy(), qm.Distance.COSINE)
        assert np.allclose(fast, slow, atol=1e-6)
        assert (np.argsort(-fast, axis=-1)[..., :10] == np.argsort(-slow, axis=-1)[..., :10]).all()
    dot = rng.normal(size=64).astype(np.float32)
    assert np.array_equal(local_collection.calculate_distance(dot, stored, qm.Distance.DOT),
                          distances.calculate_distance(dot, stored, qm.Distance.DOT))


def test_a_batch_of_queries_is_one_pass_over_the_points_and_answers_as_one_query_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server scores a batch request's dense queries in one product over the points (local mode reads every
    point once per query); each query's answer (IDs, order, scores, its own filter and limit) is the one it gets
    alone."""
    import numpy as np
    from qdrant_client import models as qm
    from qdrant_client.local import local_collection

    from kb_reindex.testing.qdrant_server import search_as_qdrant_does

    monkeypatch.setattr(local_collection, "calculate_distance", local_collection.calculate_distance)
    search_as_qdrant_does()
    rng = np.random.default_rng(11)
    with FakeQdrantServer(tmp_path / "q") as server:
        client = QdrantClient(url=server.url, timeout=30)
        client.create_collection("c", vectors_config=qm.VectorParams(size=32, distance=qm.Distance.COSINE))
        client.upsert("c", points=[qm.PointStruct(id=n, vector=rng.normal(size=32).tolist(),
                                                  payload={"tenant": "a" if n % 3 else "b"}) for n in range(600)])
        tenant_b = qm.Filter(must=[qm.FieldCondition(key="tenant", match=qm.MatchValue(value="b"))])
        requests = [qm.QueryRequest(query=rng.normal(size=32).tolist(), limit=limit, with_payload=True, filter=f)
                    for limit, f in ((5, None), (3, tenant_b), (7, None), (1, tenant_b))]
        passes: list[tuple[int, ...]] = []
        real_dot = np.dot

        def counting_dot(a: Any, b: Any, *rest: Any) -> Any:
            for operand in (a, b):
                if getattr(operand, "shape", (0,))[0] == 600 or getattr(operand, "shape", (0, 0))[-1] == 600:
                    passes.append(operand.shape)
                    break
            return real_dot(a, b, *rest)

        monkeypatch.setattr(np, "dot", counting_dot)
        batch = client.query_batch_points("c", requests=requests)
        assert len(passes) == 1, passes
        passes.clear()
        alone = [client.query_points("c", query=r.query, limit=r.limit, query_filter=r.filter, with_payload=True)
                 for r in requests]
        assert len(passes) == len(requests)
        for together, single in zip(batch, alone, strict=True):
            assert [p.id for p in together.points] == [p.id for p in single.points]
            assert np.allclose([p.score for p in together.points], [p.score for p in single.points], atol=1e-6)
        assert all(p.payload == {"tenant": "b"} for p in batch[1].points + batch[3].points)
        client.close()


def test_a_query_sorts_its_best_points_alone_and_answers_as_local_mode_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server sorts a query's best points, not every point's score (a full sort per query was 0.3 s of 20
    probes at 200k points); the answer is local mode's: the same points in the same order, also when a filter or
    a threshold walks past the best ones, and with equal scores at the partition's edge (duplicate vectors)."""
    import numpy as np
    from qdrant_client import models as qm
    from qdrant_client.local import local_collection

    from kb_reindex.testing import qdrant_server

    monkeypatch.setattr(local_collection, "calculate_distance", local_collection.calculate_distance)
    rng = np.random.default_rng(5)
    base = rng.normal(size=(2500, 16)).astype(np.float32)
    vectors = np.concatenate([base, base, base[:1000]])  # 6,000 points, every vector at least twice
    tenant_b = qm.Filter(must=[qm.FieldCondition(key="tenant", match=qm.MatchValue(value="b"))])

    def answers() -> list[list[tuple[float, int]]]:
        client = QdrantClient(":memory:")
        client.create_collection("c", vectors_config=qm.VectorParams(size=16, distance=qm.Distance.COSINE))
        client.upsert("c", points=qm.Batch(ids=list(range(len(vectors))), vectors=vectors.tolist(),
                                           payloads=[{"tenant": "b" if n % 97 == 0 else "a"} for n in range(len(vectors))]))
        query = base[3].tolist()
        found = [client.query_points("c", query=query, limit=limit, query_filter=f, score_threshold=t).points
                 for limit, f, t in ((10, None, None), (40, tenant_b, None), (5000, None, 0.2), (300, None, None))]
        client.close()
        return [[(round(p.score, 5), p.id) for p in points] for points in found]

    plain = answers()
    qdrant_server.search_as_qdrant_does()
    monkeypatch.setattr(qdrant_server, "_FULL_SORT_BELOW", 1000)
    fast = answers()
    for mine, theirs in zip(fast, plain, strict=True):
        assert [score for score, _ in mine] == [score for score, _ in theirs]
        last = mine[-1][0]  # points of equal score may come in another order, as in local mode's own sort, so
        # those of the last score the limit cuts among may differ; every other point is the same
        assert sorted(p for p in mine if p[0] != last) == sorted(p for p in theirs if p[0] != last)
        assert len({point for _, point in mine}) == len(mine)
    assert len(fast[1]) == 40 and len(fast[2]) > 300  # the filter and the threshold walked past the best 256
    scores = qdrant_server._best_first(rng.normal(size=5000).astype(np.float32))
    lazy = np.argsort(scores)
    assert [int(i) for i, _ in zip(lazy[::-1], range(10), strict=False)] == list(np.argsort(-np.asarray(scores))[:10])
    assert lazy._full is None  # the best alone were sorted, not the 5,000
    assert list(lazy) == list(np.asarray(scores).argsort())  # any other use is the full sort


def test_products_are_taken_in_the_stored_float32_and_a_loaded_folder_is_stored_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A query arrives as float64 (JSON floats): the server casts it to the stored vectors' float32, so numpy never
    converts every stored vector for a product (0.34 s a query at 51k x 1024-d); and the collections local mode loads
    from its folder (as float64) are stored as float32, as Qdrant and local mode keep what they are sent."""
    import numpy as np
    from qdrant_client import models as qm
    from qdrant_client.local import local_collection

    from kb_reindex.testing.qdrant_server import search_as_qdrant_does

    rng = np.random.default_rng(3)
    local = QdrantClient(path=str(tmp_path / "q"))
    local.create_collection("c", vectors_config=qm.VectorParams(size=16, distance=qm.Distance.COSINE))
    local.upsert("c", points=[qm.PointStruct(id=n, vector=rng.normal(size=16).tolist()) for n in range(50)])
    local.close()

    monkeypatch.setattr(local_collection, "calculate_distance", local_collection.calculate_distance)
    search_as_qdrant_does()
    with FakeQdrantServer(tmp_path / "q") as server:
        stored = server._backend.client._client._client.collections["c"].vectors[""]  # type: ignore[union-attr]
        assert stored.dtype == np.float32
        operands: list[str] = []
        real_dot = np.dot

        def recording_dot(a: Any, b: Any, *rest: Any) -> Any:
            if 50 in getattr(a, "shape", ()) + getattr(b, "shape", ()):
                operands.extend((a.dtype.name, b.dtype.name))
            return real_dot(a, b, *rest)

        monkeypatch.setattr(np, "dot", recording_dot)
        client = QdrantClient(url=server.url, timeout=30)
        query = rng.normal(size=16).tolist()
        alone = client.query_points("c", query=query, limit=5).points
        batch = client.query_batch_points("c", requests=[qm.QueryRequest(query=query, limit=5),
                                                         qm.QueryRequest(query=rng.normal(size=16).tolist(), limit=5)])
        client.close()
    assert operands and set(operands) == {"float32"}, operands
    assert [p.id for p in alone] == [p.id for p in batch[0].points]
