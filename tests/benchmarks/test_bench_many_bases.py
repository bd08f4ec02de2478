"""P9's smoke run (bench/many_bases.py --smoke: two knowledge bases, 2 ms/text, seconds), so the script cannot
rot. Speed is not judged here (bench/README.md holds the measured ratio); that both rounds build both is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_p9_smoke_builds_two_knowledge_bases_one_after_the_other_and_at_once(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "many_bases.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "many_bases.json").read_text(encoding="utf-8"))
    assert data["key"] == "P9" and data["chunks_embedded_per_round"] == 100  # 2 x the shop's 50 chunks
    assert data["sequential_s"] > 0 and data["concurrent_s"] > 0 and data["target"] == 1.6
    assert "| at once |" in (out / "many_bases.md").read_text(encoding="utf-8")
