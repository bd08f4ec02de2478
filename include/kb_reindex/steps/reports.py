"""Validation reports on disk (CSV for tools, Markdown for people, HTML from the Jinja2 templates in
`templates/`), built with pandas. `report_dir` is the one place their folder is computed."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.steps.templating import templates
from kb_reindex.domain.validation_model import NO_GOLDEN_SET, ReplayReport, ValidationResult

#: the files a validation writes into its report folder (and the only ones the page serves)
REPORT_FILES = ("validation.html", "validation.md", "validation.csv")
#: the name of the reports the validation of a build writes: its promotion report, never replaced later
PROMOTION_REPORT = "validation"


@dataclass(frozen=True)
class ReportKind:
    """Which report a validation writes. The validation of a build writes the version's promotion report
    (`validation.*`, compared with live as it was then); a later check of a kept version (`kb-reindex
    validate`, a rollback's re-score, a shadow's check before its promotion) writes one of its own,
    `validate-<UTC stamp>.*` beside it, saying which version serves now: it never replaces the first."""

    name: str = PROMOTION_REPORT
    #: the version live when the report is written (said in an on-demand report; None: nothing serves)
    live_now: int | None = None
    at: datetime | None = None

    @classmethod
    def on_demand(cls, at: datetime, live_now: int | None) -> ReportKind:
        return cls(name=f"validate-{at:%Y%m%d-%H%M%S}-{at.microsecond // 1000:03d}", live_now=live_now, at=at)

    @property
    def promotion(self) -> bool:
        return self.name == PROMOTION_REPORT

    def compared(self, result: ValidationResult) -> str:
        """How the report names the version the candidate was compared with: live then (the promotion
        report); in a later check, the version it was built on, which need not serve now."""
        if self.promotion:
            return f"live v{result.live_version}"
        return f"v{result.live_version} (the version v{result.version} was built on)"

    def header(self, version: VersionRecord) -> list[str]:
        if self.promotion:
            return []
        stamp = f"{self.at:%Y-%m-%d %H:%M:%S} UTC" if self.at else "later"
        live = f"v{self.live_now}" if self.live_now is not None else "nothing"
        return [f"- checked on demand at {stamp}, live now: {live}; the promotion report of v{version.version} is "
                "`validation.md` and stays as it was"]


def report_dir(reports_dir: Path, alias: str, version: int) -> Path:
    """`<KB_REPORTS_DIR>/<alias>/v<N>`: where the reports of one version live, for writers and the page alike."""
    return reports_dir / alias / f"v{version}"


MODELS_NOTE = ("A migration: live and the candidate scored on the same golden probes, each with its own model "
               "(the per-probe ranks are under Golden probes). Only the absolute thresholds gate across models.")


def models_frame(version: VersionRecord, result: ValidationResult, kind: ReportKind = ReportKind()
                 ) -> pd.DataFrame | None:
    """Live's model and the candidate's, their golden-set scores in one table: what a team deciding a
    migration compares. None unless the two versions have different models."""
    if result.compared_as != "side_by_side":
        return None
    probes = result.probes
    rows = [
        {"version": kind.compared(result), "embedder": result.live_embedder,
         "model": result.live_embed_model, "dim": result.live_embed_dim,
         f"hit@{result.k}": result.live_hit_rate, "MRR": result.live_mrr,
         "probes hit": sum(1 for p in probes if p.rank_live is not None)},
        {"version": f"candidate v{version.version}", "embedder": version.embedder, "model": version.embed_model,
         "dim": version.embed_dim, f"hit@{result.k}": result.hit_rate, "MRR": result.mrr,
         "probes hit": sum(1 for p in probes if p.rank_candidate is not None)},
    ]
    return pd.DataFrame(rows)


def _table(frame: pd.DataFrame, **options: Any) -> Any:
    """pandas' HTML table (it escapes cell text itself), marked safe for the templates."""
    from markupsafe import Markup

    return Markup(frame.to_html(index=False, **options))


def _score_lines(result: ValidationResult, compared: str) -> list[str]:
    """The report's score lines; a knowledge base without a golden set: that no answer was probed."""
    thresholds = result.thresholds
    if result.hit_rate is None or result.mrr is None:
        said = next((w.text for w in result.warnings if w.kind == NO_GOLDEN_SET), "no probes")
        return [f"- golden probes: none scored ({said})"]
    return [
        f"- hit@{result.k}: {result.hit_rate:.3f} (min {thresholds.min_hit_rate})"
        + (f", {compared} ({result.live_embed_model}): {result.live_hit_rate:.3f}"
           if result.live_version and result.live_hit_rate is not None else ""),
        f"- MRR: {result.mrr:.3f} (min {thresholds.min_mrr})"
        + (f", v{result.live_version}: {result.live_mrr:.3f}" if result.live_version and result.live_mrr is not None
           else ""),
        f"- regressions: {result.regressions} (max {thresholds.max_regressions})",
    ]


def write_validation_report(reports_dir: Path, version: VersionRecord, result: ValidationResult,
                            kind: ReportKind = ReportKind()) -> Path:
    """Write `<reports>/<alias>/v<N>/<kind.name>.{csv,md}` and return the Markdown path."""
    folder = report_dir(reports_dir, version.alias, version.version)
    folder.mkdir(parents=True, exist_ok=True)
    probes = _probe_frame(result, ["probe", "query", "expected", "rank_live", "rank_candidate", "hit", "regression",
                                   "top"])
    probes.to_csv(folder / f"{kind.name}.csv", index=False)
    checks = _check_frame(result)
    compared = kind.compared(result)
    lines = [
        f"# Validation of {version.alias} v{version.version}" + ("" if kind.promotion else " (on demand)"),
        "",
        *kind.header(version),
        f"- collection: `{version.collection}`",
        f"- model: `{version.embed_model}` ({version.embed_dim}-d, {version.distance})",
        f"- result: **{'PASSED' if result.passed else 'FAILED'}**",
        *_score_lines(result, compared),
        "",
    ]
    if result.failures:
        lines += ["## Failures", ""] + [f"- {f}" for f in result.failures] + [""]
    models = models_frame(version, result, kind)
    if models is not None:
        lines += ["## Models side by side", "", MODELS_NOTE, "", _markdown(models), ""]
    lines += gates_markdown(result, kind)
    lines += ["## Structural checks", "", _markdown(checks), "", "## Golden probes", "",
              _markdown(probes.drop(columns=["top"])), ""]
    flagged = list(result.flagged_instructions)
    lines += [f"## Instruction-like text ({len(flagged)})", ""]
    if flagged:
        lines += ["Knowledge text is data: these lines are listed for review and are not acted on.", "",
                  _markdown(pd.DataFrame(flagged, columns=["source", "line", "text"])), ""]
    else:
        lines += ["None found.", ""]
    lines += [f"## Tenant changes and duplicates ({len(result.warnings)})", ""]
    lines += ([_markdown(pd.DataFrame([w.to_dict() for w in result.warnings],
                                      columns=["kind", "knowledge_key", "other_key", "text"])), ""]
              if result.warnings else ["None found.", ""])
    lines += replay_markdown(result.replay)
    path = folder / f"{kind.name}.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def write_html_report(reports_dir: Path, version: VersionRecord, result: ValidationResult,
                      history: list[dict[str, Any]], kind: ReportKind = ReportKind()) -> Path:
    """`<kind.name>.html`: the same tables, plus hit rate and MRR across versions as an inline chart."""
    from markupsafe import Markup

    folder = report_dir(reports_dir, version.alias, version.version)
    folder.mkdir(parents=True, exist_ok=True)
    chart = score_chart(version.alias, history, k=result.k, min_hit_rate=result.thresholds.min_hit_rate)
    probes = _probe_frame(result, ["probe", "query", "expected", "rank_live", "rank_candidate", "hit", "regression"])
    checks = _check_frame(result)
    flagged = pd.DataFrame(list(result.flagged_instructions), columns=["source", "line", "text"])
    models = models_frame(version, result, kind)
    body = templates().get_template("validation.html.j2").render(
        models=None if models is None else _table(models), models_note=MODELS_NOTE,
        version=version, result=result, verdict="PASSED" if result.passed else "FAILED", chart=chart,
        on_demand=kind.header(version), gates=gates_html(result, kind), checks=_table(checks),
        probes=_table(probes, na_rep="-"),
        flagged_count=len(flagged), flagged=_table(flagged) if len(flagged) else None,
        replay=Markup(replay_html(result.replay)))
    path = folder / f"{kind.name}.html"
    path.write_text(body, encoding="utf-8")
    return path


CATEGORY_COLUMNS = ["category", "probes", "hit_rate", "live_hit_rate", "hit_rate_drop", "mrr", "live_mrr", "dropped"]


def _category_frame(result: ValidationResult) -> pd.DataFrame:
    return pd.DataFrame([c.to_dict() for c in result.by_category], columns=CATEGORY_COLUMNS)


def _check_frame(result: ValidationResult) -> pd.DataFrame:
    return pd.DataFrame([c.to_dict() for c in result.checks], columns=["check", "passed", "detail"])


def _paired_line(result: ValidationResult, kind: ReportKind = ReportKind()) -> str | None:
    paired = result.paired
    if not paired:
        return None
    return (f"{paired.test} against {kind.compared(result)}: {paired.better} better, "
            f"{paired.worse} worse, {paired.ties} tied of {paired.pairs}; p(worse)={paired.p_worse}, "
            f"p(better)={paired.p_better} (alpha {paired.alpha}): {paired.verdict}")


def gates_markdown(result: ValidationResult, kind: ReportKind = ReportKind()) -> list[str]:
    """Per-category scores (margin beside them) and the paired test beside the thresholds."""
    margin = result.thresholds.max_category_drop
    lines = [f"## Categories (max hit-rate drop against live: {margin})", "", _markdown(_category_frame(result)), ""]
    paired = _paired_line(result, kind)
    lines += ["## Paired comparison with live", "", paired or "No live version to compare with.", ""]
    return lines


def gates_html(result: ValidationResult, kind: ReportKind = ReportKind()) -> str:
    from markupsafe import Markup

    frame = _category_frame(result)
    return Markup(templates().get_template("_gates.html.j2").render(
        margin=result.thresholds.max_category_drop,
        categories=_table(frame, na_rep="-") if len(frame) else None, paired=_paired_line(result, kind)))


@dataclass(frozen=True)
class ScoreChart:
    """Hit rate and MRR by version as an inline SVG's coordinates (`validation.html.j2` draws it): a run writes
    its report without loading a plotting library. The x axis names whole versions only (every one when they
    are 12 or fewer, else about 10 evenly spaced)."""

    title: str
    k: int
    width: int
    height: int
    #: (x, y) of each version's hit rate and MRR
    hit: tuple[tuple[float, float], ...]
    mrr: tuple[tuple[float, float], ...]
    threshold_y: float
    #: (x, label) along the version axis; (y, label) along the score axis
    x_ticks: tuple[tuple[float, str], ...]
    y_ticks: tuple[tuple[float, str], ...]
    left: int = 48
    right: int = 628
    top: int = 30
    bottom: int = 282

    @staticmethod
    def polyline(points: tuple[tuple[float, float], ...]) -> str:
        return " ".join(f"{x:.1f},{y:.1f}" for x, y in points)


def score_chart(alias: str, history: list[dict[str, Any]], *, k: int, min_hit_rate: float) -> ScoreChart:
    """The chart of the versions in `history` that were scored."""
    points = sorted((h for h in history if h.get("hit_rate") is not None), key=lambda h: h["version"])
    versions = [int(p["version"]) for p in points]
    chart = ScoreChart(title=f"{alias}: golden-set scores by version", k=k, width=640, height=320, hit=(), mrr=(),
                       threshold_y=0.0, x_ticks=(), y_ticks=())
    low, high = (min(versions) - 0.5, max(versions) + 0.5) if versions else (0.5, 1.5)

    def x(version: float) -> float:
        return chart.left + (version - low) / (high - low) * (chart.right - chart.left)

    def y(score: float) -> float:
        return chart.bottom - score / 1.05 * (chart.bottom - chart.top)

    if len(versions) <= 12:
        ticks = versions
    else:
        step = math.ceil((versions[-1] - versions[0]) / 10)
        ticks = list(range(versions[0], versions[-1] + 1, step))
    return replace(chart, hit=tuple((x(v), y(p["hit_rate"])) for v, p in zip(versions, points, strict=True)),
                   mrr=tuple((x(v), y(p["mrr"])) for v, p in zip(versions, points, strict=True)),
                   threshold_y=y(min_hit_rate), x_ticks=tuple((x(t), f"v{t}") for t in ticks),
                   y_ticks=tuple((y(s / 4), f"{s / 4:g}") for s in range(5)))


def _probe_frame(result: ValidationResult, columns: list[str]) -> pd.DataFrame:
    """Ranks as whole numbers: a rank column with a miss (None) would otherwise become float (`1.0`)."""
    frame = pd.DataFrame([p.to_dict() for p in result.probes], columns=columns)
    for name in ("rank_live", "rank_candidate"):
        frame[name] = frame[name].astype("Int64")
    return frame


def _markdown(frame: pd.DataFrame) -> str:
    """A pipe table without the optional `tabulate` dependency."""
    if frame.empty:
        return "(none)"
    header = "| " + " | ".join(str(c) for c in frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    rows = ["| " + " | ".join("" if pd.isna(v) else " ".join(str(v).splitlines()).replace("|", "\\|")
                              for v in row) + " |"
            for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *rows])


def _replay_rows(report: ReplayReport) -> pd.DataFrame:
    """The replay's per-query rows, the query cut to 80 characters and ranks as whole numbers."""
    rows = pd.DataFrame([q.to_dict() for q in report.per_query], columns=["log_id", "query", "tenant", "overlap", "live_top", "top_changed",
                                                      "rank_candidate", "rank_change", "lost_top_hit", "empty_live",
                                                      "empty_candidate"])
    rows["query"] = rows["query"].map(lambda q: q if len(q) <= 80 else q[:79] + "…")
    for name in ("rank_candidate", "rank_change"):
        rows[name] = rows[name].astype("Int64")
    return rows


def _replay_verdict(report: ReplayReport) -> str:
    return ("PASSED" if report.passed else "FAILED") if report.gated else "reported, not gated (another model)"


def _rate(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


def replay_html(report: ReplayReport | None) -> str:
    """The replay of logged queries (kb_reindex.steps.replay): totals, thresholds and the worst queries first.
    Logged query text is personal data; it is shown here as it is in the state DB, cut to 80 characters."""
    from markupsafe import Markup

    values: dict[str, Any] = {"report": report, "skipped": None}
    if report is not None and report.skipped is not None:
        values["skipped"] = report.skipped
    elif report is not None:
        values.update(verdict=_replay_verdict(report), thresholds=report.thresholds, rate=_rate,
                      rows=_table(_replay_rows(report), na_rep="-"))
    return Markup(templates().get_template("_replay.html.j2").render(**values))


def replay_markdown(report: ReplayReport | None) -> list[str]:
    """The replay section of validation.md: the same totals and rows as the HTML report's."""
    title = "## Replay of logged queries"
    if report is None:
        return [title, "", "Not run (the structural checks failed).", ""]
    if report.skipped is not None:
        return [title, "", f"Skipped: {report.skipped}.", ""]
    thresholds = report.thresholds
    return [f"{title}: {_replay_verdict(report)}", "",
            f"- {report.queries} queries on live v{report.live_version} and on this version",
            f"- mean top-k overlap: {_rate(report.mean_overlap)}",
            f"- empty results: {_rate(report.empty_live)} on live, {_rate(report.empty_candidate)} here "
            f"(max +{thresholds['max_empty_increase']})",
            f"- live's top hit, a document this run did not change, lost from the top k: {report.lost_top_hits} of "
            f"{report.unchanged_top_hits} queries (max share {thresholds['max_lost_top_hits']})",
            f"- document(s) changed by this run: {report.changed_documents}", "",
            _markdown(_replay_rows(report)), ""]
