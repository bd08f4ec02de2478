"""Measuring without changing the code under test: peak RSS windows, counting wrappers, phase timers.

- Peak RSS per scenario: Linux keeps the process's high-water mark (VmHWM); writing "5" to
  /proc/<pid>/clear_refs resets it, so each scenario's window reports its own peak. Where that is not
  allowed a 5 ms psutil sampler does the same job, approximately. The same window works for the store
  sidecar's process (`PeakRss(pid)`), which models the Qdrant server's memory.
- Embedding calls: every embedder the engine asks `Deps.embedder_for` for is wrapped; chunk texts and
  golden-probe queries are counted apart (validation embeds the probes, readers embed their queries).
- Vector writes and copies: a `KnowledgeStore` subclass counts and times upserts and retrieves.
- Phases: the engine's step functions are wrapped in its module namespace, for this process only.
"""

from __future__ import annotations

import re
import resource
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kb_reindex.services.runtime import Deps
from kb_reindex.services.store import KnowledgeStore

MB = 1024 * 1024


def _status_kb(name: str, pid: int | str = "self") -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            match = re.search(rf"^{name}:\s+(\d+) kB", handle.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def rss_mb(pid: int | str = "self") -> float:
    kb = _status_kb("VmRSS", pid)
    if kb is not None:
        return kb / 1024
    import psutil

    return psutil.Process(None if pid == "self" else int(pid)).memory_info().rss / MB


def _reset_hwm(pid: int | str = "self") -> bool:
    try:
        with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
        return _status_kb("VmHWM", pid) is not None
    except OSError:
        return False


class PeakRss:
    """Peak RSS between start() and stop(), in MB, of this process or of another one (`pid`)."""

    def __init__(self, pid: int | str = "self") -> None:
        self.pid = pid
        self.start_mb = 0.0
        self.peak_mb = 0.0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PeakRss:
        self.start_mb = rss_mb(self.pid)
        if _reset_hwm(self.pid):
            self.method = "VmHWM"
        else:
            self.method = "sampled"
            self.peak_mb = self.start_mb
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak_mb = max(self.peak_mb, rss_mb(self.pid))

    def stop(self) -> float:
        if self.method == "VmHWM":
            self.peak_mb = (_status_kb("VmHWM", self.pid) or 0) / 1024
        else:
            self._stop.set()
            if self._thread:
                self._thread.join()
            self.peak_mb = max(self.peak_mb, rss_mb(self.pid))
        return self.peak_mb


def ru_maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- counters ----------------------------------------------------------------------------------


@dataclass
class Meter:
    """Everything counted during one scenario."""

    chunk_texts: int = 0          # chunk texts sent to an embedder (what costs money/CPU)
    query_texts: int = 0          # golden probes, reader queries, LangChain's dimension probe
    embed_requests: int = 0       # calls to embed() carrying chunk texts
    embed_s: float = 0.0          # time inside embed() for chunk texts
    points_upserted: int = 0      # vector writes
    upsert_calls: int = 0
    upsert_s: float = 0.0
    points_retrieved: int = 0     # retrieves with vectors (the copy path's reads)
    retrieve_s: float = 0.0
    points_deleted: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    swap_s: list[float] = field(default_factory=list)       # store.swap_alias (CAS + one alias request)
    alias_update_s: list[float] = field(default_factory=list)  # the update_collection_aliases request alone

    def as_dict(self) -> dict[str, Any]:
        return {
            "chunk_texts_embedded": self.chunk_texts,
            "query_texts_embedded": self.query_texts,
            "embed_requests": self.embed_requests,
            "embed_s": round(self.embed_s, 4),
            "vector_writes": self.points_upserted,
            "upsert_calls": self.upsert_calls,
            "upsert_s": round(self.upsert_s, 4),
            "points_retrieved": self.points_retrieved,
            "retrieve_s": round(self.retrieve_s, 4),
            "points_deleted": self.points_deleted,
            "phases_s": {k: round(v, 4) for k, v in self.phases.items()},
        }


class CountingEmbedder:
    """Wraps an engine embedder; texts in `queries` (the golden probes) are counted as queries."""

    def __init__(self, inner: Any, meter_ref: MeterRef, queries: set[str]) -> None:
        self._inner = inner
        self._meter_ref = meter_ref
        self._queries = queries
        self.kind = inner.kind
        self.model = inner.model
        self.recipe = inner.recipe

    @property
    def dimension(self) -> int:
        return self._inner.dimension

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        meter = self._meter_ref.meter
        queries = sum(1 for t in texts if t in self._queries)
        chunks = len(texts) - queries
        started = time.perf_counter()
        vectors = self._inner.embed(texts)
        if chunks:
            meter.embed_s += time.perf_counter() - started
            meter.embed_requests += 1
        meter.chunk_texts += chunks
        meter.query_texts += queries
        return vectors

    def embed_queries(self, texts: Sequence[str]) -> list[list[float]]:
        """Questions (the golden probes, replayed queries): counted as queries, never as embedding work."""
        self._meter_ref.meter.query_texts += len(texts)
        return self._inner.embed_queries(texts)

    def embed_batches(self, batches: Iterable[Sequence[str]]) -> Iterator[list[list[float]]]:
        """The inner embedder's (its requests in flight included); texts counted as they are drawn, and
        embed_s is the time the caller waited for answers."""
        meter = self._meter_ref.meter

        def counted() -> Iterator[Sequence[str]]:
            for texts in batches:
                queries = sum(1 for t in texts if t in self._queries)
                meter.chunk_texts += len(texts) - queries
                meter.query_texts += queries
                meter.embed_requests += 1 if len(texts) > queries else 0
                yield texts

        started = time.perf_counter()
        for vectors in self._inner.embed_batches(counted()):
            meter.embed_s += time.perf_counter() - started
            yield vectors
            started = time.perf_counter()


class MeterRef:
    """The meter of the scenario being measured; swapped between scenarios."""

    def __init__(self) -> None:
        self.meter = Meter()

    def fresh(self) -> Meter:
        self.meter = Meter()
        return self.meter


class CountingStore(KnowledgeStore):
    """The package's KnowledgeStore, counting and timing what crosses to Qdrant."""

    def __init__(self, client: Any, meter_ref: MeterRef, *, local: bool | None = True) -> None:
        # local mode in the worker or behind the sidecar's proxy (which hides the client the store would
        # tell it from): no index to restore or wait for. None: told from the client, as with the Qdrant
        # test server's remote client, which the engine treats as a server's (deferred index, restored)
        super().__init__(client, local=local)
        self.meter_ref = meter_ref
        # an instance attribute shadows the method on a QdrantClient and on the sidecar's proxy alike
        update = client.update_collection_aliases

        def timed_update(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return update(*args, **kwargs)
            finally:
                self.meter_ref.meter.alias_update_s.append(time.perf_counter() - started)

        client.update_collection_aliases = timed_update  # this client instance only

    def upsert(self, name: str, points: list[Any]) -> None:
        started = time.perf_counter()
        super().upsert(name, points)
        meter = self.meter_ref.meter
        meter.upsert_s += time.perf_counter() - started
        meter.points_upserted += len(points)
        meter.upsert_calls += 1 if points else 0

    def retrieve(self, name: str, ids: Sequence[str], *, vectors: bool = False, payload: bool = True) -> list[Any]:
        started = time.perf_counter()
        records = super().retrieve(name, ids, vectors=vectors, payload=payload)
        if vectors:
            meter = self.meter_ref.meter
            meter.retrieve_s += time.perf_counter() - started
            meter.points_retrieved += len(records)
        return records

    def swap_alias(self, alias: str, *, to: str, expected_from: str | None) -> None:
        started = time.perf_counter()
        try:
            super().swap_alias(alias, to=to, expected_from=expected_from)
        finally:
            self.meter_ref.meter.swap_s.append(time.perf_counter() - started)


@dataclass
class BenchDeps(Deps):
    """Deps whose embedders are counted; built exactly as the tests build theirs otherwise."""

    meter_ref: MeterRef | None = None
    queries: set[str] = field(default_factory=set)

    def embedder_for(self, version: Any) -> Any:
        inner = super().embedder_for(version)
        assert self.meter_ref is not None
        return CountingEmbedder(inner, self.meter_ref, self.queries)


#: (module, name) of each step the CLI's run calls: the pipeline's steps, and the rollback the run recorder calls
#: (its target's re-scoring, `rescore`, counted with it)
ENGINE_STEPS = (("pipeline", "prepare_logged"), ("pipeline", "snapshot_plan"), ("pipeline", "create_version"),
                ("pipeline", "build"), ("pipeline", "validate"), ("pipeline", "promote"), ("pipeline", "cleanup"),
                ("runs", "rescore"), ("runs", "rollback"))
#: the phase a step's time is counted in, where it is not the step's own name
PHASE_OF = {"prepare_logged": "plan", "rescore": "rollback"}


@contextmanager
def phase_timers(meter_ref: MeterRef) -> Iterator[None]:
    """Time each engine step (plan, create, build, validate, promote, cleanup, rollback) in this process; the
    plan's snapshot (manifest and texts written to the state DB) is its own phase, `snapshot_plan`."""
    import kb_reindex.run.pipeline as pipeline
    import kb_reindex.run.runs as runs

    modules = {"pipeline": pipeline, "runs": runs}
    originals = {(module, name): getattr(modules[module], name) for module, name in ENGINE_STEPS}

    def wrap(name: str, fn: Any) -> Any:
        label = PHASE_OF.get(name, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases = meter_ref.meter.phases
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - started

        return timed

    for (module, name), fn in originals.items():
        setattr(modules[module], name, wrap(name, fn))
    try:
        yield
    finally:
        for (module, name), fn in originals.items():
            setattr(modules[module], name, fn)
