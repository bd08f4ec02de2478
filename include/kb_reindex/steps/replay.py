"""Replay before promotion: the newest logged real queries, run on live and on the candidate.

Why: the golden set can pass while a corpus edit breaks what customers actually ask (a new page that
crowds an unchanged answer out of the top k, a tenant's documents gone). The last `KB_REPLAY_QUERIES`
queries of the query log (`kb_reindex.steps.querylog`) are searched on both; per query the report gives the
top-k overlap and where live's top hit now ranks, in total the empty-result rate on each side.

The gate (thresholds in the golden set file under `replay:`), for a candidate of the live model:
- its empty-result rate may not exceed live's (by more than `max_empty_increase`);
- of the queries whose live top hit is a document this run did not change, at most the share
  `max_lost_top_hits` may lose it from the top k (a changed document may rightly move).
A migration (another model) is replayed and reported side by side, not gated: its ranks differ by design.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from kb_reindex.steps import querylog
from kb_reindex.services.embedding import batched
from kb_reindex.domain.errors import GoldenSetError
from kb_reindex.steps.golden import first_hit_rank
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.domain.validation_model import NoGoldenSet, ReplayQuery, ReplayReport
from kb_reindex.services.yaml_input import load_yaml

log = logging.getLogger(__name__)

#: rows of the per-query table kept in the validation record and the report (the worst first)
PER_QUERY_KEPT = 200


@dataclass(frozen=True)
class ReplayGate:
    """`replay:` in the golden set file."""

    max_lost_top_hits: float = 0.05  # share of queries (live top hit unchanged) that may lose it from the top k
    max_empty_increase: float = 0.0  # candidate's empty-result rate may exceed live's by this much
    watch_min_queries: int = 20  # queries answered since promotion before the watch judges their empty rate


def load_replay_gate(path: Path | NoGoldenSet, *, text: str | None = None) -> ReplayGate:
    """The `replay:` thresholds, each checked with an error naming the file and the field. `text`: the
    file's content as a plan recorded it (a build's validation reads no file). No golden set: the defaults."""
    if isinstance(path, NoGoldenSet):
        return ReplayGate()
    where = str(path)
    try:
        data = load_yaml(path.read_text(encoding="utf-8") if text is None else text, where=where,
                         error=GoldenSetError)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise GoldenSetError(f"{where}: cannot read the replay thresholds: {exc}") from None
    raw = data.get("replay") if isinstance(data, dict) else None
    if raw is None:
        return ReplayGate()
    if not isinstance(raw, dict):
        raise GoldenSetError(f"{where}: 'replay' must be a mapping of thresholds, got {raw!r}")
    known = set(ReplayGate.__dataclass_fields__)
    if unknown := sorted(set(raw) - known):
        raise GoldenSetError(f"{where}: 'replay' has unknown field(s) {', '.join(map(str, unknown))}; "
                             f"known: {', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    for name in ("max_lost_top_hits", "max_empty_increase"):
        if name in raw:
            value = raw[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
                raise GoldenSetError(f"{where}: 'replay.{name}' must be a number from 0 to 1, got {value!r}")
            values[name] = float(value)
    if "watch_min_queries" in raw:
        value = raw["watch_min_queries"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GoldenSetError(f"{where}: 'replay.watch_min_queries' must be a whole number of at least 1, "
                                 f"got {value!r}")
        values["watch_min_queries"] = value
    return ReplayGate(**values)


def changed_documents(deps: Deps, version: VersionRecord, baseline: VersionRecord) -> set[str]:
    """Documents added, edited or removed between live and the candidate, from their manifests."""
    candidate = deps.state.manifest_document_hashes(version.id)
    live = deps.state.manifest_document_hashes(baseline.id)
    return {key for key in candidate.keys() | live.keys() if candidate.get(key) != live.get(key)}


def _embed(deps: Deps, version: VersionRecord, texts: list[str]) -> list[list[float]]:
    embedder = deps.embedder_for(version)
    vectors: list[list[float]] = []
    for batch in batched(texts, deps.settings.embed_batch_size):
        vectors.extend(embedder.embed_queries(list(batch)))
    return vectors


def _keys(hits: list[Any]) -> list[str]:
    return [str((h.payload or {}).get("knowledge_key")) for h in hits]


def _share(count: int, total: int) -> float | None:
    return round(count / total, 4) if total else None


def replay(deps: Deps, version: VersionRecord, baseline: VersionRecord | None, *, same_model: bool,
           gate: ReplayGate | None = None) -> tuple[ReplayReport, list[str]]:
    """(report, gate failures). Skipped, and said so, without a live version or without logged queries."""
    settings = deps.settings
    if settings.replay_queries == 0:
        return ReplayReport(skipped="KB_REPLAY_QUERIES=0"), []
    if baseline is None:
        return ReplayReport(skipped="no live version to replay against (a first version, or not compared with live)"), []
    gate = gate or load_replay_gate(settings.golden_set)
    rows = querylog.recent(deps.state, settings.alias, limit=settings.replay_queries)
    if not rows:
        return ReplayReport(skipped="no logged queries (KB_QUERY_LOG is off, or nothing was asked yet)"), []
    rows.reverse()  # oldest first, as they were asked
    texts = sorted({r.query for r in rows})
    candidate_vectors = dict(zip(texts, _embed(deps, version, texts), strict=True))
    live_vectors = candidate_vectors if same_model else dict(zip(texts, _embed(deps, baseline, texts), strict=True))
    changed = changed_documents(deps, version, baseline)

    per_query = []
    for row in rows:
        k, tenant, text = row.k, row.tenant, row.query
        on_live = _keys(deps.store.search(baseline.collection, live_vectors[text], k=k, tenant=tenant))
        on_candidate = _keys(deps.store.search(version.collection, candidate_vectors[text], k=k, tenant=tenant))
        top = on_live[0] if on_live else None
        rank = first_hit_rank(on_candidate, [top]) if top is not None else None
        per_query.append(ReplayQuery(
            log_id=row.id, query=text, tenant=tenant, k=k,
            overlap=round(len(set(on_live) & set(on_candidate)) / len(set(on_live)), 4) if on_live else None,
            live_top=top, top_changed=top in changed if top is not None else None,
            rank_candidate=rank,
            # 0: still first; n: n places lower; None: gone from the top k (or live had no hit)
            rank_change=(rank - 1) if rank is not None else None,
            lost_top_hit=top is not None and rank is None,
            empty_live=not on_live, empty_candidate=not on_candidate,
            live=",".join(on_live), candidate=",".join(on_candidate),
        ))
    total = len(per_query)
    overlaps = [q.overlap for q in per_query if q.overlap is not None]
    eligible = [q for q in per_query if q.live_top is not None and not q.top_changed]
    lost = [q for q in eligible if q.lost_top_hit]
    empty_live = sum(q.empty_live for q in per_query) / total
    empty_candidate = sum(q.empty_candidate for q in per_query) / total
    failures: list[str] = []
    if same_model:
        if empty_candidate > empty_live + gate.max_empty_increase + 1e-9:
            failures.append(f"replay: empty-result rate {empty_candidate:.3f} on the candidate > {empty_live:.3f} on "
                            f"live v{baseline.version} (+{gate.max_empty_increase} allowed) over {total} logged queries")
        if eligible and len(lost) / len(eligible) > gate.max_lost_top_hits + 1e-9:
            docs = sorted({str(q.live_top) for q in lost})
            failures.append(
                f"replay: {len(lost)} of {len(eligible)} logged queries lost live's top hit, a document this run did "
                f"not change (share {len(lost) / len(eligible):.3f} > replay.max_lost_top_hits "
                f"{gate.max_lost_top_hits}): {', '.join(docs[:5])}" + (" ..." if len(docs) > 5 else ""))
    # the worst first: lost top hits, then the lowest overlap
    per_query.sort(key=lambda q: (not q.lost_top_hit, q.overlap if q.overlap is not None else 2.0))
    report = ReplayReport(
        queries=total,
        mean_overlap=round(sum(overlaps) / len(overlaps), 4) if overlaps else None,
        empty_live=round(empty_live, 4),
        empty_candidate=round(empty_candidate, 4),
        lost_top_hits=len(lost),
        lost_top_hits_any=sum(1 for q in per_query if q.lost_top_hit),
        unchanged_top_hits=len(eligible),
        lost_share=_share(len(lost), len(eligible)),
        changed_documents=len(changed),
        live_version=baseline.version,
        gated=same_model,
        passed=not failures,
        thresholds=asdict(gate),
        per_query=tuple(per_query[:PER_QUERY_KEPT]),
    )
    log.info("kb_reindex: replay of %d logged queries on v%d vs live v%d: mean overlap %s, empty %.3f -> %.3f, "
             "%d lost top hit(s) on unchanged documents%s", total, version.version, baseline.version,
             report.mean_overlap, empty_live, empty_candidate, len(lost), "" if same_model else " (not gated)")
    return report, failures
