"""A registry entry without `golden_set` (issue 39): it is not scored with the environment's golden set (the
shop's probes, about pages it does not have) but with none: every structural and exact check, no probe, and a
warning saying so in the run's result, in `status` and on the page."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import REPO
from kb_reindex.domain.validation_model import NoGoldenSet
from kb_reindex.run.pageview import read_status
from kb_reindex.run.pipeline import run_reindex
from kb_reindex.run.status import status_view
from kb_reindex.services.registry import load_registry
from kb_reindex.services.runtime import open_deps

ALIAS = "sellers"


def test_an_entry_without_golden_set_builds_and_promotes_unprobed_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "project"
    shutil.copytree(REPO / "knowledge", project / "knowledge")
    shutil.copytree(REPO / "knowledge" / "seller" / "docs", project / "knowledge" / "sellers")
    registry = project / "knowledge" / "sellers.yaml"
    registry.write_text(f"knowledge_bases:\n  {ALIAS}:\n    source: sellers\n", encoding="utf-8")
    env = {"KB_PROJECT_ROOT": str(project), "KB_REGISTRY": "knowledge/sellers.yaml", "KB_EMBEDDER": "hashing"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = load_registry(env).get(ALIAS).settings(env)
    said = f"no golden set: answers were not probed; add golden_set to {registry}'s entry {ALIAS}"
    assert settings.golden_set == NoGoldenSet(entry=f"{registry}'s entry {ALIAS}")

    with open_deps(settings) as deps:
        first = run_reindex(deps).to_dict()
        assert first["outcome"] == "promoted", first["error"]
        assert first["validation"]["passed"] and first["validation"]["hit_rate"] is None
        assert [w["text"] for w in first["warnings"] if w["kind"] == "no_golden_set"] == [said]
        # every structural and exact check still ran
        record = deps.state.get_version(ALIAS, 1).validation
        assert record["probes"] == [] and record["checks"] and all(c["passed"] for c in record["checks"])
        # a later run, compared with live, is neither failed by probe gates it has none for
        page = project / "knowledge" / "sellers" / "settlement.md"
        page.write_text(page.read_text(encoding="utf-8") + "\n\n补充：节假日顺延。\n", encoding="utf-8")
        second = run_reindex(deps).to_dict()
        assert second["outcome"] == "promoted" and second["validation"]["regressions"] == 0, second["error"]
        assert [w["kind"] for w in second["warnings"]].count("no_golden_set") == 1
        # status: what live serves carries it
        status = status_view(deps)
        assert [w.text for w in status.warnings if w.kind == "no_golden_set"] == [said]
        assert status.problems == ()
        # a run that finds nothing changed says it again, from live's record
        again = run_reindex(deps).to_dict()
        assert again["outcome"] == "no_change" and said in [w["text"] for w in again["warnings"]]
    # the page: on the version row, where validation warnings appear
    rows = {row["version"]: row for row in read_status(settings).to_json()["versions"]}
    assert [w["text"] for w in rows[2]["warnings"]] == [said] and rows[2]["hit_rate"] is None
    report = (settings.reports_dir / ALIAS / "v2" / "validation.md").read_text(encoding="utf-8")
    assert f"- golden probes: none scored ({said})" in report
