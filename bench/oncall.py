"""On-call on the bad day: a rollback clicked on the page while two other knowledge bases' builds hold every build
slot, timed from the click to the alias move, under `make airflow` with LocalExecutor and with Celery.

    .venv/bin/python bench/oncall.py                              # both executors, ~10 min; bench/results/oncall.{json,md}
    .venv/bin/python bench/oncall.py --executors celery --clicks 2 --out /tmp/oncall

Three knowledge bases in one registry (scripts/airflow.sh, as `make airflow` starts it, on a free port; our
Qdrant-protocol server; the state DB on a fresh PostgreSQL database): the shop (knowledge/docs), the sellers
(knowledge/seller/docs) and a synthetic wiki (bench/corpus.py, --wiki-docs pages). Each is built twice by the CLI
first, so the shop has a rollback target. Then the sellers' and the wiki's full rebuilds are triggered with their
embedding held at our Ollama test server (their model, `bge-m3-held`, answers nothing until the end; the shop's
`bge-m3` answers at once), and the bench waits until each holds a build slot: with Celery one on each of the two
build workers, with LocalExecutor each its build pool's slot (AIRFLOW__CORE__PARALLELISM 7: on-call's 2, the three
build pools' 3, default_pool 2).

Each click is what the page's button sends (signed in as Airflow's user, the page's token, its own Origin:
`POST /knowledge-index/kb/shop/api/rollback`); its time runs from the request until the shop's alias points at
the target collection, read at the Qdrant server every 0.1 s. Clicks alternate between the two versions (v2 -> v1,
v1 -> v2, ...), the freeze each leaves lifted by the CLI between them. Reported per executor: each click's time
to the page's answer and to the alias move, where the rollback task ran (queue, pool, host), and whether both
builds still held their slots when the alias moved. Target (#39): <= 15 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "include"))
sys.path.insert(0, str(REPO / "bench"))

import corpus as synthetic  # noqa: E402
from stack import PG, alias_target, celery_backends, free_port, psql, signed_in, wait, write_results  # noqa: E402

from kb_reindex.services.embedding import HashingEmbedder  # noqa: E402
from kb_reindex.services.state.store import StateStore  # noqa: E402
from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer  # noqa: E402
from kb_reindex.testing.qdrant_server import FakeQdrantServer  # noqa: E402

BIN = Path(sys.executable).parent
SHOP, SELLER, WIKI = "shop", "seller", "wiki"
HELD_MODEL = "bge-m3-held"
TARGET_S = 15.0


@dataclass(frozen=True)
class Click:
    from_version: int
    to_version: int
    answered_s: float
    moved_s: float
    queue: str
    pool: str
    hostname: str
    builds_still_held: bool


@dataclass(frozen=True)
class Measured:
    executor: str
    build_slots_held: list[str]
    clicks: list[Click]

    @property
    def median_s(self) -> float:
        return round(statistics.median(c.moved_s for c in self.clicks), 2)

    @property
    def max_s(self) -> float:
        return round(max(c.moved_s for c in self.clicks), 2)


class Hold:
    """Every embedding of the held model waits until released (the dimension probe aside)."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.waiting = 0
        self.guard = threading.Lock()
        self.embedder = HashingEmbedder(model="bge-m3", dim=1024)

    def embed(self, _model: str, text: str) -> list[float]:
        if text != "dimension probe" and not self.released.is_set():
            with self.guard:
                self.waiting += 1
            self.released.wait(1800)
        return self.embedder.embed_one(text)


def project_for(root: Path, wiki_docs: int) -> Path:
    shutil.copytree(REPO / "knowledge", root / "knowledge")
    wiki = synthetic.generate(wiki_docs)
    synthetic.write(wiki, root / "knowledge" / "wiki")
    (root / "knowledge" / "wiki-golden.yaml").write_text(synthetic.golden_yaml(wiki, None), encoding="utf-8")
    (root / "knowledge" / "registry.yaml").write_text(
        "knowledge_bases:\n"
        f"  {SHOP}:\n    source: docs\n    golden_set: golden.yaml\n    schedule: null\n    model: bge-m3\n"
        f"  {SELLER}:\n    source: seller/docs\n    golden_set: seller/golden.yaml\n    schedule: null\n"
        f"    model: {HELD_MODEL}\n"
        f"  {WIKI}:\n    source: wiki\n    golden_set: wiki-golden.yaml\n    schedule: null\n    model: {HELD_MODEL}\n",
        encoding="utf-8")
    return root


def cli(env: dict[str, str], *argv: str) -> dict[str, Any]:
    done = subprocess.run([str(BIN / "kb-reindex"), *argv, "--json", "-q"], env=env, capture_output=True, text=True,
                          timeout=600)
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"kb-reindex {' '.join(argv)} failed: {done.stdout}{done.stderr}") from None


def running_builds(http: httpx.Client, dag_id: str, run_id: str) -> list[dict[str, Any]]:
    tasks = http.get(f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances",
                     params={"limit": 1000}).json()["task_instances"]
    return [t for t in tasks if t["task_id"] in ("build", "small_run") and t["state"] == "running"]


def click(base: str, access: str, qdrant_url: str, http: httpx.Client, env: dict[str, str], *, live: int,
          to: int, collection: str, held: dict[str, str]) -> Click:
    cookies = {"_token": access}
    page = httpx.get(f"{base}/knowledge-index/kb/{SHOP}/ui", cookies=cookies, timeout=60).text
    found = re.search(r'<meta name="kb-page-token" content="([0-9a-f]+)">', page)
    if found is None:
        raise SystemExit(f"the shop's page has no token: {page[:500]}")
    headers = {"Origin": base, "X-KB-Page-Token": found.group(1)}
    clicked = time.monotonic()
    answer = httpx.post(f"{base}/knowledge-index/kb/{SHOP}/api/rollback", cookies=cookies, headers=headers, timeout=120,
                        json={"to_version": to, "live_version": live, "reason": "bench: bad answers during builds"})
    answered = time.monotonic() - clicked
    if answer.status_code != 200:
        raise SystemExit(f"the page refused the rollback: {answer.status_code} {answer.text}")
    while alias_target(qdrant_url, SHOP) != collection:
        if time.monotonic() - clicked > 600:
            raise SystemExit("the shop's alias did not move within 600 s")
        time.sleep(0.1)
    moved = time.monotonic() - clicked
    still = all(running_builds(http, f"knowledge_reindex__{alias}", run_id) for alias, run_id in held.items())
    run_id = answer.json()["dag_run_id"]
    dag = f"knowledge_rollback__{SHOP}"
    wait("the rollback run's end", lambda: http.get(f"/dags/{dag}/dagRuns/{quote(run_id, safe='')}").json()["state"]
         in ("success", "failed"), 300)
    (task,) = http.get(f"/dags/{dag}/dagRuns/{quote(run_id, safe='')}/taskInstances").json()["task_instances"]
    cli(env, "--kb", SHOP, "unfreeze")  # the page's rollback freezes the alias; the next click goes the other way
    return Click(from_version=live, to_version=to, answered_s=round(answered, 2), moved_s=round(moved, 2),
                 queue=task["queue"], pool=task["pool"], hostname=task["hostname"], builds_still_held=still)


def measure(executor: str, args: argparse.Namespace, ollama: FakeOllamaServer, hold: Hold, work: Path) -> Measured:
    with FakeQdrantServer(work / executor / "qdrant") as qdrant:  # the same aliases for each executor: a store each
        return measure_on(executor, args, qdrant, ollama, hold, work)


def measure_on(executor: str, args: argparse.Namespace, qdrant: FakeQdrantServer, ollama: FakeOllamaServer,
               hold: Hold, work: Path) -> Measured:
    suffix = uuid.uuid4().hex[:8]
    state_db, airflow_db = f"kb_oncall_state_{suffix}", f"airflow_oncall_{suffix}"
    home, port = work / executor / "airflow-home", free_port()
    base = f"http://127.0.0.1:{port}"
    project = project_for(work / executor / "project", args.wiki_docs)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "KB_"))}
    env.update(AIRFLOW_HOME=str(home), KB_PROJECT_ROOT=str(project), KB_AIRFLOW_PORT=str(port),
               PATH=f"{BIN}:{env.get('PATH', '')}", PYTHONPATH=str(REPO / "include"), KB_REGISTRY="knowledge/registry.yaml",
               KB_STATE_URL=f"postgresql+psycopg://{PG}/{state_db}", KB_QDRANT_URL=qdrant.url,
               KB_EMBEDDER="ollama", OLLAMA_HOST=ollama.url, KB_EMBED_BATCH_SIZE="8", KB_EMBED_CONCURRENCY="1",
               KB_AIRFLOW_START_TIMEOUT="300", KB_BUILD_PARALLELISM="1", KB_SOURCE_POLL_S="0",
               KB_SMALL_RUN_POINTS="0", KB_AIRFLOW_API_URL=base,
               KB_INSTRUCTION_POLICY="warn")  # the edits before the clicks are not what is measured
    redis = None
    psql(f"CREATE DATABASE {state_db}")
    StateStore(env["KB_STATE_URL"]).dispose()
    if executor == "celery":
        backends, redis = celery_backends(airflow_db)
        env.update(backends)
    else:
        env.update(AIRFLOW__CORE__PARALLELISM="7")
    hold.released.set()  # the first builds (CLI) embed at once
    try:
        for alias, folder in ((SHOP, "docs"), (SELLER, "seller/docs"), (WIKI, "wiki")):
            for n in range(2):  # v1, then v2 after an edit: the shop's v1 is its rollback target
                if n:
                    page = sorted((project / "knowledge" / folder).glob("*.md"))[0]
                    page.write_text(page.read_text(encoding="utf-8") + "\n\n补充：以最新公告为准。\n", encoding="utf-8")
                ran = cli(env, "--kb", alias, "run")
                if ran.get("outcome") != "promoted":
                    raise SystemExit(f"build {n + 1} of {alias} did not promote: {ran}")
        shop = {v["version"]: v["collection"] for v in cli(env, "--kb", SHOP, "status")["versions"]}
        started = subprocess.run(["bash", str(REPO / "scripts" / "airflow.sh")], env=env, capture_output=True, text=True)
        if started.returncode != 0:
            raise SystemExit(f"{executor}: scripts/airflow.sh failed:\n{started.stdout}{started.stderr}")
        http, access = signed_in(base, home)
        for alias in (SHOP, SELLER, WIKI):
            wait(f"the DAGs of {alias}", lambda a=alias: http.get(f"/dags/knowledge_rollback__{a}").status_code == 200
                 and http.get(f"/dags/knowledge_reindex__{a}").status_code == 200, 180)
        hold.released.clear()
        held: dict[str, str] = {}
        for alias in (SELLER, WIKI):
            dag = f"knowledge_reindex__{alias}"
            http.patch(f"/dags/{dag}", json={"is_paused": False}).raise_for_status()
            answer = http.post(f"/dags/{dag}/dagRuns", json={"logical_date": None, "conf": {"force_full_rebuild": True}})
            answer.raise_for_status()
            held[alias] = answer.json()["dag_run_id"]
        wait("both builds holding their build slots", lambda: all(
            running_builds(http, f"knowledge_reindex__{a}", r) for a, r in held.items()), 300)
        slots = [f"{a}: {t['task_id']}[{t['map_index']}] on {t['hostname']} ({t['pool']})"
                 for a, r in held.items() for t in running_builds(http, f"knowledge_reindex__{a}", r)]
        clicks = []
        live = 2
        for _ in range(args.clicks):
            to = 1 if live == 2 else 2
            clicks.append(click(base, access, qdrant.url, http, env, live=live, to=to, collection=shop[to], held=held))
            print(f"{executor}: click {live} -> {to}: {clicks[-1]}", flush=True)
            live = to
        return Measured(executor=executor, build_slots_held=slots, clicks=clicks)
    finally:
        hold.released.set()
        subprocess.run(["bash", str(REPO / "scripts" / "airflow-stop.sh")], env=env, capture_output=True, text=True)
        if redis is not None:
            redis.kill()
        psql(f"DROP DATABASE IF EXISTS {state_db} WITH (FORCE)")
        psql(f"DROP DATABASE IF EXISTS {airflow_db} WITH (FORCE)")


def report(results: list[Measured], args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    data = {"target_s": TARGET_S, "wiki_docs": args.wiki_docs,
            "executors": [{**asdict(r), "median_s": r.median_s, "max_s": r.max_s,
                           "meets_target": r.max_s <= TARGET_S} for r in results]}
    lines = ["| executor | clicks | click -> alias moved, median (s) | max (s) | page answered (s, each) | task ran on "
             "| builds held throughout |", "|---|---|---|---|---|---|---|"]
    for r in results:
        ran = sorted({f"{c.hostname} ({c.queue}, {c.pool})" for c in r.clicks})
        lines.append(f"| {r.executor} | {len(r.clicks)} | **{r.median_s}** | {r.max_s} | "
                     f"{', '.join(str(c.answered_s) for c in r.clicks)} | {'; '.join(ran)} | "
                     f"{'yes' if all(c.builds_still_held for c in r.clicks) else 'no'} |")
    lines += ["", "Build slots held while clicking:"] + [f"- {r.executor}: {'; '.join(r.build_slots_held)}" for r in results]
    return data, "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--executors", default="local,celery", help="comma-separated: local, celery")
    parser.add_argument("--clicks", type=int, default=3, help="rollbacks clicked per executor, alternating v2/v1")
    parser.add_argument("--wiki-docs", type=int, default=80, help="synthetic wiki pages (~5 chunks each)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kb-oncall-bench-"))
    hold = Hold()
    try:
        # n-gram hashing vectors behind the Ollama protocol: the golden sets pass as with the hashing embedder
        with FakeOllamaServer([FakeModel(name="bge-m3", dim=1024, embed=lambda _m, text: hold.embedder.embed_one(text)),
                               FakeModel(name=HELD_MODEL, dim=1024, embed=hold.embed)]) as ollama:
            results = [measure(e, args, ollama, hold, work) for e in args.executors.split(",")]
    finally:
        hold.released.set()
        shutil.rmtree(work, ignore_errors=True)
    data, text = report(results, args)
    write_results(args.out, "oncall", data, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
