"""What a validation found, as typed values: the structural checks, the golden probes, the per-category
scores, the paired test, and the `ValidationResult` that holds them.

A version's `validation` column stores `ValidationResult.to_dict()` as JSON, and the CLI prints it; the keys
and their order are what they were when this was a dict. `from_dict` reads any stored record, including an
older one that lacks keys (a record restored from collection metadata holds only the scores). This module
imports nothing of the package, so every layer may use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NotRequired, Any, TypedDict


class FlaggedLine(TypedDict):
    """An instruction-like line of a knowledge file, as the plan's snapshot and the validation record store it
    (JSON): which document (`knowledge_key`; absent in records made before it was kept), which file, which line
    of the file (records made before counted from the end of the front matter), its text."""

    knowledge_key: NotRequired[str]
    source: str
    line: int
    text: str
    #: why the screen flagged it (a pattern's group, the classifier's score, where on the page); absent before
    why: NotRequired[str]


#: the kinds of `ContentWarning`; NO_GOLDEN_SET is version-wide (`knowledge_key` "", `line` 0)
INSTRUCTION, TENANT_CHANGED, DUPLICATE, NO_GOLDEN_SET = "instruction", "tenant_changed", "duplicate", "no_golden_set"


@dataclass(frozen=True)
class ContentWarning:
    """What a check cannot judge and a person should see before it serves, in document `knowledge_key`:
    - `instruction`: a line that reads as an instruction to the assistant, at `line` of its file;
    - `tenant_changed`: the document serves another tenant than in the version compared with (`text` says
      which), so a reader passing the old tenant no longer finds it;
    - `duplicate`: a chunk that repeats one of document `other_key`, identically (same chunk hash) or nearly
      (`score`: the cosine of their vectors, at or above the calibrated threshold); `line` is None;
    - `no_golden_set`: the knowledge base has no golden set (`NoGoldenSet`), so no answer was probed; version-wide."""

    kind: str
    knowledge_key: str
    line: int | None
    text: str
    other_key: str | None = None
    score: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "knowledge_key": self.knowledge_key, "line": self.line,
                               "text": self.text}
        if self.other_key is not None:
            out["other_key"] = self.other_key
        if self.score is not None:
            out["score"] = self.score
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ContentWarning:
        line = data.get("line")
        return cls(kind=str(data["kind"]), knowledge_key=str(data["knowledge_key"]),
                   line=None if line is None else int(line), text=str(data["text"]), other_key=data.get("other_key"),
                   score=data.get("score"))

    @property
    def message(self) -> str:
        if self.kind == TENANT_CHANGED:
            return f"tenant change of {self.knowledge_key}: {self.text}"
        if self.kind == DUPLICATE:
            return f"duplicate of {self.other_key} in {self.knowledge_key}: {self.text}"
        if self.kind == NO_GOLDEN_SET:
            return self.text
        return f"{self.kind}-like line in {self.knowledge_key} line {self.line}: {self.text}"


@dataclass(frozen=True)
class NoGoldenSet:
    """A knowledge base scored on no golden set: a registry entry without `golden_set` whose source folder holds
    no `golden.yaml` (the single form always has one, `KB_GOLDEN_SET`). Validation runs every structural and
    exact check and scores no probe; the content-loss and replay thresholds are the defaults. `entry` names
    where one is added (`<registry file>'s entry <alias>`)."""

    entry: str

    @property
    def text(self) -> str:
        return f"no golden set: answers were not probed; add golden_set to {self.entry}"

    def warning(self) -> ContentWarning:
        """What every validation of it says, in its result, status and on the page."""
        return ContentWarning(kind=NO_GOLDEN_SET, knowledge_key="", line=0, text=self.text)

    def __str__(self) -> str:  # where a golden set's path is named (an error, a report)
        return f"(no golden set: {self.entry})"


@dataclass(frozen=True)
class Check:
    """One structural check: `name` (stored as `check`), whether it passed, and what was seen."""

    name: str
    passed: bool
    detail: str

    @property
    def line(self) -> str:
        """How a failure reads in `failures` and in error messages."""
        return f"{self.name}: {self.detail}"

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.name, "passed": self.passed, "detail": self.detail}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Check:
        return cls(name=str(data.get("check", "")), passed=bool(data.get("passed")), detail=str(data.get("detail", "")))


@dataclass(frozen=True)
class ProbeRun:
    """One probe searched on one collection: the rank of its first expected document (None: not in the top
    k) and the knowledge_keys of the top k."""

    probe: str
    rank: int | None
    top: tuple[str, ...]


@dataclass(frozen=True)
class ProbeResult:
    """One golden probe on the candidate, beside live (`rank_live`). `expected` and `top` are the keys joined
    by commas, as the record and the reports show them; `category` is None only in an older record."""

    probe: str
    query: str
    expected: str
    rank_live: int | None
    rank_candidate: int | None
    hit: bool
    regression: bool
    top: str
    category: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"probe": self.probe, "query": self.query, "expected": self.expected, "rank_live": self.rank_live,
               "rank_candidate": self.rank_candidate, "hit": self.hit, "regression": self.regression, "top": self.top}
        if self.category is not None:
            out["category"] = self.category
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProbeResult:
        rank = data.get("rank_candidate")
        return cls(probe=str(data.get("probe", "")), query=str(data.get("query", "")),
                   expected=str(data.get("expected", "")), rank_live=data.get("rank_live"), rank_candidate=rank,
                   hit=bool(data.get("hit", rank is not None)), regression=bool(data.get("regression", False)),
                   top=str(data.get("top", "")), category=data.get("category"))


@dataclass(frozen=True)
class CategoryScore:
    """Hit rate and MRR of one category on the candidate and on live; `dropped`: it fell beyond the margin."""

    category: str
    probes: int
    hit_rate: float
    mrr: float
    live_hit_rate: float | None
    live_mrr: float | None
    hit_rate_drop: float | None
    dropped: bool
    lost: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"category": self.category, "probes": self.probes, "hit_rate": self.hit_rate, "mrr": self.mrr,
                "live_hit_rate": self.live_hit_rate, "live_mrr": self.live_mrr,
                "hit_rate_drop": self.hit_rate_drop, "dropped": self.dropped, "lost": list(self.lost)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CategoryScore:
        return cls(category=str(data.get("category", "")), probes=int(data.get("probes", 0)),
                   hit_rate=data.get("hit_rate", 0.0), mrr=data.get("mrr", 0.0),
                   live_hit_rate=data.get("live_hit_rate"), live_mrr=data.get("live_mrr"),
                   hit_rate_drop=data.get("hit_rate_drop"), dropped=bool(data.get("dropped", False)),
                   lost=tuple(data.get("lost") or ()))


@dataclass(frozen=True)
class PairedComparison:
    """The exact sign test of the candidate against live, probe by probe (kb_reindex.steps.golden)."""

    test: str
    alpha: float
    pairs: int
    better: int
    worse: int
    ties: int
    p_worse: float
    p_better: float
    verdict: str
    significant_worse: bool

    def to_dict(self) -> dict[str, Any]:
        return {"test": self.test, "alpha": self.alpha, "pairs": self.pairs, "better": self.better,
                "worse": self.worse, "ties": self.ties, "p_worse": self.p_worse, "p_better": self.p_better,
                "verdict": self.verdict, "significant_worse": self.significant_worse}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PairedComparison:
        return cls(test=str(data.get("test", "")), alpha=data.get("alpha", 0.05), pairs=data.get("pairs", 0),
                   better=data.get("better", 0), worse=data.get("worse", 0), ties=data.get("ties", 0),
                   p_worse=data.get("p_worse", 1.0), p_better=data.get("p_better", 1.0),
                   verdict=str(data.get("verdict", "")), significant_worse=bool(data.get("significant_worse")))


@dataclass(frozen=True)
class Thresholds:
    """The thresholds a validation applied (a migration may lower min_hit_rate/min_mrr)."""

    min_hit_rate: float
    min_mrr: float
    max_regressions: int
    max_category_drop: float | None = None
    paired_alpha: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"min_hit_rate": self.min_hit_rate, "min_mrr": self.min_mrr,
                               "max_regressions": self.max_regressions}
        if self.max_category_drop is not None:
            out["max_category_drop"] = self.max_category_drop
        if self.paired_alpha is not None:
            out["paired_alpha"] = self.paired_alpha
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Thresholds:
        return cls(min_hit_rate=data.get("min_hit_rate", 0.0), min_mrr=data.get("min_mrr", 0.0),
                   max_regressions=data.get("max_regressions", 0), max_category_drop=data.get("max_category_drop"),
                   paired_alpha=data.get("paired_alpha"))


@dataclass(frozen=True)
class ReplayQuery:
    """One logged query searched on live and on the candidate (kb_reindex.steps.replay). `rank_candidate`: where
    live's top hit ranks on the candidate; `rank_change` 0 when still first, None when gone (or no hit on live);
    `live`/`candidate` the keys of each top k joined by commas."""

    log_id: int
    query: str
    tenant: str | None
    k: int
    overlap: float | None
    live_top: str | None
    top_changed: bool | None
    rank_candidate: int | None
    rank_change: int | None
    lost_top_hit: bool
    empty_live: bool
    empty_candidate: bool
    live: str
    candidate: str

    def to_dict(self) -> dict[str, Any]:
        return {"log_id": self.log_id, "query": self.query, "tenant": self.tenant, "k": self.k,
                "overlap": self.overlap, "live_top": self.live_top, "top_changed": self.top_changed,
                "rank_candidate": self.rank_candidate, "rank_change": self.rank_change,
                "lost_top_hit": self.lost_top_hit, "empty_live": self.empty_live,
                "empty_candidate": self.empty_candidate, "live": self.live, "candidate": self.candidate}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplayQuery:
        return cls(log_id=data.get("log_id", 0), query=str(data.get("query", "")), tenant=data.get("tenant"),
                   k=data.get("k", 0), overlap=data.get("overlap"), live_top=data.get("live_top"),
                   top_changed=data.get("top_changed"), rank_candidate=data.get("rank_candidate"),
                   rank_change=data.get("rank_change"), lost_top_hit=bool(data.get("lost_top_hit")),
                   empty_live=bool(data.get("empty_live")), empty_candidate=bool(data.get("empty_candidate")),
                   live=str(data.get("live", "")), candidate=str(data.get("candidate", "")))


@dataclass(frozen=True)
class ReplayReport:
    """The replay of logged queries on live and on the candidate, or why it was skipped (`skipped`: then
    only that is recorded). `thresholds`: the `replay:` gate of the golden set file, as applied."""

    skipped: str | None = None
    queries: int = 0
    mean_overlap: float | None = None
    empty_live: float = 0.0
    empty_candidate: float = 0.0
    lost_top_hits: int = 0  # of the queries whose live top hit is a document this run did not change
    lost_top_hits_any: int = 0
    unchanged_top_hits: int = 0
    lost_share: float | None = None
    changed_documents: int = 0
    live_version: int | None = None
    gated: bool = False
    passed: bool = True
    thresholds: dict[str, Any] = field(default_factory=dict)
    per_query: tuple[ReplayQuery, ...] = ()  # the worst first, at most replay.PER_QUERY_KEPT

    def to_dict(self, *, per_query: bool = True) -> dict[str, Any]:
        """`per_query=False`: the totals a run's JSON carries, without the per-query rows (those are in the report)."""
        if self.skipped is not None:
            return {"skipped": self.skipped}
        rows = {"per_query": [q.to_dict() for q in self.per_query]} if per_query else {}
        return {"queries": self.queries, "mean_overlap": self.mean_overlap, "empty_live": self.empty_live,
                "empty_candidate": self.empty_candidate, "lost_top_hits": self.lost_top_hits,
                "lost_top_hits_any": self.lost_top_hits_any, "unchanged_top_hits": self.unchanged_top_hits,
                "lost_share": self.lost_share, "changed_documents": self.changed_documents,
                "live_version": self.live_version, "gated": self.gated, "passed": self.passed,
                "thresholds": dict(self.thresholds), **rows}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplayReport:
        if "skipped" in data:
            return cls(skipped=str(data["skipped"]))
        return cls(queries=data.get("queries", 0), mean_overlap=data.get("mean_overlap"),
                   empty_live=data.get("empty_live", 0.0), empty_candidate=data.get("empty_candidate", 0.0),
                   lost_top_hits=data.get("lost_top_hits", 0), lost_top_hits_any=data.get("lost_top_hits_any", 0),
                   unchanged_top_hits=data.get("unchanged_top_hits", 0), lost_share=data.get("lost_share"),
                   changed_documents=data.get("changed_documents", 0), live_version=data.get("live_version"),
                   gated=bool(data.get("gated")), passed=bool(data.get("passed", True)),
                   thresholds=dict(data.get("thresholds") or {}),
                   per_query=tuple(ReplayQuery.from_dict(q) for q in data.get("per_query") or ()))


@dataclass(frozen=True)
class RestoredScores:
    """The golden-set scores noted on a collection when it passed validation, as the validation record of a
    version rebuilt from Qdrant holds them (the probes and reports stay with the lost state DB)."""

    hit_rate: float
    mrr: float | None
    restored_from: str

    def to_dict(self) -> dict[str, Any]:
        return {"passed": True, "hit_rate": self.hit_rate, "mrr": self.mrr, "restored_from": self.restored_from}


@dataclass(frozen=True)
class ValidationResult:
    """What `kb_reindex.steps.validate.validate` found. `flagged_instructions` the plan's {source, line, text} rows; `report`/`report_html` the written reports'
    paths (None until they are written)."""

    version: int
    collection: str
    passed: bool
    failures: tuple[str, ...]
    checks: tuple[Check, ...]
    k: int
    thresholds: Thresholds
    #: over the golden probes; None: no golden set, nothing probed (a `no_golden_set` warning says so)
    hit_rate: float | None
    mrr: float | None
    regressions: int
    live_version: int | None = None
    live_embed_model: str | None = None
    live_embedder: str | None = None
    live_embed_dim: int | None = None
    compared_as: str | None = None  # "regression" (same model), "side_by_side" (a migration), None (no live)
    live_hit_rate: float | None = None
    live_mrr: float | None = None
    probes: tuple[ProbeResult, ...] = ()
    by_category: tuple[CategoryScore, ...] = ()
    paired: PairedComparison | None = None
    probes_fingerprint: str | None = None
    flagged_instructions: tuple[FlaggedLine, ...] = ()
    #: the instruction screen this version was judged by (kb_reindex.services.screen.Screen.to_dict: its
    #: version, mode, model and weights digest); None in records made before it was kept
    screen: dict[str, Any] | None = None
    replay: ReplayReport | None = None  # None: not run (the structural checks failed)
    #: tenant changes and duplicates this validation found (instruction-like lines are `flagged_instructions`)
    warnings: tuple[ContentWarning, ...] = ()
    report: str | None = None
    report_html: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # keys of an older record kept as they were

    def to_dict(self) -> dict[str, Any]:
        """The stored record, key for key as the dict it replaced (`report`/`report_html` once written)."""
        out: dict[str, Any] = {
            "version": self.version, "collection": self.collection, "passed": self.passed,
            "failures": list(self.failures), "checks": [c.to_dict() for c in self.checks], "k": self.k,
            "thresholds": self.thresholds.to_dict(), "hit_rate": self.hit_rate, "mrr": self.mrr,
            "regressions": self.regressions, "live_version": self.live_version,
            "live_embed_model": self.live_embed_model, "live_embedder": self.live_embedder,
            "live_embed_dim": self.live_embed_dim, "compared_as": self.compared_as,
            "live_hit_rate": self.live_hit_rate, "live_mrr": self.live_mrr,
            "probes": [p.to_dict() for p in self.probes], "by_category": [c.to_dict() for c in self.by_category],
            "paired": self.paired.to_dict() if self.paired else None, "probes_fingerprint": self.probes_fingerprint,
            "flagged_instructions": [dict(f) for f in self.flagged_instructions],
            "replay": self.replay.to_dict() if self.replay is not None else None,
            "warnings": [w.to_dict() for w in self.warnings],
        }
        if self.screen is not None:
            out["screen"] = self.screen
        if self.report is not None:
            out["report"] = self.report
        if self.report_html is not None:
            out["report_html"] = self.report_html
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ValidationResult:
        """Any stored record; a key it lacks takes its empty value (an older record, or scores restored from
        collection metadata). Keys this type does not know are kept in `extra`."""
        paired, replayed = data.get("paired"), data.get("replay")
        return cls(
            version=data.get("version", 0), collection=data.get("collection", ""),
            passed=bool(data.get("passed")), failures=tuple(data.get("failures") or ()),
            checks=tuple(Check.from_dict(c) for c in data.get("checks") or ()), k=data.get("k", 0),
            thresholds=Thresholds.from_dict(data.get("thresholds") or {}),
            hit_rate=data.get("hit_rate", 0.0), mrr=data.get("mrr", 0.0), regressions=data.get("regressions", 0),
            live_version=data.get("live_version"), live_embed_model=data.get("live_embed_model"),
            live_embedder=data.get("live_embedder"), live_embed_dim=data.get("live_embed_dim"),
            compared_as=data.get("compared_as"), live_hit_rate=data.get("live_hit_rate"),
            live_mrr=data.get("live_mrr"), probes=tuple(ProbeResult.from_dict(p) for p in data.get("probes") or ()),
            by_category=tuple(CategoryScore.from_dict(c) for c in data.get("by_category") or ()),
            paired=PairedComparison.from_dict(paired) if paired else None,
            probes_fingerprint=data.get("probes_fingerprint"),
            flagged_instructions=tuple(data.get("flagged_instructions") or ()), screen=data.get("screen"),
            replay=ReplayReport.from_dict(replayed) if replayed is not None else None,
            warnings=tuple(ContentWarning.from_dict(w) for w in data.get("warnings") or ()),
            report=data.get("report"), report_html=data.get("report_html"),
            extra={k: v for k, v in data.items() if k not in _KNOWN},
        )


_KNOWN = frozenset(ValidationResult.__dataclass_fields__) - {"extra"}
