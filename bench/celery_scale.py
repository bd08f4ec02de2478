"""One machine against two Celery workers: a full `knowledge_reindex` build under Airflow's own engines.

    .venv/bin/python bench/celery_scale.py                 # ~6 min; writes celery.json and celery.md under --out (bench/results)
    .venv/bin/python bench/celery_scale.py --docs 60 --delay 0.01 --out /tmp/celery-bench   # a quick look

Both runs start the real stack with scripts/airflow.sh (as `make airflow` does) and build the same synthetic
corpus (bench/corpus.py) into our Qdrant-protocol test server, the state on a fresh PostgreSQL database:

- **local**: LocalExecutor, SQLite metadata DB, KB_BUILD_PARALLELISM=1 (one build slice at a time);
- **celery**: CeleryExecutor, PostgreSQL metadata DB, a Redis broker of its own, 2 workers x 1 slot,
  KB_BUILD_PARALLELISM=2.

The embedder is the bottleneck: our Ollama test server with a per-text delay and two slots (like an Ollama
with OLLAMA_NUM_PARALLEL=2, or two GPUs), one batch request in flight per task (KB_EMBED_CONCURRENCY=1). One
slot of Airflow can keep one of them busy; two workers keep both. Reported: the build phase (first build slice
started -> last one ended) of each, their ratio (target >= 1.7), the whole DAG run, and the scheduling overhead
per slice: queued -> running, and the slice's duration beyond its own embedding time (texts x delay).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from urllib.parse import quote

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "include"))
sys.path.insert(0, str(REPO / "bench"))

import corpus as synthetic  # noqa: E402
from stack import PG, celery_backends, free_port, psql, signed_in, write_results  # noqa: E402

from kb_reindex.services.state.store import StateStore  # noqa: E402
from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer, FaultPlan  # noqa: E402
from kb_reindex.testing.qdrant_server import FakeQdrantServer  # noqa: E402

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Measured:
    mode: str
    slices: int
    points: int
    build_s: float
    run_s: float
    queued_to_running_s: float
    overhead_per_slice_s: float
    hostnames: list[str]


def parse(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def project_for(root: Path, docs: int) -> Path:
    corpus = synthetic.generate(docs)
    synthetic.write(corpus, root / "knowledge" / "docs")
    (root / "knowledge" / "golden.yaml").write_text(synthetic.golden_yaml(corpus, None), encoding="utf-8")
    return root


def run_once(http: httpx.Client, slice_size: int, timeout_s: float) -> tuple[dict, list[dict]]:
    deadline = time.monotonic() + timeout_s
    while http.get("/dags/knowledge_reindex").status_code != 200:
        assert time.monotonic() < deadline, "knowledge_reindex was not parsed"
        time.sleep(1)
    http.patch("/dags/knowledge_reindex", json={"is_paused": False}).raise_for_status()
    answer = http.post("/dags/knowledge_reindex/dagRuns",
                       json={"logical_date": None, "conf": {"force_full_rebuild": True, "build_slice_size": slice_size}})
    answer.raise_for_status()
    url = f"/dags/knowledge_reindex/dagRuns/{quote(answer.json()['dag_run_id'], safe='')}"
    while (run := http.get(url).json())["state"] not in ("success", "failed"):
        assert time.monotonic() < deadline, f"the run did not finish within {timeout_s:.0f} s"
        time.sleep(1)
    tasks = http.get(f"{url}/taskInstances", params={"limit": 1000}).json()["task_instances"]
    assert run["state"] == "success", [(t["task_id"], t["state"]) for t in tasks]
    return run, tasks


def measure(mode: str, args: argparse.Namespace, qdrant: FakeQdrantServer, ollama: FakeOllamaServer,
            work: Path) -> Measured:
    suffix = uuid.uuid4().hex[:8]
    state_db, airflow_db = f"kb_bench_state_{suffix}", f"airflow_bench_{suffix}"
    home, port = work / mode / "airflow-home", free_port()
    project = project_for(work / mode / "project", args.docs)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "KB_"))}
    env.update(AIRFLOW_HOME=str(home), KB_PROJECT_ROOT=str(project), KB_AIRFLOW_PORT=str(port),
               PATH=f"{BIN}:{env.get('PATH', '')}", PYTHONPATH=str(REPO / "include"),
               KB_STATE_URL=f"postgresql+psycopg://{PG}/{state_db}", KB_QDRANT_URL=qdrant.url, KB_ALIAS=f"bench_{mode}",
               KB_EMBEDDER="ollama", OLLAMA_HOST=ollama.url, KB_EMBED_MODEL="bge-m3", KB_EMBED_BATCH_SIZE="8",
               KB_EMBED_CONCURRENCY="1", KB_REINDEX_SCHEDULE="", KB_AIRFLOW_START_TIMEOUT="300",
               KB_BUILD_PARALLELISM="1" if mode == "local" else "2")
    redis = None
    psql(f"CREATE DATABASE {state_db}")
    StateStore(env["KB_STATE_URL"]).dispose()  # the schema, so `kb-reindex plan` reads it before the first run
    if mode == "celery":
        backends, redis = celery_backends(airflow_db)
        env.update(backends)
    try:
        started = subprocess.run(["bash", str(REPO / "scripts" / "airflow.sh")], env=env, capture_output=True, text=True)
        if started.returncode != 0:
            raise SystemExit(f"{mode}: scripts/airflow.sh failed:\n{started.stdout}{started.stderr}")
        plan = json.loads(subprocess.run([str(BIN / "kb-reindex"), "plan", "--json", "-q"], env=env,
                                         capture_output=True, text=True).stdout)
        if "chunks" not in plan:
            raise SystemExit(f"{mode}: kb-reindex plan failed: {plan}")
        points = plan["chunks"]["total"]
        ollama.reset_counters()
        run, tasks = run_once(signed_in(f"http://127.0.0.1:{port}", home)[0], math.ceil(points / args.slices), args.timeout)
    finally:
        subprocess.run(["bash", str(REPO / "scripts" / "airflow-stop.sh")], env=env, capture_output=True, text=True)
        if redis is not None:
            redis.kill()
        psql(f"DROP DATABASE IF EXISTS {state_db} WITH (FORCE)")
        psql(f"DROP DATABASE IF EXISTS {airflow_db} WITH (FORCE)")
    builds = [t for t in tasks if t["task_id"] == "build"]
    starts, ends = [parse(t["start_date"]) for t in builds], [parse(t["end_date"]) for t in builds]
    queued = [parse(t["start_date"]) - parse(t["queued_when"]) for t in builds if t.get("queued_when")]
    per_slice_embed = points / len(builds) * args.delay
    return Measured(mode=mode, slices=len(builds), points=points, build_s=round(max(ends) - min(starts), 2),
                    run_s=round(parse(run["end_date"]) - parse(run["start_date"]), 2),
                    queued_to_running_s=round(sum(queued) / max(len(queued), 1), 2),
                    overhead_per_slice_s=round(sum(e - s for s, e in zip(starts, ends, strict=True)) / len(builds) - per_slice_embed, 2),
                    hostnames=sorted({t["hostname"] for t in builds}))


def report(results: list[Measured], args: argparse.Namespace) -> tuple[dict, str]:
    local, celery = results
    ratio = round(local.build_s / celery.build_s, 2)
    data = {"docs": args.docs, "delay_per_text_s": args.delay, "embedder_slots": 2, "ratio_build": ratio,
            "ratio_run": round(local.run_s / celery.run_s, 2), "target": 1.7, "meets_target": ratio >= 1.7,
            "runs": [asdict(r) for r in results]}
    lines = [f"# LocalExecutor (1 slot) against Celery (2 workers x 1 slot): {local.points} points in {local.slices} "
             f"slices, embedder {args.delay * 1000:g} ms/text with 2 slots",
             "", "| | build phase (s) | DAG run (s) | queued -> running per slice (s) | overhead per slice (s) | hosts |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r.mode} | {r.build_s} | {r.run_s} | {r.queued_to_running_s} | {r.overhead_per_slice_s} | "
              f"{', '.join(r.hostnames)} |" for r in results]
    lines += ["", f"Build phase ratio: **{ratio}x** (target >= 1.7x); whole run {data['ratio_run']}x."]
    return data, "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=120, help="synthetic documents (~5 chunks each)")
    parser.add_argument("--delay", type=float, default=0.1, help="seconds per embedded text at the embedder")
    parser.add_argument("--slices", type=int, default=8, help="build slices")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kb-celery-bench-"))
    slow = FaultPlan(delay_per_text_s=args.delay)
    try:
        with FakeQdrantServer(work / "qdrant") as qdrant, \
                FakeOllamaServer([FakeModel(name="bge-m3", dim=1024)], faults=slow, parallel=2) as ollama:
            results = [measure(mode, args, qdrant, ollama, work) for mode in ("local", "celery")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data, text = report(results, args)
    write_results(args.out, "celery", data, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
