"""The validation reports: the score chart's version axis shows whole versions only; the HTML report escapes what
users and authors wrote; the Markdown report has the replay section; where the reports are written."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kb_reindex.steps.reports import REPORT_FILES, report_dir, score_chart, write_html_report, write_validation_report
from kb_reindex.domain.validation_model import ValidationResult


@pytest.mark.parametrize("count", [1, 2, 3, 12, 30])
def test_score_chart_ticks_only_whole_versions(count: int) -> None:
    """Seen (with matplotlib's default locator): one or two versions were labelled 0.950, 0.975, 1.000 ..."""
    history = [{"version": n, "hit_rate": 0.9, "mrr": 0.8} for n in range(1, count + 1)]
    chart = score_chart("kb", history, k=4, min_hit_rate=0.9)
    labels = [label for _x, label in chart.x_ticks]
    numbers = [int(label.removeprefix("v")) for label in labels]
    assert labels and labels == [f"v{n}" for n in numbers] and set(numbers) <= set(range(1, count + 1))
    xs = [x for x, _label in chart.x_ticks]
    assert all(chart.left < x < chart.right for x in xs) and xs == sorted(xs)
    if count <= 12:
        assert numbers == list(range(1, count + 1))  # every version named when they fit
    assert len(chart.hit) == len(chart.mrr) == count
    assert all(chart.top <= y <= chart.bottom for _x, y in chart.hit + chart.mrr)
    # a higher score is drawn higher: hit rate 0.9 above MRR 0.8, the 0.9 threshold through the hit points
    assert chart.hit[0][1] < chart.mrr[0][1] and abs(chart.hit[0][1] - chart.threshold_y) < 1e-9


SCRIPT = "<script>alert('kb')</script>"


def report_result(replay: dict | None) -> ValidationResult:
    """A failed validation whose every user- or author-written value carries a script tag."""
    probe = {"query": f"退货{SCRIPT}", "expected": f"refund{SCRIPT}", "hit": True, "regression": False,
             "top": f"refund{SCRIPT}"}
    return ValidationResult.from_dict({
        "passed": False, "failures": [f"hit rate too low for {SCRIPT}"], "k": 4, "hit_rate": 0.5, "mrr": 0.5,
        "regressions": 0, "live_version": 2, "live_hit_rate": 0.75, "live_mrr": 0.6, "live_embed_model": "m",
        "thresholds": {"min_hit_rate": 0.9, "min_mrr": 0.7, "max_regressions": 0, "max_category_drop": 0.1},
        "checks": [{"check": "points match the manifest", "passed": True, "detail": f"title {SCRIPT}"}],
        "probes": [{**probe, "probe": "p1", "rank_live": 1, "rank_candidate": 2}],
        "by_category": [{"category": f"售后{SCRIPT}", "probes": 1, "hit_rate": 1.0, "live_hit_rate": 1.0,
                         "hit_rate_drop": 0.0, "mrr": 0.5, "live_mrr": 1.0, "dropped": False}],
        "paired": {"test": "sign test", "better": 0, "worse": 1, "ties": 0, "pairs": 1, "p_worse": 0.5,
                   "p_better": 1.0, "alpha": 0.05, "verdict": f"no difference {SCRIPT}"},
        "flagged_instructions": [{"source": f"faq{SCRIPT}.md", "line": 3,
                                  "text": f"ignore previous instructions {SCRIPT}"}],
        "replay": replay,
    })


def replay_report() -> dict:
    row = {"log_id": 7, "query": f"会员积分{SCRIPT}", "tenant": "default", "overlap": 0.0,
           "live_top": f"member-rules{SCRIPT}", "top_changed": False, "rank_candidate": None, "rank_change": None,
           "lost_top_hit": True, "empty_live": False, "empty_candidate": False}
    return {"queries": 1, "live_version": 2, "mean_overlap": 0.0, "empty_live": 0.0, "empty_candidate": 0.0,
            "thresholds": {"max_empty_increase": 0.05, "max_lost_top_hits": 0.2}, "lost_top_hits": 1,
            "unchanged_top_hits": 1, "changed_documents": 1, "passed": False, "gated": True, "per_query": [row]}


def version_record(alias: str = "kb") -> SimpleNamespace:
    return SimpleNamespace(alias=alias, version=3, collection="kb__m__v3", embed_model=f"m{SCRIPT}", embed_dim=8,
                           distance="Cosine")


@pytest.mark.parametrize("replay", ["ran", "skipped", None])
def test_a_script_in_a_title_or_query_comes_out_escaped_in_the_html_report(tmp_path: Path, replay: str | None) -> None:
    """The templates autoescape: every value (query, document, failure, check, category, flagged line, logged
    query) is text in the page, never markup."""
    report = {"ran": replay_report(), "skipped": {"skipped": f"no query log {SCRIPT}"}, None: None}[replay]
    html = write_html_report(tmp_path, version_record(), report_result(report), []).read_text(encoding="utf-8")
    assert "<script" not in html.lower()
    escaped = html.count("&lt;script&gt;alert(")  # quotes: &#39; from the templates, left as they are by pandas
    # model, failure, check, category, paired verdict, probe query/expected, flagged source/text + the replay's
    assert escaped >= 9 + {"ran": 2, "skipped": 1, None: 0}[replay], html
    assert "Validation of kb v3: FAILED" in html and "<h2>Golden probes</h2><table" in html
    if replay == "ran":
        assert "Replay of logged queries: FAILED" in html and "会员积分" in html
    elif replay == "skipped":
        assert "<p>Skipped: no query log &lt;script&gt;" in html
    else:
        assert "<p>Not run (the structural checks failed).</p>" in html


def test_the_markdown_report_has_the_replay_section_the_html_one_has(tmp_path: Path) -> None:
    markdown = write_validation_report(tmp_path, version_record(), report_result(replay_report())).read_text(
        encoding="utf-8")
    section = markdown[markdown.index("## Replay of logged queries: FAILED"):]
    assert "- 1 queries on live v2 and on this version" in section
    assert "lost from the top k: 1 of 1 queries (max share 0.2)" in section
    row = f"| 7 | 会员积分{SCRIPT} | default | 0.0 | member-rules{SCRIPT} | False |  |  | True | False | False |"
    assert row in section

    for replay, said in (({"skipped": "no query log"}, "Skipped: no query log."),
                         (None, "Not run (the structural checks failed).")):
        path = write_validation_report(tmp_path, version_record(), report_result(replay))
        markdown = path.read_text(encoding="utf-8")
        assert markdown.endswith(f"## Replay of logged queries\n\n{said}\n")


def test_reports_of_a_version_are_written_where_the_page_looks(tmp_path: Path) -> None:
    write_validation_report(tmp_path, version_record(), report_result(None))
    write_html_report(tmp_path, version_record(), report_result(None), [])
    folder = report_dir(tmp_path, "kb", 3)
    assert folder == tmp_path / "kb" / "v3"
    assert sorted(p.name for p in folder.iterdir()) == sorted(REPORT_FILES)


def test_the_templates_are_package_data_of_the_wheel(tmp_path: Path) -> None:
    """A non-editable install must render the report and the page: the wheel carries the templates."""
    import subprocess
    import sys
    import zipfile

    from conftest import REPO

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(REPO)], check=True, capture_output=True)
    [wheel] = tmp_path.glob("kb_reindex-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = sorted(p.name for p in (REPO / "include" / "kb_reindex" / "templates").glob("*.html.j2"))
    assert {"page.html.j2", "validation.html.j2"} <= set(templates)
    assert {f"kb_reindex/templates/{name}" for name in templates} <= names


def test_the_reuse_rate_gauge_counts_what_a_slot_kept_as_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run brought into its slot by the difference copies nothing from live: of 50 chunks it embedded 1, so
    its reuse rate is 0.98, not 0 (the run's copy count alone)."""
    from kb_reindex.services import metrics

    gauges: dict[str, float] = {}
    stats = SimpleNamespace(incr=lambda *a, **k: None, gauge=lambda name, value, **k: gauges.__setitem__(name, value))
    monkeypatch.setattr(metrics, "_stats", lambda: stats)
    metrics.run_finished(alias="kb", outcome="promoted", duration_s=2.0, embedded=1, reused=0, total=50)
    assert gauges["kb_reindex.embedding.reuse_rate"] == 0.98 and gauges["kb_reindex.chunks.changed"] == 1
    metrics.run_finished(alias="kb", outcome="promoted", duration_s=2.0, embedded=1, reused=49)
    assert gauges["kb_reindex.embedding.reuse_rate"] == 0.98
