"""Calibrating the near-duplicate threshold (KB_DUPLICATE_COSINE, kb_reindex.services.config.DEFAULT_DUPLICATE_COSINE) on e5.

Validation warns (kind `duplicate`) when a chunk it embedded lies at or above a cosine to a chunk of another
document. This measures, with multilingual-e5-small (the embedded default, offline), the chunks as the build
embeds them (`chunk_document`, the e5 passage form):

- negatives: every pair of chunks of two different shipped documents (both knowledge bases), the most alike
  of which must stay below the threshold (no warning on the shipped pages);
- positives: near-copies of each shipped page as people make them (the trial's eight near-copies of one page):
  retitled, a sentence added, a sentence dropped, a number changed, retitled with a sentence changed, the
  page's first half only, and the page with its paragraphs of each section reordered; each copy's chunk is
  scored against the most alike chunk of its original. Identical chunks (the same hash) are left out: those
  are caught by their hash, whatever the cosine.

    .venv/bin/python bench/duplicates.py    # prints the table; writes bench/results/duplicates.{json,md}
    .venv/bin/python bench/duplicates.py --cost [--docs 2000]   # what the check costs a routine run (-> duplicates-cost.json)

`--cost` times the duplicate check inside validation on the benchmark's synthetic corpus (bench/corpus.py, hashing
embedder, Qdrant local mode as the embedded default runs): the first build (at most MAX_NEAR_CHECKS new chunks
searched) and the routine run after `mutate()` (1% of the documents edited, 0.5% added, 0.5% removed).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "include"))

from kb_reindex.services.chunking import Chunk, chunk_document  # noqa: E402
from kb_reindex.services.e5 import E5Embedder  # noqa: E402
from kb_reindex.services.sources import parse_document  # noqa: E402
from kb_reindex.services.config import DEFAULT_DUPLICATE_COSINE  # noqa: E402


def _sentences(body: str) -> list[str]:
    return [s for s in re.split(r"(?<=[。！？；])", body) if s.strip() and not s.lstrip().startswith("#")]


def variants(text: str) -> dict[str, str]:
    """Near-copies of one page's file text (front matter and body), each as a person might make it."""
    head, _, body = text.partition("\n---\n")
    title = re.search(r"^title:\s*(.+)$", head, re.M)
    name = title.group(1).strip() if title else ""
    retitled = text.replace(name, f"{name}（2026版）") if name else text
    sentences = _sentences(body)
    middle = sentences[len(sentences) // 2] if sentences else ""
    numbers = re.findall(r"\d+", body)
    changed_number = body.replace(numbers[0], str(int(numbers[0]) + 3), 1) if numbers else body
    sections = body.split("\n## ")
    reordered = "\n## ".join(
        [sections[0]] + ["\n\n".join(reversed(s.split("\n\n"))) for s in sections[1:]])
    return {
        "retitled": retitled,
        "sentence added": text.replace(middle, middle + "如有疑问，请联系在线客服。", 1),
        "sentence dropped": text.replace(middle, "", 1),
        "number changed": head + "\n---\n" + changed_number,
        "retitled, sentence changed": retitled.replace(middle, middle.replace("，", "，另外，", 1), 1),
        "first half only": head + "\n---\n" + body[: len(body) // 2],
        "paragraphs reordered": head + "\n---\n" + reordered,
    }


def _chunks(path: Path, text: str) -> list[Chunk]:
    document = parse_document(path, path.name, text.encode("utf-8"))
    return chunk_document(document, chunk_size=500, overlap=50)


def measure() -> dict[str, object]:
    embedder = E5Embedder()
    pages = sorted((HERE.parent / "knowledge").rglob("docs/*.md"))
    originals = {p: _chunks(p, p.read_text(encoding="utf-8")) for p in pages}
    vectors = {p: np.array(embedder.embed([c.text for c in cs])) for p, cs in originals.items()}
    # negatives: the most alike chunks of two different shipped documents
    negatives: list[tuple[float, str, str]] = []
    for i, a in enumerate(pages):
        for b in pages[i + 1:]:
            sims = vectors[a] @ vectors[b].T
            negatives.append((float(sims.max()), a.stem, b.stem))
    negatives.sort(reverse=True)
    positives: list[tuple[float, str, str]] = []
    for page in pages:
        hashes = {c.chunk_hash for c in originals[page]}
        for kind, text in variants(page.read_text(encoding="utf-8")).items():
            copy = [c for c in _chunks(page, text) if c.chunk_hash not in hashes]
            if not copy:
                continue
            sims = np.array(embedder.embed([c.text for c in copy])) @ vectors[page].T
            positives += [(float(s), kind, page.stem) for s in sims.max(axis=1)]
    positives.sort()
    threshold = DEFAULT_DUPLICATE_COSINE
    copies: dict[tuple[str, str], float] = {}  # a near-copy is named when any of its changed chunks crosses
    for score, kind, page in positives:
        copies[(kind, page)] = max(score, copies.get((kind, page), 0.0))
    found = sum(1 for s, _, _ in positives if s >= threshold)
    false = sum(1 for s, _, _ in negatives if s >= threshold)
    by_kind: dict[str, list[float]] = {}
    for s, kind, _ in positives:
        by_kind.setdefault(kind, []).append(s)
    return {
        "model": embedder.model, "threshold": threshold, "documents": len(pages),
        "chunks": sum(len(c) for c in originals.values()),
        "negative_pairs": len(negatives), "positive_chunks": len(positives),
        "max_negative": round(negatives[0][0], 4), "most_alike_documents": negatives[0][1:],
        "negatives_top5": [[round(s, 4), a, b] for s, a, b in negatives[:5]],
        "min_positive": round(positives[0][0], 4), "least_alike_copy": positives[0][1:],
        "positives_bottom5": [[round(s, 4), k, p] for s, k, p in positives[:5]],
        "recall": round(found / len(positives), 3), "false_positive_pairs": false,
        "copies": len(copies), "copies_named": sum(1 for v in copies.values() if v >= threshold),
        "copies_missed": sorted(f"{kind} of {page}" for (kind, page), v in copies.items() if v < threshold),
        "by_kind": {k: {"chunks": len(v), "min": round(min(v), 4), "caught": sum(1 for s in v if s >= threshold)}
                    for k, v in sorted(by_kind.items())},
        # every candidate threshold: the recall on the near-copies, the pairs of shipped documents warned
        "sweep": [{"threshold": t, "recall": round(sum(1 for s, _, _ in positives if s >= t) / len(positives), 3),
                   "shipped_pairs_warned": sum(1 for s, _, _ in negatives if s >= t)}
                  for t in (0.93, 0.94, 0.95, 0.96, 0.965, 0.97, 0.975, 0.98, 0.985, 0.99)],
    }


def cost(docs: int) -> dict[str, Any]:
    """Seconds the duplicate check takes inside the first build's and a routine run's validation."""
    import corpus as corpus_mod

    import kb_reindex.steps.validate as validate_module
    from kb_reindex.run.pipeline import run_reindex
    from kb_reindex.services.config import Settings
    from kb_reindex.services.runtime import open_deps

    spent: list[tuple[float, int]] = []
    check = validate_module.duplicate_warnings

    def timed_check(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        found = check(*args, **kwargs)
        spent.append((time.perf_counter() - started, len(found)))
        return found

    validate_module.duplicate_warnings = timed_check  # type: ignore[assignment]
    out: dict[str, Any] = {"docs": docs, "store": "Qdrant local mode on disk", "embedder": "hashing"}
    with tempfile.TemporaryDirectory(prefix="kb-dup-cost-") as tmp:
        root = Path(tmp) / "project"
        corpus = corpus_mod.generate(docs)
        corpus_mod.write_project(root, corpus, None)
        settings = Settings.from_env({"KB_PROJECT_ROOT": str(root), "KB_EMBEDDER": "hashing"})
        with open_deps(settings) as deps:
            for name in ("first_build", "routine_run"):
                if name == "routine_run":
                    changed, mutation = corpus_mod.mutate(corpus)
                    corpus_mod.write_project(root, changed, mutation)
                started = time.perf_counter()
                result = run_reindex(deps)
                total = time.perf_counter() - started
                seconds, warnings = spent[-1]
                out[name] = {"outcome": str(result.outcome), "run_s": round(total, 2),
                             "duplicate_check_s": round(seconds, 3), "share": round(seconds / total, 4),
                             "chunks": result.chunks.total, "embedded": result.chunks.embedded,
                             "duplicate_warnings": warnings}
                print(f"[cost] {name}: {out[name]}", file=sys.stderr, flush=True)
    validate_module.duplicate_warnings = check  # type: ignore[assignment]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cost", action="store_true", help="time the check in a first build and a routine run")
    parser.add_argument("--docs", type=int, default=2000)
    args = parser.parse_args()
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    if args.cost:
        sys.path.insert(0, str(HERE))
        measured = cost(args.docs)
        (out / "duplicates-cost.json").write_text(json.dumps(measured, indent=2) + "\n", encoding="utf-8")
        print(json.dumps(measured, indent=2))
        return
    result = measure()
    rows = [f"| {kind} | {v['chunks']} | {v['min']} | {v['caught']} |"  # type: ignore[index]
            for kind, v in result["by_kind"].items()]  # type: ignore[attr-defined]
    table = "\n".join([
        f"e5 ({result['model']}), threshold {result['threshold']}: {result['documents']} shipped documents, "
        f"{result['chunks']} chunks",
        "",
        f"- shipped pages, most alike chunks of two different documents: {result['max_negative']} "
        f"({' / '.join(result['most_alike_documents'])}); pairs of documents at or above the threshold: "  # type: ignore[arg-type]
        f"{result['false_positive_pairs']} of {result['negative_pairs']}",
        f"- near-copies: {result['positive_chunks']} changed chunks, least alike {result['min_positive']} "
        f"({' of '.join(result['least_alike_copy'])}); recall {result['recall']} by chunk; near-copies named (any "
        f"chunk at or above): {result['copies_named']} of {result['copies']}",  # type: ignore[arg-type]
        "",
        "| near-copy | changed chunks | least cosine to its original | at or above the threshold |",
        "|---|---|---|---|", *rows, "",
        "| threshold | recall on the near-copies | pairs of shipped documents warned |", "|---|---|---|",
        *(f"| {r['threshold']} | {r['recall']} | {r['shipped_pairs_warned']} |" for r in result["sweep"])])  # type: ignore[attr-defined]
    (out / "duplicates.json").write_text(json.dumps(result, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    (out / "duplicates.md").write_text(table + "\n", encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()
