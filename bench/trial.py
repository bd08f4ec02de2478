"""Issue #38's acceptance, tried as a user would: a large knowledge base (a synthetic corpus, 50k chunks by default)
under `make airflow` with its source watched; five edits, each timed to searchable; a rollback clicked on the page
while a bulk edit builds; an older version, residing in no slot, restored from the CLI and rolled back to.

    .venv/bin/python bench/trial.py                          # 50k chunks, ~15-25 min on 2 idle cores
    .venv/bin/python bench/trial.py --chunks 2000 --edits 2  # a quick look

The corpus (bench/corpus.py, about five chunks a document, hashing embedder: what is tried is the version model,
not the model) is built once by the CLI (`kb-reindex run`) into our Qdrant-protocol test server (a process, in
memory), as a team would have it before turning Airflow on. Then scripts/airflow.sh (LocalExecutor, SQLite, the
watcher's defaults: KB_SOURCE_POLL_S=15, KB_SOURCE_QUIET_S=5) serves it. Each edit appends a sentence to one
document; `kb-reindex query` asks for it every 0.5 s until it is in the top 3. The phases come from Airflow's
records as in bench/freshness.py; the vectors each edit sent to Qdrant and read back are counted at the server.
Writes `<out>/trial.json` and `<out>/trial.md`.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import corpus as corpus_mod  # noqa: E402
from freshness import DAG, PHASES, Airflow, append, kb, start, start_airflow, wait_searchable  # noqa: E402
from stack import alias_target, free_port, wait, write_results  # noqa: E402

ALIAS = "mall_knowledge"


def live_version(env: dict[str, str]) -> int | None:
    return (kb(env, "status").get("live") or {}).get("version")


def task_ids(airflow: Airflow, run_id: str, states: set[str] | None = None) -> set[str]:
    """The run's tasks in one of `states` (None: not yet ended: running, or waiting between two build slices)."""
    tasks = airflow.http.get(f"/dags/{DAG}/dagRuns/{quote(run_id, safe='')}/taskInstances",
                             params={"limit": 1000}).json()["task_instances"]
    ended = {"success", "failed", "skipped", "upstream_failed", "removed"}
    return {t["task_id"] for t in tasks if (t["state"] in states if states else t["state"] not in ended)}


def page_rollback(base: str, access: str, *, live: int, to: int) -> tuple[float, dict[str, Any]]:
    """What the page's Roll back button sends: signed in (the `_token` cookie), the page's token, its Origin."""
    cookies = {"_token": access}
    page = httpx.get(f"{base}/knowledge-index/ui", cookies=cookies, timeout=60).text
    found = re.search(r'<meta name="kb-page-token" content="([0-9a-f]+)">', page)
    if found is None:
        raise SystemExit(f"the page has no token: {page[:500]}")
    clicked = time.monotonic()
    answer = httpx.post(f"{base}/knowledge-index/api/rollback", cookies=cookies, timeout=120,
                        headers={"Origin": base, "X-KB-Page-Token": found.group(1)},
                        json={"to_version": to, "live_version": live, "reason": "trial: bad answers after an edit"})
    if answer.status_code != 200:
        raise SystemExit(f"the page refused the rollback: {answer.status_code} {answer.text}")
    return clicked, answer.json()


def trial(work: Path, chunks: int, edits: int, bulk_every: int) -> dict[str, Any]:
    project = work / "project"
    generated = corpus_mod.generate(max(1, chunks // 5))
    corpus_mod.write_project(project, generated, None)
    qdrant, qdrant_url = start(["kb_reindex.testing.qdrant_server", "--port", "0", "--path", ":memory:"])
    admin = httpx.Client(base_url=qdrant_url, timeout=600)
    home = work / "airflow-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KB_", "AIRFLOW"))}
    env.update(AIRFLOW_HOME=str(home), KB_PROJECT_ROOT=str(project), KB_REGISTRY="", KB_QDRANT_URL=qdrant_url,
               KB_EMBEDDER="hashing", KB_QDRANT_TIMEOUT="600", KB_AIRFLOW_PORT=str(free_port()),
               PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}")
    result: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        built = kb(env, "run")
        if built.get("outcome") != "promoted":
            raise SystemExit(f"the first build ended {built.get('outcome')}: {built.get('error') or built}")
        result["first_build"] = {"by": "kb-reindex run", "s": round(time.perf_counter() - t0, 1),
                                 "chunks": (built.get("chunks") or {}).get("total")}
        base, airflow = start_airflow(env, home)
        airflow.http.patch(f"/dags/{DAG}", json={"is_paused": False})
        keys = sorted(generated.docs)
        rows = []
        for i in range(edits):
            key = keys[(i * 7919) % len(keys)]
            sentence = f"第{i + 1}号补充规则：周末提交的申请顺延至周一处理，编号T{i + 1}Z{chunks}。"
            before = len(airflow.runs())
            admin.delete("/__vectors")
            edited = append(project, key, sentence)
            found = wait_searchable(env, sentence, sentence)
            wait("the edit's runs to end", airflow.idle, 600, 1)
            counts = admin.get("/__vectors").json()
            new = airflow.runs()[before:]
            rows.append({"edit": i + 1, "doc": key, "runs": len(new), "searchable_s": round(found - edited, 2),
                         "written": counts["written"], "read": counts["read"],
                         **airflow.phases(new[0], edited, found)})
            print(f"edit {i + 1}: {rows[-1]}", flush=True)
        result["edits"] = rows

        # a rollback from the page while a large build writes (the on-call's bad day): a bulk edit of every
        # `--bulk-every`-th document, which the watcher starts a run for. (`force_full_rebuild` is no long build any
        # more: it reads every file again, and the slot still takes only the difference.)
        before = len(airflow.runs())
        bulk = keys[::bulk_every]
        for key in bulk:
            append(project, key, "本页规则已于本周复核，内容不变。")
        wait("the bulk edit's run", lambda: len(airflow.runs()) > before, 600, 1)
        run_id = airflow.runs()[before]["dag_run_id"]
        wait("the bulk edit's build to write", lambda: bool({"build", "small_run"} & task_ids(airflow, run_id, {"running"})),
             600)
        status = kb(env, "status")
        live, target = status["live"]["version"], status["rollback_target"]
        collection = next(v["collection"] for v in status["versions"] if v["version"] == target)
        access = airflow.http.headers["Authorization"].split(" ", 1)[1]
        clicked, answer = page_rollback(base, access, live=live, to=target)
        wait(f"the alias to move to v{target} ({collection})", lambda: alias_target(qdrant_url, ALIAS) == collection,
             600, 0.1)
        moved_s = time.monotonic() - clicked
        building = sorted(task_ids(airflow, run_id))
        if not {"build", "validate", "small_run"} & set(building):
            raise SystemExit(f"the bulk edit's build ended before the alias moved ({building}): try a larger --chunks")
        wait("status to say the rollback's version is live", lambda: live_version(env) == target, 120)
        result["rollback"] = {"from": live, "to": target, "alias_moved_s": round(moved_s, 2),
                              "build_tasks_running_when_moved": building, "dag_run_id": answer.get("dag_run_id")}
        print(f"rollback: {result['rollback']}", flush=True)
        wait("the bulk edit's run to end", lambda: all(
            r["state"] in ("success", "failed") for r in airflow.runs()), 1800, 2)
        result["bulk_edit"] = {"documents": len(bulk), "run": next(r["state"] for r in airflow.runs()
                                                                   if r["dag_run_id"] == run_id)}
        airflow.http.patch(f"/dags/{DAG}", json={"is_paused": True})  # the CLI's turn: nothing starts beside it

        # an older version, residing in no slot, restored from the CLI and rolled back to
        status = kb(env, "status")
        result["residence_before_restore"] = status.get("residence")
        evicted = [r for r in status.get("residence") or [] if not r["one_move_away"]]
        if not evicted:
            raise SystemExit(f"no kept version resides outside the slots: {status.get('residence')}")
        older = evicted[0]["version"]
        admin.delete("/__vectors")
        t0 = time.perf_counter()
        restored = kb(env, "restore", "--version", str(older))
        restore_s = time.perf_counter() - t0
        counts = admin.get("/__vectors").json()
        if restored.get("error"):
            raise SystemExit(f"restore failed: {restored['error']}")
        t0 = time.perf_counter()
        rolled = kb(env, "rollback", "--to-version", str(older), "--reason", "trial: an older version back", "--yes")
        rollback_s = time.perf_counter() - t0
        result["restore"] = {"version": older, "restore_points": evicted[0]["restore_points"],
                             "restore_s": round(restore_s, 2), "written": counts["written"], "read": counts["read"],
                             "rollback_s": round(rollback_s, 2), "live_after": live_version(env),
                             "rollback_outcome": rolled.get("outcome") or rolled.get("error")}
        print(f"restore: {result['restore']}", flush=True)
        names = [c["name"] for c in admin.get("/collections").json()["result"]["collections"]]
        result["points_stored"] = sum(admin.post(f"/collections/{n}/points/count", json={"exact": True})
                                      .json()["result"]["count"] for n in names)
        result["collections"] = len(names)
    finally:
        subprocess.run(["bash", str(REPO / "scripts" / "airflow-stop.sh")], env=env, capture_output=True, timeout=120)
        admin.close()
        qdrant.terminate()
        qdrant.wait(timeout=60)
    return result


def markdown(result: dict[str, Any]) -> str:
    lines = [f"{result['at']} · {result['machine']} · load {result['load_at_start']:.1f} at start · "
             f"{result['first_build']['chunks']} chunks (first build by the CLI in {result['first_build']['s']} s) · "
             "LocalExecutor, the watcher's defaults · hashing embedder", "",
             "| edit | runs | path | searchable s | " + " | ".join(PHASES) + " | vectors written | read back |",
             "|---|---|---|---|" + "---|" * len(PHASES) + "---|---|"]
    for r in result.get("edits") or []:
        lines.append(f"| {r['edit']} | {r['runs']} | {r.get('path', '?')} | {r['searchable_s']} | "
                     + " | ".join(str(r.get(p, "")) for p in PHASES) + f" | {r['written']} | {r['read']} |")
    if "rollback" in result:
        rb = result["rollback"]
        bulk = result.get("bulk_edit") or {}
        lines += ["", f"Rollback clicked on the page while a bulk edit ({bulk.get('documents')} documents) builds: "
                  f"v{rb['from']} -> v{rb['to']}, the alias moved **{rb['alias_moved_s']} s** after the click, with the "
                  f"bulk edit's {', '.join(rb['build_tasks_running_when_moved'])} not yet ended; its run "
                  f"ended {bulk.get('run')}."]
    if "restore" in result:
        rs = result["restore"]
        lines += ["", f"Restore from the CLI of v{rs['version']} (in no slot; status said {rs['restore_points']} points "
                  f"to write): **{rs['restore_s']} s**, {rs['written']} vectors written, {rs['read']} read back; "
                  f"then `kb-reindex rollback --to-version {rs['version']}` {rs['rollback_s']} s "
                  f"({rs['rollback_outcome']}), live v{rs['live_after']}. Points stored at the end: "
                  f"{result['points_stored']} in {result['collections']} collections."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=50000)
    parser.add_argument("--edits", type=int, default=5)
    parser.add_argument("--bulk-every", type=int, default=2, help="the bulk edit touches every N-th document")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    result: dict[str, Any] = {
        "key": "trial-38", "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "load_at_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="kb-trial-") as work:
        result.update(trial(Path(work), args.chunks, args.edits, args.bulk_every))
    write_results(args.out, "trial", result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
