from __future__ import annotations

from pathlib import Path

import pytest

from kb_reindex.domain.errors import GoldenSetError
from kb_reindex.steps.golden import check_probe_keys, first_hit_rank, load_golden_set, score

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "golden.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_shipped_golden_set_covers_every_document() -> None:
    golden = load_golden_set(REPO / "knowledge" / "golden.yaml")
    keys = {p.stem for p in (REPO / "knowledge" / "docs").glob("*.md")}
    assert len(golden.probes) >= 24
    assert {e for p in golden.probes for e in p.expected} == keys
    check_probe_keys(golden, keys)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("k: 0\nprobes: [{id: a, query: q, expected: [x]}]", "'k' must be a whole number of at least 1"),
        ("k: 2\nmin_hit_rate: 1.5\nprobes: [{id: a, query: q, expected: [x]}]", "'min_hit_rate' must be a number from 0 to 1"),
        ("min_mrr: -0.1\nprobes: [{id: a, query: q, expected: [x]}]", "'min_mrr'"),
        ("max_regressions: -1\nprobes: [{id: a, query: q, expected: [x]}]", "'max_regressions'"),
        ("k: 2\nprobes: []", "'probes' must be a non-empty list"),
        ("probes: [{id: a, expected: [x]}]", "probe 'a': 'query' must be non-empty text"),
        ("probes: [{id: a, query: q}]", "probe 'a': 'expected' must be a non-empty list"),
        ("probes: [{query: q, expected: [x]}]", "probes[0]: 'id'"),
        ("probes: [{id: a, query: q, expected: [x]}, {id: a, query: r, expected: [x]}]", "id is used twice"),
        ("k: [unclosed", "not valid YAML"),
        ("probes: [{id: a, query: q, expected: [x], tenant: ''}]", "probe 'a': 'tenant' must be non-empty text"),
        ("probes: [{id: a, query: q, expected: [x], tenant: [vip]}]", "probe 'a': 'tenant' must be non-empty text"),
    ],
)
def test_malformed_golden_set_names_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(GoldenSetError) as error:
        load_golden_set(path)
    assert message in str(error.value)
    assert str(path) in str(error.value)


def test_probe_naming_a_missing_key_is_reported_with_its_id(tmp_path: Path) -> None:
    golden = load_golden_set(write(tmp_path, "probes: [{id: ghost, query: q, expected: [nowhere]}, {id: ok, query: q, expected: [a]}]"))
    with pytest.raises(GoldenSetError, match="ghost -> nowhere"):
        check_probe_keys(golden, {"a"})


def test_rank_and_scores() -> None:
    assert first_hit_rank(["a", "b", "c"], ["c"]) == 3
    assert first_hit_rank(["a", "b"], ["z"]) is None
    hit_rate, mrr = score([1, 2, None, 4])
    assert hit_rate == 0.75
    assert mrr == pytest.approx((1 + 0.5 + 0.25) / 4)
    assert score([]) == (0.0, 0.0)


def _edit_golden(path: Path, **fields: object) -> None:
    import yaml

    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    data.update(fields)
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")


def test_plan_command_reports_a_bad_threshold_with_file_and_field(project: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kb_reindex.cli import main

    from conftest import init_embedded

    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    init_embedded(project)
    golden = project / "knowledge" / "golden.yaml"
    _edit_golden(golden, min_hit_rate=1.5)
    code = main(["plan", "--json", "-q"])
    answer = json.loads(capsys.readouterr().out)
    assert code == 1 and answer["outcome"] == "failed"
    assert str(golden) in answer["error"] and "'min_hit_rate' must be a number from 0 to 1" in answer["error"]


def test_run_with_a_bad_golden_set_stops_before_any_version_exists(deps) -> None:
    from kb_reindex.run.pipeline import run_reindex

    _edit_golden(deps.settings.golden_set, k=0)
    result = run_reindex(deps)
    assert result.outcome == "failed" and "'k' must be a whole number" in result.error
    assert result.version is None and deps.state.list_versions(deps.settings.alias) == []
    assert not deps.store.collection_names()
    assert deps.state.list_runs(deps.settings.alias)[0].outcome == "failed"


def test_plan_refuses_a_probe_expecting_a_document_not_in_the_files(deps) -> None:
    from kb_reindex.steps.plan import plan

    (deps.settings.knowledge_dir / "payment-guide.md").unlink()
    with pytest.raises(GoldenSetError) as error:
        plan(deps)
    message = str(error.value)
    assert str(deps.settings.golden_set) in message and "'expected'" in message and "-> payment-guide" in message


def test_airflow_plan_task_fails_for_good_on_a_bad_golden_set(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from kb_reindex.airflow import connections, tasks
    from kb_reindex.services.config import Settings
    from kb_reindex.services.runtime import open_deps

    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    monkeypatch.setattr(connections, "_connection", lambda conn_id: None)  # no Airflow Connections defined
    _edit_golden(project / "knowledge" / "golden.yaml", min_mrr=1.5)
    with pytest.raises(AirflowFailException, match="GoldenSetError: .*golden.yaml: 'min_mrr'"):
        tasks.plan_task(run_id="airflow__plan__golden")
    with open_deps(Settings.from_env()) as deps:
        assert deps.state.get_run("airflow__plan__golden").outcome == "failed"
        assert deps.state.list_versions(deps.settings.alias) == []


def test_a_probe_whose_document_left_its_tenant_fails_by_name_whatever_the_regressions_allow(tmp_path: Path) -> None:
    from kb_reindex.steps.golden import invisible_to_tenant

    golden = load_golden_set(write(tmp_path, "max_regressions: 5\nprobes: [{id: ship, query: q, expected: [shipping], "
                                             "tenant: default}, {id: any, query: q, expected: [shipping]}]"))
    assert golden.probes[0].tenant == "default" and golden.probes[1].tenant is None
    assert invisible_to_tenant(golden, {"shipping": "default"}, version=2) == []
    failures = invisible_to_tenant(golden, {"shipping": "vip"}, was={"shipping": "default"}, version=2, live_version=1)
    assert failures == ["probe ship (tenant default): its document shipping is under tenant vip in v2 (tenant default "
                        "in live v1), so tenant default no longer finds it (a tenant gate: max_regressions does not "
                        "apply)"]


def test_identical_chunks_of_two_documents_are_one_warning_on_the_changed_one() -> None:
    from kb_reindex.services.state.manifests import ManifestChunk
    from kb_reindex.steps.duplicates import identical

    rows = [ManifestChunk("p1", "coupon-copy", None, 0, "h0"), ManifestChunk("p2", "coupon-copy", None, 1, "h1"),
            ManifestChunk("p3", "coupon-rules", None, 0, "h0"), ManifestChunk("p4", "coupon-rules", None, 1, "h1")]
    [warning] = identical(rows, changed={"coupon-copy"})
    assert (warning.kind, warning.knowledge_key, warning.other_key, warning.line) == (
        "duplicate", "coupon-copy", "coupon-rules", None)
    assert warning.text == "chunk 0 is identical to chunk 0 of coupon-rules (2 identical chunks)"
    assert warning.to_dict() == {"kind": "duplicate", "knowledge_key": "coupon-copy", "line": None,
                                 "text": warning.text, "other_key": "coupon-rules"}


def test_a_golden_set_with_several_mistakes_names_every_one_and_stays_readable(tmp_path: Path) -> None:
    golden = tmp_path / "golden.yaml"
    long_id = "p" * 4024
    golden.write_text(f"k: 0\nmin_hit_rate: 1.5\nmin_mrr: high\nprobes:\n  - {{id: {long_id}, query: ''}}\n"
                      "  - {id: ok, query: q, expected: [a]}\n  - {id: ok, query: q, expected: [a]}\n",
                      encoding="utf-8")
    with pytest.raises(GoldenSetError) as refused:
        load_golden_set(golden)
    message = str(refused.value)
    assert message.startswith(f"{golden}: 5 problems: 'k' must be a whole number of at least 1, got 0; "
                              "'min_hit_rate' must be a number from 0 to 1, got 1.5; "
                              "'min_mrr' must be a number from 0 to 1, got 'high'; probe 'ppp"), message
    assert "(4,026 characters)" in message and "probe 'ok': id is used twice" in message
    assert len(message) < 500
