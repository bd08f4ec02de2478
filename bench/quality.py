"""Retrieval quality beside embedding cost: hashing against multilingual-e5-small on the shipped corpus.

Each embedder embeds the chunks of knowledge/docs exactly as a build cuts them (default chunking), the
probes as questions (`embed_queries`, so e5's `query: ` recipe), and ranks the chunks by cosine, as
validation ranks Qdrant's answers: a probe's rank is the first of the top k chunks whose document it
expects. Two probe sets: the shipped golden set (Chinese questions) and bench/crosslingual.yaml (English
questions about the Chinese pages). The cost is the wall time of embedding the chunks, per 1,000 chunks
(model loading excluded, measured apart).

    .venv/bin/python bench/quality.py                      # writes bench/results/quality.{json,md}
    .venv/bin/python bench/quality.py --out /tmp/quality   # elsewhere
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "include"))

from kb_reindex.services.chunking import chunk_document  # noqa: E402
from kb_reindex.services.config import DEFAULT_DIMS, DEFAULT_MODELS  # noqa: E402
from kb_reindex.services.embedding import Embedder, HashingEmbedder  # noqa: E402
from kb_reindex.steps.golden import GoldenSet, first_hit_rank, load_golden_set, score  # noqa: E402
from kb_reindex.services.sources import load_corpus  # noqa: E402

PROBE_SETS = {"golden": REPO / "knowledge" / "golden.yaml", "crosslingual": REPO / "bench" / "crosslingual.yaml"}


@dataclass(frozen=True)
class SetScore:
    probes: int
    hit_rate: float
    mrr: float
    misses: tuple[str, ...]


@dataclass(frozen=True)
class EmbedderQuality:
    embedder: str
    model: str
    dim: int
    load_s: float
    chunks: int
    embed_s: float
    s_per_1000_chunks: float
    cpu_s_per_1000_chunks: float  # CPU time of this process (all its threads): what a shared machine cannot inflate
    query_ms: float
    sets: dict[str, SetScore]


def make(kind: str) -> tuple[Embedder, float]:
    started = time.perf_counter()
    if kind == "hashing":
        embedder: Embedder = HashingEmbedder(model=DEFAULT_MODELS["hashing"], dim=DEFAULT_DIMS["hashing"])
    else:
        from kb_reindex.services.e5 import E5Embedder

        embedder = E5Embedder()
        embedder.embed(["warm-up: loads the model"])
    return embedder, time.perf_counter() - started


def score_set(embedder: Embedder, golden: GoldenSet, chunk_vectors: np.ndarray, chunk_keys: list[str]) -> SetScore:
    queries = np.asarray(embedder.embed_queries([p.query for p in golden.probes]))
    ranks = []
    misses = []
    for probe, similarities in zip(golden.probes, queries @ chunk_vectors.T, strict=True):
        top = [chunk_keys[i] for i in np.argsort(-similarities)[: golden.k]]
        rank = first_hit_rank(top, probe.expected)
        ranks.append(rank)
        if rank is None:
            misses.append(probe.id)
    hit_rate, mrr = score(ranks)
    return SetScore(probes=len(ranks), hit_rate=round(hit_rate, 4), mrr=round(mrr, 4), misses=tuple(misses))


def measure(kind: str, texts: list[str], keys: list[str], sets: dict[str, GoldenSet]) -> EmbedderQuality:
    embedder, load_s = make(kind)
    started, cpu_started = time.perf_counter(), time.process_time()
    vectors = np.asarray(embedder.embed(texts))
    embed_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    started = time.perf_counter()
    probes = [p.query for g in sets.values() for p in g.probes]
    embedder.embed_queries(probes)
    query_ms = (time.perf_counter() - started) / len(probes) * 1000
    return EmbedderQuality(
        embedder=kind, model=embedder.model, dim=embedder.dimension, load_s=round(load_s, 3), chunks=len(texts),
        embed_s=round(embed_s, 3), s_per_1000_chunks=round(embed_s / len(texts) * 1000, 2),
        cpu_s_per_1000_chunks=round(cpu_s / len(texts) * 1000, 2),
        query_ms=round(query_ms, 2), sets={name: score_set(embedder, g, vectors, keys) for name, g in sets.items()},
    )


def markdown(results: list[EmbedderQuality], meta: dict[str, Any]) -> str:
    names = list(results[0].sets)
    k = meta["k"]
    header = ["embedder", "model", "dim"] + [f"{n} hit@{k}" for n in names] + [f"{n} MRR" for n in names] + [
        "embed s / 1,000 chunks", "CPU s / 1,000 chunks", "ms / query", "load s"]
    lines = [
        "# Retrieval quality: hashing vs multilingual-e5-small",
        "",
        (f"Corpus: knowledge/docs ({meta['documents']} documents, {meta['chunks']} chunks, default chunking). "
         f"Probe sets: golden = knowledge/golden.yaml ({meta['probes']['golden']} Chinese questions), crosslingual = "
         f"bench/crosslingual.yaml ({meta['probes']['crosslingual']} English questions about the Chinese pages). "
         f"Machine: {meta['cpus']} CPUs, Python {meta['python']}. Generated by `bench/quality.py`. Wall times "
         "rise when other work shares the CPUs; CPU time is the engine's own work (both cores when it has them)."),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    for r in results:
        row = [r.embedder, r.model, str(r.dim)] + [f"{r.sets[n].hit_rate:.3f}" for n in names] + [
            f"{r.sets[n].mrr:.3f}" for n in names]
        row += [f"{r.s_per_1000_chunks:.2f}", f"{r.cpu_s_per_1000_chunks:.2f}", f"{r.query_ms:.1f}", f"{r.load_s:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Misses (probe ids, not in the top k):", ""]
    for r in results:
        for n in names:
            lines.append(f"- {r.embedder} / {n}: {', '.join(r.sets[n].misses) or 'none'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--embedders", default="hashing,e5", help="comma-separated: hashing, e5")
    args = parser.parse_args(argv)
    documents = load_corpus(REPO / "knowledge" / "docs")
    chunks = [c for d in documents for c in chunk_document(d)]
    texts, keys = [c.text for c in chunks], [c.knowledge_key for c in chunks]
    sets = {name: load_golden_set(path) for name, path in PROBE_SETS.items()}
    results = [measure(kind.strip(), texts, keys, sets) for kind in args.embedders.split(",") if kind.strip()]
    meta: dict[str, Any] = {"documents": len(documents), "chunks": len(chunks), "k": sets["golden"].k,
            "probes": {name: len(g.probes) for name, g in sets.items()}, "cpus": os.cpu_count(),
            "python": platform.python_version()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]},
                                                      indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    report = markdown(results, meta)
    (args.out / "quality.md").write_text(report, encoding="utf-8")
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
