"""A rollback against a build in flight, and a run that lost its lock, as separate `kb-reindex` processes
against the Qdrant test server; the build is held mid-way by the Ollama test server's hold, not by timing.

- A rollback needs no reindex lock: it completes while a build is held; the build's promotion then fails
  its compare-and-swap and its version stays `ready`, unpromoted, and the run says so.
- A rollback acts only on the live version it was confirmed against: a stale one is refused, nothing moves.
- A run stopped (SIGSTOP) past KB_LOCK_TTL loses its lock to the next run; continued, it writes nothing more
  (fencing) and says why; `history` records the expired lock's takeover.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kb_reindex.services.embedding import HashingEmbedder
from kb_reindex.services.state.store import StateStore
from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer
from kb_reindex.testing.qdrant_server import QdrantServerProcess, start_process

from conftest import PATTERNS_SCREEN

ALIAS = "mall_knowledge"
CLI = Path(sys.executable).with_name("kb-reindex")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[QdrantServerProcess]:
    process = start_process(tmp_path / "qdrant-server")
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def ollama() -> Iterator[FakeOllamaServer]:
    embedder = HashingEmbedder(model="bge-m3", dim=1024)
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=1024, embed=lambda _m, text: embedder.embed_one(text))]) as s:
        yield s


def env_for(project: Path, server: QdrantServerProcess, ollama: FakeOllamaServer, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_") or k.startswith("KB_TEST_")}
    env.update(KB_PROJECT_ROOT=str(project), KB_QDRANT_URL=server.url, KB_EMBEDDER="ollama",
               OLLAMA_HOST=ollama.url, KB_EMBED_BATCH_SIZE="4", KB_EMBED_CONCURRENCY="1", **PATTERNS_SCREEN, **extra)
    return env


def cli(env: dict[str, str], *argv: str, timeout: float = 180) -> tuple[int, dict[str, Any]]:
    done = subprocess.run([str(CLI), *argv, "--json", "-q"], env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    assert done.stdout.strip(), done.stderr[-2000:]
    return done.returncode, json.loads(done.stdout)


def start_run(env: dict[str, str], *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([str(CLI), "run", *argv, "--json", "-q"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finished(run: subprocess.Popen[str]) -> tuple[int, dict[str, Any]]:
    out, err = run.communicate(timeout=180)
    assert out.strip(), err[-2000:]
    return run.returncode, json.loads(out)


def edit_every_doc(project: Path, line: str) -> None:
    for path in sorted((project / "knowledge" / "docs").glob("*.md")):
        path.write_text(path.read_text(encoding="utf-8") + f"\n\n{line}\n", encoding="utf-8")


def versions(env: dict[str, str]) -> dict[int, str]:
    return {v["version"]: v["status"] for v in cli(env, "status")[1]["versions"]}


def test_a_rollback_completes_during_a_build_whose_promotion_then_keeps_its_version_unpromoted(
        project: Path, server: QdrantServerProcess, ollama: FakeOllamaServer) -> None:
    env = env_for(project, server, ollama)
    assert cli(env, "run")[1]["outcome"] == "promoted"
    edit_every_doc(project, "本条款自下月起生效。")
    assert cli(env, "run")[1]["version"] == 2  # live v2, the rollback target v1

    ollama.hold()
    build = start_run(env, "--force-full")  # v3, held at its first embedding request
    try:
        assert ollama.wait_until_held(60), "the build of v3 never asked for an embedding"
        # the build holds the reindex lock all along; the rollback must not wait for it (KB_LOCK_WAIT=0 would refuse)
        # (--no-revalidate: the golden-set scores would ask the embedder, which the hold stops as well)
        code, rolled = cli({**env, "KB_LOCK_WAIT": "0"}, "rollback", "--reason", "v2 is bad", "--yes",
                           "--no-revalidate")
        assert build.poll() is None, "the rollback completed while the build was still held"
    finally:
        ollama.release()
    assert code == 0, rolled
    assert (rolled["from_version"], rolled["to_version"]) == (2, 1)
    code, run = finished(build)
    assert code == 1 and run["outcome"] == "failed" and run["version"] == 3, run
    assert "alias moved by a rollback to v1 while this run built" in run["error"], run["error"]
    assert "v3 kept unpromoted (`kb-reindex promote --version 3` to serve it)" in run["error"], run["error"]
    status = cli(env, "status")[1]
    assert status["live"]["version"] == 1 and status["serving_collection"].endswith("__s1")
    assert versions(env) == {1: "live", 2: "retired", 3: "ready"}, "v3 is a shadow, not failed; nothing dropped"
    assert status["locks"] == [] and status["problems"] == []
    assert [e["action"] for e in cli(env, "history")[1]["events"]] == ["promote", "promote", "rollback"]

    # a rollback confirmed against v2 while v1 serves (the stale prompt): refused, nothing moves
    code, stale = cli(env, "rollback", "--live-version", "2", "--reason", "v2 is bad", "--yes")
    assert code != 0
    assert stale["error"].startswith(f"{ALIAS} serves v1 now, not v2 (which you confirmed): nothing was rolled back")
    code, stale = cli(env, "promote", "--version", "3", "--live-version", "2", "--yes")
    assert code != 0 and f"{ALIAS} serves v1 now, not v2 (which you confirmed): nothing was promoted" in stale["error"]
    assert versions(env) == {1: "live", 2: "retired", 3: "ready"}
    assert [e["action"] for e in cli(env, "history")[1]["events"]] == ["promote", "promote", "rollback"]
    # confirmed against what serves now, the kept shadow goes live
    code, promoted = cli(env, "promote", "--version", "3", "--live-version", "1", "--yes")
    assert code == 0 and promoted["previous_version"] == 1, promoted


def upserts_into(server: QdrantServerProcess, collection: str) -> int:
    return sum(1 for r in server.requests() if r["op"] == "upsert" and r.get("collection") == collection)


def test_a_run_stopped_past_its_lock_ttl_is_fenced_when_it_continues(
        project: Path, server: QdrantServerProcess, ollama: FakeOllamaServer, tmp_path: Path) -> None:
    env = env_for(project, server, ollama, KB_LOCK_TTL="10")
    assert cli(env, "run")[1]["outcome"] == "promoted"
    edit_every_doc(project, "本条款自下月起生效。")

    ollama.hold()
    first = start_run(env)
    try:
        assert ollama.wait_until_held(60), "the first run never asked for an embedding"
        first.send_signal(signal.SIGSTOP)
        state = StateStore(f"sqlite:///{project / '.kb' / 'state.db'}", create=False)
        try:
            deadline = time.monotonic() + 60
            while state.lock_held_by(f"reindex:{ALIAS}") is not None:  # expires KB_LOCK_TTL after its last renewal
                assert time.monotonic() < deadline, "the stopped run's lock never expired"
                time.sleep(0.2)
        finally:
            state.dispose()
        ollama.release()
        code, second = cli({**env, "KB_LOCK_WAIT": "0"}, "run")
        assert code == 0 and second["outcome"] == "promoted" and second["version"] == 2, second
        collection = second["collection"]
        points = cli(env, "status")[1]["live"]["points"]
        written = upserts_into(server, collection)
    finally:
        ollama.release()
        first.send_signal(signal.SIGCONT)
    code, fenced = finished(first)
    assert code == 1 and fenced["outcome"] == "failed", fenced
    assert "no longer holds the lock 'reindex:mall_knowledge'" in fenced["error"], fenced["error"]
    assert "Stopped before writing" in fenced["error"], fenced["error"]
    assert upserts_into(server, collection) == written, "the fenced run wrote into the live version"
    status = cli(env, "status")[1]
    assert status["live"]["version"] == 2 and status["live"]["points"] == points and status["problems"] == []
    assert versions(env) == {1: "retired", 2: "live"}, "the fenced run did not mark the version it lost"
    history = cli(env, "history")[1]["events"]
    assert [e["action"] for e in history] == ["promote", "lock-takeover", "promote"]
    assert "its lock expired at" in history[1]["reason"] and "fenced" in history[1]["reason"]
