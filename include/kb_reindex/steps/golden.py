"""The golden set: customer questions with the documents that answer them, and the scores over them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import comb
from pathlib import Path
from typing import Any

import yaml

from kb_reindex.rules.content_loss import DEFAULT_MAX_DOCS_REMOVED, DEFAULT_MAX_SHRINK
from kb_reindex.domain.errors import GoldenSetError, GoldenSetMissing
from kb_reindex.services.yaml_input import load_yaml
from kb_reindex.domain.validation_model import CategoryScore, NoGoldenSet, PairedComparison, ProbeResult


@dataclass(frozen=True)
class Probe:
    id: str
    query: str
    expected: tuple[str, ...]
    category: str | None = None  # None: the category of its first expected document
    #: the tenant the caller passes: scored with that tenant's filter, as the reader applies it (None: no filter)
    tenant: str | None = None


@dataclass(frozen=True)
class GoldenSet:
    k: int
    min_hit_rate: float
    min_mrr: float
    max_regressions: int
    probes: tuple[Probe, ...]
    max_category_drop: float = 0.2
    paired_alpha: float = 0.05
    #: content loss held for a person (kb_reindex.rules.content_loss)
    max_docs_removed: int = DEFAULT_MAX_DOCS_REMOVED
    max_shrink: float = DEFAULT_MAX_SHRINK


class _Problems:
    """The golden set's problems, every one found before any is raised: one run shows them all."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.found: list[str] = []

    def add(self, problem: str) -> None:
        self.found.append(problem)

    def raise_any(self) -> None:
        if len(self.found) == 1:
            raise GoldenSetError(f"{self.where}: {self.found[0]}")
        if self.found:
            shown = "; ".join(self.found[:20]) + (f"; and {len(self.found) - 20} more" if len(self.found) > 20 else "")
            raise GoldenSetError(f"{self.where}: {len(self.found)} problems: {shown}")


def _fraction(data: dict[str, Any], name: str, default: float, problems: _Problems) -> float:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        problems.add(f"'{name}' must be a number from 0 to 1, got {_short(value)}")
        return default
    return float(value)


def _whole(data: dict[str, Any], name: str, default: int, least: int, problems: _Problems) -> int:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        problems.add(f"'{name}' must be a whole number of at least {least}, got {_short(value)}")
        return default
    return value


def _short(value: Any, limit: int = 80) -> str:
    shown = repr(value)
    return shown if len(shown) <= limit else f"{shown[:limit - 12]}... ({len(shown):,} characters)"


def no_probes() -> GoldenSet:
    """The golden set of a knowledge base that has none (`NoGoldenSet`): no probe, every threshold its default
    (content loss is still held for a person by `max_docs_removed` and `max_shrink`)."""
    return GoldenSet(k=4, min_hit_rate=0.9, min_mrr=0.7, max_regressions=0, probes=())


def load_golden_set(path: Path | NoGoldenSet, *, text: str | None = None) -> GoldenSet:
    """`text`: the file's content as a plan recorded it (validation then needs no file); `path` names it.
    Every problem of the file is named in one error. `NoGoldenSet`: `no_probes()`."""
    if isinstance(path, NoGoldenSet):
        return no_probes()
    where = str(path)
    if text is None and not path.is_file():
        raise GoldenSetMissing(f"golden set {where} does not exist (KB_GOLDEN_SET): set KB_GOLDEN_SET to the golden "
                               "set file, or restore it")
    try:
        data = load_yaml(path.read_text(encoding="utf-8") if text is None else text, where=where,
                         error=GoldenSetError)
    except UnicodeDecodeError:
        raise GoldenSetError(f"{where}: not valid UTF-8") from None
    except yaml.YAMLError as exc:
        raise GoldenSetError(f"{where}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise GoldenSetError(f"{where}: must be a mapping with k, thresholds and probes")
    problems = _Problems(where)
    k = _whole(data, "k", 4, 1, problems)
    max_regressions = _whole(data, "max_regressions", 0, 0, problems)
    max_removed = _whole(data, "max_docs_removed", DEFAULT_MAX_DOCS_REMOVED, 0, problems)
    thresholds = {name: _fraction(data, name, default, problems) for name, default in (
        ("min_hit_rate", 0.9), ("min_mrr", 0.7), ("max_category_drop", 0.2), ("max_shrink", DEFAULT_MAX_SHRINK))}
    alpha = _fraction(data, "paired_alpha", 0.05, problems)
    if not 0.0 < alpha < 1.0:
        problems.add(f"'paired_alpha' must be above 0 and below 1, got {alpha!r}")
    raw_probes = data.get("probes")
    probes: list[Probe] = []
    if not isinstance(raw_probes, list) or not raw_probes:
        problems.add("'probes' must be a non-empty list")
        raw_probes = []
    seen: set[str] = set()
    for index, raw in enumerate(raw_probes):
        probe = _probe(raw, index, seen, problems)
        if probe is not None:
            probes.append(probe)
    problems.raise_any()
    return GoldenSet(
        k=k, min_hit_rate=thresholds["min_hit_rate"], min_mrr=thresholds["min_mrr"], max_regressions=max_regressions,
        probes=tuple(probes), max_category_drop=thresholds["max_category_drop"], paired_alpha=alpha,
        max_docs_removed=max_removed, max_shrink=thresholds["max_shrink"],
    )


def _probe(raw: Any, index: int, seen: set[str], problems: _Problems) -> Probe | None:
    """One probe, or None with its first problem added."""
    if not isinstance(raw, dict):
        problems.add(f"probes[{index}]: must be a mapping with id, query and expected")
        return None
    probe_id, query, expected = raw.get("id"), raw.get("query"), raw.get("expected")
    if not isinstance(probe_id, str) or not probe_id.strip():
        problems.add(f"probes[{index}]: 'id' must be non-empty text")
        return None
    at = f"probe {_short(probe_id)}"
    if probe_id in seen:
        problems.add(f"{at}: id is used twice")
        return None
    seen.add(probe_id)
    if not isinstance(query, str) or not query.strip():
        problems.add(f"{at}: 'query' must be non-empty text")
        return None
    if isinstance(expected, str):
        expected = [expected]
    if not isinstance(expected, list) or not expected or not all(isinstance(e, str) and e for e in expected):
        problems.add(f"{at}: 'expected' must be a non-empty list of knowledge_keys")
        return None
    category = raw.get("category")
    if category is not None and (not isinstance(category, str) or not category.strip()):
        problems.add(f"{at}: 'category' must be non-empty text when given, got {_short(category)}")
        return None
    tenant = raw.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not tenant.strip()):
        problems.add(f"{at}: 'tenant' must be non-empty text when given (the tenant the assistant passes to the "
                     f"reader), got {_short(tenant)}")
        return None
    return Probe(id=probe_id, query=query.strip(), expected=tuple(expected),
                 category=category.strip() if category else None, tenant=tenant.strip() if tenant else None)


def check_probe_keys(golden: GoldenSet, keys: set[str], *, where: str | None = None) -> None:
    """A probe that names a missing document can never hit: say which one instead of scoring it."""
    missing = [f"{p.id} -> {', '.join(e for e in p.expected if e not in keys)}" for p in golden.probes
               if any(e not in keys for e in p.expected)]
    if missing:
        raise GoldenSetError(
            (f"{where}: " if where else "")
            + f"{len(missing)} golden probe(s) name knowledge_keys in 'expected' that are not in the corpus: "
            + "; ".join(missing)
        )


def invisible_to_tenant(golden: GoldenSet, tenants: dict[str, str], *, was: dict[str, str] | None = None,
                        version: int, live_version: int | None = None) -> list[str]:
    """A gate failure for each probe naming a tenant whose expected document that tenant cannot see in this
    version (`tenants`: knowledge_key -> tenant of its documents; `was`: live's, to say what it was): the reader
    filters by tenant, so that customer's question lost its answer whatever `max_regressions` allows."""
    failures = []
    for probe in golden.probes:
        if probe.tenant is None:
            continue
        for key in probe.expected:
            now = tenants.get(key)
            if now is None or now == probe.tenant:
                continue
            before = (was or {}).get(key)
            since = (f" (tenant {before} in live v{live_version})" if before is not None and live_version is not None
                     else "")
            failures.append(f"probe {probe.id} (tenant {probe.tenant}): its document {key} is under tenant {now} in "
                            f"v{version}{since}, so tenant {probe.tenant} no longer finds it (a tenant gate: "
                            "max_regressions does not apply)")
    return failures


def check_golden_set(path: Path | NoGoldenSet, keys: set[str]) -> GoldenSet:
    """The golden set as the plan sees it: well-formed, and every expected key among the documents being
    planned. Checked before a version exists, so a threshold of 1.5 is not found after a full build."""
    golden = load_golden_set(path)
    check_probe_keys(golden, keys, where=str(path))
    return golden


def below_golden(validation: dict[str, Any] | None, golden: GoldenSet) -> list[str]:
    """Where a version validated with lowered thresholds (a migration's min_hit_rate/min_mrr) scores under
    the golden set's own: every later reindex of it is held to the golden set's and fails. Empty otherwise."""
    if not validation or validation.get("hit_rate") is None:
        return []
    used = validation.get("thresholds") or {}
    found = []
    for name, key, need in (("hit rate", "hit_rate", golden.min_hit_rate), ("MRR", "mrr", golden.min_mrr)):
        lowered = used.get(f"min_{key}")
        if lowered is not None and lowered < need and validation[key] < need:
            found.append(f"{name} {validation[key]:.3f} < the golden set's {need} (validated against a lowered {lowered})")
    return found


def lowered_threshold_advice(version: int, validation: dict[str, Any] | None, golden: GoldenSet,
                             golden_path: Path | NoGoldenSet) -> str | None:
    """What on-call reads when the version going (or gone) live scores under the golden set's own thresholds."""
    found = below_golden(validation, golden)
    if not found:
        return None
    return (f"v{version} was promoted with lowered thresholds: {'; '.join(found)}. Every later reindex is validated "
            f"against the golden set's thresholds and will fail. Either raise the quality back (a better model, a "
            f"rollback), or lower min_hit_rate/min_mrr in {golden_path} (KB_GOLDEN_SET) to what this model reaches, "
            "as a reviewed change")


def first_hit_rank(ranked_keys: Sequence[str], expected: Sequence[str]) -> int | None:
    """1-based rank of the first result whose document is expected, or None when none is in the list."""
    for position, key in enumerate(ranked_keys, start=1):
        if key in expected:
            return position
    return None


def score(ranks: Sequence[int | None]) -> tuple[float, float]:
    """(hit rate, mean reciprocal rank) over probes; a miss counts 0 for MRR."""
    if not ranks:
        return 0.0, 0.0
    hits = [r for r in ranks if r is not None]
    return len(hits) / len(ranks), sum(1.0 / r for r in hits) / len(ranks)


# --- sharper gates: per category, and paired against live ------------------------------------------


def probe_categories(golden: GoldenSet, doc_categories: dict[str, str]) -> dict[str, str]:
    """Each probe's category: its own `category`, else that of its first expected document (front matter)."""
    return {p.id: p.category or doc_categories.get(p.expected[0]) or "(none)" for p in golden.probes}


def category_scores(probes: Sequence[ProbeResult], categories: dict[str, str], *, compare: bool,
                    max_drop: float) -> list[CategoryScore]:
    """Hit rate and MRR per category on the candidate and on live. `dropped`: the category's hit rate fell
    more than `max_drop` below live's (only meaningful when `compare`: live was scored like for like).
    Totals can hide a category that lost most of its probes while the others held or improved."""
    groups: dict[str, list[ProbeResult]] = {}
    for p in probes:
        groups.setdefault(categories.get(p.probe, "(none)"), []).append(p)
    rows = []
    for name in sorted(groups):
        members = groups[name]
        hit, mrr = score([p.rank_candidate for p in members])
        live_hit, live_mrr = score([p.rank_live for p in members]) if compare else (None, None)
        drop = None if live_hit is None else live_hit - hit
        rows.append(CategoryScore(
            category=name, probes=len(members), hit_rate=round(hit, 4), mrr=round(mrr, 4),
            live_hit_rate=None if live_hit is None else round(live_hit, 4),
            live_mrr=None if live_mrr is None else round(live_mrr, 4),
            hit_rate_drop=None if drop is None else round(drop, 4),
            dropped=drop is not None and drop > max_drop + 1e-9,
            lost=tuple(p.probe for p in members if p.rank_live is not None and p.rank_candidate is None),
        ))
    return rows


def sign_test_p(successes: int, trials: int) -> float:
    """One-sided exact sign test: P(X >= successes) for X ~ Binomial(trials, 1/2)."""
    if trials <= 0:
        return 1.0
    return sum(comb(trials, i) for i in range(successes, trials + 1)) / 2 ** trials


def paired_comparison(probes: Sequence[ProbeResult], *, alpha: float) -> PairedComparison:
    """Probe by probe, candidate against live on the reciprocal rank (a miss counts 0), with an exact sign
    test: ties carry no information and are left out. `worse` is significant when seeing that many probes
    worse out of the untied ones is unlikely (p < alpha) if the candidate were as good as live. A small
    golden set thus fails on a pattern of losses, not on the one probe that moved by chance, and a
    threshold met by luck is shown as such (`p_better`, `p_worse` beside the thresholds)."""
    better = worse = ties = 0
    for p in probes:
        live_rr = 1.0 / p.rank_live if p.rank_live else 0.0
        cand_rr = 1.0 / p.rank_candidate if p.rank_candidate else 0.0
        if cand_rr > live_rr:
            better += 1
        elif cand_rr < live_rr:
            worse += 1
        else:
            ties += 1
    n = better + worse
    p_worse, p_better = sign_test_p(worse, n), sign_test_p(better, n)
    verdict = ("worse" if p_worse < alpha else "better" if p_better < alpha else "no significant difference")
    return PairedComparison(test="exact sign test on reciprocal rank (one-sided)", alpha=alpha, pairs=len(probes),
                            better=better, worse=worse, ties=ties, p_worse=round(p_worse, 4),
                            p_better=round(p_better, 4), verdict=verdict, significant_worse=p_worse < alpha)
