"""Step 4, validate: nobody sees a version until it is complete, well-formed and answers as well as live.

Structural checks compare Qdrant with the manifest exactly (count and every ID, dimension, distance,
payload and text hash on a sample). The golden set then runs on the candidate and, when live uses the
same model, on live too, so a change that makes answers worse is caught as a regression.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from kb_reindex.checks import structural_checks
from kb_reindex.errors import ConfigError, GoldenSetError, KbError, ValidationFailed
from kb_reindex.golden import (
    GoldenSet,
    category_scores,
    check_probe_keys,
    first_hit_rank,
    load_golden_set,
    paired_comparison,
    probe_categories,
    score,
)
from kb_reindex.lifecycle import BUILDING, READY, may_validate
from kb_reindex.runtime import Deps
from kb_reindex.state import VersionRecord

log = logging.getLogger(__name__)



def run_probes(deps: Deps, version: VersionRecord, golden: GoldenSet, *, collection: str | None = None,
               vectors: list[list[float]] | None = None) -> list[dict[str, Any]]:
    """Rank of each probe's expected document among the top k of `collection` (default: the version's).
    `vectors`: the probes already embedded with this version's model."""
    if vectors is None:
        vectors = embed_probes(deps, version, golden)
    results = []
    for probe, vector in zip(golden.probes, vectors, strict=True):
        hits = deps.store.search(collection or version.collection, vector, k=golden.k)
        keys = [str((h.payload or {}).get("knowledge_key")) for h in hits]
        results.append({"probe": probe.id, "rank": first_hit_rank(keys, probe.expected), "top": keys})
    return results


def golden_fingerprint(golden: GoldenSet) -> str:
    """What decides a version's ranks besides its collection: k and every probe's id, query and answer."""
    text = json.dumps([golden.k, [[p.id, p.query, list(p.expected)] for p in golden.probes]], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def recorded_ranks(baseline: VersionRecord, golden: GoldenSet, fingerprint: str) -> dict[str, int | None] | None:
    """Live's ranks from its own validation, when that scored the same probes: a promoted collection is
    never written again, so searching it again would give the same answers (and costs a search per probe)."""
    recorded = baseline.validation or {}
    if recorded.get("probes_fingerprint") != fingerprint or recorded.get("collection") != baseline.collection:
        return None
    ranks = {p["probe"]: p["rank_candidate"] for p in recorded.get("probes") or []}
    if any(p.id not in ranks for p in golden.probes):
        return None
    return {p.id: ranks[p.id] for p in golden.probes}


def embed_probes(deps: Deps, version: VersionRecord, golden: GoldenSet) -> list[list[float]]:
    return deps.embedder_for(version).embed_queries([p.query for p in golden.probes])


def validate(
    deps: Deps,
    version_number: int,
    *,
    min_hit_rate: float | None = None,
    min_mrr: float | None = None,
    compare_live: bool = True,
    raise_on_failure: bool = True,
    flagged: list[dict[str, Any]] | None = None,
    record: bool = True,
) -> dict[str, Any]:
    """`flagged`: the instruction-like lines of the files this version was planned from, when the caller
    has them; else those its plan recorded in the snapshot (the knowledge folder is not read).
    `record=False` checks without touching the version's status or record (a shadow re-checked before its
    promotion stays a shadow when it fails)."""
    alias = deps.settings.alias
    version = deps.state.get_version(alias, version_number)
    if version is None:
        raise KbError(f"version {version_number} of {alias} does not exist")
    if version.status == "deleted":
        raise ConfigError(f"v{version.version} of {alias} was deleted"
                          + (f" at {version.deleted_at:%Y-%m-%d %H:%M:%S} UTC" if version.deleted_at else "")
                          + f": its collection {version.collection} is gone, there is nothing to validate")
    from kb_reindex.collection_setup import finish_bulk_load

    try:
        finish_bulk_load(deps, version)
    except KbError as exc:
        if version.status == BUILDING:  # a kept version re-checked while Qdrant re-indexes it stays as it is
            deps.state.mark_failed(version.id, step="validate", error=str(exc), from_=[BUILDING])
        raise
    try:
        result = _validate(deps, version, min_hit_rate=min_hit_rate, min_mrr=min_mrr, compare_live=compare_live,
                           flagged=flagged)
    except GoldenSetError as exc:
        if record and version.status in (BUILDING, READY):
            deps.state.mark_failed(version.id, step="validate", error=str(exc), from_=[version.status])
        raise ValidationFailed(f"v{version.version} not validated: {exc}") from None
    if not record:
        pass
    elif may_validate(version.status, version.failed_step):
        if result["passed"]:
            deps.state.transition_version(version.id, from_=[version.status], to=READY, validation=result)
            try:
                # the scores too: a state DB rebuilt from Qdrant shows them again
                deps.store.annotate(version.collection, {"validated": True, "hit_rate": result["hit_rate"],
                                                         "mrr": result["mrr"]})
            except Exception as exc:  # the state DB has it; only a rebuilt state would miss it
                log.warning("kb_reindex: could not note on %s that it passed validation (%s: %s)",
                            version.collection, type(exc).__name__, exc)
        else:
            deps.state.update_version(version.id, validation=result)
            deps.state.mark_failed(version.id, step="validate", error="; ".join(result["failures"]),
                                   from_=[version.status])
    else:
        deps.state.update_version(version.id, validation=result)
    log.info("kb_reindex: validate v%d: %s (hit rate %.3f, MRR %.3f, regressions %d)", version.version,
             "passed" if result["passed"] else "FAILED", result["hit_rate"], result["mrr"], result["regressions"])
    if not result["passed"] and raise_on_failure:
        raise ValidationFailed(f"v{version.version} failed validation; the alias was not moved: " + "; ".join(result["failures"]))
    return result


def _validate(deps: Deps, version: VersionRecord, *, min_hit_rate: float | None, min_mrr: float | None,
              compare_live: bool, flagged: list[dict[str, Any]] | None) -> dict[str, Any]:
    golden = _golden_for(deps, version)
    manifest = deps.state.manifest_refs(version.id)
    documents = deps.state.manifest_documents(version.id)
    check_probe_keys(golden, {d["knowledge_key"] for d in documents})
    categories = probe_categories(golden, {d["knowledge_key"]: d["category"] for d in documents})
    del documents
    checks = structural_checks(deps, version, manifest)
    del manifest
    structural_ok = all(c["passed"] for c in checks)
    probe_vectors = embed_probes(deps, version, golden) if structural_ok else None
    candidate = run_probes(deps, version, golden, vectors=probe_vectors) if structural_ok else []

    # Live is scored with its own model. Same model: a probe lost against live is a regression. Another
    # model (a migration): the ranks stand side by side, and only the absolute thresholds decide.
    baseline: VersionRecord | None = None
    if compare_live and version.base_version is not None:
        base = deps.state.get_version(version.alias, version.base_version)
        if base and base.status not in ("deleted", "failed") and deps.store.exists(base.collection):
            baseline = base
    same_model = baseline is not None and (baseline.embedder, baseline.embed_model, baseline.embed_dim) == (
        version.embedder, version.embed_model, version.embed_dim)
    probes_fingerprint = golden_fingerprint(golden)
    live_rank = recorded_ranks(baseline, golden, probes_fingerprint) if baseline and structural_ok else None
    if baseline is not None and live_rank is not None and same_model and probe_vectors and golden.probes:
        # one search with today's vectors: if the model's answers drifted since live was scored
        # (e.g. new weights under the same tag), the record no longer compares like with like
        first = golden.probes[0]
        hits = deps.store.search(baseline.collection, probe_vectors[0], k=golden.k)
        if first_hit_rank([str((h.payload or {}).get("knowledge_key")) for h in hits], first.expected) != live_rank[first.id]:
            live_rank = None
    if live_rank is None:
        live_results = (run_probes(deps, baseline, golden, vectors=probe_vectors if same_model else None)
                        if baseline and structural_ok else [])
        live_rank = {r["probe"]: r["rank"] for r in live_results}

    probes = []
    by_id = {p.id: p for p in golden.probes}
    for r in candidate:
        on_live = live_rank.get(r["probe"]) if baseline else None
        probes.append({
            "probe": r["probe"],
            "query": by_id[r["probe"]].query,
            "expected": ",".join(by_id[r["probe"]].expected),
            "rank_live": on_live,
            "rank_candidate": r["rank"],
            "hit": r["rank"] is not None,
            "regression": same_model and on_live is not None and r["rank"] is None,
            "top": ",".join(r["top"]),
        })
    hit_rate, mrr = score([p["rank_candidate"] for p in probes])
    live_hit_rate, live_mrr = score(list(live_rank.values())) if baseline else (None, None)
    regressions = sum(1 for p in probes if p["regression"])
    need_hit = golden.min_hit_rate if min_hit_rate is None else min_hit_rate
    need_mrr = golden.min_mrr if min_mrr is None else min_mrr

    failures = [f"{c['check']}: {c['detail']}" for c in checks if not c["passed"]]
    if structural_ok:
        if hit_rate < need_hit:
            failures.append(f"hit rate {hit_rate:.3f} < {need_hit}")
        if mrr < need_mrr:
            failures.append(f"MRR {mrr:.3f} < {need_mrr}")
        if regressions > golden.max_regressions:
            lost = [p["probe"] for p in probes if p["regression"]]
            failures.append(f"{regressions} regression(s) against live v{baseline.version if baseline else '?'} "
                            f"(max {golden.max_regressions}): {', '.join(lost)}")
    by_category, paired, gate_failures = sharper_gates(probes, categories, golden, baseline=baseline,
                                                       same_model=same_model)
    if structural_ok:
        failures += gate_failures
    # real (logged) queries on live and on the candidate: kb_reindex.replay
    replayed = None
    if structural_ok:
        from kb_reindex.replay import load_replay_gate, replay

        replayed, replay_failures = replay(deps, version, baseline, same_model=same_model,
                                           gate=load_replay_gate(deps.settings.golden_set,
                                                                 text=_planned_golden_text(deps, version)))
        failures += replay_failures
    if flagged is None:
        flagged = planned_instruction_lines(deps, version)
    if flagged and deps.settings.block_on_instructions:
        failures.append(f"{len(flagged)} instruction-like line(s) in the knowledge text (KB_BLOCK_ON_INSTRUCTIONS); "
                        f"first: {flagged[0]['source']}:{flagged[0]['line']}")
    result = {
        "version": version.version,
        "collection": version.collection,
        "passed": not failures,
        "failures": failures,
        "checks": checks,
        "k": golden.k,
        "thresholds": {"min_hit_rate": need_hit, "min_mrr": need_mrr, "max_regressions": golden.max_regressions,
                       "max_category_drop": golden.max_category_drop, "paired_alpha": golden.paired_alpha},
        "hit_rate": round(hit_rate, 4),
        "mrr": round(mrr, 4),
        "regressions": regressions,
        "live_version": baseline.version if baseline else None,
        "live_embed_model": baseline.embed_model if baseline else None,
        "live_embedder": baseline.embedder if baseline else None,
        "live_embed_dim": baseline.embed_dim if baseline else None,
        "compared_as": "regression" if same_model else ("side_by_side" if baseline else None),
        "live_hit_rate": None if live_hit_rate is None else round(live_hit_rate, 4),
        "live_mrr": None if live_mrr is None else round(live_mrr, 4),
        "probes": probes,
        "by_category": by_category,
        "paired": paired,
        "probes_fingerprint": probes_fingerprint,
        "flagged_instructions": flagged,
        "replay": replayed,
    }
    from kb_reindex.reports import write_html_report, write_validation_report

    result["report"] = str(write_validation_report(deps.settings.reports_dir, version, result))
    history = [{"version": v.version, "hit_rate": (v.validation or {}).get("hit_rate"), "mrr": (v.validation or {}).get("mrr")}
               for v in deps.state.list_versions(version.alias) if v.id != version.id]
    history.append({"version": version.version, "hit_rate": result["hit_rate"], "mrr": result["mrr"]})
    result["report_html"] = str(write_html_report(deps.settings.reports_dir, version, result, history))
    return result


def sharper_gates(probes: list[dict[str, Any]], categories: dict[str, str], golden: GoldenSet, *,
                  baseline: VersionRecord | None, same_model: bool
                  ) -> tuple[list[dict[str, Any]], dict[str, Any] | None, list[str]]:
    """(`by_category`, `paired`, failures). Both compare with live; they gate only a like-for-like
    comparison (same model), as the regression count does: across models only the absolute thresholds
    decide, and these are reported beside them. A category gate catches a loss the totals average away;
    the paired test fails a candidate only when it is worse than live beyond what chance explains."""
    for p in probes:
        p["category"] = categories.get(p["probe"], "(none)")
    by_category = category_scores(probes, categories, compare=baseline is not None,
                                  max_drop=golden.max_category_drop)
    paired = paired_comparison(probes, alpha=golden.paired_alpha) if baseline is not None and probes else None
    failures: list[str] = []
    if same_model and baseline is not None:
        for row in by_category:
            if row["dropped"]:
                failures.append(
                    f"category {row['category']}: hit rate {row['hit_rate']:.3f} fell {row['hit_rate_drop']:.3f} below "
                    f"live v{baseline.version}'s {row['live_hit_rate']:.3f} (max_category_drop {golden.max_category_drop}; "
                    f"lost: {', '.join(row['lost']) or '-'})")
        if paired and paired["significant_worse"]:
            failures.append(
                f"paired sign test: {paired['worse']} probe(s) ranked worse than on live v{baseline.version}, "
                f"{paired['better']} better (p={paired['p_worse']:.4f} < paired_alpha {golden.paired_alpha})")
    return by_category, paired, failures


def _golden_for(deps: Deps, version: VersionRecord) -> GoldenSet:
    """A version being built is scored with the golden set its plan checked (recorded in the snapshot: the
    build's tasks read no knowledge file); a kept version re-checked later (rollback, shadow promotion,
    `kb-reindex validate` of a ready one) with today's file."""
    return load_golden_set(deps.settings.golden_set, text=_planned_golden_text(deps, version))


def _planned_golden_text(deps: Deps, version: VersionRecord) -> str | None:
    """The golden file as the plan of a version being built recorded it; None: read today's file."""
    if version.status in ("building", "failed"):
        snapshot = deps.state.snapshot(version.id)
        if snapshot is not None and snapshot.get("golden") is not None:
            return snapshot["golden"]
    return None


def planned_instruction_lines(deps: Deps, version: VersionRecord) -> list[dict[str, Any]]:
    """The instruction-like lines of the files this version was planned from, as its plan recorded them:
    no step after the plan reads the knowledge folder (a rollback's target is judged by its own files)."""
    snapshot = deps.state.snapshot(version.id)
    if snapshot is None:
        log.warning("kb_reindex: v%d was planned before plans recorded instruction-like lines; none are reported",
                    version.version)
        return []
    return snapshot["flagged"]
