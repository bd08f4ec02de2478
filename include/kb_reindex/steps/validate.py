"""Step 4, validate: nobody sees a version until it is complete, well-formed and answers as well as live.

Structural checks compare Qdrant with the manifest exactly (count and every ID, dimension, distance,
payload and text hash on a sample). The golden set then runs on the candidate and, when live uses the
same model, on live too, so a change that makes answers worse is caught as a regression.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import replace

from kb_reindex.rules.checks import structural_checks
from kb_reindex.rules.collection_setup import finish_bulk_load
from kb_reindex.rules.content_warnings import tenant_changes, warn
from kb_reindex.domain.errors import ConfigError, GoldenSetError, KbError, ValidationFailed
from kb_reindex.steps.golden import (
    GoldenSet,
    category_scores,
    check_probe_keys,
    first_hit_rank,
    invisible_to_tenant,
    load_golden_set,
    paired_comparison,
    probe_categories,
    score,
)
from kb_reindex.domain.lifecycle import BUILDING, READY, may_validate
from kb_reindex.domain.model import VersionStatus
from kb_reindex.steps.duplicates import duplicate_warnings
from kb_reindex.steps.replay import load_replay_gate, replay
from kb_reindex.services.layouts import version_profile
from kb_reindex.services.runtime import Deps
from kb_reindex.services.screen import screen_for
from kb_reindex.services.sources import sha256_text
from kb_reindex.services.state.clock import utcnow
from kb_reindex.services.state.manifests import ManifestDocument
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.domain.validation_model import (
    CategoryScore,
    Check,
    ContentWarning,
    FlaggedLine,
    NoGoldenSet,
    PairedComparison,
    ProbeResult,
    ProbeRun,
    Thresholds,
    ValidationResult,
)

log = logging.getLogger(__name__)


def run_probes(deps: Deps, version: VersionRecord, golden: GoldenSet, *, collection: str | None = None,
               vectors: list[list[float]] | None = None) -> list[ProbeRun]:
    """Rank of each probe's expected document among the top k of `collection` (default: the version's).
    `vectors`: the probes already embedded with this version's model."""
    if vectors is None:
        vectors = embed_probes(deps, version, golden)
    results = []
    # with each probe's tenant, filtered exactly as the reader filters (KnowledgeStore.search), in one request
    answers = deps.store.search_many(collection or version.collection,
                                     [(vector, probe.tenant) for probe, vector in zip(golden.probes, vectors, strict=True)],
                                     k=golden.k)
    for probe, hits in zip(golden.probes, answers, strict=True):
        keys = tuple(str((h.payload or {}).get("knowledge_key")) for h in hits)
        results.append(ProbeRun(probe=probe.id, rank=first_hit_rank(keys, probe.expected), top=keys))
    return results


def golden_fingerprint(golden: GoldenSet) -> str:
    """What decides a version's ranks besides its collection: k and every probe's id, query and answer."""
    text = json.dumps([golden.k, [[p.id, p.query, list(p.expected)] + ([p.tenant] if p.tenant else [])
                                  for p in golden.probes]], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def recorded_ranks(baseline: VersionRecord, golden: GoldenSet, fingerprint: str) -> dict[str, int | None] | None:
    """Live's ranks from its own validation, when that scored the same probes: a promoted collection is
    never written again, so searching it again would give the same answers (and costs a search per probe)."""
    recorded = ValidationResult.from_dict(baseline.validation or {})
    if recorded.probes_fingerprint != fingerprint or recorded.collection != baseline.collection:
        return None
    ranks = {p.probe: p.rank_candidate for p in recorded.probes}
    if any(p.id not in ranks for p in golden.probes):
        return None
    return {p.id: ranks[p.id] for p in golden.probes}


def embed_probes(deps: Deps, version: VersionRecord, golden: GoldenSet) -> list[list[float]]:
    """The probes' query vectors under the version's model: those a validation of its profile embedded before
    from the state DB, the others embedded (the model loaded only then) and kept."""
    queries = [p.query for p in golden.probes]
    digests = [sha256_text(q) for q in queries]
    profile = version_profile(version)
    kept = {d: v for d, v in deps.state.recall_query_vectors(profile, sorted(set(digests))).items()
            if len(v) == version.embed_dim}
    missing = {d: q for q, d in zip(queries, digests, strict=True) if d not in kept}
    if missing:
        fresh = dict(zip(missing, deps.embedder_for(version).embed_queries(list(missing.values())), strict=True))
        deps.state.remember_query_vectors(profile, fresh)
        kept.update(fresh)
    log.info("kb_reindex: golden probes of v%d: %d embedded, %d kept from an earlier validation", version.version,
             len(missing), len(queries) - len(missing))
    return [kept[d] for d in digests]


def validate(
    deps: Deps,
    version_number: int,
    *,
    min_hit_rate: float | None = None,
    min_mrr: float | None = None,
    compare_live: bool = True,
    raise_on_failure: bool = True,
    flagged: list[FlaggedLine] | None = None,
    record: bool = True,
) -> ValidationResult:
    """`flagged`: the instruction-like lines of the files this version was planned from, when the caller
    has them; else those its plan recorded in the snapshot (the knowledge folder is not read).
    `record=False` checks without touching the version's status or record (a shadow re-checked before its
    promotion stays a shadow when it fails)."""
    alias = deps.settings.alias
    version = deps.state.get_version(alias, version_number)
    if version is None:
        raise KbError(f"version {version_number} of {alias} does not exist")
    if version.status == VersionStatus.DELETED:
        raise ConfigError(f"v{version.version} of {alias} was deleted"
                          + (f" at {version.deleted_at:%Y-%m-%d %H:%M:%S} UTC" if version.deleted_at else "")
                          + f": its collection {version.collection} is gone, there is nothing to validate")
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
    if record:
        _record(deps, version, result)
    log.info("kb_reindex: validate v%d: %s (hit rate %s, MRR %s, regressions %d)", version.version,
             "passed" if result.passed else "FAILED", _score(result.hit_rate), _score(result.mrr), result.regressions)
    if not result.passed and raise_on_failure:
        raise ValidationFailed(f"v{version.version} failed validation; the alias was not moved: " + "; ".join(result.failures))
    return result


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _record(deps: Deps, version: VersionRecord, result: ValidationResult) -> None:
    """The result on the version's record; its status too when it was checked as a build (building, a ready
    shadow, or one a rerun resumes: `lifecycle.may_validate`): ready when it passed, failed when not."""
    stored = result.to_dict()
    if not may_validate(version.status, version.failed_step):
        deps.state.update_version(version.id, validation=stored)
    elif result.passed:
        deps.state.transition_version(version.id, from_=[version.status], to=READY, validation=stored)
        try:
            # the scores too: a state DB rebuilt from Qdrant shows them again
            deps.store.annotate(version.collection, {"validated": True, "hit_rate": result.hit_rate,
                                                     "mrr": result.mrr})
        except Exception as exc:  # the state DB has it; only a rebuilt state would miss it
            log.warning("kb_reindex: could not note on %s that it passed validation (%s: %s)",
                        version.collection, type(exc).__name__, exc)
    else:
        deps.state.update_version(version.id, validation=stored)
        deps.state.mark_failed(version.id, step="validate", error="; ".join(result.failures), from_=[version.status])


def _validate(deps: Deps, version: VersionRecord, *, min_hit_rate: float | None, min_mrr: float | None,
              compare_live: bool, flagged: list[FlaggedLine] | None) -> ValidationResult:
    golden = _golden_for(deps, version)
    categories, checks, probed = _inspect(deps, version, golden)
    structural_ok = all(c.passed for c in checks)
    probe_vectors = embed_probes(deps, version, golden) if structural_ok else None
    candidate = run_probes(deps, version, golden, vectors=probe_vectors) if structural_ok else []

    # Live is scored with its own model. Same model: a probe lost against live is a regression. Another
    # model (a migration): the ranks stand side by side, and only the absolute thresholds decide.
    baseline = _baseline(deps, version) if compare_live else None
    same_model = baseline is not None and (baseline.embedder, baseline.embed_model, baseline.embed_dim) == (
        version.embedder, version.embed_model, version.embed_dim)
    probes_fingerprint = golden_fingerprint(golden)
    live_rank = (_live_ranks(deps, baseline, golden, probe_vectors, same_model=same_model,
                             fingerprint=probes_fingerprint) if baseline and structural_ok else {})
    probes = _probe_rows(candidate, golden, live_rank, categories, compared=baseline is not None,
                         same_model=same_model)
    # no golden set (NoGoldenSet): every structural and exact check, no probe scored, and said so
    unprobed = deps.settings.golden_set if not golden.probes and isinstance(deps.settings.golden_set, NoGoldenSet) \
        else None
    hit_rate, mrr = score([p.rank_candidate for p in probes])
    live_hit_rate, live_mrr = score(list(live_rank.values())) if baseline and golden.probes else (None, None)
    regressions = sum(1 for p in probes if p.regression)
    thresholds = Thresholds(min_hit_rate=golden.min_hit_rate if min_hit_rate is None else min_hit_rate,
                            min_mrr=golden.min_mrr if min_mrr is None else min_mrr,
                            max_regressions=golden.max_regressions, max_category_drop=golden.max_category_drop,
                            paired_alpha=golden.paired_alpha)

    failures = [c.line for c in checks if not c.passed]
    by_category, paired, gate_failures = sharper_gates(probes, categories, golden, baseline=baseline,
                                                       same_model=same_model)
    probed_before = {d.knowledge_key: d.tenant
                     for d in deps.state.manifest_documents(baseline.id, keys=probed)} if baseline else {}
    replayed = None
    if structural_ok:
        if unprobed is None:
            failures += _score_failures(probes, hit_rate, mrr, thresholds, baseline)
        failures += gate_failures
        # a probe's document its tenant no longer sees fails whatever max_regressions allows
        failures += invisible_to_tenant(golden, {key: d.tenant for key, d in probed.items()}, was=probed_before,
                                        version=version.version, live_version=baseline.version if baseline else None)
        # real (logged) queries on live and on the candidate: kb_reindex.steps.replay
        replayed, replay_failures = replay(deps, version, baseline, same_model=same_model,
                                           gate=load_replay_gate(deps.settings.golden_set,
                                                                 text=_planned_golden_text(deps, version)))
        failures += replay_failures
    if flagged is None:
        flagged = planned_instruction_lines(deps, version)
    if flagged and deps.settings.instruction_policy == "block":
        named = "; ".join(f"{f['source']}:{f['line']}: {f['text'][:80]}" for f in flagged[:5])
        failures.append(f"{len(flagged)} instruction-like line(s) in the knowledge text (KB_INSTRUCTION_POLICY=block): "
                        f"{named}{'; ...' if len(flagged) > 5 else ''}")
    result = ValidationResult(
        version=version.version, collection=version.collection, passed=not failures, failures=tuple(failures),
        checks=tuple(checks), k=golden.k, thresholds=thresholds,
        hit_rate=None if unprobed else round(hit_rate, 4), mrr=None if unprobed else round(mrr, 4),
        regressions=regressions,
        live_version=baseline.version if baseline else None,
        live_embed_model=baseline.embed_model if baseline else None,
        live_embedder=baseline.embedder if baseline else None,
        live_embed_dim=baseline.embed_dim if baseline else None,
        compared_as="regression" if same_model else ("side_by_side" if baseline else None),
        live_hit_rate=None if live_hit_rate is None else round(live_hit_rate, 4),
        live_mrr=None if live_mrr is None else round(live_mrr, 4),
        probes=probes, by_category=tuple(by_category), paired=paired, probes_fingerprint=probes_fingerprint,
        flagged_instructions=tuple(flagged), replay=replayed,
        screen=screen_for(deps.settings.instruction_screen, version.embedder).to_dict(),
        warnings=warn(deps.settings.alias, (content_checks(deps, version, baseline) if structural_ok else ())
                      + ((unprobed.warning(),) if unprobed else ())),
    )
    return _with_reports(deps, version, result)


def content_checks(deps: Deps, version: VersionRecord, baseline: VersionRecord | None
                   ) -> tuple[ContentWarning, ...]:
    """What a person should see before this version serves and no gate decides: documents whose tenant
    changed against the version it was built on, and duplicates (kb_reindex.steps.duplicates). Only the
    documents that differ from the base are read (all of them when there is none to compare with)."""
    changes = (deps.state.documents_changed(version.id, baseline.id) if baseline else
               [(d, None) for d in deps.state.manifest_documents(version.id)])
    return (tenant_changes(changes, base_version=baseline.version if baseline else None)
            + duplicate_warnings(deps, version, changes, baseline))


def _inspect(deps: Deps, version: VersionRecord, golden: GoldenSet
             ) -> tuple[dict[str, str], list[Check], dict[str, ManifestDocument]]:
    """(each probe's category, the structural checks, the documents the probes expect, by key): the golden set
    checked against the version's manifest first, so a probe naming a missing document fails by name rather
    than as a miss. Only the probes' documents are read, not the version's every document."""
    probed = {d.knowledge_key: d for d in deps.state.manifest_documents(
        version.id, keys={key for p in golden.probes for key in p.expected})}
    check_probe_keys(golden, set(probed))
    categories = probe_categories(golden, {key: d.category for key, d in probed.items()})
    return categories, structural_checks(deps, version), probed


def _baseline(deps: Deps, version: VersionRecord) -> VersionRecord | None:
    """The version this one was planned against, when it is still there to compare with."""
    if version.base_version is None:
        return None
    base = deps.state.get_version(version.alias, version.base_version)
    if base and base.status not in (VersionStatus.DELETED, VersionStatus.FAILED) and deps.store.exists(base.collection):
        return base
    return None


def _live_ranks(deps: Deps, baseline: VersionRecord, golden: GoldenSet, probe_vectors: list[list[float]] | None, *,
                same_model: bool, fingerprint: str) -> dict[str, int | None]:
    """Live's rank of each probe: from its own validation when that scored the same probes (and, same model,
    one search shows its answers have not drifted), else searched again."""
    live_rank = recorded_ranks(baseline, golden, fingerprint)
    if live_rank is not None and same_model and probe_vectors and golden.probes:
        # one search with today's vectors: if the model's answers drifted since live was scored
        # (e.g. new weights under the same tag), the record no longer compares like with like
        first = golden.probes[0]
        hits = deps.store.search(baseline.collection, probe_vectors[0], k=golden.k, tenant=first.tenant)
        if first_hit_rank([str((h.payload or {}).get("knowledge_key")) for h in hits], first.expected) != live_rank[first.id]:
            live_rank = None
    if live_rank is None:
        live_results = run_probes(deps, baseline, golden, vectors=probe_vectors if same_model else None)
        live_rank = {r.probe: r.rank for r in live_results}
    return live_rank


def _probe_rows(candidate: list[ProbeRun], golden: GoldenSet, live_rank: dict[str, int | None],
                categories: dict[str, str], *, compared: bool, same_model: bool) -> tuple[ProbeResult, ...]:
    """Each probe on the candidate beside live; a probe live found and the candidate lost is a regression
    when both use the same model."""
    by_id = {p.id: p for p in golden.probes}
    rows = []
    for r in candidate:
        on_live = live_rank.get(r.probe) if compared else None
        rows.append(ProbeResult(
            probe=r.probe, query=by_id[r.probe].query, expected=",".join(by_id[r.probe].expected),
            rank_live=on_live, rank_candidate=r.rank, hit=r.rank is not None,
            regression=same_model and on_live is not None and r.rank is None, top=",".join(r.top),
            category=categories.get(r.probe, "(none)"),
        ))
    return tuple(rows)


def _score_failures(probes: Sequence[ProbeResult], hit_rate: float, mrr: float, thresholds: Thresholds,
                    baseline: VersionRecord | None) -> list[str]:
    """The absolute thresholds and the regression count."""
    failures = []
    if hit_rate < thresholds.min_hit_rate:
        failures.append(f"hit rate {hit_rate:.3f} < {thresholds.min_hit_rate}")
    if mrr < thresholds.min_mrr:
        failures.append(f"MRR {mrr:.3f} < {thresholds.min_mrr}")
    lost = [p.probe for p in probes if p.regression]
    if len(lost) > thresholds.max_regressions:
        failures.append(f"{len(lost)} regression(s) against live v{baseline.version if baseline else '?'} "
                        f"(max {thresholds.max_regressions}): {', '.join(lost)}")
    return failures


def _with_reports(deps: Deps, version: VersionRecord, result: ValidationResult) -> ValidationResult:
    """The reports written (Markdown and CSV, then HTML with the scores of every version) and named in the result."""
    # pandas: loaded only by a command that writes reports
    from kb_reindex.steps.reports import ReportKind, write_html_report, write_validation_report

    kind = ReportKind()
    if version.status not in (VersionStatus.BUILDING, VersionStatus.FAILED):
        # a kept version checked again: a report of its own, never over the promotion report of its build
        live = deps.state.live_version(version.alias)
        kind = ReportKind.on_demand(utcnow(), live.version if live else None)
    result = replace(result, report=str(write_validation_report(deps.settings.reports_dir, version, result, kind)))
    history = [{"version": v.version, "hit_rate": (v.validation or {}).get("hit_rate"), "mrr": (v.validation or {}).get("mrr")}
               for v in deps.state.list_versions(version.alias) if v.id != version.id]
    history.append({"version": version.version, "hit_rate": result.hit_rate, "mrr": result.mrr})
    return replace(result, report_html=str(write_html_report(deps.settings.reports_dir, version, result, history,
                                                             kind)))


def sharper_gates(probes: Sequence[ProbeResult], categories: dict[str, str], golden: GoldenSet, *,
                  baseline: VersionRecord | None, same_model: bool
                  ) -> tuple[list[CategoryScore], PairedComparison | None, list[str]]:
    """(`by_category`, `paired`, failures). Both compare with live; they gate only a like-for-like
    comparison (same model), as the regression count does: across models only the absolute thresholds
    decide, and these are reported beside them. A category gate catches a loss the totals average away;
    the paired test fails a candidate only when it is worse than live beyond what chance explains."""
    by_category = category_scores(probes, categories, compare=baseline is not None,
                                  max_drop=golden.max_category_drop)
    paired = paired_comparison(probes, alpha=golden.paired_alpha) if baseline is not None and probes else None
    failures: list[str] = []
    if same_model and baseline is not None:
        for row in by_category:
            if row.dropped:
                failures.append(
                    f"category {row.category}: hit rate {row.hit_rate:.3f} fell {row.hit_rate_drop:.3f} below "
                    f"live v{baseline.version}'s {row.live_hit_rate:.3f} (max_category_drop {golden.max_category_drop}; "
                    f"lost: {', '.join(row.lost) or '-'})")
        if paired and paired.significant_worse:
            failures.append(
                f"paired sign test: {paired.worse} probe(s) ranked worse than on live v{baseline.version}, "
                f"{paired.better} better (p={paired.p_worse:.4f} < paired_alpha {golden.paired_alpha})")
    return by_category, paired, failures


def _golden_for(deps: Deps, version: VersionRecord) -> GoldenSet:
    """A version being built is scored with the golden set its plan checked (recorded in the snapshot: the
    build's tasks read no knowledge file); a kept version re-checked later (rollback, shadow promotion,
    `kb-reindex validate` of a ready one) with today's file."""
    return load_golden_set(deps.settings.golden_set, text=_planned_golden_text(deps, version))


def _planned_golden_text(deps: Deps, version: VersionRecord) -> str | None:
    """The golden file as the plan of a version being built recorded it; None: read today's file."""
    if version.status in (VersionStatus.BUILDING, VersionStatus.FAILED):
        snapshot = deps.state.snapshot(version.id)
        if snapshot is not None and snapshot.golden is not None:
            return snapshot.golden
    return None


def planned_instruction_lines(deps: Deps, version: VersionRecord) -> list[FlaggedLine]:
    """The instruction-like lines of the files this version was planned from, as its plan recorded them:
    no step after the plan reads the knowledge folder (a rollback's target is judged by its own files)."""
    snapshot = deps.state.snapshot(version.id)
    if snapshot is None:
        log.warning("kb_reindex: v%d was planned before plans recorded instruction-like lines; none are reported",
                    version.version)
        return []
    return snapshot.flagged
