"""Races as separate processes against the Qdrant test server, where they really overlap: a run being
watched by status in a loop, a reconcile and a second run started mid-build, and four reader processes
querying through the alias while it moves. (Local mode admits one process per folder, so there these
races cannot even start; the thread-level versions are in test_recovery.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kb_reindex.services.embedding import HashingEmbedder
from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer, FaultPlan
from kb_reindex.testing.qdrant_server import QdrantServerProcess, start_process

from conftest import PATTERNS_SCREEN

ALIAS = "mall_knowledge"
CLI = Path(sys.executable).with_name("kb-reindex")

#: a process that reads status in a loop until the stop file appears, one JSON line per read (20 ms apart: reading
#: back to back, the loops took the two cores the run they watch needs, and the suite's time with them)
STATUS_LOOP = """
import json, pathlib, sys, time
from kb_reindex.run.status import status_view
from kb_reindex.services.config import Settings
from kb_reindex.services.runtime import open_deps
stop = pathlib.Path(sys.argv[1])
with open_deps(Settings.from_env(), create=False) as deps:
    while not stop.exists():
        s = status_view(deps).to_dict()
        print(json.dumps({"problems": s["problems"], "notes": s["notes"], "live": (s["live"] or {}).get("version")}),
              flush=True)
        time.sleep(0.02)
"""

#: a process that queries through the alias in a loop (saying `reading` after its first read) until three reads
#: after the stop file appears
READER_LOOP = """
import json, pathlib, sys, time
from kb_reindex.services.config import Settings
from kb_reindex.reader import search_knowledge
from kb_reindex.services.runtime import open_reader
stop = pathlib.Path(sys.argv[1])
queries = ["退货需要什么条件", "运费怎么算", "积分怎么抵扣", "优惠券能叠加吗"]
reads = errors = empty = 0
versions = set()
with open_reader(Settings.from_env()) as reader:
    last = 0  # reads after the stop file appeared: what serves at the end is read too
    while last < 3:
        last += stop.exists()
        try:
            found = search_knowledge(reader, queries[reads % len(queries)], k=3)
            versions.add(found.version)
            empty += not found.results
        except Exception as exc:
            errors += 1
            print("error:", type(exc).__name__, exc, file=sys.stderr, flush=True)
        reads += 1
        if reads == 1:
            print("reading", flush=True)
        time.sleep(0.02)
print(json.dumps({"reads": reads, "errors": errors, "empty": empty, "versions": sorted(versions)}), flush=True)
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[QdrantServerProcess]:
    process = start_process(tmp_path / "qdrant-server")
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def slow_ollama() -> Iterator[FakeOllamaServer]:
    """bge-m3 at 1024-d (hashing vectors) over the real ollama protocol; slowed per test."""
    embedder = HashingEmbedder(model="bge-m3", dim=1024)
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=1024, embed=lambda _m, text: embedder.embed_one(text))]) as s:
        yield s


def env_for(project: Path, server: QdrantServerProcess, ollama: FakeOllamaServer, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_") or k.startswith("KB_TEST_")}
    env.update(KB_PROJECT_ROOT=str(project), KB_QDRANT_URL=server.url, KB_EMBEDDER="ollama",
               OLLAMA_HOST=ollama.url, KB_EMBED_BATCH_SIZE="4", **PATTERNS_SCREEN, **extra)
    return env


def cli(env: dict[str, str], *argv: str, timeout: float = 180) -> tuple[int, dict[str, Any]]:
    done = subprocess.run([str(CLI), *argv, "--json", "-q"], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.stdout.strip(), done.stderr[-2000:]
    return done.returncode, json.loads(done.stdout)


def edit_every_doc(project: Path) -> None:
    for path in sorted((project / "knowledge" / "docs").glob("*.md")):
        path.write_text(path.read_text(encoding="utf-8") + "\n\n本条款自下月起生效。\n", encoding="utf-8")


def add_a_long_page(project: Path) -> None:
    """A new page of 40 sections: 40 chunks to embed (the golden probes' vectors are kept from the first run, so
    an edit of a line or two embeds only a few texts)."""
    # words no golden probe asks about, so no probe's answer moves
    sections = "\n\n".join(f"## Zebra quartz {i}\n\nZebra quartz protocol {i}: llama grooming kits ship in crate "
                            f"{i * 7} of the orchard depot." for i in range(40))
    (project / "knowledge" / "docs" / "zebra-quartz.md").write_text(f"# Zebra quartz\n\n{sections}\n",
                                                                     encoding="utf-8")


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_status_reconcile_and_a_second_run_during_a_run(project: Path, server: QdrantServerProcess,
                                                        slow_ollama: FakeOllamaServer, tmp_path: Path) -> None:
    env = env_for(project, server, slow_ollama)
    assert cli(env, "run")[1]["outcome"] == "promoted"
    edit_every_doc(project)
    # the build held at its first embedding request (no timing): the second run arrives mid-build whatever the load;
    # the reconcile, started while the build is held, waits for the run
    slow_ollama.hold()

    stop = tmp_path / "stop-status"
    watcher = subprocess.Popen([sys.executable, "-c", STATUS_LOOP, str(stop)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    runner = subprocess.Popen([str(CLI), "run", "--json", "-q"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    reconcile = None
    try:
        assert slow_ollama.wait_until_held(120), "the build of v2 never asked for an embedding"
        second_code, second = cli({**env, "KB_LOCK_WAIT": "0"}, "run")
        assert second_code == 1 and f"another run is working on {ALIAS}: cli__reindex__" in second["error"]
        assert runner.poll() is None, "the build finished while it was held"
        reconcile = subprocess.Popen([str(CLI), "reconcile", "--json", "-q"], env={**env, "KB_LOCK_WAIT": "120"},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1)  # the reconcile on its way to the lock while the build still holds it (its wait is proven below)
        slow_ollama.release()
        reconcile_out, reconcile_err = reconcile.communicate(timeout=180)
        assert reconcile_out.strip(), reconcile_err[-2000:]
        reconcile_code, reconciled = reconcile.returncode, json.loads(reconcile_out)
        assert runner.wait(timeout=180) == 0, runner.stderr.read()[-2000:] if runner.stderr else ""
    finally:
        slow_ollama.release()
        stop.touch()
        out, err = watcher.communicate(timeout=60)
        runner.kill()
        if reconcile is not None:
            reconcile.kill()
    run = json.loads(runner.stdout.read()) if runner.stdout else {}
    assert run["outcome"] == "promoted" and run["version"] == 2
    assert reconcile_code == 0 and reconciled["changed"] is False
    reads = [json.loads(line) for line in out.splitlines()]
    assert watcher.returncode == 0, err[-2000:]
    assert len(reads) > 10 and {r["live"] for r in reads} >= {1, 2}, "status watched the promotion"
    assert [r["problems"] for r in reads if r["problems"]] == [], "status never reports a promotion as drift"
    code, status = cli(env, "status")
    assert code == 0 and status["live"]["version"] == 2 and status["locks"] == []
    assert [e["action"] for e in cli(env, "history")[1]["events"]] == ["promote", "promote"]


def test_four_reader_processes_see_no_error_and_no_empty_result_through_a_promotion(
        project: Path, server: QdrantServerProcess, slow_ollama: FakeOllamaServer, tmp_path: Path) -> None:
    env = env_for(project, server, slow_ollama)
    assert cli(env, "run")[1]["outcome"] == "promoted"
    edit_every_doc(project)
    stop = tmp_path / "stop-readers"
    readers = [subprocess.Popen([sys.executable, "-c", READER_LOOP, str(stop)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        for reader in readers:  # each has read v1 (no sleep: a reader slow to start on a loaded machine is waited for)
            assert reader.stdout is not None and reader.stdout.readline().strip() == "reading"
        code, run = cli(env, "run")
        assert code == 0 and run["version"] == 2
    finally:  # each reader reads three more times after the stop file appears: v2 by then
        stop.touch()
        results = [r.communicate(timeout=60) for r in readers]
    for out, err in results:
        seen = json.loads(out.strip().splitlines()[-1])
        assert seen["errors"] == 0 and seen["empty"] == 0, err[-2000:]
        assert seen["reads"] > 5 and seen["versions"][-1] == 2


@pytest.mark.parametrize("store", ["embedded", "server"])
def test_a_run_killed_mid_build_leaves_live_serving_and_the_next_run_resumes_at_once(
        project: Path, slow_ollama: FakeOllamaServer, tmp_path: Path, store: str) -> None:
    """kill -9 of a real `kb-reindex run`: its lock is taken over at once (its process is gone), the alias
    never moved, and the rerun continues the same version instead of starting another."""
    server = start_process(tmp_path / "qdrant-server") if store == "server" else None
    try:
        env = env_for(project, server, slow_ollama) if server else {
            **{k: v for k, v in os.environ.items() if not k.startswith("KB_") or k.startswith("KB_TEST_")},
            "KB_PROJECT_ROOT": str(project), "KB_EMBEDDER": "ollama", "OLLAMA_HOST": slow_ollama.url,
            "KB_EMBED_BATCH_SIZE": "4", **PATTERNS_SCREEN}
        assert cli(env, "run")[1]["outcome"] == "promoted"
        add_a_long_page(project)
        slow_ollama.faults = FaultPlan(delay_per_text_s=0.1)
        before = slow_ollama.embedded_texts
        victim = subprocess.Popen([str(CLI), "run", "-q"], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        wait_for(lambda: slow_ollama.embedded_texts - before >= 12, 60, "the build to embed a few batches")
        victim.kill()
        victim.wait()
        slow_ollama.faults = FaultPlan()
        code, status = cli(env, "status")
        assert status["live"]["version"] == 1 and status["serving_collection"].endswith("__s1")
        assert [lock["owner_alive"] for lock in status["locks"]] == ["no"]
        code, rerun = cli({**env, "KB_LOCK_WAIT": "0"}, "run")
        assert code == 0 and rerun["outcome"] == "promoted" and rerun["version"] == 2, rerun
        assert rerun["chunks"]["skipped"] > 0, "the rerun resumed the killed build"
        history = cli(env, "history")[1]["events"]
        assert [e["action"] for e in history] == ["promote", "lock-takeover", "promote"]
        assert cli(env, "status")[1]["metrics"]["failed_runs"] == 1, "the killed run is on record as failed"
    finally:
        if server is not None:
            server.stop()
