"""`make airflow` with two knowledge bases in one registry, under the real scheduler (scripts/airflow.sh on a free
port, LocalExecutor, our Qdrant-protocol server): both run on their own schedules; a rollback of one completes
while the other's build is held at Qdrant, and moves only its own alias; a migration of one to another model
runs while the other serves; an entry added to the registry gets its DAGs at the dag-processor's next parse,
with no `airflow dags reserialize`, and its first version with no command typed (its watcher starts the run, its
pool made when it starts) from a bucket (moto's S3 server) read through the Airflow Connection `aws_default` alone
(the stack's environment holds no AWS variable, and the server refuses every other key); an entry with a typo, and
then one deleted before it was retired, keep their rollback DAG."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from conftest import REPO
from test_local_airflow import BIN, LocalAirflow, finished_state, free_port
from test_local_airflow import kb as cli
from kb_reindex.testing.s3_server import REGION, MotoS3Server

pytestmark = pytest.mark.airflow
SHOP, SELLER = "shop", "seller"
CONNECTION_KEY, BUCKET = "kb-airflow-connection", "kb-airflow"
REGISTRY = f"""knowledge_bases:
  {SHOP}:
    source: docs
    golden_set: golden.yaml
    schedule: "@daily"
  {SELLER}:
    source: seller/docs
    golden_set: seller/golden.yaml
    schedule: "0 3 * * *"
"""


class CollectionHold:
    """Every upsert into one knowledge base's collections waits at our Qdrant server until released."""

    def __init__(self, qdrant: Any, alias: str) -> None:
        self.qdrant, self.real, self.prefix = qdrant, qdrant._backend_call, f"{alias}__"
        self.held, self.open = threading.Event(), threading.Event()

    def __enter__(self) -> CollectionHold:
        def held_call(op: str, params: dict, query: dict, body: Any, record: Any = None) -> Any:
            if op == "upsert" and params.get("name", "").startswith(self.prefix) and not self.open.is_set():
                self.held.set()
                self.open.wait(300)
            return self.real(op, params, query, body, record)

        self.qdrant._backend_call = held_call
        return self

    def __exit__(self, *exc: object) -> None:
        self.open.set()
        self.qdrant._backend_call = self.real


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalAirflow, Path, Any, MotoS3Server]]:
    from kb_reindex.testing.qdrant_server import FakeQdrantServer

    root = tmp_path_factory.mktemp("many-bases-airflow")
    project = root / "project"
    shutil.copytree(REPO / "knowledge", project / "knowledge")
    (project / "knowledge" / "registry.yaml").write_text(REGISTRY, encoding="utf-8")
    with FakeQdrantServer(root / "qdrant-server") as qdrant, MotoS3Server(access_keys={CONNECTION_KEY}) as s3:
        port = free_port()
        # the bucket's credentials and endpoint are the Airflow Connection's alone (no AWS_* variable anywhere)
        connection = {"conn_type": "aws", "login": CONNECTION_KEY, "password": "kb-airflow-secret",
                      "extra": {"endpoint_url": s3.url, "region_name": REGION}}
        env = {name: value for name, value in os.environ.items() if not name.startswith(("AIRFLOW", "AWS_"))}
        env.update(AIRFLOW_HOME=str(root / "airflow-home"), KB_PROJECT_ROOT=str(project), KB_AIRFLOW_PORT=str(port),
                   PATH=f"{BIN}:{env.get('PATH', '')}", KB_QDRANT_URL=qdrant.url, KB_REGISTRY="knowledge/registry.yaml",
                   KB_RETRY_DELAY_S="2", AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL="10",
                   AIRFLOW_CONN_AWS_DEFAULT=json.dumps(connection),
                   KB_SMALL_RUN_POINTS="1000")  # the product's default: small plans run as one task
        try:
            started = subprocess.run(["bash", str(REPO / "scripts" / "airflow.sh")], env=env, capture_output=True,
                                     text=True, timeout=240)
            assert started.returncode == 0, started.stdout + started.stderr
            yield LocalAirflow(f"http://127.0.0.1:{port}", root / "airflow-home", env), project, qdrant, s3
        finally:
            stopped = subprocess.run(["bash", str(REPO / "scripts" / "airflow-stop.sh")], env=env,
                                     capture_output=True, text=True, timeout=120)
            assert stopped.returncode == 0, stopped.stderr


def scheduled_run(airflow: LocalAirflow, dag_id: str) -> str:
    """Unpause `dag_id`; its schedule starts the latest interval's run (catchup off), which is returned."""
    airflow.wait(f"{dag_id} parsed", lambda: airflow.http.get(f"/dags/{dag_id}").status_code == 200, 120)
    airflow.set_paused(dag_id, False)
    runs: list[dict] = []

    def started() -> bool:
        runs[:] = airflow.http.get(f"/dags/{dag_id}/dagRuns").json()["dag_runs"]
        return bool(runs)

    airflow.wait(f"a scheduled run of {dag_id}", started, 120)
    assert runs[0]["run_type"] == "scheduled", runs
    return runs[0]["dag_run_id"]


def test_two_knowledge_bases_under_the_real_scheduler(stack: tuple[LocalAirflow, Path, Any, MotoS3Server]) -> None:
    airflow, project, qdrant, s3 = stack
    env = {**airflow.env, "KB_LOCK_WAIT": "0"}
    pools = {p["name"]: p["slots"] for p in airflow.http.get("/pools").json()["pools"]}
    assert pools[f"kb_qdrant_writes__{SHOP}"] == 1 and pools[f"kb_qdrant_writes__{SELLER}"] == 1

    # both on their own schedules: unpausing each starts its scheduled run, and both promote
    runs = {alias: scheduled_run(airflow, f"knowledge_reindex__{alias}") for alias in (SHOP, SELLER)}
    for alias, run_id in runs.items():
        airflow.wait_for_success(f"knowledge_reindex__{alias}", run_id, 300)
        assert kb_status(env, alias)["live"]["version"] == 1
    doc = project / "knowledge" / "docs" / "coupon-rules.md"
    doc.write_text(doc.read_text(encoding="utf-8") + "\n\n补充：限时活动券不可叠加。\n", encoding="utf-8")
    assert cli(env, "--kb", SHOP, "run")["outcome"] == "promoted"

    # the sellers' build held at Qdrant; the shop's rollback completes meanwhile and moves only the shop's alias
    with CollectionHold(qdrant, SELLER) as hold:
        build = airflow.trigger(f"knowledge_reindex__{SELLER}", {"force_full_rebuild": True})
        assert hold.held.wait(240), f"the sellers' build never wrote\n{airflow.logs()}"
        rollback = airflow.trigger(f"knowledge_rollback__{SHOP}", {"reason": "coupon text", "confirm": True,
                                                                  "live_version": 2, "freeze": False})
        airflow.wait_for_success(f"knowledge_rollback__{SHOP}", rollback, 180)
        assert not hold.open.is_set(), "the rollback completed while the other knowledge base built"
        assert kb_status(env, SHOP)["live"]["version"] == 1
        assert kb_status(env, SELLER)["live"]["version"] == 1, "the other alias did not move"
    airflow.wait_for_success(f"knowledge_reindex__{SELLER}", build, 300)
    assert kb_status(env, SELLER)["live"]["version"] == 2, "its own compare-and-swap saw its own alias unmoved"

    # the shop migrates to another model while the sellers' knowledge base serves its questions
    migration = airflow.trigger(f"knowledge_model_migration__{SHOP}", {"embedder": "hashing",
                                                                       "model": "hashing-ngram-v4", "dimension": 512})
    answers = 0
    while finished_state_now(airflow, f"knowledge_model_migration__{SHOP}", migration) is None:
        found = cli(env, "--kb", SELLER, "query", "货款什么时候到账", "-k", "1")
        assert found["results"][0]["knowledge_key"] == "settlement", found
        answers += 1
        time.sleep(1)  # a question a second, not back to back: each is a process whose start takes the migration's CPU
    assert finished_state(airflow, f"knowledge_model_migration__{SHOP}", migration, 10) == "success"
    assert answers >= 1
    shop, seller = kb_status(env, SHOP), kb_status(env, SELLER)
    assert (shop["live"]["embed_model"], shop["live"]["dim"]) == ("hashing-ngram-v4", 512)
    assert seller["live"]["embed_model"] == "hashing-ngram-v1" and seller["live"]["version"] == 2

    # a third entry, in a bucket: its DAGs appear at the dag-processor's next parse of the DAG files, no reserialize
    import boto3

    client = boto3.client("s3", endpoint_url=s3.url, aws_access_key_id=CONNECTION_KEY,
                          aws_secret_access_key="kb-airflow-secret", region_name=REGION)
    client.create_bucket(Bucket=BUCKET)
    client.put_object(Bucket=BUCKET, Key="wiki/about.md", Body="# 关于\n\n内部说明。\n".encode())
    client.put_object(Bucket=BUCKET, Key="wiki/售后 指南/退货 规则.md", Body="# 退货规则\n\n签收后七天内可申请无理由退货。\n".encode())
    s3.clear_requests()
    (project / "knowledge" / "wiki-golden.yaml").write_text(
        "k: 3\nmin_hit_rate: 0.5\nmin_mrr: 0.5\nmax_regressions: 0\nprobes:\n  - id: about\n    query: 内部说明\n"
        "    expected: [about]\n", encoding="utf-8")
    registry = project / "knowledge" / "registry.yaml"
    assert airflow.http.get("/pools/kb_qdrant_writes__wiki").status_code == 404  # `make airflow` never set it
    # watched (the suite's stacks watch no source but this entry, tests/conftest.py): nobody triggers anything
    registry.write_text(REGISTRY + f"  wiki:\n    source: s3://{BUCKET}/wiki\n    golden_set: wiki-golden.yaml\n"
                        "    schedule: null\n    source_poll_s: 1\n", encoding="utf-8")
    for kind in ("knowledge_reindex", "knowledge_rollback"):
        airflow.wait(f"{kind}__wiki parsed", lambda k=kind: airflow.http.get(f"/dags/{k}__wiki").status_code == 200,
                     120)
    assert not airflow.http.get("/dags/knowledge_rollback__wiki").json()["is_paused"], "on-call's DAG starts unpaused"
    # ... and its source's watcher starts its first run, which builds its first version with no command typed: its
    # build pool is created by the scheduler's listener when the run starts, before create_version needs it
    # (without it, the run would wait at create_version for ever, holding the lock)
    first: list[dict] = []

    def started() -> bool:
        first[:] = airflow.http.get("/dags/knowledge_reindex__wiki/dagRuns").json()["dag_runs"]
        return bool(first)

    airflow.wait("the wiki's first run, started by its watcher", started, 180)
    assert first[0]["run_type"] == "asset_triggered", first
    airflow.wait_for_success("knowledge_reindex__wiki", first[0]["dag_run_id"], 240)
    wiki = cli(env, "--kb", "wiki", "status")
    assert wiki["live"]["version"] == 1 and wiki["live"]["points"] == 2 and wiki["problems"] == [], wiki
    assert airflow.http.get("/pools/kb_qdrant_writes__wiki").json()["slots"] == 1
    # the watcher's listing and the tasks' reads went through the Connection: every request signed with its key
    requests = s3.requests()
    read = {r.key for r in requests if r.object_get}
    assert {"wiki/about.md", "wiki/售后 指南/退货 规则.md"} <= read, read
    assert requests and {r.access_key for r in requests} == {CONNECTION_KEY}, "signed with the Connection's key"
    assert all(r.status == 200 for r in requests), [r for r in requests if r.status != 200]
    found = cli(env, "--kb", "wiki", "query", "无理由退货", "-k", "1")["results"]
    assert found[0]["knowledge_key"] == "售后 指南/退货 规则", found

    # a typo in the sellers' entry: at the next parse its build DAGs go, its rollback DAG stays (saying why) and
    # rolls its alias back under the real scheduler, from the entry its runs recorded; the others are untouched
    registry.write_text(registry.read_text(encoding="utf-8").replace('    schedule: "0 3 * * *"', '    schedul: "0 3"'),
                        encoding="utf-8")
    rollback_id = f"knowledge_rollback__{SELLER}"
    airflow.wait("the sellers' rollback DAG parsed from the broken entry", lambda: (airflow.http.get(
        f"/dags/{rollback_id}/details").json().get("doc_md") or "").startswith("**Its registry entry is refused"), 120)
    live = cli(env, "--kb", SELLER, "status")
    assert live["live"]["version"] == 2 and "schedul: unknown key" in live["registry_error"]
    rolled = airflow.trigger(rollback_id, {"reason": "typo drill", "confirm": True, "live_version": 2, "freeze": False})
    airflow.wait_for_success(rollback_id, rolled, 180)
    assert cli(env, "--kb", SELLER, "status")["live"]["version"] == 1
    assert kb_status(env, SHOP)["live"]["version"] == shop["live"]["version"]

    # the sellers' entry deleted before anyone retired it: what it serves keeps its rollback DAG (the DAG file
    # reads the recorded entries), which moves it forward again under the real scheduler; the others untouched
    registry.write_text(registry.read_text(encoding="utf-8").split(f"  {SELLER}:")[0]
                        + "  wiki:" + registry.read_text(encoding="utf-8").split("  wiki:")[1], encoding="utf-8")
    airflow.wait("the sellers' rollback DAG parsed from the recorded entry", lambda: (airflow.http.get(
        f"/dags/{rollback_id}/details").json().get("doc_md") or "").startswith(
        "**Its registry entry is no longer in the registry"), 120)
    airflow.wait("the sellers' build DAG gone", lambda: airflow.http.get(
        f"/dags/knowledge_reindex__{SELLER}").json().get("is_stale", True) is not False, 120)
    forward = airflow.trigger(rollback_id, {"reason": "entry removed by mistake", "confirm": True, "live_version": 1,
                                            "to_version": 2, "freeze": False})
    airflow.wait_for_success(rollback_id, forward, 180)
    assert cli(env, "--kb", SELLER, "status")["live"]["version"] == 2
    assert kb_status(env, SHOP)["live"]["version"] == shop["live"]["version"]


def kb_status(env: dict[str, str], alias: str) -> dict:
    return cli(env, "--kb", alias, "status")


def finished_state_now(airflow: LocalAirflow, dag_id: str, run_id: str) -> str | None:
    state = airflow.http.get(f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}").json()["state"]
    return state if state in ("success", "failed") else None
