"""The benchmark's smoke run (tiny corpus, seconds), so bench/run.py cannot rot.

The full benchmark is run by hand (`.venv/bin/python bench/run.py`); its latest table is in bench/README.md.
The smoke run needs the benchmark's extra packages (bench/requirements.txt) and is skipped without them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_classic.indexes")
pytest.importorskip("langchain_qdrant")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import report  # noqa: E402  (bench/report.py: the scenario and target names the benchmark promises)


def test_smoke_benchmark_reports_every_scenario_peer_and_target(tmp_path: Path) -> None:
    """The local-mode smoke run, then the over-the-wire one (`--store server`) merged into its results."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--smoke", "--out", str(out), "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,  # a hang, not a slow machine (113-300+ s)
    )
    assert proc.returncode == 0, proc.stderr[-6000:]

    data = json.loads((out / "latest.json").read_text(encoding="utf-8"))
    assert data["meta"]["smoke"] is True
    sizes = data["sizes"]
    assert len(sizes) >= 2
    ollama_sizes = set(data["meta"]["ollama_sizes"])
    seen_peers = set()
    for entry in sizes:
        embedders = ["hashing"] + (["ollama"] if entry["docs"] in ollama_sizes else [])
        for embedder in embedders:
            runs = entry[embedder]
            for name in report.SCENARIOS[embedder]:
                assert name in runs, f"{entry['docs']} docs/{embedder}: scenario {name} missing"
                row = runs[name]
                assert row["wall_s"] > 0 and row["peak_rss_mb"] > 0
                for key in ("chunk_texts_embedded", "embed_requests", "vector_writes"):
                    assert key in row
                seen_peers.add(name.split(".")[0])
            # what the scenarios promise regardless of speed
            assert runs["kb.noop"]["outcome"] == "no_change" and runs["kb.noop"]["vector_writes"] == 0
            assert runs["kb.noop"]["chunk_texts_embedded"] == 0
            assert runs["kb.incremental"]["outcome"] == "promoted" and runs["kb.incremental"]["points_copied"] > 0
            assert runs["full_rebuild.incremental"]["chunks_reused"] == 0
            assert runs["kb.rollback"]["outcome"] == "rolled_back"
            if embedder == "ollama":  # the fake server saw exactly what our counters saw
                inc = runs["kb.incremental"]
                assert inc["server_texts_embedded"] == inc["chunk_texts_embedded"] + inc["query_texts_embedded"]
        assert entry["corpus"]["new_chunk_hashes_after_edit"] > 0
    assert seen_peers == set(report.PEERS)

    targets = data["targets"]
    assert set(targets) == set(report.TARGET_KEYS)
    for key in report.TARGET_KEYS:
        assert "passed" in targets[key] and "target" in targets[key]
    # deterministic targets hold even at smoke scale; timing targets are only reported
    assert targets["P1"]["passed"] is True, targets["P1"]
    assert targets["P6"]["passed"] is True, targets["P6"]
    assert targets["P5"]["docs"] == sorted(data["meta"]["sizes"])[:2]
    # P5 is judged against the store's own upsert scaling of the same points, P2 against its read + write
    assert targets["P5"]["raw_upsert_time_ratio"] and targets["P5"]["time_vs_store_scaling"] is not None
    assert targets["P2"]["checks"] and all(c["raw_read_write_points_per_s"] for c in targets["P2"]["checks"])
    # P7 and P8 ran in the same run, on the same package snapshot (bench/p7.py, bench/noop.py)
    p7, p8 = data["p7"], data["p8"]
    assert p7["run"]["package_sha256"] == p8["run"]["package_sha256"] == data["meta"]["package_sha256"]
    # P7's setups (bench/p7.py, run by run.py here; once a test of its own): each embedded every chunk, the
    # serial one a request at a time, two servers of 2 slots never more than 2 at once each, and all the same texts
    serial, one_server, two_servers = p7["rows"]
    assert all(row["chunks_embedded"] == p7["chunks"] > 0 for row in p7["rows"])
    assert (serial["concurrency"], serial["servers"], serial["server_max_in_flight"]) == (1, [4], [1])
    assert (one_server["concurrency"], one_server["servers"]) == (4, [4])
    assert two_servers["servers"] == [2, 2] and all(n > 0 for n in two_servers["server_texts"]), two_servers
    assert all(n <= 2 for n in two_servers["server_max_in_flight"])
    assert sum(serial["server_texts"]) == sum(one_server["server_texts"]) == sum(two_servers["server_texts"])
    assert p7["target"]["key"] == "P7" and len(p7["target"]["checks"]) == 2
    assert len(targets["P7"]["checks"]) == 2 and targets["P7"]["passed"] is not None
    assert p8["docs"] == data["meta"]["p8_size"] and p8["noop_s"] > 0 and p8["cli_plan_s"] > 0
    assert targets["P8"]["noop_s"] == p8["noop_s"] and targets["P8"]["passed"] is not None

    markdown = (out / "latest.md").read_text(encoding="utf-8")
    assert "| scenario | peer | wall s |" in markdown and "## Targets" in markdown
    for key in report.TARGET_KEYS:
        assert f"| {key} " in markdown
    assert "## P7: concurrent embedding" in markdown and "| setup | wall s | speedup |" in markdown
    excerpt = subprocess.run([sys.executable, str(REPO / "bench" / "run.py"), "--readme", "--out", str(out)],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert excerpt.returncode == 0, excerpt.stderr[-3000:]
    assert [line.split(" ")[1] for line in excerpt.stdout.splitlines() if line.startswith("| P")] == report.TARGET_KEYS
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob("*.tmp"))

    # over the wire: the Qdrant test server as the store, merged beside the local-mode rows, not over them
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--smoke", "--store", "server", "--sizes", "8",
         "--ollama-sizes", "none", "--merge", "--out", str(out), "--workdir", str(tmp_path / "work-wire")],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,  # a hang, not a slow machine (113-300+ s)
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    merged = json.loads((out / "latest.json").read_text(encoding="utf-8"))
    assert [e["docs"] for e in merged["sizes"]] == [e["docs"] for e in sizes]
    assert merged["p7"] == data["p7"] and merged["p8"] == data["p8"]  # a wire run runs neither; the merge keeps them
    assert merged["targets"]["P7"]["passed"] is not None and merged["targets"]["P8"]["passed"] is not None
    assert merged["meta"]["store"] == "sidecar" and merged["sizes"][0]["hashing"] == sizes[0]["hashing"]
    wire = merged["wire"]
    assert wire["meta"]["store"] == "server" and [e["docs"] for e in wire["sizes"]] == [8]
    runs = wire["sizes"][0]["hashing"]
    for name in report.SCENARIOS["hashing"]:
        assert name in runs, f"over the wire: scenario {name} missing"
        assert runs[name]["qdrant_requests"], f"{name}: the test server logged no request"
    assert runs["kb.incremental"]["outcome"] == "promoted" and runs["kb.incremental"]["points_copied"] > 0
    # the engine took the store for a server (reached over REST): the bulk load's index was restored
    assert any(key.startswith("update_collection ") for key in runs["kb.full_build"]["qdrant_requests"])
    assert runs["wire.costs"]["encode_upsert_s"] > 0 and runs["wire.costs"]["round_trip_s"] > 0
    assert wire["targets"]["P1"]["passed"] is True and wire["targets"]["P6"]["passed"] is True
    assert wire["targets"]["P2_wire"]["checks"] and wire["time_split"][0]["raw"]["server_store_s"] > 0
    markdown = (out / "latest.md").read_text(encoding="utf-8")
    assert "## Over the wire" in markdown and "gRPC cannot be measured here" in markdown
    assert "Where the copy path's time goes over REST" in markdown
