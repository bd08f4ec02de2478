"""P15: one edit -> searchable over the Qdrant test server, at growing collection sizes, with the vectors each
edit sends to Qdrant and reads back counted at the server; this release (slots, the difference) beside the
release before it (a full copy per version, `0a70e71`, its package taken from git) in the same run.

    .venv/bin/python bench/versions.py                           # 1k, 10k, 50k chunks; ~30-40 min on 2 cores
    .venv/bin/python bench/versions.py --sizes 1000 --edits 4    # a quick look
    .venv/bin/python bench/versions.py --releases slots          # this release alone
    .venv/bin/python bench/versions.py --before-commit b9cb78b --before-edits 5   # beside the last release whose
                                                                 # manifests held a row per chunk
    .venv/bin/python bench/versions.py --sizes 1000,200000 --releases slots --workdir /work/p15 --reuse
                                                                 # a size built there before is not built again:
                                                                 # its edits go on from its filled slots (the test
                                                                 # server reloads them: 4 min at 200k; its first
                                                                 # write into each slot regrows that collection's
                                                                 # arrays, so a reused size's first three edits
                                                                 # are not figures; at 200k it then holds ~21 GB:
                                                                 # run nothing else beside it)
    .venv/bin/python bench/versions.py --sizes 1000,200000 --releases slots --feed alternate
                                                                 # every second edit told the file it edited
                                                                 # (`run --changed`, as the source watcher's
                                                                 # event tells its run): listed / fed pairs

For each release and size: a synthetic corpus (bench/corpus.py, about five chunks a document) built once by the
CLI (`kb-reindex run`, hashing embedder: what is measured is the version model, not the model), then `--edits`
edits, each one document rewritten to one new sentence and `kb-reindex run` timed from its start to the moment the
server first answered the alias on the new version (searchable: polled every 20 ms from another client, so within
20 ms) and to the process's exit (after the cleanup that follows the move: retention, texts and manifests no kept
version needs). The
first two edits of this release fill its second and third slots (a full copy each, once per alias and profile);
from the third edit on an edit costs the difference. The server (this release's test server, the same protocol
for both) counts vectors in upserts and vectors in retrieve/scroll answers. At the end, the points stored in all
of the alias's collections. Writes `<out>/versions.json` and `<out>/versions.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from datetime import UTC, datetime
from io import BytesIO
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
CLI = Path(sys.executable).with_name("kb-reindex")
BEFORE = "0a70e71"


def old_package(work: Path, commit: str = BEFORE) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit, "include"],
                             capture_output=True, check=True, timeout=60)
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(work / "old", filter="data")
    return work / "old" / "include"


def kb(env: dict[str, str], *argv: str, package: Path | None, profile: Path | None = None) -> dict[str, Any]:
    command = ([sys.executable, "-c", "import sys; from kb_reindex.cli import main; sys.exit(main(sys.argv[1:]))"]
               if package is not None else [str(CLI)])
    if profile is not None and package is None:  # where the time goes (cProfile slows the run: not a figure)
        command = [sys.executable, "-m", "cProfile", "-o", str(profile), *command]
    run_env = {**env, "PYTHONPATH": str(package)} if package is not None else env
    done = subprocess.run([*command, *argv, "--json", "-q"], env=run_env, capture_output=True, text=True,
                          timeout=7200)
    return json.loads(done.stdout) if done.stdout.strip() else {"error": done.stderr[-800:]}


def alias_target(admin: httpx.Client) -> str | None:
    aliases = admin.get("/aliases").json()["result"]["aliases"]
    return next((a["collection_name"] for a in aliases if a["alias_name"] == "mall_knowledge"), None)


class AliasWatch:
    """When the alias moved, as the server answered it (`GET /aliases` every 20 ms from another client):
    edit -> searchable without the process exit and the cleanup that follow the move."""

    def __init__(self, url: str, t0: float) -> None:
        self.client = httpx.Client(base_url=url, timeout=60)
        self.before, self.t0 = alias_target(self.client), t0
        self.moved_s: float | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.is_set() and self.moved_s is None:
            if alias_target(self.client) != self.before:
                self.moved_s = time.perf_counter() - self.t0
            self.done.wait(0.02)

    def stop(self) -> float | None:
        self.done.set()
        self.thread.join()
        self.client.close()
        return None if self.moved_s is None else round(self.moved_s, 2)


def measure(work: Path, chunks: int, edits: int, release: str, package: Path | None, *,
            keep_versions: int = 2, profile: Path | None = None, reuse: bool = False,
            feed: str = "never") -> dict[str, Any]:
    """`feed`: whether an edit's run is told the file it edited (`run --changed`, as the source watcher's event
    tells the run it starts): never, always, or alternate (the even edits, from the second: pairs in one run)."""
    import corpus as corpus_mod

    folder = work / f"{release}-{chunks}"
    built_mark = folder / "bench-first-build.json"  # written once the first build served: `--reuse` starts after it
    generated = corpus_mod.generate(max(1, chunks // 5))
    reused = reuse and built_mark.exists()
    if not reused:
        corpus_mod.write_project(folder, generated, None)
    proc = subprocess.Popen([sys.executable, "-m", "kb_reindex.testing.qdrant_server", "--port", "0", "--path",
                             str(folder / "q")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    url = proc.stdout.readline().split(" at ", 1)[1].split()[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_") and k != "PYTHONPATH"}
    env.update(KB_PROJECT_ROOT=str(folder), KB_QDRANT_URL=url, KB_EMBEDDER="hashing", KB_REGISTRY="",
               KB_KEEP_VERSIONS=str(keep_versions), KB_QDRANT_TIMEOUT="600")
    admin = httpx.Client(base_url=url, timeout=600)
    try:
        if reused:  # the project as an earlier run of this script left it (its edits since included)
            first = json.loads(built_mark.read_text(encoding="utf-8"))
            first["reused"] = True
        else:
            t0 = time.perf_counter()
            built = kb(env, "run", package=package)
            first = {"chunks": (built.get("chunks") or {}).get("total"),
                     "first_build_s": round(time.perf_counter() - t0, 1),
                     "first_build": built.get("outcome") or built.get("error")}
            if built.get("outcome") == "promoted":
                built_mark.write_text(json.dumps(first), encoding="utf-8")
        row: dict[str, Any] = {"release": release, **first, "edits": []}
        stamp = datetime.now(UTC).strftime("%H%M%S")  # a rerun over a kept project never repeats an edit's text
        keys = sorted(generated.docs)
        for n in range(edits):
            key = keys[(n * 7919) % len(keys)]
            sentence = f"本条于今日更新（第{n + 1}次，{stamp}）：第{chunks}号规则全文改为线下门店统一受理。"
            (folder / "knowledge" / "docs" / f"{key}.md").write_text(f"# {key}\n\n{sentence}\n", encoding="utf-8")
            admin.delete("/__vectors")
            admin.delete("/__requests")
            t0 = time.perf_counter()
            watch = AliasWatch(url, t0)
            fed = package is None and (feed == "always" or (feed == "alternate" and n % 2 == 1))
            answer = kb(env, "run", *(("--changed", f"{key}.md") if fed else ()), package=package, profile=(
                profile / f"{release}-{chunks}.prof" if profile is not None and n == edits - 1 else None))
            took = time.perf_counter() - t0
            moved = watch.stop()
            counts = admin.get("/__vectors").json()
            # the test server's time answering searches (the golden probes, the duplicates' neighbours): local mode
            # scans every point per query, where a Qdrant server answers from its HNSW index
            searched = sum(q.get("handle_s") or 0.0 for q in admin.get("/__requests").json()
                           if q["op"] in ("query", "query_batch"))
            build = answer.get("build") or {}
            row["edits"].append({"edit": n + 1, "fed": fed, "s": round(took, 2), "searchable_s": moved,
                                 "outcome": answer.get("outcome"),
                                 "written": counts["written"], "read": counts["read"],
                                 "server_search_s": round(searched, 3),
                                 "embedded": (answer.get("chunks") or {}).get("embedded"),
                                 "copied": (answer.get("chunks") or {}).get("copied"), "kept": build.get("kept"),
                                 "collection": answer.get("collection")})
        names = [c["name"] for c in admin.get("/collections").json()["result"]["collections"]]
        row["collections"] = len(names)
        row["points_stored"] = sum(admin.post(f"/collections/{name}/points/count", json={"exact": True})
                                   .json()["result"]["count"] for name in names)
        return row
    finally:
        admin.close()
        proc.terminate()
        proc.wait(timeout=60)


def markdown(result: dict[str, Any]) -> str:
    lines = [f"{result['at']} · {result['machine']} · load {result['load_at_start']:.1f} at start · hashing embedder · "
             f"Qdrant test server · `{result['command']}`", "",
             "| release | chunks | first build s | edit -> searchable s (each) | edit -> exit s (each) | "
             "the server's searches s (each) | vectors written / read back (each edit) | points stored after | "
             "collections |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['release']} | {r['chunks']} | {r['first_build_s']} | "
                     + ", ".join(f"{e.get('searchable_s')}{' (fed)' if e.get('fed') else ''}" for e in r["edits"])
                     + " | "
                     + ", ".join(str(e["s"]) for e in r["edits"]) + " | "
                     + ", ".join(str(e.get("server_search_s")) for e in r["edits"]) + " | "
                     + ", ".join(f"{e['written']} / {e['read']}" for e in r["edits"])
                     + f" | {r['points_stored']} | {r['collections']} |")
    sizes = sorted({r["chunks"] for r in result["rows"] if r["chunks"]})
    for field, said in (("searchable_s", "searchable"), ("s", "exit")) if len(sizes) > 1 else ():
        steady = {(r["release"], r["chunks"]): r["edits"][-1].get(field) for r in result["rows"] if r["edits"]}
        lines.append("")
        for release in ("slots", "before"):
            base = steady.get((release, sizes[0]))
            if base:
                lines.append(f"- {release}, edit -> {said}: last edit at " + ", ".join(
                    f"{size} chunks {steady[(release, size)] / base:.2f}x" for size in sizes[1:]
                    if steady.get((release, size))) + f" the one at {sizes[0]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,50000")
    parser.add_argument("--edits", type=int, default=4)
    parser.add_argument("--before-edits", type=int, default=2, help="edits of the release before (each a full copy)")
    parser.add_argument("--releases", default="slots,before",
                        help="which to measure: this release (slots), the release before (before), or both")
    parser.add_argument("--before-commit", default=BEFORE,
                        help="the commit whose package is the release before (default: the last with a collection per "
                             "version; b9cb78b: the last with a manifest row per chunk)")
    parser.add_argument("--keep-versions", type=int, default=2,
                        help="KB_KEEP_VERSIONS: what the points stored after the edits depend on (or not)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--profile", type=Path, default=None,
                        help="a folder: this release's last edit of each size runs under cProfile, its profile "
                             "written there (<release>-<chunks>.prof); that edit's times are then not figures")
    parser.add_argument("--feed", choices=("never", "always", "alternate"), default="never",
                        help="this release's edits told the file they edited (`run --changed`, the source watcher's "
                             "change feed): no listing of the corpus; alternate: every second edit, pairs in one run")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the projects (and the test server's storage) in this folder instead of a "
                             "temporary one: a kept project can be edited and profiled by hand afterwards")
    parser.add_argument("--reuse", action="store_true",
                        help="with --workdir: a size whose project an earlier run built there is not generated and "
                             "built again; its edits go on from the state that run left (the slots already filled; "
                             "the test server's first write into each reloaded slot regrows its arrays: the first "
                             "three edits are not figures)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    result: dict[str, Any] = {"at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
                              "machine": f"{platform.machine()} {os.cpu_count()} cores",
                              "load_at_start": os.getloadavg()[0], "command": " ".join(["bench/versions.py", *sys.argv[1:]]),
                              "rows": []}
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)  # cProfile writes no file into a folder that is not there
    with tempfile.TemporaryDirectory(prefix="kb-p15-") as tmp:
        work = Path(tmp) if args.workdir is None else args.workdir
        work.mkdir(parents=True, exist_ok=True)
        releases = {r.strip() for r in args.releases.split(",") if r.strip()}
        package = old_package(work, args.before_commit) if "before" in releases else None
        for chunks in sizes:
            if "slots" in releases:
                result["rows"].append(measure(work, chunks, args.edits, "slots", None,
                                              keep_versions=args.keep_versions, profile=args.profile,
                                              reuse=args.reuse, feed=args.feed))
            if package is not None:
                result["rows"].append(measure(work, chunks, args.before_edits, "before", package,
                                              keep_versions=args.keep_versions))
            print(json.dumps(result["rows"][-len(releases):], ensure_ascii=False), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "versions.json").write_text(json.dumps(result, ensure_ascii=False, indent=2), encoding="utf-8")
    (args.out / "versions.md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))


if __name__ == "__main__":
    main()
