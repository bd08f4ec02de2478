"""What a version holds twice: warnings of kind `duplicate`, naming both documents, for validation to show.

- **Identical**: a chunk whose text (its hash) is also a chunk of another document, found in SQL over the
  version's manifest (one grouped query on the `(version_id, chunk_hash)` index), for the hashes of the
  documents added or changed against the base version; those between documents unchanged since are carried.
- **Near-identical**: each chunk embedded for this version, of a document added or changed against the version
  it was built on, searched on the version's own collection (one batch request, the vectors read back from it)
  for chunks of other documents at or above `KB_DUPLICATE_COSINE` (calibrated on e5: bench/duplicates.py). A
  routine run embeds a few chunks, so this costs a few searches; a first build checks at most
  `MAX_NEAR_CHECKS` chunks. Near-duplicates the base version's validation found between documents unchanged
  since are carried over, so what live serves keeps its warnings.

Nothing is gated on a duplicate: crowding shows in the golden set's regressions, and this names its cause.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from kb_reindex.domain.validation_model import DUPLICATE, ContentWarning, ValidationResult
from kb_reindex.services.runtime import StepDeps
from kb_reindex.services.state.manifests import ManifestChunk, ManifestDocument
from kb_reindex.services.state.ports import DuplicateReads
from kb_reindex.services.state.versions import VersionRecord

log = logging.getLogger(__name__)

#: at most this many new chunks are searched for near-duplicates in one validation (a first build of a big corpus)
MAX_NEAR_CHECKS = 500
#: nearest points looked at per new chunk (itself and its own document's among them, passed over)
NEIGHBOURS = 6
_BATCH = 256


def duplicate_warnings(deps: StepDeps[DuplicateReads], version: VersionRecord,
                       changes: Sequence[tuple[ManifestDocument, ManifestDocument | None]],
                       baseline: VersionRecord | None) -> tuple[ContentWarning, ...]:
    """Identical and near-identical chunks across the version's documents, one warning per pair of documents
    (on the added or changed one), sorted by document. `changes`: the version's documents that differ from
    the base's, each with the base's of its key (None: added); every document when there is no base."""
    changed = {d.knowledge_key for d, was in changes if was is None or was.content_hash != d.content_hash}
    found: dict[frozenset[str], ContentWarning] = {}
    # what the base version recorded between documents unchanged since stands as it was (the same document named)
    shared = deps.state.shared_chunks(version.id, changed)
    for w in (*carried(deps, version, baseline, changed), *identical(shared, changed),
              *near(deps, version, changed)):
        found.setdefault(frozenset((w.knowledge_key, w.other_key or "")), w)
    return tuple(sorted(found.values(), key=lambda w: (w.knowledge_key, w.other_key or "")))


def identical(chunks: Iterable[ManifestChunk], changed: set[str]) -> list[ContentWarning]:
    """One warning per pair of documents sharing chunks of the same hash: on the changed one of the two (else
    the second by key), naming the first shared chunk of each and how many there are."""
    by_hash: dict[str, list[ManifestChunk]] = {}
    for chunk in chunks:
        by_hash.setdefault(chunk.chunk_hash, []).append(chunk)
    pairs: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for group in by_hash.values():
        firsts: dict[str, ManifestChunk] = {}
        for chunk in group:
            firsts.setdefault(chunk.knowledge_key, chunk)
        keys = sorted(firsts)
        for i, a in enumerate(keys):
            for b in keys[i + 1:]:
                own, other = (a, b) if a in changed and b not in changed else (b, a)
                pairs.setdefault((own, other), []).append((firsts[own].chunk_index, firsts[other].chunk_index))
    warnings = []
    for (own, other), shared in sorted(pairs.items()):
        mine, theirs = min(shared)
        more = f" ({len(shared)} identical chunks)" if len(shared) > 1 else ""
        warnings.append(ContentWarning(kind=DUPLICATE, knowledge_key=own, line=None, other_key=other,
                                       text=f"chunk {mine} is identical to chunk {theirs} of {other}{more}"))
    return warnings


def near(deps: StepDeps[DuplicateReads], version: VersionRecord, changed: set[str]) -> list[ContentWarning]:
    """The chunks embedded for this version of the changed documents, each searched on the version's collection
    for chunks of other documents at or above the threshold: one warning per pair, with its highest cosine."""
    threshold = deps.settings.duplicate_cosine
    new = deps.state.embedded_chunks(version.id, changed) if changed else []
    if len(new) > MAX_NEAR_CHECKS:
        log.info("kb_reindex: v%d: %d new chunks; the near-duplicate check searches the first %d", version.version,
                 len(new), MAX_NEAR_CHECKS)
        new = new[:MAX_NEAR_CHECKS]
    best: dict[frozenset[str], tuple[float, str, str, int, int]] = {}
    for start in range(0, len(new), _BATCH):
        batch = new[start:start + _BATCH]
        records = {str(r.id): r for r in deps.store.retrieve(version.collection, [c.point_id for c in batch],
                                                              vectors=True, payload=False)}
        queries = [(c, records[c.point_id].vector) for c in batch if c.point_id in records]
        answers = deps.store.nearest(version.collection, [_dense(vector) for _, vector in queries],
                                     limit=NEIGHBOURS, score_threshold=threshold)
        for (chunk, _), hits in zip(queries, answers, strict=True):
            for hit in hits:
                payload = hit.payload or {}
                other, score = str(payload.get("knowledge_key")), float(hit.score)
                if other == chunk.knowledge_key:  # itself, or its own document's neighbours
                    continue
                pair = frozenset((chunk.knowledge_key, other))
                if pair not in best or score > best[pair][0]:
                    best[pair] = (score, chunk.knowledge_key, other, chunk.chunk_index,
                                  int(payload.get("chunk_index", -1)))
    return [ContentWarning(kind=DUPLICATE, knowledge_key=own, line=None, other_key=other, score=round(score, 4),
                           text=f"chunk {mine} is nearly identical to chunk {theirs} of {other} (cosine "
                                f"{score:.3f} >= {threshold})")
            for score, own, other, mine, theirs in sorted(best.values(), key=lambda v: (v[1], v[2]))]


def carried(deps: StepDeps[DuplicateReads], version: VersionRecord, baseline: VersionRecord | None,
            changed: set[str]) -> list[ContentWarning]:
    """The base version's duplicates between documents this version did not change: still served, and named as
    they were (the identical ones would be found again; the near ones are not searched again). The documents
    they name are looked up in the version, not its every document read."""
    if baseline is None:
        return []
    recorded = [w for w in ValidationResult.from_dict(baseline.validation or {}).warnings if w.kind == DUPLICATE]
    named = {key for w in recorded for key in (w.knowledge_key, w.other_key) if key is not None}
    held = {d.knowledge_key for d in deps.state.manifest_documents(version.id, keys=named)} if named else set()
    return [w for w in recorded if {w.knowledge_key, w.other_key} <= held - changed]


def _dense(vector: Any) -> list[float]:
    """A point's vector as read back (this engine's collections hold one unnamed dense vector)."""
    if isinstance(vector, dict):  # named vectors: the unnamed one
        vector = vector.get("") or next(iter(vector.values()))
    return [float(x) for x in vector]
