"""Benchmark: incremental blue-green reindexing against full rebuilds and LangChain's indexing API.

    .venv/bin/pip install -c constraints.txt -r bench/requirements.txt
    .venv/bin/python bench/run.py                                  # 500 and 2,000 docs; 20 ms Ollama at 500
    .venv/bin/python bench/run.py --sizes 500,2000,20000           # + 20,000 docs (~100k chunks)
    .venv/bin/python bench/run.py --smoke --out /tmp/bench         # tiny corpus, seconds (the test suite runs this)
    .venv/bin/python bench/run.py --sizes 2000 --profile-size 2000 # + a pyinstrument profile of our incremental run
    .venv/bin/python bench/run.py --store inprocess                # local-mode Qdrant inside each worker
    .venv/bin/python bench/run.py --sizes 500,2000,20000 --ollama-sizes 500 --profile-size 2000   # P1-P8, one table
    .venv/bin/python bench/run.py --readme                         # print that table for bench/README.md

After the peers, the same run also runs P7 (`bench/p7.py`: concurrent embedding, a full build at the Ollama cost
against 4-slot test servers; `--p7-size`, default 500 docs) and P8 (`bench/noop.py`: the no-op in the process and
as a fresh `kb-reindex plan`; `--p8-size`, default 20,000 docs), one after the other on the same package snapshot,
so the targets table in latest.md shows P1-P8 of one revision. `--p7-size none --p8-size none` skips them (a
`--merge` then keeps the previous results' P7/P8); `--store server` skips them unless asked (they pick their own
stores).

Per size, each peer runs in its own subprocess (so peak RSS is its own) on the same deterministic corpus,
the same embedder and the same local-mode Qdrant (`:memory:`), which by default runs in a sidecar process
of its own, as a Qdrant server would (`--store inprocess`: inside the worker, as before): our engine (full build, no-op, incremental
1% edited / 0.5% added / 0.5% deleted, rollback, a promotion under 4 readers), the full rebuild
(`run --force-full`), LangChain `index()` (SQLRecordManager, cleanup="incremental", QdrantVectorStore,
in place) and Qdrant's raw bulk upsert of the same points. Writes `<out>/latest.json`, `latest.md`,
`scaling.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import corpus as corpus_mod  # noqa: E402
import report  # noqa: E402
from sidecar import STORE_KINDS  # noqa: E402

DEFAULT_SIZES = "500,2000"
QDRANT_WHERE = {"sidecar": "local mode, :memory:, in a sidecar process (bench/sidecar.py) like a server",
                "server": "the Qdrant-protocol test server (kb_reindex.testing.qdrant_server: REST over one local-mode "
                          ":memory: client) in a process of its own; every client is the remote one (KB_QDRANT_URL)",
                "inprocess": "local mode, :memory:, inside each worker process"}
SMOKE_SIZES = "8,80"
DEFAULT_P7_SIZE, SMOKE_P7_SIZE = 500, 8  # P7: a full build at the Ollama cost (bench/p7.py)
DEFAULT_P8_SIZE, SMOKE_P8_SIZE = 20000, 20  # P8: the no-op over 20,000 docs (bench/noop.py)


def corpus_stats(size: int, seed: int, workdir: Path) -> dict[str, Any]:
    """Chunk counts and the exact number of chunks the edit makes new (hash not in the base corpus)."""
    from kb_reindex.services.chunking import chunk_document
    from kb_reindex.services.sources import load_corpus

    base = corpus_mod.generate(size, seed)
    mutated, mutation = corpus_mod.mutate(base, seed)
    stats: dict[str, Any] = {"docs": len(base.docs), "bytes": sum(len(t.encode("utf-8")) for t in base.docs.values()),
                             "mutation": mutation.summary()}
    hashes = []
    for name, c in (("base", base), ("mutated", mutated)):
        folder = workdir / f"stats-{size}-{name}"
        corpus_mod.write(c, folder)
        hashes.append([ch.chunk_hash for d in load_corpus(folder) for ch in chunk_document(d)])
    live = set(hashes[0])
    stats.update(chunks=len(hashes[0]), chunks_after_edit=len(hashes[1]),
                 new_chunk_hashes_after_edit=sum(1 for h in hashes[1] if h not in live))
    return stats


def snapshot_package(folder: Path) -> dict[str, str]:
    """Copy kb_reindex as it is now; every worker imports this copy (PYTHONPATH), so one run measures one
    revision of the package even if someone edits include/ meanwhile. Its fingerprint goes into the results."""
    import hashlib
    import shutil

    import kb_reindex

    source = Path(kb_reindex.__file__).resolve().parent
    target = folder / "kb_reindex"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    digest = hashlib.sha256()
    for path in sorted(target.rglob("*.py")):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return {"source": str(source), "snapshot": str(folder), "sha256": digest.hexdigest()[:16]}


def run_job(job: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    started = time.perf_counter()
    label = f"{job['peer']}/" + ",".join(f"{t['embedder']}@{t['size']}" for t in job["tasks"])
    print(f"[bench] {label} ...", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, str(HERE / "peers.py"), json.dumps(job)], timeout=timeout,
                          capture_output=True, text=True,
                          env=_worker_env(Path(job["workdir"]), job["package"]))
    sys.stderr.write(proc.stderr[-20000:])
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker {label} failed (exit {proc.returncode})")
    runs = json.loads(Path(job["out"]).read_text(encoding="utf-8"))["runs"]
    print(f"[bench] {label} done in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return runs


def run_extra(kind: str, size: int, ms: float, seed: int, smoke: bool, workdir: Path, package: str,
              timeout: float) -> dict[str, Any]:
    """P7 (bench/p7.py) or P8 (bench/noop.py) in a process of its own on the run's package snapshot; its JSON."""
    folder = workdir / kind
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "p7":
        out = folder / "p7.json"
        cmd = [sys.executable, str(HERE / "p7.py"), "--docs", str(size), "--ms", str(ms), "--seed", str(seed),
               "--out", str(folder)]
    else:
        out = folder / "noop.json"
        cmd = [sys.executable, str(HERE / "noop.py"), "--docs", str(size), "--out", str(out)]
        if smoke:  # one run of each kind: the smoke run checks the wiring, not the median
            cmd += ["--repeat", "1"]
    started = time.perf_counter()
    print(f"[bench] {kind} at {size} docs ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True,
                          env=_worker_env(folder, package))
    sys.stderr.write(proc.stderr[-20000:])
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark {kind} ({' '.join(cmd[1:])}) failed (exit {proc.returncode})")
    result = json.loads(out.read_text(encoding="utf-8"))
    result["job_wall_s"] = round(time.perf_counter() - started, 1)
    print(f"[bench] {kind} done in {result['job_wall_s']} s", file=sys.stderr, flush=True)
    return result


def parse_size(text: str) -> int:
    """One document count for P7/P8, or 'none' to skip it (0)."""
    if text.strip().lower() == "none":
        return 0
    size = int(text)
    if size < 5:
        raise argparse.ArgumentTypeError("a size must be a document count of at least 5 (or 'none')")
    return size


def _worker_env(workdir: Path, package: str) -> dict[str, str]:
    """The worker's settings come from the env mapping it builds; no KB_*/OLLAMA_HOST leaks in.

    The engine imports Airflow's Stats when Airflow is installed; a scratch AIRFLOW_HOME keeps that
    import from writing an airflow.cfg into ~/airflow.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_") and k != "OLLAMA_HOST"}
    env.setdefault("AIRFLOW_HOME", str(workdir / "airflow-home"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package, env.get("PYTHONPATH", "")) if p)
    env.setdefault("AIRFLOW__LOGGING__LOGGING_LEVEL", "WARNING")
    env["PYTHONHASHSEED"] = "0"
    return env


def versions() -> dict[str, str]:
    out = {}
    for name in ("kb-reindex", "qdrant-client", "langchain-core", "langchain-classic", "langchain-qdrant", "SQLAlchemy",
                 "ollama", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def machine() -> str:
    cpus = os.cpu_count()
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        return f"{platform.machine()} {cpus} CPU {mem:.0f} GiB {platform.system()}"
    except (ValueError, OSError, AttributeError):
        return f"{platform.machine()} {cpus} CPU {platform.system()}"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def parse_sizes(text: str) -> list[int]:
    if text.strip().lower() == "none":
        return []
    sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    if not sizes or min(sizes) < 5:
        raise argparse.ArgumentTypeError("sizes must be document counts of at least 5")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--sizes", type=parse_sizes, default=None, help=f"document counts (default {DEFAULT_SIZES})")
    parser.add_argument("--ollama-ms", type=float, default=None, help="fake Ollama cost per text in ms (default 20)")
    parser.add_argument("--ollama-sizes", type=parse_sizes, default=None,
                        help="sizes that also run the Ollama scenarios (default: the smallest size only; 'none')")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="results folder (default bench/results)")
    parser.add_argument("--seed", type=int, default=corpus_mod.DEFAULT_SEED)
    parser.add_argument("--smoke", action="store_true", help=f"tiny corpus (sizes {SMOKE_SIZES}, 1 ms/text), seconds")
    parser.add_argument("--jobs", type=int, default=None,
                        help="workers in parallel (default 1: timings must not share the CPU; --smoke uses 2)")
    parser.add_argument("--profile-size", type=int, default=None,
                        help="also profile our incremental run at this size (pyinstrument; not in the table)")
    parser.add_argument("--store", choices=STORE_KINDS, default="sidecar",
                        help="where local-mode Qdrant runs: 'sidecar' (default), a process of its own like a Qdrant "
                             "server, so peak RSS is the engine's own; 'inprocess', inside each worker")
    parser.add_argument("--p7-size", type=parse_size, default=None,
                        help=f"P7 (bench/p7.py) at this many docs, at --ollama-ms per text (default {DEFAULT_P7_SIZE}; "
                             f"--smoke {SMOKE_P7_SIZE}; 'none' skips it; not run with --store server unless given)")
    parser.add_argument("--p8-size", type=parse_size, default=None,
                        help=f"P8 (bench/noop.py) at this many docs (default {DEFAULT_P8_SIZE}; --smoke {SMOKE_P8_SIZE}; "
                             "'none' skips it; not run with --store server unless given)")
    parser.add_argument("--timeout", type=float, default=3 * 3600, help="seconds per worker")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp folder)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other sizes of <out>/latest.json (e.g. add 20000 to a 500,2000 run)")
    parser.add_argument("--render", action="store_true",
                        help="only recompute targets, latest.md and scaling.png from <out>/latest.json")
    parser.add_argument("--readme", action="store_true",
                        help="only print the P1-P8 targets table of <out>/latest.json (recomputed), for bench/README.md")
    args = parser.parse_args(argv)
    if args.readme:
        data = json.loads((args.out / "latest.json").read_text(encoding="utf-8"))
        data["targets"] = report.targets(data["sizes"], p7=data.get("p7"), p8=data.get("p8"))
        print(report.targets_excerpt(data), end="")
        return 0
    if args.render:
        render(json.loads((args.out / "latest.json").read_text(encoding="utf-8")), args.out)
        return 0

    sizes = args.sizes or parse_sizes(SMOKE_SIZES if args.smoke else DEFAULT_SIZES)
    if not sizes:
        parser.error("--sizes: give at least one size")
    ollama_ms = args.ollama_ms if args.ollama_ms is not None else (1.0 if args.smoke else 20.0)
    ollama_sizes = args.ollama_sizes if args.ollama_sizes is not None else [min(sizes)]
    jobs_parallel = args.jobs or (2 if args.smoke else 1)
    extras_default = args.store != WIRE_STORE  # P7/P8 pick their own stores: a wire run adds nothing to them
    p7_size = args.p7_size if args.p7_size is not None else (
        (SMOKE_P7_SIZE if args.smoke else DEFAULT_P7_SIZE) if extras_default else 0)
    p8_size = args.p8_size if args.p8_size is not None else (
        (SMOKE_P8_SIZE if args.smoke else DEFAULT_P8_SIZE) if extras_default else 0)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    started = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="kb-bench-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        tasks = [{"size": size, "embedder": embedder} for size in sizes
                 for embedder in ["hashing"] + (["ollama"] if size in ollama_sizes else [])]
        # a full run gives every (peer, size, embedder) its own process, so each peak RSS is its own;
        # --smoke runs all of a peer's tasks in one process (imports are most of a tiny run's time)
        groups = [tasks] if args.smoke else [[task] for task in tasks]
        if args.smoke:  # seconds, not minutes: a fresh process per kb scenario only for the first task (the
            for task in tasks:  # sidecar's per-scenario path stays tested); the others run in their worker
                task["scenario_processes"] = args.store == "sidecar" and task is tasks[0]
        common = {"seed": args.seed, "ollama_ms": ollama_ms, "workdir": str(workdir), "raw": True, "readers": True,
                  "store": args.store,
                  "reader_pause_s": 0.02 if args.smoke else None,
                  # a smoke run checks the wiring: the instruction screen by its patterns alone (under `auto` an
                  # Ollama task's engine would load e5 and judge every line of its first build, the product's real
                  # cost in a full run, measured apart in bench/screen_cost.sh)
                  "instruction_screen": "patterns" if args.smoke else None}
        jobs: list[dict[str, Any]] = []
        for group in groups:
            for peer in ("kb", "langchain"):
                name = "-".join(f"{t['embedder']}{t['size']}" for t in group)
                jobs.append({**common, "peer": peer, "tasks": group, "out": str(workdir / f"{peer}-{name}.json")})
        if args.profile_size:
            (workdir / "profile").mkdir(exist_ok=True)
            jobs.append({**common, "peer": "kb", "tasks": [{"size": args.profile_size, "embedder": "hashing"}],
                         "workdir": str(workdir / "profile"), "raw": False, "readers": False,
                         "profile": str(args.out / f"profile-incremental-{args.profile_size}"),
                         "out": str(workdir / f"profile-{args.profile_size}.json")})

        package = snapshot_package(workdir / "package")
        stats = {size: corpus_stats(size, args.seed, workdir) for size in sizes}
        for job in jobs:
            job["package"] = package["snapshot"]

        with ThreadPoolExecutor(max_workers=jobs_parallel) as pool:
            results = list(pool.map(lambda job: run_job(job, args.timeout), jobs))
        # P7 and P8 after the peers (a full run: one at a time, the machine otherwise idle), same snapshot
        extras = [(kind, size) for kind, size in (("p7", p7_size), ("p8", p8_size)) if size]
        with ThreadPoolExecutor(max_workers=jobs_parallel) as pool:
            extra_results = list(pool.map(
                lambda ks: run_extra(ks[0], ks[1], ollama_ms, args.seed, args.smoke, workdir, package["snapshot"],
                                     args.timeout), extras))

    entries = []
    for size in sizes:
        entry: dict[str, Any] = {"docs": size, "corpus": stats[size], "ollama_ms": ollama_ms}
        for job, runs in zip(jobs, results, strict=True):
            if job.get("profile"):
                continue
            for result in runs:
                if result["job"]["size"] != size:
                    continue
                peer, embedder = job["peer"], result["job"]["embedder"]
                block = entry.setdefault(embedder, {})
                block.update(result["scenarios"])
                block[f"{peer}_peak_rss_mb"] = result["peak_rss_mb"]
                block[f"{peer}_store_peak_rss_mb"] = result.get("store_peak_rss_mb")
                block[f"{peer}_ru_maxrss_mb"] = result["ru_maxrss_mb"]
                block[f"{peer}_job_wall_s"] = result["job_wall_s"]
                if result.get("warmup"):
                    block[f"{peer}_warmup"] = result["warmup"]
        entries.append(entry)
    run_meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "command": command.strip(),
                "package_sha256": package["sha256"], "store": args.store,
                "total_s": round(time.perf_counter() - started, 1)}
    for entry in entries:
        entry["run"] = run_meta
    data = {
        "meta": {**run_meta, "package": {"sha256": package["sha256"], "source": package["source"]},
                 "machine": machine(), "python": platform.python_version(), "versions": versions(),
                 "sizes": sizes, "ollama_sizes": ollama_sizes, "ollama_ms": ollama_ms, "seed": args.seed,
                 "smoke": args.smoke, "store": args.store, "p7_size": p7_size or None, "p8_size": p8_size or None, "qdrant": QDRANT_WHERE[args.store]},
        "scenarios": report.SCENARIOS,
        "sizes": entries,
    }
    for (kind, _size), extra in zip(extras, extra_results, strict=True):
        data[kind] = {**extra, "run": run_meta}
    if args.profile_size:
        profile = next(r for j, r in zip(jobs, results, strict=True) if j.get("profile"))[0]
        data["profile"] = {"size": args.profile_size, "text": str(args.out / f"profile-incremental-{args.profile_size}.txt"),
                           "scenario": profile["scenarios"]["kb.incremental"]}
    previous = args.out / "latest.json"
    if args.merge and previous.exists():
        data = merge(json.loads(previous.read_text(encoding="utf-8")), data)
    render(data, args.out)
    return 0


WIRE_STORE = "server"


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Sizes of this run replace the same sizes of the previous results; the others are kept (same seed).

    The over-the-wire results (`--store server`) are kept apart, under "wire", so that merging them into a
    local-mode run adds a section beside its rows and replaces none of them (and the other way round)."""
    new_wire = new["meta"].get("store") == WIRE_STORE
    old_wire = set(old["meta"].get("stores") or [old["meta"].get("store")]) == {WIRE_STORE}
    if new_wire and not old_wire:
        kept = dict(old)
        kept["wire"] = merge(old["wire"], new) if old.get("wire") else new
        return kept
    if not new_wire and old_wire:
        return {**new, "wire": old}
    wire = old.get("wire")
    if old["meta"].get("seed") != new["meta"]["seed"] or old["meta"].get("smoke") != new["meta"]["smoke"]:
        raise SystemExit("--merge: the previous results used another seed or smoke setting; not merging")
    fresh = {e["docs"] for e in new["sizes"]}
    kept = [e for e in old["sizes"] if e["docs"] not in fresh]
    for entry in kept:
        entry.setdefault("run", {"date": old["meta"]["date"], "command": old["meta"]["command"]})
    merged = dict(new)
    merged["sizes"] = sorted(kept + new["sizes"], key=lambda e: e["docs"])
    merged["meta"] = {**new["meta"], "sizes": [e["docs"] for e in merged["sizes"]],
                      "ollama_sizes": sorted(set(old["meta"].get("ollama_sizes", [])) | set(new["meta"]["ollama_sizes"])),
                      "merged_from": sorted({e["run"]["command"] for e in merged["sizes"]}),
                      "package_revisions": sorted({str(e["run"].get("package_sha256")) for e in merged["sizes"]}),
                      "stores": sorted({str(e["run"].get("store", "inprocess")) for e in merged["sizes"]})}
    if len(merged["meta"]["package_revisions"]) > 1:
        print("[bench] warning: the merged sizes were measured on different kb_reindex revisions "
              f"{merged['meta']['package_revisions']}; ratios across them compare different code", file=sys.stderr)
    if len(merged["meta"]["stores"]) > 1:
        print(f"[bench] warning: the merged sizes ran with different stores {merged['meta']['stores']}; "
              "peak RSS across them measures different things", file=sys.stderr)
    for key in ("p7", "p8"):  # a run that skipped P7/P8 (--p7-size none) keeps the previous ones
        if key in old and key not in new:
            merged[key] = old[key]
    if "profile" in old and "profile" not in new:
        merged["profile"] = old["profile"]
    if wire and not new_wire:
        merged["wire"] = wire
    return merged


def render(data: dict[str, Any], out: Path) -> None:
    """Targets, latest.json, latest.md and scaling.png from the assembled results."""
    data["targets"] = report.targets(data["sizes"], p7=data.get("p7"), p8=data.get("p8"))
    if data.get("wire"):  # the over-the-wire run's own targets, its copy-vs-ceiling check, where the time goes
        wire = data["wire"]
        wire["targets"] = {**report.targets(wire["sizes"]), "P2_wire": report.wire_copy_checks(wire["sizes"])}
        wire["time_split"] = [s for s in (report.wire_time_split(e) for e in wire["sizes"]) if s]
    elif data["meta"].get("store") == WIRE_STORE:  # a server run written on its own
        data["targets_wire"] = {"P2_wire": report.wire_copy_checks(data["sizes"])}
        data["time_split"] = [s for s in (report.wire_time_split(e) for e in data["sizes"]) if s]
    write_atomic(out / "latest.json", json.dumps(data, ensure_ascii=False, indent=1))
    md = report.markdown(data)
    write_atomic(out / "latest.md", md)
    tmp_png = out / "scaling.png.tmp"
    report.plot(data, tmp_png)
    os.replace(tmp_png, out / "scaling.png")
    print(md)
    print(f"[bench] wrote {out / 'latest.json'}, latest.md, scaling.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
