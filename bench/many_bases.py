"""P9: two knowledge bases reindexed at once against one Qdrant server, wall time against one after the other.

    .venv/bin/python bench/many_bases.py                          # 2 x 6 docs (~50 chunks each), 40 ms/text: ~1 min
    .venv/bin/python bench/many_bases.py --smoke --out /tmp/p9    # 2 ms/text, seconds (tests/benchmarks)

The two knowledge bases of one registry (the shop's pages, and a copy of them under a second alias, so both
builds cost the same) are built from nothing as `kb-reindex --kb <alias> run --force-full` processes, the
way a user runs them: into one Qdrant server (our Qdrant-protocol test server, a process), one state DB,
embedding through one Ollama server (our test server, a process) with 2 slots (OLLAMA_NUM_PARALLEL=2), each
text costing `--ms`: an embedder-bound build. First one after the other, then both at once, each round into
a fresh project. The target: at once at least 1.6x faster than one after the other (the limit is 2x).
Writes `<out>/many_bases.json` and `<out>/many_bases.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CLI = Path(sys.executable).with_name("kb-reindex")
TARGET = 1.6
ALIASES = ("shop", "shop_copy")
REGISTRY = """knowledge_bases:
  shop:
    source: docs
    golden_set: golden.yaml
  shop_copy:
    source: docs-copy
    golden_set: golden.yaml
"""


def start(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    """A test server as a process; its URL from its first line."""
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, line.split(" at ", 1)[1].split()[0]


def project(root: Path) -> Path:
    shutil.copytree(REPO / "knowledge" / "docs", root / "knowledge" / "docs")
    shutil.copytree(REPO / "knowledge" / "docs", root / "knowledge" / "docs-copy")
    shutil.copy(REPO / "knowledge" / "golden.yaml", root / "knowledge" / "golden.yaml")
    (root / "knowledge" / "registry.yaml").write_text(REGISTRY, encoding="utf-8")
    return root


def run(env: dict[str, str], aliases: tuple[str, ...]) -> list[dict[str, Any]]:
    """`kb-reindex --kb <alias> run --force-full` for each alias at once; their answers."""
    procs = [subprocess.Popen([str(CLI), "--kb", alias, "run", "--force-full", "--json", "-q"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for alias in aliases]
    answers = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        answer = json.loads(out) if out.strip() else {"outcome": "failed", "error": err[-400:]}
        if answer.get("outcome") != "promoted":
            raise SystemExit(f"a build did not promote: {answer.get('error')}")
        answers.append(answer)
    return answers


def measure(ms: float, work: Path) -> dict[str, Any]:
    ollama, ollama_url = start(["kb_reindex.testing.ollama_server", "--embedder", "hashing", "--port", "0",
                                "--model", "bge-m3", "--dim", "1024", "--delay-ms", str(ms), "--parallel", "2"])
    rounds: dict[str, float] = {}
    chunks = 0
    try:
        for name in ("one after the other", "at once"):
            folder = work / name.replace(" ", "-")
            # each round a fresh project, state DB and Qdrant server
            qdrant, qdrant_url = start(["kb_reindex.testing.qdrant_server", "--port", "0", "--path",
                                        str(folder / "qdrant")])
            env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
            env.update(KB_PROJECT_ROOT=str(project(folder)), KB_REGISTRY="knowledge/registry.yaml",
                       KB_QDRANT_URL=qdrant_url, KB_EMBEDDER="ollama", KB_EMBED_MODEL="bge-m3",
                       OLLAMA_HOST=ollama_url, KB_LOCK_WAIT="0")
            try:
                started = time.perf_counter()
                if name == "at once":
                    answers = run(env, ALIASES)
                else:
                    answers = [a for alias in ALIASES for a in run(env, (alias,))]
                rounds[name] = time.perf_counter() - started
            finally:
                qdrant.terminate()
                qdrant.wait(timeout=30)
            chunks = sum(a["chunks"]["embedded"] for a in answers)
    finally:
        ollama.terminate()
        ollama.wait(timeout=30)
    ratio = rounds["one after the other"] / rounds["at once"]
    return {"key": "P9", "ms_per_text": ms, "chunks_embedded_per_round": chunks,
            "sequential_s": round(rounds["one after the other"], 2), "concurrent_s": round(rounds["at once"], 2),
            "ratio": round(ratio, 2), "target": TARGET, "met": ratio >= TARGET,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=float, default=40.0, help="cost per embedded text at the Ollama server")
    parser.add_argument("--smoke", action="store_true", help="2 ms/text: checks the script, not the speed")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kb-p9-") as work:
        result = measure(2.0 if args.smoke else args.ms, Path(work))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "many_bases.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    table = ("| P9: two knowledge bases, one Qdrant server | wall s |\n|---|---|\n"
             f"| one after the other | {result['sequential_s']} |\n| at once | {result['concurrent_s']} |\n"
             f"| ratio (target >= {TARGET}) | {result['ratio']} ({'met' if result['met'] else 'NOT met'}) |\n")
    (args.out / "many_bases.md").write_text(table, encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()
