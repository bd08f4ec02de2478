"""`KB_AIRFLOW_EXECUTOR=CeleryExecutor make airflow`: Airflow's own way past one machine, proven for real.

scripts/airflow.sh starts the api-server, scheduler, dag-processor, triggerer, two Celery workers and on-call's
worker of the queue kb_oncall (each its own process group, Celery node and hostname on the task instance) on a fresh PostgreSQL metadata DB and a Redis
broker of the module's own (a real redis-server on a free port, so the test can restart it). The state DB is on
PostgreSQL too, Qdrant our Qdrant-protocol server, the embedder our Ollama server, whose hold keeps build slices
in flight while the test looks at them and kills what runs them. One stack serves the module (starting it is
the slow part); the tests run in order, each leaving the stack whole for the next.

Short timeouts make a killed task's retry quick here, as the runbook (docs/runbook/celery.md) explains:
[scheduler] task_instance_heartbeat_timeout 20 s (a task whose worker died is failed, then retried),
task_queued_timeout 30 s (a task whose broker message was lost is queued again), KB_RETRY_DELAY_S 2.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from conftest import PATTERNS_SCREEN, REPO, create_postgres_database, drop_postgres_database, postgres_base_url
from test_local_airflow import BIN, TEST_STACK_ENV, LocalAirflow, finished_state, free_port, kb, points

pytestmark = [pytest.mark.airflow, pytest.mark.celery, pytest.mark.postgres]

WORKER_HOSTS = {"kbtest-worker-1": 1, "kbtest-worker-2": 2}
PROBE = "dimension probe"  # the embedder's dimension probe is never held


@dataclass
class Hold:
    """Holds every embed request (but the dimension probe) while `on`, until released; counts who waits."""

    on: bool = False
    released: threading.Event = field(default_factory=threading.Event)
    waiting: int = 0
    guard: threading.Lock = field(default_factory=threading.Lock)

    def engage(self) -> None:
        with self.guard:
            self.on, self.waiting = True, 0
            self.released.clear()

    def release(self) -> None:
        self.on = False
        self.released.set()

    def embed(self, embedder: Any, text: str) -> list[float]:
        if self.on and text != PROBE:
            with self.guard:
                self.waiting += 1
            self.released.wait(180)
        return embedder.embed_one(text)


class Redis:
    """A redis-server of the test's own on a free port, no persistence: a restart loses the broker's queue."""

    def __init__(self, folder: Path) -> None:
        self.port, self.folder, self.process = free_port(), folder, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no", "--dir", str(self.folder)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=30)


def three_free_ports() -> int:
    """A free port whose next two are free too: the log servers of the two workers and of on-call's."""
    while True:
        port = free_port()
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port + 1))
                b.bind(("127.0.0.1", port + 2))
            return port
        except OSError:
            continue


@pytest.fixture(scope="module")
def hold() -> Hold:
    return Hold()


@pytest.fixture(scope="module")
def ollama(hold: Hold) -> Iterator[Any]:
    from kb_reindex.services.embedding import HashingEmbedder
    from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer

    embedder = HashingEmbedder(model="bge-m3", dim=1024)
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=1024, embed=lambda _m, text: hold.embed(embedder, text))]) as s:
        yield s


@pytest.fixture(scope="module")
def databases() -> Iterator[tuple[str, str]]:
    """A fresh Airflow metadata DB and a fresh state DB on the real PostgreSQL server, dropped afterwards."""
    base = postgres_base_url().replace("postgresql+psycopg://", "postgresql://").split("://", 1)[1].rstrip("/")
    suffix = uuid.uuid4().hex[:10]
    names = (f"airflow_test_{suffix}", f"kb_state_test_{suffix}")
    for name in names:
        create_postgres_database(postgres_base_url(), name, linguistic=False)
    try:
        yield f"postgresql+psycopg2://{base}/{names[0]}", f"postgresql+psycopg://{base}/{names[1]}"
    finally:
        for name in names:
            drop_postgres_database(postgres_base_url(), name)


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    server = Redis(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import shutil

    root = tmp_path_factory.mktemp("celery-project")
    shutil.copytree(REPO / "knowledge", root / "knowledge")
    return root


@pytest.fixture(scope="module")
def qdrant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from kb_reindex.testing.qdrant_server import FakeQdrantServer

    with FakeQdrantServer(tmp_path_factory.mktemp("qdrant-server")) as server:
        yield server


def start(env: dict[str, str]) -> str:
    """scripts/airflow.sh, as the README says: `KB_AIRFLOW_EXECUTOR=CeleryExecutor make airflow`."""
    started = subprocess.run(["bash", str(REPO / "scripts" / "airflow.sh")], env=env, capture_output=True, text=True,
                             timeout=300)
    assert started.returncode == 0, started.stdout + started.stderr
    return started.stdout


@pytest.fixture(scope="module")
def celery_airflow(project: Path, qdrant: Any, ollama: Any, redis: Redis, databases: tuple[str, str],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAirflow]:
    home = tmp_path_factory.mktemp("celery-airflow") / "airflow-home"
    port = free_port()
    from kb_reindex.services.state.store import StateStore

    airflow_db, state_db = databases
    StateStore(state_db).dispose()  # the schema, so `kb-reindex plan` can read the state DB before the first run
    env = {name: value for name, value in os.environ.items() if not name.startswith("AIRFLOW")}
    env.update(
        AIRFLOW_HOME=str(home), KB_PROJECT_ROOT=str(project), KB_AIRFLOW_PORT=str(port),
        PATH=f"{BIN}:{env.get('PATH', '')}", KB_AIRFLOW_EXECUTOR="CeleryExecutor", KB_AIRFLOW_DB_URL=airflow_db,
        KB_CELERY_BROKER_URL=redis.url, KB_CELERY_WORKERS="2", KB_CELERY_LOG_PORT=str(three_free_ports()),
        KB_WORKER_HOSTNAME_PREFIX="kbtest", KB_STATE_URL=state_db, KB_QDRANT_URL=qdrant.url,
        KB_BUILD_PARALLELISM="2", KB_EMBEDDER="ollama", OLLAMA_HOST=ollama.url, KB_EMBED_MODEL="bge-m3", **PATTERNS_SCREEN,
        KB_EMBED_BATCH_SIZE="4", KB_EMBED_CONCURRENCY="1", KB_RETRY_DELAY_S="2", KB_AIRFLOW_START_TIMEOUT="240",
        AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT="20",
        AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL="5",
        AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT="30", **TEST_STACK_ENV,
    )
    try:
        out = start(env)
        assert f"http://127.0.0.1:{port}" in out and "executor CeleryExecutor" in out, out
        assert {f"started airflow worker-{n}" for n in (1, 2, "oncall")} <= {line.split(" (")[0]
                                                                            for line in out.splitlines()}
        yield LocalAirflow(f"http://127.0.0.1:{port}", home, env)
    finally:
        stopped = subprocess.run(["bash", str(REPO / "scripts" / "airflow-stop.sh")], env=env, capture_output=True,
                                 text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        assert not list((home / "run").glob("*.pid"))
        assert started_from(home) == [], "make airflow-stop left processes of this Airflow running"


def started_from(home: Path) -> list[int]:
    """Processes still running (zombies aside) with this AIRFLOW_HOME in their environment."""
    mark = f"AIRFLOW_HOME={home}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark in (proc / "environ").read_bytes().split(b"\0") \
                    and (proc / "stat").read_text().split(") ", 1)[1][0] != "Z":
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def build_tasks(airflow: LocalAirflow, run_id: str) -> list[dict[str, Any]]:
    answer = airflow.http.get(f"/dags/knowledge_reindex/dagRuns/{quote(run_id, safe='')}/taskInstances",
                              params={"task_id": "build"})
    return sorted((t for t in answer.json()["task_instances"] if t["task_id"] == "build"), key=lambda t: t["map_index"])


def group_of(airflow: LocalAirflow, component: str) -> int:
    return int((airflow.home / "run" / f"{component}.pid").read_text())


def kill_session(leader: int) -> None:
    """`kill -9` of a worker and everything it started: Celery's pool, the task supervisor and the task process
    (which Airflow puts in a process group of its own, so the worker's group alone would miss it)."""
    listing = subprocess.run(["ps", "-e", "-o", "pid=,sid="], capture_output=True, text=True, check=True).stdout
    members = [int(pid) for pid, sid in (line.split() for line in listing.splitlines() if line.strip())
               if int(sid) == leader]
    assert leader in members and len(members) >= 3, listing
    for pid in members:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def both_slices_held(airflow: LocalAirflow, hold: Hold, run_id: str) -> list[dict[str, Any]]:
    """Waits until two build slices run at once, each waiting at the embedder: the running task instances."""
    airflow.wait("two build slices held at the embedder at once", lambda: hold.waiting >= 2 and
                 [t["state"] for t in build_tasks(airflow, run_id)] == ["running", "running"], 240)
    return build_tasks(airflow, run_id)


def start_held_run(airflow: LocalAirflow, hold: Hold) -> str:
    total = kb(airflow.env, "plan")["chunks"]["total"]
    hold.engage()
    return airflow.trigger("knowledge_reindex", {"force_full_rebuild": True, "build_slice_size": math.ceil(total / 2)})


def test_slices_run_on_both_workers_and_a_worker_killed_mid_slice_is_retried_on_the_other(
        celery_airflow: LocalAirflow, hold: Hold, qdrant: Any) -> None:
    """Two mapped build slices held at the embedder at once, each on its own worker (the task instance's
    hostname); `kill -9` of one worker and all it started (its session: pool, supervisor, task) mid-slice. The scheduler
    fails the silent task, which is retried on the other worker; the version is promoted with exactly its
    manifest's points and equals a serial CLI build (IDs, vectors, payloads). `make airflow` again starts the
    killed worker alone, leaving what runs."""
    airflow = celery_airflow
    airflow.wait("knowledge_reindex parsed", lambda: airflow.http.get("/dags/knowledge_reindex").status_code == 200, 120)
    assert airflow.http.get("/pools/kb_qdrant_writes").json()["slots"] == 2
    run_id = start_held_run(airflow, hold)
    try:
        running = both_slices_held(airflow, hold, run_id)
        assert {t["hostname"] for t in running} == set(WORKER_HOSTS), running
        victim = running[0]
        worker = WORKER_HOSTS[victim["hostname"]]
        kill_session(group_of(airflow, f"worker-{worker}"))
    finally:
        hold.release()
    airflow.wait_for_success("knowledge_reindex", run_id, 240)

    retried = build_tasks(airflow, run_id)[victim["map_index"]]
    assert retried["state"] == "success" and retried["try_number"] >= 2, retried
    assert retried["hostname"] != victim["hostname"], "the retry ran on the worker that is still alive"

    status = kb(airflow.env, "status")
    assert status["problems"] == [] and status["live"]["version"] >= 1
    parallel = status["live"]["collection"]
    serial = kb({**airflow.env, "KB_ALIAS": "serial_check"}, "run", "--force-full")
    assert serial["outcome"] == "promoted", serial
    built, reference = points(qdrant.url, parallel), points(qdrant.url, serial["collection"])
    assert len(built) == kb(airflow.env, "plan")["chunks"]["total"] and built.keys() == reference.keys()
    for point_id, (vector, payload) in built.items():
        ref_vector, ref_payload = reference[point_id]
        assert vector == pytest.approx(ref_vector, abs=1e-6), point_id
        assert {**payload, "version": None} == {**ref_payload, "version": None}, point_id

    others = {name: group_of(airflow, name) for name in ("api-server", "scheduler", f"worker-{3 - worker}")}
    out = start(airflow.env)
    assert f"started airflow worker-{worker}" in out and "started airflow scheduler" not in out, out
    assert {name: group_of(airflow, name) for name in others} == others


def test_scheduler_killed_and_broker_restarted_mid_run_the_run_still_promotes(celery_airflow: LocalAirflow,
                                                                              hold: Hold, redis: Redis) -> None:
    """While two slices are in flight: `kill -9` of the scheduler, and the broker restarted empty. `make airflow`
    starts the scheduler alone (it no longer refuses because the others run); the new scheduler adopts the
    running tasks, the workers reconnect to the broker, and the run promotes its version whole."""
    airflow = celery_airflow
    before = kb(airflow.env, "status")["live"]["version"]
    run_id = start_held_run(airflow, hold)
    try:
        both_slices_held(airflow, hold, run_id)
        os.kill(group_of(airflow, "scheduler"), signal.SIGKILL)
        redis.stop()
        redis.start()
        others = {name: group_of(airflow, name) for name in ("api-server", "worker-1", "worker-2")}
        out = start(airflow.env)
        assert "started airflow scheduler" in out and "started airflow worker" not in out, out
        assert {name: group_of(airflow, name) for name in others} == others
    finally:
        hold.release()
    airflow.wait_for_success("knowledge_reindex", run_id, 240)
    status = kb(airflow.env, "status")
    assert status["problems"] == [] and status["live"]["version"] == before + 1


def test_an_airflow_command_by_hand_reaches_the_stack_after_sourcing_its_env_file(celery_airflow: LocalAirflow) -> None:
    """`airflow connections add` against the PostgreSQL metadata DB needs what the components were started with (its
    async URL among it): `make airflow` writes it to run/airflow-env.sh and says so."""
    airflow = celery_airflow
    env = {name: value for name, value in airflow.env.items() if not name.startswith("AIRFLOW")}
    added = subprocess.run(["bash", "-c", f"source {airflow.home / 'run' / 'airflow-env.sh'} && airflow connections add "
                            "kb_by_hand --conn-type http --conn-host example.invalid"], env=env, capture_output=True,
                           text=True, timeout=180)
    assert added.returncode == 0, added.stdout + added.stderr
    assert airflow.http.get("/connections/kb_by_hand").json()["host"] == "example.invalid"


def test_a_rollback_runs_on_on_calls_worker_while_builds_hold_every_build_worker(celery_airflow: LocalAirflow,
                                                                                  hold: Hold) -> None:
    """Two build slices held at the embedder, one on each build worker (every build slot busy): knowledge_rollback
    runs on on-call's queue and worker, in on-call's pool with the highest weight, and moves the alias while the
    slices are still held. Without the lane its task would queue until a build worker frees. The build's promotion
    then meets the moved alias (its compare-and-swap) and keeps its version unpromoted."""
    from kb_reindex.airflow.lanes import ONCALL_PRIORITY

    airflow = celery_airflow
    status = kb(airflow.env, "status")
    live, target = status["live"]["version"], status["rollback_target"]
    assert target is not None and target < live, status
    run_id = start_held_run(airflow, hold)
    try:
        both_slices_held(airflow, hold, run_id)
        clicked = time.monotonic()
        # revalidate off: the held embedder would hold the target's golden-set scoring too
        rollback = airflow.trigger("knowledge_rollback", {"reason": "bad answers during a build", "confirm": True,
                                                          "live_version": live, "freeze": False, "revalidate": False})
        airflow.wait_for_success("knowledge_rollback", rollback, 150)
        took = time.monotonic() - clicked
        assert hold.on and [t["state"] for t in build_tasks(airflow, run_id)] == ["running", "running"], \
            "the rollback finished while both build slices still held their workers"
        assert kb(airflow.env, "status")["live"]["version"] == target
        ti = airflow.http.get(f"/dags/knowledge_rollback/dagRuns/{quote(rollback, safe='')}/taskInstances").json()
        (task,) = ti["task_instances"]
        assert (task["queue"], task["pool"], task["priority_weight"], task["hostname"]) == (
            "kb_oncall", "kb_oncall", ONCALL_PRIORITY, "kbtest-worker-oncall"), task
        print(f"knowledge_rollback moved the alias {took:.1f} s after it was triggered, every build slot busy")
    finally:
        hold.release()
    assert finished_state(airflow, "knowledge_reindex", run_id, 240) == "failed", "its CAS met the rolled-back alias"
    assert kb(airflow.env, "status")["live"]["version"] == target


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-x"]))
