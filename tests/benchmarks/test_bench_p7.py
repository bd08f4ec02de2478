"""The P7 benchmark's smoke run (bench/p7.py --smoke: 8 docs, 2 ms/text, seconds), so the script cannot rot.

Speed is not judged here (the full run is by hand, its ratios in bench/README.md); what the setups promise is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_p7_smoke_builds_with_each_setup_and_reports_the_target(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "p7.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    data = json.loads((out / "p7.json").read_text(encoding="utf-8"))
    serial, one_server, two_servers = data["rows"]
    chunks = data["chunks"]
    assert chunks > 0 and all(row["chunks_embedded"] == chunks for row in data["rows"])
    assert (serial["concurrency"], serial["servers"], serial["server_max_in_flight"]) == (1, [4], [1])
    assert (one_server["concurrency"], one_server["servers"]) == (4, [4])
    assert two_servers["servers"] == [2, 2] and all(n > 0 for n in two_servers["server_texts"]), two_servers
    assert all(n <= 2 for n in two_servers["server_max_in_flight"])
    # every setup embedded the same texts in all (chunks plus validation's golden queries)
    assert sum(serial["server_texts"]) == sum(one_server["server_texts"]) == sum(two_servers["server_texts"])
    assert data["target"]["key"] == "P7" and len(data["target"]["checks"]) == 2
    assert "| setup | wall s | speedup |" in (out / "p7.md").read_text(encoding="utf-8")
