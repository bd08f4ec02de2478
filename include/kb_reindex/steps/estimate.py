"""`kb-reindex migrate --dry-run`: what a migration would cost, before anything is built.

A migration embeds every chunk with the new model (no vector crosses models), so its cost is the
corpus: the number of texts, their estimated tokens, and the time one real batch takes, times the
batches. Nothing is written: no run, no version, no lock row, no collection; the only call that leaves
the process is one embedding batch to the model (which is the point: latency is measured, not guessed).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from kb_reindex.services.chunking import chunk_document
from kb_reindex.services.embedding import make_embedder
from kb_reindex.domain.model import RunKind
from kb_reindex.steps.plan import prepare
from kb_reindex.services.runtime import Deps
from kb_reindex.services.sources import iter_corpus


def estimate_tokens(text: str) -> int:
    """A model-free token estimate: one token per CJK character (as BPE and sentencepiece vocabularies mostly
    cut them), one per four other non-space characters. Good to a factor well under two on this corpus;
    an estimate for planning, never used for billing or limits."""
    cjk = sum(1 for ch in text if "\u3000" <= ch <= "\u9fff" or "\uac00" <= ch <= "\ud7af" or "\uff00" <= ch <= "\uffef")
    other = sum(1 for ch in text if not ch.isspace()) - cjk
    return cjk + math.ceil(other / 4)


@dataclass(frozen=True)
class MigrationEstimate:
    """What a migration to `embedder`/`embed_model` would cost, measured on one probe batch; `to_dict()` is
    the JSON `kb-reindex migrate --dry-run --json` prints."""

    alias: str
    embedder: str
    embed_model: str
    dim: int
    live_version: int | None
    live_embed_model: str | None
    documents: int
    texts: int
    chars: int
    estimated_tokens: int
    batch_size: int
    batches: int
    probe_batch_texts: int
    probe_batch_s: float
    estimated_embed_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "outcome": "dry_run",
            "kind": "migration",
            "alias": self.alias,
            "embedder": self.embedder,
            "embed_model": self.embed_model,
            "dim": self.dim,
            "live_version": self.live_version,
            "live_embed_model": self.live_embed_model,
            "documents": self.documents,
            "texts": self.texts,
            "chars": self.chars,
            "estimated_tokens": self.estimated_tokens,
            "batch_size": self.batch_size,
            "batches": self.batches,
            "probe_batch_texts": self.probe_batch_texts,
            "probe_batch_s": self.probe_batch_s,
            "estimated_embed_s": self.estimated_embed_s,
            "writes": "none: no run, version, lock or collection was created",
        }


def estimate_migration(deps: Deps, *, embedder: str, model: str, dim: int | None = None) -> MigrationEstimate:
    """Texts, estimated tokens and time of a migration to `embedder`/`model`, from one probe batch."""
    settings = deps.settings
    # the same checks a migration's plan makes (live consistent, model served, golden set, files readable);
    # reads only: no audit is recorded, no lock is taken
    prepared = prepare(deps, kind=RunKind.MIGRATION, force_full=True, embedder=embedder, model=model, dim=dim)
    plan = prepared.plan
    texts = tokens = chars = 0
    probe: list[str] = []
    for document in iter_corpus(deps.knowledge, max_bytes=settings.max_doc_bytes,
                                default_tenant=settings.default_tenant):
        for chunk in chunk_document(document, chunk_size=settings.chunk_size, overlap=settings.chunk_overlap):
            texts += 1
            chars += len(chunk.text)
            tokens += estimate_tokens(chunk.text)
            if len(probe) < settings.embed_batch_size:
                probe.append(chunk.text)
    client = make_embedder(settings.with_embedder(embedder=embedder, model=model, dim=dim), headers=deps.ollama_headers)
    dimension = client.dimension  # probed first when not given, so the timed batch is one request alone
    started = time.perf_counter()
    if probe:
        client.embed(probe)
    batch_s = time.perf_counter() - started
    batches = math.ceil(texts / settings.embed_batch_size) if texts else 0
    return MigrationEstimate(
        alias=settings.alias, embedder=embedder, embed_model=model, dim=dimension, live_version=plan.base_version,
        live_embed_model=plan.base_embed_model, documents=plan.docs.current, texts=texts, chars=chars,
        estimated_tokens=tokens, batch_size=settings.embed_batch_size, batches=batches, probe_batch_texts=len(probe),
        probe_batch_s=round(batch_s, 4), estimated_embed_s=round(batch_s * batches, 2))


def estimate_human(e: MigrationEstimate) -> str:
    return "\n".join([
        f"migration dry run: {e.embedder}/{e.embed_model} ({e.dim}-d), live v{e.live_version or '-'} "
        f"({e.live_embed_model or '-'})",
        f"texts: {e.texts} from {e.documents} documents, {e.chars} characters, ~{e.estimated_tokens} tokens",
        f"time: one batch of {e.probe_batch_texts} took {e.probe_batch_s} s; {e.batches} batches of "
        f"{e.batch_size} -> ~{e.estimated_embed_s} s of embedding (copying and validation not included)",
        "nothing was written",
    ])
