"""The benchmark's workers: each runs one peer's scenarios on one corpus size in its own process.

- `kb`: our engine (`kb_reindex.run_reindex`, blue-green): full build, no-op, incremental,
  rollback; the full-rebuild peer (`run --force-full`) on the no-op and on the incremental corpus; the
  backend's raw bulk upsert of the same points; a promotion with 4 threads reading through the alias.
- `langchain`: LangChain's indexing API (`index()`, SQLRecordManager, cleanup="incremental",
  QdrantVectorStore), in place, on the same chunk texts (`kb_reindex.services.chunking`), the same embedder and
  the same local-mode Qdrant (`:memory:`).

The Qdrant store runs in a sidecar process (`sidecar.py`, the default) the way a Qdrant server runs
apart from the engine, so a worker's peak RSS is the engine's (or LangChain's) own and the store's is
measured separately; `--store inprocess` keeps local mode inside the worker, as before; `--store server`
runs our Qdrant-protocol test server and every client reaches it over REST (`KB_QDRANT_URL`), with the
server's own per-request timings beside each scenario and a breakdown of the copy path's time on the wire.

Each worker writes one JSON file; `run.py` starts them (one subprocess per peer and size, so the peak
RSS of one never includes another's) and assembles the report.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corpus as corpus_mod
from measure import BenchDeps, CountingStore, Meter, MeterRef, PeakRss, phase_timers, ru_maxrss_mb
from sidecar import qdrant_store, server_requests

if TYPE_CHECKING:
    from kb_reindex.run.pipeline import RunResult

OLLAMA_MODEL = "bge-m3"
DIM = 1024
READERS = 4
SCENARIO_TIMEOUT_S = 3 * 3600  # one scenario's process; run.py's --timeout bounds the whole worker
READER_PAUSE_S = 0.005  # think time between one reader's queries
READER_QUERIES = ["规则编号 R00001 适用于哪些情况？", "退货申请需要在签收后几天内提交", "coupons with store promotions",
                  "运费券怎么使用"]


class Scenarios:
    """Runs named scenarios, each with a fresh meter and its own peak-RSS window (for the store sidecar
    too, when there is one: the Qdrant server's memory, reported apart from the engine's)."""

    def __init__(self, meter_ref: MeterRef, server: Any = None, store_pid: int | None = None,
                 store_url: str | None = None) -> None:
        self.meter_ref = meter_ref
        self.server = server
        self.store_pid = store_pid
        self.store_url = store_url  # the Qdrant test server's, whose request log says what it spent
        self.results: dict[str, dict[str, Any]] = {}

    def run(self, name: str, fn: Callable[[Meter], dict[str, Any]]) -> dict[str, Any]:
        meter = self.meter_ref.fresh()
        if self.server is not None:
            self.server.reset_counters()
        if self.store_url is not None:
            server_requests(self.store_url, clear=True)
        store_peak = PeakRss(self.store_pid).start() if self.store_pid is not None else None
        peak = PeakRss().start()
        started = time.perf_counter()
        extra = fn(meter)
        wall = time.perf_counter() - started
        peak.stop()
        row: dict[str, Any] = {"wall_s": round(wall, 4), **meter.as_dict(),
                               "peak_rss_mb": round(peak.peak_mb, 1), "rss_start_mb": round(peak.start_mb, 1),
                               "rss_delta_mb": round(peak.peak_mb - peak.start_mb, 1), "rss_method": peak.method}
        self._add_store_and_server(row, store_peak)
        row.update(extra)
        self.results[name] = row
        store = f"  store {store_peak.peak_mb:7.0f} MB" if store_peak is not None else ""
        print(f"  {name:<34} {wall:8.2f} s  embedded {meter.chunk_texts:>7}  writes {meter.points_upserted:>7}  "
              f"peak {peak.peak_mb:7.0f} MB{store}", file=sys.stderr, flush=True)
        return row

    def run_child(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        """Scenario `name` in a fresh process (`peers.py --scenario`); it times and measures its own run, this
        process adds the store's peak RSS and the fake Ollama server's counters over the same window."""
        if self.server is not None:
            self.server.reset_counters()
        if self.store_url is not None:
            server_requests(self.store_url, clear=True)
        store_peak = PeakRss(self.store_pid).start() if self.store_pid is not None else None
        out = Path(spec["scratch"]) / "row.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        spec = {**spec, "spawned_at": time.time()}
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--scenario", str(out)],
                                  input=json.dumps(spec), text=True, stdout=subprocess.DEVNULL,
                                  timeout=spec["job"].get("scenario_timeout_s", SCENARIO_TIMEOUT_S))
        except subprocess.TimeoutExpired:  # subprocess.run has killed it
            raise RuntimeError(f"scenario {name} ran past its timeout and was killed") from None
        process_wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise RuntimeError(f"scenario {name} failed in its process (exit {proc.returncode}); its stderr is above")
        row = json.loads(out.read_text(encoding="utf-8"))
        row["process_wall_s"] = round(process_wall, 3)
        self._add_store_and_server(row, store_peak)
        self.results[name] = row
        return row

    def _add_store_and_server(self, row: dict[str, Any], store_peak: PeakRss | None) -> None:
        """The store's peak RSS and the fake Ollama server's counters over the scenario's window."""
        if store_peak is not None:
            store_peak.stop()
            row.update(store_peak_rss_mb=round(store_peak.peak_mb, 1), store_rss_start_mb=round(store_peak.start_mb, 1),
                       store_rss_method=store_peak.method)
        if self.server is not None:
            row["server_texts_embedded"] = self.server.embedded_texts
            row["server_embed_requests"] = self.server.embed_requests
        if self.store_url is not None:
            row["qdrant_requests"] = summarise_requests(server_requests(self.store_url))


def summarise_requests(log: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The test server's requests by "operation collection": how many, the server's whole handling time
    (body decoding, the operation, answer encoding) and the part inside local mode itself."""
    out: dict[str, dict[str, Any]] = {}
    for record in log:
        key = f"{record['op']} {record['collection']}" if record.get("collection") else record["op"]
        total = out.setdefault(key, {"requests": 0, "handle_s": 0.0, "store_s": 0.0, "lock_wait_s": 0.0})
        total["requests"] += 1
        for field in ("handle_s", "store_s", "lock_wait_s"):
            total[field] += record.get(field) or 0.0
    return {key: {**v, **{f: round(v[f], 4) for f in ("handle_s", "store_s", "lock_wait_s")}}
            for key, v in sorted(out.items())}


def fake_ollama(ms: float) -> Any:
    from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer, FaultPlan

    return FakeOllamaServer([FakeModel(name=OLLAMA_MODEL, dim=DIM)],
                            faults=FaultPlan(delay_per_text_s=ms / 1000.0)).start()


# --- our engine ----------------------------------------------------------------------------------


def run_kb(job: dict[str, Any]) -> dict[str, Any]:
    size, seed, embedder = job["size"], job["seed"], job["embedder"]
    base = corpus_mod.generate(size, seed)
    mutated, mutation = corpus_mod.mutate(base, seed)
    root = corpus_mod.write_project(Path(job["workdir"]) / f"kb-{embedder}-{size}", base, mutation)
    one_more = mutated.copy()
    key = sorted(one_more.docs)[len(one_more.docs) // 2]
    one_more.docs[key] = one_more.docs[key].rstrip("\n") + "\n\n补充说明：节假日期间以上时限顺延。\n"
    variants = {"mutated": root.parent / f"{root.name}-mutated", "one_more": root.parent / f"{root.name}-one-more"}
    corpus_mod.write(mutated, variants["mutated"])
    corpus_mod.write(one_more, variants["one_more"])
    # the corpus lives on disk from here: the worker's peak RSS is the engine's, not the generator's
    del base, mutated, one_more
    gc.collect()

    server = fake_ollama(job["ollama_ms"]) if embedder == "ollama" else None
    # the benchmark times builds, not the hold for a person: a flagged line is listed (warn), never a stopped run
    env = {"KB_PROJECT_ROOT": str(root), "KB_EMBEDDER": embedder, "KB_EMBED_DIM": str(DIM),
           "KB_INSTRUCTION_POLICY": "warn"}
    if job.get("instruction_screen"):
        env["KB_INSTRUCTION_SCREEN"] = job["instruction_screen"]
    if server is not None:
        env.update(OLLAMA_HOST=server.url, KB_EMBED_MODEL=OLLAMA_MODEL)
    try:
        with qdrant_store(job["store"]) as store:
            if store.url is not None:  # the engine reaches the test server as it reaches Qdrant in production
                env["KB_QDRANT_URL"] = store.url
            # a store in this worker runs every scenario here too; so does a --smoke run's, but for its first
            # sidecar task (bench/run.py sets scenario_processes), which keeps the per-process path tested
            if (store.address is None and store.url is None) or not job.get("scenario_processes", True):
                client, local = store.client, True
                if store.url is not None:  # the client the CLI builds, from KB_QDRANT_URL
                    from kb_reindex.services.config import Settings
                    from kb_reindex.services.store import make_client

                    client, local = make_client(Settings.from_env(env)), None
                warm = warmup(env, root.parent / f"{root.name}-warmup", client, alias="bench_warmup", local=local)
                out = _kb_scenarios_in_process(job, env, root, variants, store, server, client, local)
            else:
                warm = {"per_scenario_process": True}
                out = _kb_scenarios_in_processes(job, env, root, variants, store, server)
    finally:
        if server is not None:
            server.stop()
    out.update(mutation=mutation.summary(), warmup=warm)
    return out


def kb_scenario_plan(job: dict[str, Any]) -> list[str]:
    """The engine's scenarios in order; `mirror:<variant>` steps replace the knowledge folder in between."""
    hashing = job["embedder"] == "hashing"
    wire = job.get("store") == "server"
    return ["kb.full_build", "kb.noop", "full_rebuild.noop", "mirror:mutated", "kb.incremental", "kb.rollback",
            "full_rebuild.incremental",
            *(["raw.upsert"] if job.get("raw", True) and hashing else []),
            *(["wire.costs"] if job.get("raw", True) and hashing and wire else []),
            *(["mirror:one_more", "kb.promotion_under_readers"] if job.get("readers", True) and hashing else [])]


def kb_steps(job: dict[str, Any], root: Path, variants: dict[str, Path]) -> Iterator[tuple[int, str]]:
    """(position, scenario) in order; the knowledge folder is replaced in between where the plan says."""
    for number, step in enumerate(kb_scenario_plan(job)):
        if step.startswith("mirror:"):
            corpus_mod.mirror(variants[step.split(":", 1)[1]], root / "knowledge" / "docs")
        else:
            yield number, step


def engine_deps(env: dict[str, str], client: Any, *, local: bool | None = True) -> tuple[BenchDeps, MeterRef]:
    """The engine's Deps over `client`, with a counting store and embedder; the caller disposes deps.state.
    `local=None`: told from the client (the test server's remote client is a server's)."""
    from kb_reindex.services.config import Settings
    from kb_reindex.steps.golden import load_golden_set
    from kb_reindex.services.state.store import StateStore

    settings = Settings.from_env(env)
    meter_ref = MeterRef()
    queries = {p.query for p in load_golden_set(settings.golden_set).probes}
    deps = BenchDeps(settings=settings, state=StateStore(settings.state_url),
                     store=CountingStore(client, meter_ref, local=local), meter_ref=meter_ref, queries=queries)
    return deps, meter_ref


def engine_scenario(name: str, deps: BenchDeps, job: dict[str, Any]) -> Callable[[Meter], dict[str, Any]]:
    """What scenario `name` runs: the same engine functions the CLI calls."""
    from kb_reindex.run.pipeline import run_reindex
    from kb_reindex.run.runs import run_rollback

    def reindex(**options: Any) -> Callable[[Meter], dict[str, Any]]:
        def go(meter: Meter) -> dict[str, Any]:
            result = run_reindex(deps, **options)
            if result.outcome not in ("promoted", "no_change"):
                raise RuntimeError(f"run_reindex {options}: {result.outcome}: {result.error}")
            return summarize_run(result, meter)
        return go

    def rollback(meter: Meter) -> dict[str, Any]:
        result = run_rollback(deps, reason="benchmark rollback")
        return {"outcome": str(result.outcome), "from_version": result.from_version,
                "to_version": result.to_version, "swap_s": round(max(meter.swap_s, default=0.0), 6)}

    if name in ("kb.full_build", "kb.noop"):
        return reindex()
    if name == "kb.incremental":
        return profiled(reindex(), Path(job["profile"])) if job.get("profile") else reindex()
    if name.startswith("full_rebuild."):
        return reindex(force_full=True)
    if name == "kb.rollback":
        return rollback
    if name == "raw.upsert":
        return lambda meter: raw_bulk_upsert(deps, meter, copy_batch=deps.settings.copy_batch_size)
    if name == "wire.costs":
        return lambda meter: wire_costs(deps, copy_batch=deps.settings.copy_batch_size)
    if name == "kb.promotion_under_readers":
        return lambda meter: promotion_under_readers(deps, meter, reindex(), job.get("reader_pause_s"))
    raise ValueError(f"unknown benchmark scenario {name!r}")


def _kb_scenarios_in_process(job: dict[str, Any], env: dict[str, str], root: Path, variants: dict[str, Path],
                             store: Any, server: Any, client: Any, local: bool | None) -> dict[str, Any]:
    """`--store inprocess` (and --smoke): every scenario in this worker, after one warm-up run."""
    deps, meter_ref = engine_deps(env, client, local=local)
    sc = Scenarios(meter_ref, server, store.pid, store.url)
    quiet_logs()
    try:
        with phase_timers(meter_ref):
            for _number, step in kb_steps(job, root, variants):
                sc.run(step, engine_scenario(step, deps, job))
    finally:
        deps.state.dispose()
    return {"job": job, "scenarios": sc.results, "ru_maxrss_mb": round(ru_maxrss_mb(), 1)}


def _kb_scenarios_in_processes(job: dict[str, Any], env: dict[str, str], root: Path, variants: dict[str, Path],
                               store: Any, server: Any) -> dict[str, Any]:
    """Store in a sidecar: each scenario in a fresh process of its own, as each CLI run or Airflow task is.

    A process that ran the earlier scenarios keeps memory from them (freed objects leave the allocator's
    arenas resident); a fresh one per scenario makes each peak RSS that run's own. Each child first makes a
    throwaway engine run on 3 documents under another alias (imports, first-use caches) before it is timed.
    """
    sc = Scenarios(MeterRef(), server, store.pid, store.url)
    scratch = root.parent / f"{root.name}-children"
    scratch.mkdir(exist_ok=True)
    for number, step in kb_steps(job, root, variants):
        spec = {"name": step, "job": job, "env": env, "store_address": store.address,
                "store_authkey": store.authkey_hex, "store_url": store.url, "scratch": str(scratch / f"{number:02d}")}
        sc.run_child(step, spec)
    return {"job": job, "scenarios": sc.results, "ru_maxrss_mb": round(ru_maxrss_mb(), 1)}


def run_scenario_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine scenario in this (fresh) process against the worker's store sidecar; returns its row.

    `process_startup_s`: from the worker starting this process to here, with what the `kb-reindex` CLI
    imports for a run (the interpreter, the engine, qdrant-client, SQLAlchemy): what a fresh CLI process pays
    before its run starts, reported next to the run's own time.
    """
    import importlib

    from sidecar import connect, exit_with_parent

    for module in ("kb_reindex.cli", "kb_reindex.run.pipeline", "kb_reindex.run.runs"):  # the CLI's own imports, counted as startup
        importlib.import_module(module)

    startup_s = time.time() - spec["spawned_at"]
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()
    quiet_logs()
    local: bool | None = True
    if spec.get("store_url"):  # the Qdrant test server: the client the CLI builds, from KB_QDRANT_URL
        from kb_reindex.services.config import Settings
        from kb_reindex.services.store import make_client

        client, local = make_client(Settings.from_env(spec["env"])), None
    else:
        client = connect(spec["store_address"], spec["store_authkey"])
    scratch = Path(spec["scratch"])
    warm = warmup(spec["env"], scratch, client, alias=f"bench_warmup_{os.getpid()}", local=local)
    deps, meter_ref = engine_deps(spec["env"], client, local=local)
    try:
        with phase_timers(meter_ref):
            row = Scenarios(meter_ref).run(spec["name"], engine_scenario(spec["name"], deps, spec["job"]))
    finally:
        deps.state.dispose()
    row.update(process_startup_s=round(startup_s, 3), process_warmup_s=warm["first_run_s"],
               process_peak_rss_mb=round(ru_maxrss_mb(), 1))
    return row


def warmup(env: dict[str, str], workdir: Path, client: Any, *, alias: str, local: bool | None = True) -> dict[str, float]:
    """A whole engine run on a 3-document throwaway project before anything is timed; says what it cost.

    The first run in a process pays one-time costs that no later run does: lazy imports (pandas,
    matplotlib for the HTML report, the Ollama client) and first-use caches. Every CLI process pays them
    once; here they would otherwise land on the scenario being measured. It runs against `client` (the
    same kind of store the scenarios use) under its own alias and state DB, with the offline embedder (the
    fake Ollama server counts what the scenario embeds), and deletes its collections afterwards.
    """
    if env.get("KB_EMBEDDER") == "ollama":
        import importlib

        importlib.import_module("ollama")  # the Ollama embedder's import, paid here rather than in the timed run
    from kb_reindex.run.pipeline import run_reindex
    from kb_reindex.services.config import Settings
    from kb_reindex.services.runtime import Deps
    from kb_reindex.services.state.store import StateStore
    from kb_reindex.services.store import KnowledgeStore

    started = time.perf_counter()
    tiny = corpus_mod.generate(3, seed=1)
    root = corpus_mod.write_project(workdir / "warmup", tiny, None)
    warm_env = {k: v for k, v in env.items() if k not in ("OLLAMA_HOST", "KB_EMBED_MODEL")}
    settings = Settings.from_env({**warm_env, "KB_PROJECT_ROOT": str(root), "KB_EMBEDDER": "hashing",
                                  "KB_ALIAS": alias})
    state = StateStore(settings.state_url)
    try:
        result = run_reindex(Deps(settings=settings, state=state, store=KnowledgeStore(client, local=local)))
    finally:
        state.dispose()
    if result.outcome != "promoted":
        raise RuntimeError(f"warm-up run failed: {result.error}")
    for collection in client.get_collections().collections:
        if collection.name.startswith(f"{alias}__"):
            client.delete_collection(collection.name)
    return {"first_run_s": round(time.perf_counter() - started, 3)}


def summarize_run(result: RunResult, meter: Meter) -> dict[str, Any]:
    built = result.build
    copied = built.copied if built else 0
    build_s = meter.phases.get("build", 0.0)
    outside_embed_s = max(build_s - meter.embed_s, 1e-9)
    # the engine's own timing of its copy loop (read live vectors + write the new points), when it reports one
    copy_loop_s = built.copy_s if built else None
    loop_rate = round(copied / copy_loop_s, 1) if copied and copy_loop_s else None
    return {
        "outcome": result.outcome,
        "version": result.version,
        "docs": result.docs.to_dict(),
        "chunks_total": result.chunks.total,
        "chunks_embedded": result.chunks.embedded,
        "chunks_reused": result.chunks.copied,
        "points_copied": copied,
        # over the whole build step outside the embedder: loading and chunking the corpus, the manifest,
        # listing existing IDs, the copy loop, the embed loop's writes, the final count and state updates
        "copy_points_per_s": round(copied / outside_embed_s, 1) if copied else None,
        # the copy loop alone (retrieve live vectors + upsert the new points), as the engine times it
        "copy_loop_s": round(copy_loop_s, 4) if copy_loop_s is not None else None,
        "copy_loop_points_per_s": loop_rate,
        "validation": {k: (result.validation.to_dict() if result.validation else {}).get(k)
                       for k in ("passed", "hit_rate", "mrr")},
        "swap_s": round(max(meter.swap_s, default=0.0), 6),
        "alias_update_s": round(max(meter.alias_update_s, default=0.0), 6),
    }


def profiled(fn: Callable[[Meter], dict[str, Any]], out: Path) -> Callable[[Meter], dict[str, Any]]:
    def go(meter: Meter) -> dict[str, Any]:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.001)
        profiler.start()
        try:
            return fn(meter)
        finally:
            profiler.stop()
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_suffix(".txt").write_text(profiler.output_text(unicode=True, color=False, show_all=False),
                                               encoding="utf-8")
    return go


def raw_bulk_upsert(deps: BenchDeps, meter: Meter, *, copy_batch: int) -> dict[str, Any]:
    """The backend's physical limit for the copy path: the live points (same IDs, vectors, payloads)
    upserted into a fresh collection of the same shape in batches of KB_COPY_BATCH_SIZE; only the upsert
    calls are timed. Then the same points read back by ID with vectors, as the copy path reads them."""
    from qdrant_client import models

    client = deps.store.client
    live_version = deps.state.live_version(deps.settings.alias)
    assert live_version is not None
    live = live_version.collection
    name = "bench_raw_upsert"
    deps.store.delete_collection(name)
    deps.store.create_collection(name, dim=DIM)
    upsert_s = retrieve_s = 0.0
    points = 0
    # the live points by ID from its manifest (local mode's scroll re-sorts every ID for each page)
    ids = [row.point_id for row in deps.state.manifest_chunks(live_version.id)]
    for start in range(0, len(ids), copy_batch):
        records = client.retrieve(live, ids=ids[start:start + copy_batch], with_payload=True, with_vectors=True)
        batch = [models.PointStruct(id=r.id, vector=r.vector, payload=r.payload) for r in records]
        started = time.perf_counter()
        client.upsert(name, points=batch, wait=True)
        upsert_s += time.perf_counter() - started
        points += len(batch)
    for start in range(0, len(ids), copy_batch):
        started = time.perf_counter()
        client.retrieve(name, ids=ids[start:start + copy_batch], with_vectors=True, with_payload=False)
        retrieve_s += time.perf_counter() - started
    deps.store.delete_collection(name)
    meter.points_upserted += points
    meter.upsert_s += upsert_s
    return {"points": points, "upsert_s": round(upsert_s, 4), "upsert_points_per_s": round(points / upsert_s, 1),
            "retrieve_s": round(retrieve_s, 4), "retrieve_points_per_s": round(points / retrieve_s, 1),
            "batch": copy_batch}


WIRE_REPEATS = 5  # encode/decode timings per batch: the median of these
WIRE_PINGS = 30  # cheap requests (count on an empty collection) for the per-request latency


def wire_costs(deps: BenchDeps, *, copy_batch: int) -> dict[str, Any]:
    """Where the copy path's time goes over REST, in parts the server's request log cannot see: the
    remote client's own JSON work on one batch of KB_COPY_BATCH_SIZE live points, done exactly as the client
    does it (`jsonable_encoder` of the `PointsList` an upsert sends; `parse_response` of a retrieve's answer
    of the same points with vectors, as the copy reads them), and the latency of one cheap request (count on
    an empty collection). The server's side (its JSON, local mode's time) is in its request log."""
    import statistics

    from qdrant_client import models
    from qdrant_client.common.response_parsing import parse_response
    from qdrant_client.http.api.points_api import jsonable_encoder

    client = deps.store.client
    live_version = deps.state.live_version(deps.settings.alias)
    assert live_version is not None
    ids = [row.point_id for row in deps.state.manifest_chunks(live_version.id)][:copy_batch]
    records = client.retrieve(live_version.collection, ids=ids, with_vectors=True, with_payload=True)
    points = [models.PointStruct.model_construct(id=r.id, vector=r.vector, payload=r.payload) for r in records]
    answer = json.dumps({"result": [r.model_copy(update={"payload": None}).model_dump(mode="json", exclude_none=True)
                                    for r in records], "status": "ok", "time": 0.001}).encode("utf-8")

    def median_s(fn: Callable[[], Any]) -> tuple[float, Any]:
        times, result = [], None
        for _ in range(WIRE_REPEATS):
            started = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times), result

    encode_s, body = median_s(lambda: jsonable_encoder(models.PointsList(points=points)))
    decode_s, parsed = median_s(lambda: parse_response(answer, models.InlineResponse20017))
    assert len(parsed.result) == len(records)
    ping = "bench_wire_ping"
    deps.store.delete_collection(ping)
    client.create_collection(ping, vectors_config=models.VectorParams(size=4, distance=models.Distance.COSINE))
    latencies = []
    for _ in range(WIRE_PINGS):
        started = time.perf_counter()
        client.count(ping, exact=True)
        latencies.append(time.perf_counter() - started)
    deps.store.delete_collection(ping)
    return {"batch": copy_batch, "points": len(points), "encode_upsert_s": round(encode_s, 5),
            "upsert_request_bytes": len(body), "decode_retrieve_s": round(decode_s, 5),
            "retrieve_answer_bytes": len(answer), "round_trip_s": round(statistics.median(latencies), 6),
            "round_trip_max_s": round(max(latencies), 6), "pings": WIRE_PINGS}


def promotion_under_readers(deps: BenchDeps, meter: Meter, run: Callable[[Meter], dict[str, Any]],
                            pause_s: float | None = None) -> dict[str, Any]:
    """A reindex whose promotion (and the retention after it) happens while 4 threads search through the
    alias with the reader API. Readers start when the promote step starts and read the old version for a
    moment first; they stop once each has read the new one, after cleanup. The build and validation
    before are not slowed down by them (that is not what P6 is about)."""
    import kb_reindex.run.pipeline as pipeline
    from kb_reindex.reader import search_knowledge
    from kb_reindex.services.runtime import Deps
    from kb_reindex.services.store import KnowledgeStore

    # readers get their own, uncounted Deps over the same Qdrant client and state DB
    reader_deps = Deps(settings=deps.settings, state=deps.state,
                       store=KnowledgeStore(deps.store.client, local=deps.store.is_local))
    pause = pause_s or READER_PAUSE_S
    stop = threading.Event()
    lock = threading.Lock()
    stats: dict[str, Any] = {"reads": 0, "failed": 0, "empty": 0, "max_latency_s": 0.0, "errors": []}
    by_version: dict[int, int] = {}

    def reader(query: str) -> None:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                found = search_knowledge(reader_deps, query, k=4)
                latency = time.perf_counter() - started
                with lock:
                    stats["reads"] += 1
                    stats["max_latency_s"] = max(stats["max_latency_s"], latency)
                    by_version[found.version] = by_version.get(found.version, 0) + 1
                    if not found.results:
                        stats["empty"] += 1
            except Exception as exc:  # every failure counts
                with lock:
                    stats["failed"] += 1
                    if len(stats["errors"]) < 5:
                        stats["errors"].append(f"{type(exc).__name__}: {exc}")
            time.sleep(pause)

    threads = [threading.Thread(target=reader, args=(q,), daemon=True) for q in READER_QUERIES[:READERS]]
    original_promote = pipeline.promote  # the name the pipeline's promote step calls

    def wait_for_reads(count: int, version: int | None = None, limit_s: float = 10.0) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            with lock:
                done = by_version.get(version, 0) if version is not None else stats["reads"]
            if done >= count:
                return
            time.sleep(0.005)

    def promote_under_readers(*args: Any, **kwargs: Any) -> Any:
        for t in threads:
            t.start()
        wait_for_reads(2 * READERS)  # every reader is busy on the old version
        return original_promote(*args, **kwargs)

    pipeline.promote = promote_under_readers  # type: ignore[assignment]
    row: dict[str, Any] | None = None
    try:
        row = run(meter)
    finally:
        pipeline.promote = original_promote  # type: ignore[assignment]
        started = [t for t in threads if t.ident is not None]
        if started:  # every reader also reads the new version before they stop
            wait_for_reads(2 * READERS, version=row["version"] if row else None)
        stop.set()
        for t in started:
            t.join()
    row.update(readers=READERS, reads=stats["reads"], failed_reads=stats["failed"], empty_reads=stats["empty"],
               reader_errors=stats["errors"], reader_max_latency_s=round(stats["max_latency_s"], 4),
               reads_by_version={str(k): v for k, v in sorted(by_version.items())},
               versions_seen=sorted(by_version), promote_s=round(meter.phases.get("promote", 0.0), 6))
    return row


# --- LangChain's indexing API --------------------------------------------------------------------


def run_langchain(job: dict[str, Any]) -> dict[str, Any]:
    """The LangChain peer; the fake Ollama server and the store sidecar are stopped on errors too."""
    with ExitStack() as stack:
        return _langchain(job, stack)


def _langchain(job: dict[str, Any], stack: ExitStack) -> dict[str, Any]:
    from langchain_classic.indexes import SQLRecordManager, index
    from langchain_core.documents import Document as LCDocument
    from langchain_core.embeddings import Embeddings
    from langchain_qdrant import QdrantVectorStore
    from qdrant_client import models

    from kb_reindex.services.chunking import chunk_document
    from kb_reindex.services.embedding import HashingEmbedder, OllamaEmbedder
    from kb_reindex.services.sources import load_corpus

    size, seed, embedder_kind = job["size"], job["seed"], job["embedder"]
    base = corpus_mod.generate(size, seed)
    mutated, mutation = corpus_mod.mutate(base, seed)
    root = Path(job["workdir"]) / f"langchain-{embedder_kind}-{size}"
    corpus_mod.write_project(root, base, mutation)
    docs_dir = root / "knowledge" / "docs"
    mutated_dir = root.parent / f"{root.name}-mutated"
    corpus_mod.write(mutated, mutated_dir)
    del base, mutated  # on disk from here, as for our engine's worker
    gc.collect()

    server = fake_ollama(job["ollama_ms"]) if embedder_kind == "ollama" else None
    if server is not None:
        stack.callback(server.stop)
        inner: Any = OllamaEmbedder(host=server.url, model=OLLAMA_MODEL, dim=DIM, batch_size=32)
    else:
        inner = HashingEmbedder(dim=DIM)
    meter_ref = MeterRef()

    class CountedEmbeddings(Embeddings):
        """LangChain's Embeddings over the very embedder our engine uses (same batching of 32 for Ollama)."""

        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            meter = meter_ref.meter
            started = time.perf_counter()
            vectors = inner.embed(texts)
            meter.embed_s += time.perf_counter() - started
            meter.embed_requests += 1
            meter.chunk_texts += len(texts)
            return vectors

        def embed_query(self, text: str) -> list[float]:
            meter_ref.meter.query_texts += 1
            return inner.embed_queries([text])[0]

    # QdrantVectorStore only calls client methods (no isinstance check), so the sidecar's proxy serves
    store_handle = stack.enter_context(qdrant_store(job["store"]))
    client, store_pid = store_handle.client, store_handle.pid
    upsert, delete = client.upsert, client.delete

    def counted_upsert(collection_name: str, points: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return upsert(collection_name, points=points, **kwargs)
        finally:
            meter = meter_ref.meter
            meter.upsert_s += time.perf_counter() - started
            meter.points_upserted += len(points)
            meter.upsert_calls += 1

    def counted_delete(collection_name: str, points_selector: Any, **kwargs: Any) -> Any:
        ids = points_selector.points if isinstance(points_selector, models.PointIdsList) else points_selector
        meter_ref.meter.points_deleted += len(ids) if isinstance(ids, list) else 0
        return delete(collection_name, points_selector=points_selector, **kwargs)

    client.upsert = counted_upsert  # type: ignore[method-assign]
    client.delete = counted_delete  # type: ignore[method-assign]
    collection = "langchain_knowledge"
    client.create_collection(collection, vectors_config=models.VectorParams(size=DIM, distance=models.Distance.COSINE))
    store = QdrantVectorStore(client=client, collection_name=collection, embedding=CountedEmbeddings())
    records = SQLRecordManager(f"qdrant/{collection}", db_url=f"sqlite:///{root / 'records.db'}")
    records.create_schema()

    def documents() -> Iterator[LCDocument]:
        for doc in load_corpus(docs_dir):
            for chunk in chunk_document(doc):
                yield LCDocument(page_content=chunk.text,
                                 metadata={"source": doc.knowledge_key, "title": doc.title, "section": chunk.section})

    def uuid_key(doc: LCDocument) -> str:
        """LangChain's own content+metadata hash, in SHA-256, as a UUID (Qdrant IDs are UUIDs or ints)."""
        content = hashlib.sha256(doc.page_content.encode("utf-8")).hexdigest()
        meta = hashlib.sha256(json.dumps(doc.metadata, sort_keys=True).encode("utf-8")).hexdigest()
        return str(uuid.uuid5(uuid.NAMESPACE_URL, content + meta))

    def run_index(meter: Meter) -> dict[str, Any]:
        result = index(documents(), records, store, cleanup="incremental", source_id_key="source",
                       key_encoder=uuid_key)
        count = client.count(collection, exact=True).count
        return {"indexing_result": dict(result), "points_in_store": count}

    # warm-up: the same calls on a 3-document throwaway collection, so first-use costs are not timed
    warm_started = time.perf_counter()
    warm_root = root.parent / f"{root.name}-warmup"
    corpus_mod.write_project(warm_root, corpus_mod.generate(3, seed=1), None)
    client.create_collection("warmup", vectors_config=models.VectorParams(size=DIM, distance=models.Distance.COSINE))
    warm_records = SQLRecordManager("qdrant/warmup", db_url=f"sqlite:///{warm_root / 'records.db'}")
    warm_records.create_schema()
    warm_docs = [LCDocument(page_content=c.text, metadata={"source": d.knowledge_key, "title": d.title,
                                                           "section": c.section})
                 for d in load_corpus(warm_root / "knowledge" / "docs") for c in chunk_document(d)]
    index(warm_docs, warm_records, QdrantVectorStore(client=client, collection_name="warmup",
                                                     embedding=CountedEmbeddings()),
          cleanup="incremental", source_id_key="source", key_encoder=uuid_key)
    client.delete_collection("warmup")
    warm = {"first_run_s": round(time.perf_counter() - warm_started, 3)}

    sc = Scenarios(meter_ref, server, store_pid, store_handle.url)
    sc.run("langchain.full_build", run_index)
    sc.run("langchain.noop", run_index)
    corpus_mod.mirror(mutated_dir, docs_dir)
    row = sc.run("langchain.incremental", run_index)
    expected = sum(len(chunk_document(d)) for d in load_corpus(docs_dir))
    row["points_expected"] = expected
    row["stale_points"] = row["points_in_store"] - expected
    out = {"job": job, "scenarios": sc.results, "ru_maxrss_mb": round(ru_maxrss_mb(), 1),
           "mutation": mutation.summary(), "warmup": warm}
    return out


JOBS = {"kb": run_kb, "langchain": run_langchain}


def quiet_logs() -> None:
    """Progress logs per batch would cost time and flood stderr; importing Airflow may reconfigure logging."""
    logging.basicConfig(level=logging.WARNING)
    for name in ("kb_reindex", "httpx", "airflow"):
        logging.getLogger(name).setLevel(logging.WARNING)


def main(job_json: str) -> int:
    """One worker process: one peer; one (size, embedder) task in a full run, all of the peer's in --smoke."""
    quiet_logs()
    job = json.loads(job_json)
    job.setdefault("store", "sidecar")
    runs = []
    for task in job["tasks"]:
        started = time.perf_counter()
        result = JOBS[job["peer"]]({**job, **task})
        result["job_wall_s"] = round(time.perf_counter() - started, 2)
        result["peak_rss_mb"] = max(row["peak_rss_mb"] for row in result["scenarios"].values())
        store_peaks = [row["store_peak_rss_mb"] for row in result["scenarios"].values() if "store_peak_rss_mb" in row]
        result["store_peak_rss_mb"] = max(store_peaks) if store_peaks else None
        result["store"] = job["store"]
        runs.append(result)
        gc.collect()
    import kb_reindex

    where = str(Path(kb_reindex.__file__).resolve().parent)
    if job.get("package") and not where.startswith(str(Path(job["package"]).resolve())):
        raise RuntimeError(f"worker imported kb_reindex from {where}, not from the snapshot {job['package']}")
    out = Path(job["out"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"runs": runs, "kb_reindex_from": where}, ensure_ascii=False, indent=1), encoding="utf-8")
    os.replace(tmp, out)
    return 0


def scenario_main(out: str) -> int:
    """`peers.py --scenario <row.json>`: one engine scenario in this process; its spec comes on stdin."""
    row = run_scenario_child(json.loads(sys.stdin.read()))
    tmp = Path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(row, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--scenario":
        raise SystemExit(scenario_main(sys.argv[2]))
    if len(sys.argv) != 2:
        raise SystemExit("usage: peers.py '<job JSON>' | peers.py --scenario <row.json> (spec on stdin); "
                         "bench/run.py starts these")
    raise SystemExit(main(sys.argv[1]))
