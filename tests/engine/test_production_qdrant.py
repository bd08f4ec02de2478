"""Production Qdrant settings, checked by the calls that reach the Qdrant-protocol test server.

The server is the in-process :class:`FakeQdrantServer` (local mode behind REST): it records every request
and reports the settings collections were created and patched with, so these tests read what kb-reindex
asked of Qdrant. What no test here can show: that a real server builds the index it was asked for.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from qdrant_client import QdrantClient, models


from kb_reindex.run.pipeline import run_reindex
from kb_reindex.services.config import Settings
from kb_reindex.domain.errors import ConfigError
from kb_reindex.services.runtime import open_deps
from kb_reindex.services.store import make_client
from kb_reindex.testing.qdrant_server import FakeQdrantServer
from kb_reindex.run.status import status_view

from conftest import settings_for

API_KEY = "kb-prod-secret-0815"
pytestmark = [pytest.mark.filterwarnings("ignore:Api key is used with an insecure connection"),
              # clients pointed at nowhere, built only to read their options, fail their version check
              pytest.mark.filterwarnings("ignore:Failed to obtain server version")]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FakeQdrantServer]:
    with FakeQdrantServer(tmp_path / "qdrant-server", api_key=API_KEY) as running:
        yield running


def on_server(project: Path, server: FakeQdrantServer, **env: str) -> Settings:
    return settings_for(project, KB_QDRANT_URL=server.url, KB_QDRANT_API_KEY=API_KEY, **env)


def append_to(project: Path, key: str, text: str) -> None:
    path = project / "knowledge" / "docs" / f"{key}.md"
    path.write_text(path.read_text(encoding="utf-8") + f"\n\n{text}\n", encoding="utf-8")


def created(server: FakeQdrantServer, collection: str) -> dict[str, Any]:
    [request] = [r for r in server.requests() if r.op == "create_collection" and r.collection == collection]
    return request.body


# --- 1. one client factory ---------------------------------------------------------------------------


def test_every_environment_option_reaches_the_client(project: Path) -> None:
    settings = settings_for(project, KB_QDRANT_URL="https://127.0.0.1:9", KB_QDRANT_API_KEY="key-123456",
                            KB_QDRANT_HTTPS="true", KB_QDRANT_PREFIX="/qdrant/", KB_QDRANT_PREFER_GRPC="yes",
                            KB_QDRANT_GRPC_PORT="7334", KB_QDRANT_TIMEOUT="17")
    client = make_client(settings)
    try:
        options = client.init_options
        assert (options["url"], options["api_key"], options["https"], options["prefix"], options["prefer_grpc"],
                options["grpc_port"], options["timeout"]) == (
            "https://127.0.0.1:9", "key-123456", True, "qdrant", True, 7334, 17)
        assert client._client.rest_uri == "https://127.0.0.1:9/qdrant"
    finally:
        client.close()
    defaults = make_client(settings_for(project, KB_QDRANT_URL="http://127.0.0.1:9"))
    assert (defaults.init_options["timeout"], defaults.init_options["prefer_grpc"]) == (60, False)
    defaults.close()


@pytest.mark.parametrize(("env", "named"), [
    ({"KB_QDRANT_HTTPS": "maybe"}, "KB_QDRANT_HTTPS='maybe' is not a boolean"),
    ({"KB_QDRANT_HTTPS": "false", "KB_QDRANT_URL": "https://q:6333"}, "KB_QDRANT_HTTPS=false contradicts"),
    ({"KB_QDRANT_URL": "ftp://q:6333"}, "KB_QDRANT_URL='ftp://q:6333' must start with http"),
    ({"KB_QDRANT_GRPC_PORT": "70000"}, "KB_QDRANT_GRPC_PORT=70000 is not a port"),
    ({"KB_QDRANT_TIMEOUT": "0"}, "KB_QDRANT_TIMEOUT=0 must be at least 1"),
    ({"KB_QDRANT_PREFER_GRPC": "grpc"}, "KB_QDRANT_PREFER_GRPC='grpc' is not a boolean"),
    ({"KB_INDEX_WAIT_S": "soon"}, "KB_INDEX_WAIT_S='soon' is not an integer"),
])
def test_bad_client_options_are_refused_by_name(project: Path, env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(".", r"\.")):
        settings_for(project, **env)


def test_an_airflow_connection_in_json_gives_a_client_at_the_server(
    project: Path, server: FakeQdrantServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kb_reindex.airflow.connections import task_deps

    port = int(server.url.rsplit(":", 1)[1])
    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    monkeypatch.setenv("AIRFLOW_CONN_QDRANT_DEFAULT", json.dumps({
        "conn_type": "qdrant", "host": "127.0.0.1", "port": port, "password": API_KEY,
        "extra": {"https": False, "timeout": 7, "collection_config": {"hnsw_config": {"m": 24}}}}))
    with task_deps() as deps:
        options = deps.store.client.init_options
        assert (options["host"], options["port"], options["api_key"], options["timeout"]) == (
            "127.0.0.1", port, API_KEY, 7)
        assert not deps.store.is_local and deps.settings.qdrant_path is None
        assert deps.settings.collection_config is not None
        assert deps.settings.collection_config.to_dict() == {"hnsw_config": {"m": 24}}
        assert deps.store.collection_names() == set()
    # qdrant-client checks the server's version from a thread of its own, so that request may come last
    assert "collections" in [r.op for r in server.requests()], "the task's client spoke to the test server"

    monkeypatch.setenv("AIRFLOW_CONN_QDRANT_DEFAULT", json.dumps({
        "conn_type": "qdrant", "host": "127.0.0.1", "port": port, "extra": {"grpc_port": "lots"}}))
    with pytest.raises(ConfigError, match="connection qdrant_default: extra grpc_port='lots' is not an integer"):
        with task_deps():
            pass


# --- 2. collection settings ------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "named"), [
    ('{"hnsw_config": {"m": 16, "ef": 100}}', "hnsw_config.ef: unknown key"),
    ('{"hnsw": {"m": 16}}', "hnsw: unknown key"),
    ('{"hnsw_config": {"ef_construct": 2}}', "hnsw_config: Value error, ef_construct=2 must be at least 4"),
    ('{"shard_number": 0}', "shard_number: Input should be greater than 0"),
    ('{"on_disk": "sometimes"}', "on_disk: Input should be a valid boolean"),
    ('{"quantization_config": {"product": {"compression": "x16"}}}', "quantization_config: use scalar or binary"),
    ('{"quantization_config": {"scalar": {"type": "int4"}}}', "quantization_config.scalar.type"),
    ('{"replication_factor": 2, "write_consistency_factor": 3}', "write_consistency_factor=3 exceeds"),
    ("[1, 2]", "must be a mapping of collection settings"),
    ("conf/nowhere.yaml", "'conf/nowhere.yaml' is neither a file nor a JSON/YAML mapping"),
    ("{m: [", "is not valid JSON or YAML"),
])
def test_bad_collection_config_is_refused_naming_the_key(project: Path, raw: str, named: str) -> None:
    with pytest.raises(ConfigError, match="KB_QDRANT_COLLECTION_CONFIG") as refused:
        settings_for(project, KB_QDRANT_COLLECTION_CONFIG=raw)
    assert named in str(refused.value), str(refused.value)


def test_collection_config_from_json_yaml_or_a_file(project: Path) -> None:
    wanted = {"hnsw_config": {"m": 32, "ef_construct": 200}, "on_disk": True,
              "quantization_config": {"scalar": {"type": "int8", "always_ram": True}}}
    inline_json = settings_for(project, KB_QDRANT_COLLECTION_CONFIG=json.dumps(wanted)).collection_config
    inline_yaml = settings_for(project, KB_QDRANT_COLLECTION_CONFIG=(
        "hnsw_config: {m: 32, ef_construct: 200}\non_disk: true\n"
        "quantization_config: {scalar: {type: int8, always_ram: true}}")).collection_config
    (project / "qdrant.yaml").write_text("binary_and_more: 1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"KB_QDRANT_COLLECTION_CONFIG \(.*qdrant.yaml\): binary_and_more: unknown"):
        settings_for(project, KB_QDRANT_COLLECTION_CONFIG="qdrant.yaml")
    (project / "qdrant.yaml").write_text(json.dumps(wanted), encoding="utf-8")
    from_file = settings_for(project, KB_QDRANT_COLLECTION_CONFIG="qdrant.yaml").collection_config
    assert inline_json is not None and inline_yaml is not None and from_file is not None
    assert inline_json.to_dict() == inline_yaml.to_dict() == from_file.to_dict() == wanted


def test_new_versions_carry_configured_or_inherited_settings_and_three_payload_indexes(
    project: Path, server: FakeQdrantServer
) -> None:
    configured = {"hnsw_config": {"m": 32, "ef_construct": 256}, "on_disk": True, "on_disk_payload": True,
                  "quantization_config": {"scalar": {"type": "int8", "quantile": 0.99}}, "shard_number": 2,
                  "replication_factor": 2, "write_consistency_factor": 1}
    with open_deps(on_server(project, server, KB_QDRANT_COLLECTION_CONFIG=json.dumps(configured))) as deps:
        first = run_reindex(deps)
        assert first.outcome == "promoted", first.error
    body = created(server, first.collection)
    assert body["hnsw_config"] == {"m": 0, "ef_construct": 256}, "HNSW deferred for the bulk load"
    assert body["vectors"]["on_disk"] is True and body["on_disk_payload"] is True
    assert (body["shard_number"], body["replication_factor"], body["write_consistency_factor"]) == (2, 2, 1)
    assert body["quantization_config"] == {"scalar": "{quantile,type}"}  # the log cuts depth: keys only
    indexed = sorted(r.body["field_name"] for r in server.requests()
                     if r.op == "create_index" and r.collection == first.collection)
    assert indexed == ["category", "knowledge_key", "tenant"]
    assert {r.body["field_schema"] for r in server.requests() if r.op == "create_index"} == {"keyword"}

    # unconfigured, the next version takes live's settings; a configured key still wins, field by field for HNSW
    append_to(project, "payment-guide", "补充：支持先用后付。")
    server.clear_requests()
    with open_deps(on_server(project, server, KB_QDRANT_COLLECTION_CONFIG='{"hnsw_config": {"m": 48}}')) as deps:
        second = run_reindex(deps)
        assert second.outcome == "promoted", second.error
        versions = {v["version"]: v for v in status_view(deps).to_dict()["versions"]}
    body = created(server, second.collection)
    assert body["hnsw_config"]["m"] == 0 and body["hnsw_config"]["ef_construct"] == 256
    assert body["shard_number"] == 2 and body["vectors"]["on_disk"] is True and "quantization_config" in body
    recorded = versions[2]["collection_config"]
    assert recorded["hnsw_config"]["m"] == 48 and recorded["hnsw_config"]["ef_construct"] == 256
    assert recorded["quantization_config"] == {"scalar": {"type": "int8", "quantile": 0.99}}
    assert versions[1]["collection_config"] == {**configured, "hnsw_config": {"m": 32, "ef_construct": 256}}


def test_local_mode_records_only_what_was_configured(settings: Settings, project: Path) -> None:
    local = settings_for(project, KB_QDRANT_COLLECTION_CONFIG='{"on_disk": true}')
    with open_deps(local) as deps:
        assert deps.store.is_local
        result = run_reindex(deps)
        assert result.outcome == "promoted", result.error
        [version] = status_view(deps).to_dict()["versions"]
    assert version["collection_config"] == {"on_disk": True}


# --- 4. bulk build, indexing restored, index wait --------------------------------------------------------


def test_indexing_is_restored_after_the_last_upsert_and_before_the_first_query(
    project: Path, server: FakeQdrantServer
) -> None:
    with open_deps(on_server(project, server)) as deps:
        result = run_reindex(deps)
        assert result.outcome == "promoted", result.error
    collection = result.collection
    mine = [r for r in server.requests() if r.collection == collection]
    ops = [r.op for r in mine]
    assert created(server, collection)["hnsw_config"] == {"m": 0}
    patch = ops.index("update_collection")
    assert mine[patch].body == {"hnsw_config": {"m": 16}}, "Qdrant's default m when nothing is configured"
    first_query = min(i for i, op in enumerate(ops) if op in ("query", "query_batch"))  # the golden set is one batch
    assert max(i for i, op in enumerate(ops) if op == "upsert") < patch < first_query
    assert ops.index("get_collection", patch) < first_query, "the index is checked before validation queries"
    assert ops.count("update_collection") == 3, "one PATCH restores m; the others note 'validated' and 'served'"
    assert QdrantClient(url=server.url, api_key=API_KEY).get_collection(collection).config.hnsw_config.m == 16


def test_validation_waits_for_green_and_times_out_naming_collection_and_wait(
    project: Path, server: FakeQdrantServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kb_reindex.services.store.INDEX_POLL_S", 0.05)
    settings = on_server(project, server, KB_INDEX_WAIT_S="1")
    with open_deps(settings) as deps:
        server.hold_indexing(3)
        waited = run_reindex(deps)
        assert waited.outcome == "promoted", waited.error
        assert [r.status for r in server.requests() if r.op == "get_collection"].count(200) >= 3

        append_to(project, "member-rules", "补充：生日当月双倍积分。")
        server.hold_indexing(10_000, status="yellow")
        stuck = run_reindex(deps)
        assert stuck.outcome == "failed"
        assert stuck.error.startswith(f"collection {stuck.collection} is not ready for queries after 1 s "
                                         "(KB_INDEX_WAIT_S): status yellow, optimizer ok, 0 of ")
        assert deps.store.alias_target(settings.alias) == waited.collection, "the alias did not move"
        assert not [r for r in server.requests() if r.op == "query" and r.collection == stuck.collection]
        version = deps.state.get_version(settings.alias, stuck.version)
        assert (version.status, version.failed_step) == ("failed", "validate")

        server.hold_indexing(0)
        server.clear_requests()
        resumed = run_reindex(deps)
        assert resumed.outcome == "promoted" and resumed.version == stuck.version, resumed.error
        assert resumed.chunks.skipped > 0 and resumed.chunks.embedded == 0
        # m was restored by the failed attempt already: nothing to PATCH again, only the notes
        notes = [r.body for r in server.requests() if r.op == "update_collection"]
        assert [list(body) for body in notes] == [["metadata"], ["metadata"]]


def test_a_build_resumed_after_a_crash_still_restores_indexing(project: Path, server: FakeQdrantServer) -> None:
    settings = on_server(project, server, KB_EMBED_BATCH_SIZE="4")
    server.faults.add("upsert", status=503, after=2, count=1)
    with open_deps(settings) as deps:
        failed = run_reindex(deps)
        assert failed.outcome == "failed" and "503" in failed.error
        assert not [r for r in server.requests() if r.op == "update_collection"], "not restored mid-build"
        server.clear_requests()
        again = run_reindex(deps)
        assert again.outcome == "promoted" and again.version == failed.version, again.error
    assert "create_collection" not in [r.op for r in server.requests()]
    patches = [r.body for r in server.requests() if r.op == "update_collection" and "hnsw_config" in r.body]
    assert patches == [{"hnsw_config": {"m": 16}}]


def test_the_index_wait_expects_an_index_only_where_qdrant_builds_one() -> None:
    from kb_reindex.services.store import index_state

    def info(*, points: int, indexed: int, segments: int = 1, threshold_kb: int = 10_000,
             status: str = "green") -> models.CollectionInfo:
        return models.CollectionInfo(
            status=status, optimizer_status=models.OptimizersStatusOneOf.OK, points_count=points,
            indexed_vectors_count=indexed, segments_count=segments, payload_schema={},
            config=models.CollectionConfig(
                params=models.CollectionParams(vectors=models.VectorParams(size=1024, distance="Cosine")),
                hnsw_config=models.HnswConfig(m=16, ef_construct=100, full_scan_threshold=10_000),
                optimizer_config=models.OptimizersConfig(deleted_threshold=0.2, vacuum_min_vector_number=1000,
                                                         default_segment_number=0, indexing_threshold=threshold_kb,
                                                         flush_interval_sec=5),
                wal_config=models.WalConfig(wal_capacity_mb=32, wal_segments_ahead=0)))

    assert index_state(info(points=100, indexed=0), m=16)[0], "100 x 4 KB is below 10,000 KB: no index expected"
    big = 10_000  # 40,000 KB of vectors
    assert not index_state(info(points=big, indexed=big // 2), m=16)[0]
    assert index_state(info(points=big, indexed=big), m=16)[0]
    assert index_state(info(points=big, indexed=0, segments=8), m=16)[0], "5,000 KB per segment: none built"
    assert index_state(info(points=big, indexed=0), m=0)[0], "m=0 configured: no graph to wait for"
    assert index_state(info(points=big, indexed=0, threshold_kb=0), m=16)[0], "indexing disabled"
    ready, state = index_state(info(points=100, indexed=0, status="yellow"), m=16)
    assert not ready and state.startswith("status yellow, optimizer ok, 0 of 100 vectors indexed")


# --- 5. snapshots before retention drops a collection --------------------------------------------------


def test_snapshot_before_drop_is_refused_in_local_mode(project: Path) -> None:
    with pytest.raises(ConfigError, match=r"^KB_SNAPSHOT_BEFORE_DROP needs a Qdrant server \(KB_QDRANT_URL\); "
                                          "local mode has no snapshots$"):
        with open_deps(settings_for(project, KB_SNAPSHOT_BEFORE_DROP="true")):
            pass


def test_retention_snapshots_each_collection_before_dropping_it(project: Path, server: FakeQdrantServer) -> None:
    settings = on_server(project, server, KB_SNAPSHOT_BEFORE_DROP="true", KB_KEEP_VERSIONS="0")
    with open_deps(settings) as deps:
        for n in range(3):
            if n:
                append_to(project, "payment-guide", f"补充 {n}：支持先用后付。")
            result = run_reindex(deps)
            assert result.outcome == "promoted", result.error
        [dropped] = result.cleanup.deleted
        # v1 leaves its slot, which stays for the next build's difference: snapshotted, not deleted
        assert dropped.version == 1 and not dropped.collection_dropped
        assert dropped.snapshot.endswith(".snapshot") and dropped.snapshot.startswith(dropped.collection)
        ops = [(r.op, r.collection) for r in server.requests() if r.op in ("create_snapshot", "delete_collection")]
        assert ops == [("create_snapshot", dropped.collection)]
        assert deps.store.exists(dropped.collection)
        v1 = next(v for v in status_view(deps).to_dict()["versions"] if v["version"] == 1)
        assert v1["status"] == "deleted" and v1["snapshot"]["name"] == dropped.snapshot
        assert v1["snapshot"]["collection"] == dropped.collection

        # a snapshot that fails keeps the collection
        append_to(project, "payment-guide", "补充：再次修改。")
        server.faults.add("create_snapshot", status=500, count=1)
        failed_cleanup = run_reindex(deps)
        assert failed_cleanup.outcome == "failed"
        assert "snapshot of mall_knowledge__" in failed_cleanup.error and "not dropped" in failed_cleanup.error
        assert deps.store.exists(next(v["collection"] for v in status_view(deps).to_dict()["versions"] if v["version"] == 2))


def test_drop_takes_a_snapshot_too(project: Path, server: FakeQdrantServer) -> None:
    from kb_reindex.steps.retention import drop_version

    settings = on_server(project, server, KB_SNAPSHOT_BEFORE_DROP="1")
    with open_deps(settings) as deps:
        assert run_reindex(deps).outcome == "promoted"
        shadow = run_reindex(deps, force_full=True, promote_version=False)
        assert shadow.outcome == "shadow", shadow.error
        dropped = drop_version(deps, shadow.version)
    # the shadow leaves its slot (kept for the next build): snapshotted first, the slot not deleted
    assert not dropped.collection_dropped
    assert dropped.snapshot is not None and dropped.snapshot.startswith(shadow.collection)
    creates = [r.collection for r in server.requests() if r.op == "create_snapshot"]
    assert creates == [shadow.collection]
