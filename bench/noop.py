"""P8: what a scheduled run with nothing to do costs, in the process and as a fresh `kb-reindex plan`.

    .venv/bin/python bench/noop.py                      # 20,000 docs (~100k chunks); writes bench/results/noop.json
    .venv/bin/python bench/noop.py --docs 2000 --out /tmp/noop.json

One project (`corpus.py`'s documents), our Qdrant-protocol test server in memory as the store (a process of its
own, reached over REST as a production server would be), SQLite state, the offline embedder with 16-d vectors
(`--dim`: a no-op reads no vector, and small ones keep the one full build before it short). After that build
it times, each the median of `--repeat`:

- `noop_s`: `run_reindex` on the unchanged corpus in this process (the file hashes recorded by the
  plans before are trusted: no file is read). The first no-op after the build is reported apart
  (`first_noop_s`): files written within the mtime margin of the build's recording are read again once.
- `noop_unrecorded_s`: the same with the recorded file hashes deleted first: every file read and hashed (not
  chunked), as the first plan after an upgrade does.
- `noop_full_scan_s`: the same with the recorded hashes not consulted at all: every file read, parsed and
  chunked, as every no-op did before (an earlier run's 9.95 s at 20,000 docs, measured through the sidecar store).
- `cli_plan_s`: a fresh `kb-reindex plan --json` process, start to exit; `cli_plan_overhead_s` is that minus
  `noop_s` (interpreter, imports, opening the stores); `fresh_python_s`, `fresh_import_qdrant_client_s` and
  `fresh_import_cli_s` split it. `python -X importtime` of that command goes to `importtime` (the slowest
  top-level imports).

Targets: `noop_s` <= 1.5 s at 20,000 docs; `cli_plan_overhead_s` <= 1 s. Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import corpus as corpus_mod  # noqa: E402
from sidecar import qdrant_server  # noqa: E402


def timed(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def slowest_imports(stderr: str, top: int = 12) -> list[dict[str, Any]]:
    rows = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split(":", 1)[1].split("|")
        if cumulative.strip().isdigit():
            rows.append({"module": name.strip(), "cumulative_ms": round(int(cumulative) / 1000, 1),
                         "depth": (len(name) - len(name.lstrip()) - 1) // 2})
    top_level = [r for r in rows if r["depth"] == 0]
    return sorted(top_level, key=lambda r: -r["cumulative_ms"])[:top]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    # a no-op reads no vector: small ones keep the one full build before it short (JSON over REST)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "noop.json")
    args = parser.parse_args(argv)


    from kb_reindex.run.pipeline import run_reindex
    from kb_reindex.services.config import Settings
    from kb_reindex.services.runtime import open_deps
    from kb_reindex.services.state.schema import file_hashes

    with tempfile.TemporaryDirectory(prefix="kb-noop-") as tmp, qdrant_server() as (url, _pid):
        root = Path(tmp) / "project"
        corpus = corpus_mod.generate(args.docs)
        corpus_mod.write_project(root, corpus, None)
        env = {"KB_PROJECT_ROOT": str(root), "KB_QDRANT_URL": url, "KB_STATE_URL": f"sqlite:///{root}/state.db",
               "KB_EMBEDDER": "hashing", "KB_EMBED_DIM": str(args.dim), "KB_REPORTS_DIR": str(root / "reports"),
               "KB_LOCK_WAIT": "5"}
        settings = Settings.from_env(env)
        result: dict[str, Any] = {"docs": args.docs, "store": "qdrant test server (REST, in memory)",
                                  "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
        with open_deps(settings) as deps:
            build_s, built = timed(lambda: run_reindex(deps))
            if built.outcome != "promoted":
                raise RuntimeError(f"the full build failed: {built.error}")
            result.update(build_s=round(build_s, 2), chunks=built.chunks.total)
            print(f"[noop] full build of {args.docs} docs ({built.chunks.total} chunks): {build_s:.1f} s",
                  file=sys.stderr, flush=True)
            time.sleep(2.1)  # past the mtime margin of the build's recording, as a scheduled run a day later is
            first_s, first = timed(lambda: run_reindex(deps))
            assert first.outcome == "no_change", first
            noops = []
            for _ in range(args.repeat):
                seconds, quiet = timed(lambda: run_reindex(deps))
                assert quiet.outcome == "no_change", quiet
                noops.append(seconds)
            unrecorded = []
            for _ in range(args.repeat):
                with deps.state.engine.begin() as conn:
                    conn.execute(file_hashes.delete())
                seconds, quiet = timed(lambda: run_reindex(deps))
                assert quiet.outcome == "no_change", quiet
                unrecorded.append(seconds)
            full_scans = []
            import kb_reindex.steps.plan as plan_module

            recognise = plan_module.quick_fingerprint
            plan_module.quick_fingerprint = lambda *a, **k: None  # as before: every file read, parsed, chunked
            try:
                for _ in range(args.repeat):
                    seconds, quiet = timed(lambda: run_reindex(deps))
                    assert quiet.outcome == "no_change", quiet
                    full_scans.append(seconds)
            finally:
                plan_module.quick_fingerprint = recognise
            time.sleep(2.1)
            run_reindex(deps)  # records again what the full scans read
        result.update(first_noop_s=round(first_s, 3), noop_s=round(statistics.median(noops), 3),
                      noop_runs_s=[round(s, 3) for s in noops],
                      noop_unrecorded_s=round(statistics.median(unrecorded), 3),
                      noop_full_scan_s=round(statistics.median(full_scans), 3))
        cli = [str(Path(sys.executable).with_name("kb-reindex")), "plan", "--json"]
        child_env = {**{k: v for k, v in os.environ.items() if not k.startswith("KB_")}, **env}
        plans = []
        for _ in range(args.repeat):
            seconds, proc = timed(lambda: subprocess.run(cli, env=child_env, capture_output=True, text=True))
            if proc.returncode != 0:
                raise RuntimeError(f"kb-reindex plan failed: {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
            assert json.loads(proc.stdout)["no_change"] is True
            plans.append(seconds)
        for label, code in (("fresh_python_s", "pass"), ("fresh_import_qdrant_client_s", "import qdrant_client"),
                            ("fresh_import_cli_s", "import kb_reindex.cli, kb_reindex.run.pipeline, kb_reindex.run.runs")):
            runs = [timed(lambda code=code: subprocess.run([sys.executable, "-c", code], env=child_env, check=True))[0]
                    for _ in range(args.repeat)]
            result[label] = round(statistics.median(runs), 3)
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "kb_reindex.cli", "plan", "--json"],
                              env=child_env, capture_output=True, text=True)
        result.update(cli_plan_s=round(statistics.median(plans), 3), cli_plan_runs_s=[round(s, 3) for s in plans],
                      importtime=slowest_imports(proc.stderr))
        result["cli_plan_overhead_s"] = round(result["cli_plan_s"] - result["noop_s"], 3)
        result["targets"] = {"P8_noop_le_1_5_s": result["noop_s"] <= 1.5,
                             "P8_cli_overhead_le_1_s": result["cli_plan_overhead_s"] <= 1.0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "importtime"}, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
