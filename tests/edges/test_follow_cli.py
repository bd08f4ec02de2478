"""`kb-reindex run --follow` as a user runs it: a process in the foreground that builds a fresh install at once,
reindexes each edit within seconds (searchable through the alias, which it leaves free between runs), and ends
cleanly on Ctrl-C with no lock left behind."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def _reader(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)


def _wait_for(lines: queue.Queue, text: str, seen: list[str], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
        except queue.Empty:
            raise AssertionError(f"{text!r} not printed within {timeout_s} s:\n{''.join(seen)}") from None
        if text in seen[-1]:
            return


def test_follow_reindexes_each_edit_and_stops_on_ctrl_c(project: Path) -> None:
    env = {**os.environ, "KB_PROJECT_ROOT": str(project), "KB_EMBEDDER": "hashing", "KB_SOURCE_POLL_S": "0.3",
           "KB_SOURCE_QUIET_S": "0.8"}
    follower = subprocess.Popen([str(BIN / "kb-reindex"), "run", "--follow"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    out: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(follower.stdout, out), daemon=True).start()
    seen: list[str] = []
    try:
        _wait_for(out, "outcome: promoted  version: v1", seen)  # a fresh install: built at once
        doc = project / "knowledge" / "docs" / "shipping-policy.md"
        doc.write_text(doc.read_text(encoding="utf-8") + "\n\n偏远海岛地区的包裹由渡轮转运，另加两天。\n",
                       encoding="utf-8")
        _wait_for(out, "outcome: promoted  version: v2", seen)
        found = subprocess.run([str(BIN / "kb-reindex"), "query", "偏远海岛的包裹怎么送", "--json", "-q"], env=env,
                               capture_output=True, text=True, timeout=60)
        assert found.returncode == 0, found.stderr  # the local-mode store is free between runs
        assert json.loads(found.stdout)["results"][0]["knowledge_key"] == "shipping-policy"
    finally:
        follower.send_signal(signal.SIGINT)
        code = follower.wait(timeout=30)
    stderr = follower.stderr.read() if follower.stderr else ""
    assert code == 130, stderr
    assert "stopped following" in stderr and "Traceback" not in stderr
    status = subprocess.run([str(BIN / "kb-reindex"), "status", "--json", "-q"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert json.loads(status.stdout)["locks"] == []
    assert "".join(seen).count("outcome: promoted") == 2  # two runs, no third for a source that stood still
