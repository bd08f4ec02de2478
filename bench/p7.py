"""P7: a full build at 20 ms/text against Ollama test servers: KB_EMBED_CONCURRENCY=4 against 1 on one
4-slot server, and 4 in flight over two servers of 2 slots each.

    .venv/bin/python bench/p7.py                       # 500 docs (~2.5k chunks), 20 ms/text: ~2 min
    .venv/bin/python bench/p7.py --docs 2000           # ~10k chunks: ~6 min
    .venv/bin/python bench/p7.py --smoke --out /tmp/p7 # 8 docs, 2 ms/text, seconds (the suite runs it inside bench/run.py --smoke)

Each setup builds the same corpus from nothing (`run_reindex`, as `kb-reindex run` does: plan, create,
build, validate, promote) into a project, state DB and in-memory local-mode Qdrant of its own, through the
real `ollama` client over HTTP. The servers (`kb_reindex.testing.ollama_server`) process at most `parallel`
requests at once, the rest wait (Ollama's OLLAMA_NUM_PARALLEL), each text costing `--ms`: the capacity is
what a real Ollama with that many slots would give. One warm-up run on a 3-document project first pays the
one-time imports. Writes `<out>/p7.json` and `<out>/p7.md`; the target: both concurrent setups at least
3.2x faster than the serial one (the limit is 4x: 4 slots).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import corpus as corpus_mod  # noqa: E402

MODEL = "bge-m3"
DIM = 256
TARGET = 3.2
#: (name, slots of each server, KB_EMBED_CONCURRENCY); the first is the baseline
SETUPS = (
    ("serial: 1 server x 4 slots, concurrency 1", (4,), 1),
    ("1 server x 4 slots, concurrency 4", (4,), 4),
    ("2 servers x 2 slots, concurrency 4", (2, 2), 4),
)


def build_once(root: Path, env: dict[str, str]) -> dict[str, Any]:
    """One full `run_reindex` on a fresh in-memory store; wall time and what the engine reports."""
    from qdrant_client import QdrantClient


    from kb_reindex.run.pipeline import run_reindex
    from kb_reindex.services.config import Settings
    from kb_reindex.services.runtime import Deps
    from kb_reindex.services.state.store import StateStore
    from kb_reindex.services.store import KnowledgeStore

    settings = Settings.from_env({**env, "KB_PROJECT_ROOT": str(root)})
    client = QdrantClient(":memory:")
    state = StateStore(settings.state_url)
    try:
        started = time.perf_counter()
        result = run_reindex(Deps(settings=settings, state=state, store=KnowledgeStore(client, local=True)))
        wall = time.perf_counter() - started
    finally:
        state.dispose()
        client.close()
    if result.outcome != "promoted":
        raise RuntimeError(f"{root.name}: the build did not promote: {result.outcome}: {result.error}")
    return {"wall_s": round(wall, 3), "chunks_embedded": result.chunks.embedded}


def run(docs: int, ms: float, seed: int, workdir: Path) -> dict[str, Any]:
    import logging

    from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer, FaultPlan

    logging.getLogger("kb_reindex").setLevel(logging.WARNING)
    corpus = corpus_mod.generate(docs, seed)
    # the instruction screen by its patterns alone: under `auto` with Ollama the first setup alone judged every line
    # with e5 (the smoke run's serial build took 11.5 s with it, 0.59 s without; the process remembered the scores
    # for the setups after it), which inflated every speedup over it. Its cost is measured apart (bench/screen_cost.sh)
    base_env = {"KB_EMBEDDER": "ollama", "KB_EMBED_MODEL": MODEL, "KB_EMBED_DIM": str(DIM),
                "KB_INSTRUCTION_SCREEN": "patterns"}

    def servers(slots: tuple[int, ...], delay_s: float) -> list[FakeOllamaServer]:
        return [FakeOllamaServer([FakeModel(name=MODEL, dim=DIM)], faults=FaultPlan(delay_per_text_s=delay_s),
                                 parallel=n).start() for n in slots]

    warm = servers((4,), 0.0)
    try:
        root = corpus_mod.write_project(workdir / "warmup", corpus_mod.generate(3, seed=1), None)
        build_once(root, {**base_env, "OLLAMA_HOST": warm[0].url})
    finally:
        warm[0].stop()

    rows = []
    for position, (name, slots, concurrency) in enumerate(SETUPS):
        root = corpus_mod.write_project(workdir / f"setup-{position}", corpus, None)
        fakes = servers(slots, ms / 1000.0)
        try:
            print(f"[p7] {name} ...", file=sys.stderr, flush=True)
            measured = build_once(root, {**base_env, "OLLAMA_HOST": ",".join(f.url for f in fakes),
                                         "KB_EMBED_CONCURRENCY": str(concurrency)})
            rows.append({"setup": name, "servers": list(slots), "concurrency": concurrency, **measured,
                         "server_texts": [f.embedded_texts for f in fakes],
                         "server_max_in_flight": [f.max_in_flight for f in fakes]})
            print(f"[p7] {name}: {measured['wall_s']} s", file=sys.stderr, flush=True)
        finally:
            for fake in fakes:
                fake.stop()
    serial = rows[0]["wall_s"]
    for row in rows:
        row["speedup"] = round(serial / row["wall_s"], 2)
    checks = [{"setup": row["setup"], "speedup": row["speedup"], "passed": row["speedup"] >= TARGET}
              for row in rows[1:]]
    return {
        "meta": {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "docs": docs, "ms_per_text": ms,
                 "seed": seed, "dim": DIM, "machine": f"{platform.machine()} {os.cpu_count()} CPU",
                 "python": platform.python_version(),
                 "command": "bench/p7.py " + " ".join(sys.argv[1:])},
        "chunks": rows[0]["chunks_embedded"],
        "rows": rows,
        "target": {"key": "P7", "target": f"concurrency 4 over 4 slots (one server or two of 2) >= {TARGET}x "
                                          "the serial build (limit 4x)",
                   "checks": checks, "passed": all(c["passed"] for c in checks)},
    }


def markdown(data: dict[str, Any]) -> str:
    meta = data["meta"]
    lines = [f"## P7: concurrent embedding ({meta['docs']} docs, {data['chunks']} chunks, {meta['ms_per_text']:g} ms/text)",
             "", f"{meta['date']}, {meta['machine']}, `{meta['command'].strip()}`", "",
             "| setup | wall s | speedup | texts per server | max in flight per server |",
             "|---|---:|---:|---|---|"]
    for row in data["rows"]:
        lines.append(f"| {row['setup']} | {row['wall_s']:.2f} | {row['speedup']:.2f}x | "
                     f"{', '.join(map(str, row['server_texts']))} | {', '.join(map(str, row['server_max_in_flight']))} |")
    verdict = "passed" if data["target"]["passed"] else "FAILED"
    lines += ["", f"Target: {data['target']['target']}: **{verdict}**", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--docs", type=int, default=None, help="documents in the corpus (default 500)")
    parser.add_argument("--ms", type=float, default=None, help="simulated cost per text in ms (default 20)")
    parser.add_argument("--seed", type=int, default=corpus_mod.DEFAULT_SEED)
    parser.add_argument("--smoke", action="store_true", help="8 docs at 2 ms/text: seconds")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="results folder (default bench/results)")
    args = parser.parse_args(argv)
    docs = args.docs or (8 if args.smoke else 500)
    ms = args.ms if args.ms is not None else (2.0 if args.smoke else 20.0)
    with tempfile.TemporaryDirectory(prefix="kb-bench-p7-") as tmp:
        os.environ.setdefault("AIRFLOW_HOME", str(Path(tmp) / "airflow-home"))  # Stats import writes no ~/airflow
        data = run(docs, ms, args.seed, Path(tmp))
    data["meta"]["smoke"] = args.smoke
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "p7.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    md = markdown(data)
    (args.out / "p7.md").write_text(md, encoding="utf-8")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
