"""`make airflow`: the DAGs under a real scheduler, started by scripts/airflow.sh on a free port.

Not `dag.test()`: the api-server, scheduler, dag-processor and triggerer run as they would on a laptop
(LocalExecutor, SQLite), each task in a process of its own that reports through the execution API.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from conftest import REPO

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalAirflow:
    """The REST API of the Airflow the script started, signed in as the admin it printed."""

    def __init__(self, base: str, home: Path, env: dict[str, str]) -> None:
        self.base, self.home, self.env = base, home, env
        user, password = next(iter(json.loads((home / "simple_auth_manager_passwords.json.generated")
                                              .read_text(encoding="utf-8")).items()))
        self.http = httpx.Client(base_url=f"{base}/api/v2", timeout=30)
        token = httpx.post(f"{base}/auth/token", json={"username": user, "password": password}, timeout=30)
        self.http.headers["Authorization"] = f"Bearer {token.json()['access_token']}"

    def logs(self) -> str:
        run = self.home / "run"
        return "\n".join(f"--- {name}.log\n" + (run / f"{name}.log").read_text(errors="replace")[-2000:]
                         for name in ("scheduler", "dag-processor", "api-server"))

    def wait(self, what: str, check, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s\n{self.logs()}"
            time.sleep(2)

    def trigger(self, dag_id: str, conf: dict | None = None) -> str:
        self.wait(f"{dag_id} parsed", lambda: self.http.get(f"/dags/{dag_id}").status_code == 200, 120)
        assert self.http.patch(f"/dags/{dag_id}", json={"is_paused": False}).status_code == 200
        answer = self.http.post(f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf or {}})
        assert answer.status_code == 200, answer.text
        return answer.json()["dag_run_id"]

    def wait_for_success(self, dag_id: str, run_id: str, timeout_s: float) -> None:
        url = f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}"

        def finished() -> bool:
            state = self.http.get(url).json()["state"]
            if state == "failed":
                tasks = self.http.get(f"{url}/taskInstances").json()["task_instances"]
                pytest.fail(f"{dag_id} {run_id} failed: {[(t['task_id'], t['state']) for t in tasks]}\n{self.logs()}")
            return state == "success"

        self.wait(f"{dag_id} {run_id} succeeded", finished, timeout_s)

    def idle(self, dag_id: str) -> bool:
        runs = self.http.get(f"/dags/{dag_id}/dagRuns").json()["dag_runs"]
        return all(run["state"] in ("success", "failed") for run in runs)


@pytest.fixture
def local_airflow(project: Path, tmp_path: Path) -> Iterator[LocalAirflow]:
    """scripts/airflow.sh with its home and the project under tmp_path (never the checkout's .airflow/ or .kb/)."""
    port = free_port()
    env = {name: value for name, value in os.environ.items() if not name.startswith("AIRFLOW")}
    env.update(AIRFLOW_HOME=str(tmp_path / "airflow-home"), KB_PROJECT_ROOT=str(project),
               KB_AIRFLOW_PORT=str(port), PATH=f"{BIN}:{env.get('PATH', '')}")
    try:
        started = subprocess.run(["bash", str(REPO / "scripts" / "airflow.sh")], env=env, capture_output=True,
                                 text=True, timeout=240)
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"http://127.0.0.1:{port}" in started.stdout and "admin / " in started.stdout, started.stdout
        yield LocalAirflow(f"http://127.0.0.1:{port}", tmp_path / "airflow-home", env)
    finally:
        stopped = subprocess.run(["bash", str(REPO / "scripts" / "airflow-stop.sh")], env=env, capture_output=True,
                                 text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        assert not list((tmp_path / "airflow-home" / "run").glob("*.pid"))


def kb(env: dict[str, str], *argv: str) -> dict:
    """`kb-reindex` with the environment the Airflow tasks had: the same project, state and store."""
    done = subprocess.run([str(BIN / "kb-reindex"), *argv, "--json", "-q"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.airflow
def test_make_airflow_runs_reindex_and_rollback_under_the_real_scheduler(local_airflow: LocalAirflow,
                                                                         project: Path) -> None:
    airflow = local_airflow
    # unpausing also lets the scheduler create today's scheduled run; max_active_runs=1 runs them in turn
    run_id = airflow.trigger("knowledge_reindex")
    airflow.wait_for_success("knowledge_reindex", run_id, 180)
    airflow.wait("every knowledge_reindex run finished", lambda: airflow.idle("knowledge_reindex"), 120)
    status = kb(airflow.env, "status")
    assert status["live"]["version"] == 1 and status["problems"] == []
    assert kb(airflow.env, "history")["events"][0]["run_id"].startswith("airflow__knowledge_reindex__")

    doc = project / "knowledge" / "docs" / "coupon-rules.md"
    doc.write_text(doc.read_text(encoding="utf-8") + "\n\n补充：限时活动券不可叠加。\n", encoding="utf-8")
    assert kb(airflow.env, "run")["outcome"] == "promoted"
    assert kb(airflow.env, "status")["live"]["version"] == 2

    run_id = airflow.trigger("knowledge_rollback", {"reason": "local airflow check", "confirm": True, "to_version": None})
    airflow.wait_for_success("knowledge_rollback", run_id, 120)
    status = kb(airflow.env, "status")
    assert status["live"]["version"] == 1
    assert {v["version"]: v["status"] for v in status["versions"]}[2] == "retired"
    last = kb(airflow.env, "history")["events"][-1]
    assert (last["action"], last["reason"]) == ("rollback", "local airflow check")
    assert last["run_id"].startswith("airflow__knowledge_rollback__")
