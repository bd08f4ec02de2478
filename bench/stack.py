"""What the benchmarks that start `make airflow`'s stack share: a free port, the PostgreSQL server their
databases go on (KB_BENCH_POSTGRES, `user@host:port`), Airflow's REST API signed in as its generated user, a wait
and the alias's collection asked at Qdrant, and the results written as JSON and Markdown."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

PG = os.environ.get("KB_BENCH_POSTGRES", "postgres@127.0.0.1:5432")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def psql(sql: str) -> None:
    """One statement on the `postgres` database of the benchmark's PostgreSQL server (CREATE/DROP DATABASE)."""
    user, host = PG.split("@")
    subprocess.run(["psql", "-h", host.split(":")[0], "-p", host.split(":")[1], "-U", user, "-d", "postgres", "-qc", sql],
                   check=True, capture_output=True, text=True)


def signed_in(base: str, home: Path) -> tuple[httpx.Client, str]:
    """Airflow's REST API (`<base>/api/v2`) as the user `make airflow` generated, and its access token (what the
    page's session cookie carries)."""
    user, password = next(iter(json.loads((home / "simple_auth_manager_passwords.json.generated")
                                          .read_text(encoding="utf-8")).items()))
    token = httpx.post(f"{base}/auth/token", json={"username": user, "password": password}, timeout=30).json()
    access = str(token["access_token"])
    return httpx.Client(base_url=f"{base}/api/v2", timeout=30, headers={"Authorization": f"Bearer {access}"}), access


def wait(what: str, check: Any, timeout_s: float, every_s: float = 0.5) -> None:
    """Until `check()` is true, every `every_s`; past `timeout_s` the benchmark stops naming what it waited for."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def alias_target(qdrant_url: str, alias: str) -> str | None:
    """The collection `alias` points at, asked at the Qdrant server."""
    aliases = httpx.get(f"{qdrant_url}/aliases", timeout=10).json()["result"]["aliases"]
    return next((a["collection_name"] for a in aliases if a["alias_name"] == alias), None)


def write_results(out: Path, name: str, data: Any, text: str) -> None:
    """`<out>/<name>.json` and `<out>/<name>.md`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    (out / f"{name}.md").write_text(text, encoding="utf-8")


def celery_backends(airflow_db: str) -> tuple[dict[str, str], subprocess.Popen[bytes]]:
    """What `KB_AIRFLOW_EXECUTOR=CeleryExecutor make airflow` needs besides: the metadata database `airflow_db`
    created on the PostgreSQL server and a Redis broker of its own (no persistence); the settings that point the
    stack at them (two workers), and the Redis process (the caller kills it and drops the database)."""
    psql(f"CREATE DATABASE {airflow_db}")
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL)
    return {"KB_AIRFLOW_EXECUTOR": "CeleryExecutor", "KB_AIRFLOW_DB_URL": f"postgresql+psycopg2://{PG}/{airflow_db}",
            "KB_CELERY_BROKER_URL": f"redis://127.0.0.1:{port}/0", "KB_CELERY_WORKERS": "2",
            "KB_CELERY_LOG_PORT": str(free_port())}, redis
