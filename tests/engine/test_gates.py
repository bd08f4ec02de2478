"""Sharper gates (per category, paired against live), pinned versions, the audit of live, and
`migrate --dry-run` writing nothing."""

from __future__ import annotations

import json
import sqlite3
import uuid
from pathlib import Path

import pytest
import yaml
from conftest import force_status, settings_for, write_doc
from kb_reindex.run.pipeline import run_reindex
from kb_reindex.domain.errors import GoldenSetError, KbError
from kb_reindex.steps.golden import load_golden_set, paired_comparison, sign_test_p
from kb_reindex.domain.validation_model import ProbeResult, ValidationResult
from kb_reindex.steps.retention import cleanup, drop_version, pin_version, unpin_version
from kb_reindex.services.runtime import Deps
from kb_reindex.run.status import status_view
from qdrant_client import QdrantClient, models

ALIAS = "mall_knowledge"


def edit(deps: Deps, key: str, extra: str) -> None:
    path = deps.settings.knowledge_dir / f"{key}.md"
    path.write_text(path.read_text(encoding="utf-8") + f"\n\n{extra}\n", encoding="utf-8")


def set_golden(deps: Deps, **fields: object) -> None:
    path = deps.settings.golden_set
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    data.update(fields)
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")


# --- per category --------------------------------------------------------------------------------


def test_a_category_that_loses_its_probes_fails_the_gate_while_the_totals_pass(deps: Deps) -> None:
    first = run_reindex(deps)
    assert first.outcome == "promoted"
    member = next(c for c in first.validation.by_category if c["category"] == "会员")
    assert member["probes"] == 7 and member["hit_rate"] == 1.0
    # totals and the regression count leave room for 7 lost probes; the paired test is set aside here
    set_golden(deps, min_hit_rate=0.5, min_mrr=0.3, max_regressions=10, max_category_drop=0.2, paired_alpha=1e-9)
    # the member rules lose their substance (the document stays, so every probe's key still exists)
    write_doc(deps.settings.root, "member-rules",
              "---\ntitle: 会员规则\ncategory: 会员\ntenant: default\n---\n\n# 会员规则\n\n本页正在整理中。\n")
    second = run_reindex(deps)

    assert second.outcome == "failed"
    v = second.validation
    assert v.hit_rate >= 0.5 and v.mrr >= 0.3 and 0 < v.regressions <= 10  # the totals pass
    assert len(v.failures) == 1 and v.failures[0].startswith("category 会员:")
    rows = {c["category"]: c for c in v.by_category}
    assert rows["会员"]["dropped"] and rows["会员"]["hit_rate_drop"] > 0.2 and rows["会员"]["lost"]
    assert not any(r["dropped"] for name, r in rows.items() if name != "会员")
    assert deps.state.live_version(ALIAS).version == 1  # the alias did not move
    html = (Path(v.report).with_suffix(".html")).read_text(encoding="utf-8")
    assert "Categories" in html and "会员" in html and "Paired comparison with live" in html
    md = Path(v.report).read_text(encoding="utf-8")
    assert "## Categories" in md and "sign test" in md

    # the same edit with the margin wide open passes: the category gate alone refused it (the emptied page's
    # content loss, held for a person otherwise, is approved here as the paired test is set aside)
    set_golden(deps, max_category_drop=1.0, max_shrink=1.0)
    assert run_reindex(deps).outcome == "promoted"


def test_probe_category_can_be_named_in_the_golden_set(deps: Deps) -> None:
    data = yaml.safe_load(deps.settings.golden_set.read_text(encoding="utf-8"))
    data["probes"][0]["category"] = "退货时效"
    deps.settings.golden_set.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    result = run_reindex(deps)
    rows = {c["category"]: c for c in result.validation.by_category}
    assert rows["退货时效"]["probes"] == 1
    assert rows["售后"]["probes"] == 14  # the other return and after-sales probes keep their documents' category


@pytest.mark.parametrize("field, value, message", [
    ("max_category_drop", 1.5, "'max_category_drop' must be a number from 0 to 1, got 1.5"),
    ("max_category_drop", "a lot", "'max_category_drop' must be a number from 0 to 1"),
    ("paired_alpha", 0, "'paired_alpha' must be above 0 and below 1, got 0.0"),
    ("paired_alpha", True, "'paired_alpha' must be a number from 0 to 1"),
])
def test_bad_gate_settings_name_the_file_and_field(tmp_path: Path, field: str, value: object, message: str) -> None:
    path = tmp_path / "golden.yaml"
    path.write_text(yaml.safe_dump({"probes": [{"id": "a", "query": "q", "expected": ["k"]}], field: value}),
                    encoding="utf-8")
    with pytest.raises(GoldenSetError) as caught:
        load_golden_set(path)
    assert str(path) in str(caught.value) and message in str(caught.value)


def test_a_blank_probe_category_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "golden.yaml"
    path.write_text(yaml.safe_dump({"probes": [{"id": "a", "query": "q", "expected": ["k"], "category": " "}]}),
                    encoding="utf-8")
    with pytest.raises(GoldenSetError, match="probe 'a': 'category' must be non-empty text"):
        load_golden_set(path)


# --- paired test ---------------------------------------------------------------------------------


def test_sign_test_is_exact() -> None:
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(5, 5) == pytest.approx(1 / 32)
    assert sign_test_p(4, 5) == pytest.approx(6 / 32)
    assert sign_test_p(0, 7) == 1.0


def test_paired_comparison_separates_a_pattern_from_one_probe() -> None:
    def probes(pairs: list[tuple[int | None, int | None]]) -> list[ProbeResult]:
        return [ProbeResult.from_dict({"probe": str(i), "rank_live": live, "rank_candidate": cand})
                for i, (live, cand) in enumerate(pairs)]

    one = paired_comparison(probes([(1, 2)] + [(1, 1)] * 10), alpha=0.05)
    assert (one.worse, one.better, one.ties) == (1, 0, 10)
    assert one.p_worse == 0.5 and not one.significant_worse and one.verdict == "no significant difference"
    many = paired_comparison(probes([(1, None)] * 3 + [(1, 3)] * 3 + [(2, 2)] * 10), alpha=0.05)
    assert many.worse == 6 and many.p_worse == pytest.approx(1 / 64, abs=1e-4)
    assert many.significant_worse and many.verdict == "worse"
    better = paired_comparison(probes([(None, 1)] * 6), alpha=0.05)
    assert better.verdict == "better" and not better.significant_worse


def test_candidate_worse_than_live_by_the_sign_test_fails_even_within_the_thresholds(deps: Deps) -> None:
    assert run_reindex(deps).outcome == "promoted"
    # thresholds, regressions and categories all leave room; only the paired test remains to decide
    set_golden(deps, min_hit_rate=0.0, min_mrr=0.0, max_regressions=45, max_category_drop=1.0, paired_alpha=0.05)
    for key in ("member-rules", "coupon-rules", "payment-guide"):
        write_doc(deps.settings.root, key, f"---\ntitle: {key}\ncategory: 其他\ntenant: default\n---\n\n"
                                                   f"# {key}\n\n本页正在整理中。\n")
    result = run_reindex(deps)
    paired = result.validation.paired
    assert result.outcome == "failed" and paired["significant_worse"] and paired["worse"] > paired["better"]
    assert [f for f in result.validation.failures if f.startswith("paired sign test:")]
    assert len(result.validation.failures) == 1


# --- pins ------------------------------------------------------------------------------------------


def test_a_pinned_version_survives_retention_and_drop_until_unpinned(deps: Deps) -> None:
    deps.settings = deps.settings.__class__(**{**deps.settings.__dict__, "keep_versions": 0})
    assert run_reindex(deps).outcome == "promoted"
    pinned = pin_version(deps, 1, reason="known-good baseline before the spring sale", by="alice@test")
    assert pinned.pinned_by == "alice@test" and not pinned.already_pinned
    for number, text in enumerate(("补充一：优惠券不可兑换现金。", "补充二：大件商品送货上门。", "补充三：支持数字人民币。"), 2):
        edit(deps, "coupon-rules", text)
        assert run_reindex(deps).version == number  # each run's cleanup ran with keep=0
    statuses = {v.version: v.status for v in deps.state.list_versions(ALIAS)}
    # without the pin v1 goes first (it did in the plain retention test); v2 is the oldest unpinned
    assert statuses == {4: "live", 3: "retired", 2: "deleted", 1: "retired"}
    assert deps.store.exists(deps.state.get_version(ALIAS, 1).collection)
    assert cleanup(deps).pinned == (1,)
    with pytest.raises(KbError, match=r"v1 is pinned \('known-good baseline before the spring sale', by alice@test"):
        drop_version(deps, 1)

    status = status_view(deps).to_dict()
    row = next(v for v in status["versions"] if v["version"] == 1)
    assert row["pinned"] and row["pin"]["reason"].startswith("known-good") and status["pinned"] == [1]

    assert unpin_version(deps, 1, by="bob@test").was_pinned
    assert unpin_version(deps, 1).was_pinned is False
    assert [d.version for d in cleanup(deps).deleted] == [1]
    assert not status_view(deps).to_dict()["pinned"]


def test_only_a_whole_version_can_be_pinned(deps: Deps, monkeypatch: pytest.MonkeyPatch) -> None:
    from kb_reindex.domain.errors import ConfigError

    run_reindex(deps)
    with pytest.raises(ConfigError, match="pin needs --reason"):
        pin_version(deps, 1, reason="  ")
    with pytest.raises(ConfigError, match="has no version 7"):
        pin_version(deps, 7, reason="x")
    force_status(deps.state, deps.state.get_version(ALIAS, 1).id, "failed")
    with pytest.raises(ConfigError, match="v1 is failed; only a live, ready or retired version can be pinned"):
        pin_version(deps, 1, reason="x")


# --- audit -----------------------------------------------------------------------------------------


def _a_point(deps: Deps, collection: str) -> str:
    records, _ = deps.store.client.scroll(collection, limit=1, with_payload=False, with_vectors=False)
    return str(records[0].id)


@pytest.mark.parametrize("damage", ["delete", "orphan", "swap"])
def test_every_run_audits_live_and_status_reports_it(deps: Deps, damage: str) -> None:
    first = run_reindex(deps)
    assert first.plan.audit is None  # nothing was live to audit
    collection, total = first.collection, first.chunks.total
    again = run_reindex(deps)
    assert again.outcome == "no_change" and again.plan.audit.missing == again.plan.audit.orphans == 0
    assert status_view(deps).to_dict()["audit"]["expected"] == total

    if damage in ("delete", "swap"):
        deps.store.client.delete(collection, points_selector=models.PointIdsList(points=[_a_point(deps, collection)]),
                                 wait=True)
    if damage in ("orphan", "swap"):
        deps.store.upsert(collection, [models.PointStruct(id=str(uuid.uuid4()), vector=[0.5] * 1024, payload={})])
    edit(deps, "coupon-rules", "补充：测试审计。")
    result = run_reindex(deps)
    # a plan on a live version that lacks points is refused, as before; a count that still matches
    # (one deleted, one added) no longer hides it
    assert result.outcome == "failed" and "nothing was changed" not in result.error
    assert result.error.startswith(f"live collection {collection} ")
    if damage == "swap":
        assert "lacks 1 of the points its manifest lists" in result.error
    missing, orphans = {"delete": (1, 0), "orphan": (0, 1), "swap": (1, 1)}[damage]
    audit = status_view(deps).to_dict()["audit"]
    assert (audit["missing"], audit["orphans"], audit["expected"]) == (missing, orphans, total)
    assert audit["missing_ratio"] == pytest.approx(missing / total, abs=1e-6)
    assert audit["run_id"] == deps.state.list_runs(ALIAS, limit=1)[0].run_id
    assert any("the audit of live v1" in p for p in status_view(deps).to_dict()["problems"])


# --- migrate --dry-run -----------------------------------------------------------------------------


def _state_rows(db: Path) -> dict[str, list]:
    with sqlite3.connect(db) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        return {t: conn.execute(f"SELECT * FROM {t}").fetchall() for t in tables}


def _qdrant_view(path: Path) -> dict:
    client = QdrantClient(path=str(path))
    try:
        names = sorted(c.name for c in client.get_collections().collections)
        return {"collections": names, "counts": {n: client.count(n, exact=True).count for n in names},
                "aliases": sorted((a.alias_name, a.collection_name) for a in client.get_aliases().aliases)}
    finally:
        client.close()


def test_migrate_dry_run_estimates_and_writes_nothing(project: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from kb_reindex.cli import main

    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    assert main(["run", "-q"]) == 0
    capsys.readouterr()
    settings = settings_for(project)
    db = Path(settings.state_url.removeprefix("sqlite:///"))
    before_state, before_qdrant = _state_rows(db), _qdrant_view(settings.qdrant_path)
    files_before = sorted(p.relative_to(project) for p in (project / ".kb").rglob("*") if p.is_file()
                          and "qdrant" not in p.parts)

    code = main(["migrate", "--embedder", "hashing", "--model", "hashing-ngram-v9", "--dim", "512", "--dry-run",
                 "--json", "-q"])
    estimate = json.loads(capsys.readouterr().out)
    assert code == 0 and estimate["outcome"] == "dry_run"
    assert estimate["texts"] == before_qdrant["counts"][before_qdrant["aliases"][0][1]]  # every chunk, once
    assert estimate["estimated_tokens"] > estimate["texts"] and estimate["dim"] == 512
    assert estimate["batches"] == -(-estimate["texts"] // settings.embed_batch_size)
    assert estimate["probe_batch_texts"] == min(settings.embed_batch_size, estimate["texts"])
    assert estimate["estimated_embed_s"] >= 0 and estimate["live_version"] == 1

    assert _state_rows(db) == before_state  # no run, version, lock or audit row
    assert _qdrant_view(settings.qdrant_path) == before_qdrant
    assert sorted(p.relative_to(project) for p in (project / ".kb").rglob("*") if p.is_file()
                  and "qdrant" not in p.parts) == files_before  # no report either

    assert main(["migrate", "--embedder", "hashing", "--model", "hashing-ngram-v9", "--dry-run"]) == 0
    human = capsys.readouterr().out
    assert "nothing was written" in human and "tokens" in human


def test_pin_and_unpin_commands_take_the_write_lock_and_show_in_status(
        project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kb_reindex.cli import main
    from kb_reindex.rules.locking import reindex_lock_name
    from kb_reindex.services.state.store import StateStore

    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    monkeypatch.setenv("KB_LOCK_WAIT", "0")
    assert main(["run", "-q"]) == 0
    capsys.readouterr()
    assert main(["pin", "--version", "1", "--reason", "baseline", "--json", "-q"]) == 0
    pinned = json.loads(capsys.readouterr().out)
    assert pinned["pinned"] and pinned["reason"] == "baseline" and "@" in pinned["pinned_by"]
    assert main(["status", "-q"]) == 0
    human = capsys.readouterr().out
    assert "live *pinned" in human and "pinned: v1 (baseline;" in human
    assert "audit of live v1" in human and "missing 0" in human  # its validation checked every point
    assert main(["pin", "--version", "9", "--reason", "x", "-q"]) == 2  # a version that does not exist
    capsys.readouterr()

    state = StateStore(settings_for(project).state_url)
    try:
        with state.lock(reindex_lock_name(ALIAS), ttl_s=60):
            assert main(["unpin", "--version", "1", "-q"]) == 1
            assert "another run is working on mall_knowledge" in capsys.readouterr().err
        assert main(["unpin", "--version", "1", "-q"]) == 0
        assert "v1 unpinned" in capsys.readouterr().out
        assert state.active_pins(ALIAS) == {}
    finally:
        state.dispose()


def test_status_reads_a_state_db_made_before_pins_and_audits(project: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from kb_reindex.cli import main

    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    assert main(["run", "-q"]) == 0
    db = Path(settings_for(project).state_url.removeprefix("sqlite:///"))
    with sqlite3.connect(db) as conn:
        conn.execute("DROP TABLE kb_pins")
        conn.execute("DROP TABLE kb_audits")
    capsys.readouterr()
    assert main(["status", "--json", "-q"]) == 0  # read-only: no table is created, none is needed
    status = json.loads(capsys.readouterr().out)
    assert status["pinned"] == [] and status["audit"] is None and status["live"]["version"] == 1


def test_migrate_dry_run_times_one_real_batch_of_the_new_model(project: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """To Ollama: one embed request of one batch, the rest extrapolated from its latency."""
    from kb_reindex.cli import main
    from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer, FaultPlan

    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    assert main(["run", "-q"]) == 0
    capsys.readouterr()
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=64)], faults=FaultPlan(delay_per_text_s=0.002)) as ollama:
        monkeypatch.setenv("OLLAMA_HOST", ollama.url)
        code = main(["migrate", "--embedder", "ollama", "--dry-run", "--json", "-q"])
        estimate = json.loads(capsys.readouterr().out)
        assert code == 0, estimate
        # the model checks and the dimension probe send one text each; the timed batch is one request
        assert ollama.embedded_texts - estimate["probe_batch_texts"] == ollama.embed_requests - 1
    assert estimate["embed_model"] == "bge-m3" and estimate["dim"] == 64
    assert estimate["probe_batch_s"] >= 0.002 * estimate["probe_batch_texts"]  # the server's delay was measured
    assert estimate["estimated_embed_s"] == pytest.approx(estimate["probe_batch_s"] * estimate["batches"], abs=0.01)


# --- the validation record --------------------------------------------------------------------------


def test_a_stored_validation_reads_back_as_the_same_record_and_an_older_one_still_loads(deps: Deps) -> None:
    """The `validation` column holds ValidationResult.to_dict(); from_dict gives back the same JSON, key for
    key. A record with keys missing (scores restored from collection metadata) loads, its unknown keys kept."""
    assert run_reindex(deps).outcome == "promoted"
    stored = deps.state.live_version(ALIAS).validation
    result = ValidationResult.from_dict(stored)
    assert json.dumps(result.to_dict(), ensure_ascii=False) == json.dumps(stored, ensure_ascii=False)
    assert result.passed and result.checks and all(c.passed for c in result.checks) and result.probes

    older = {"passed": True, "hit_rate": 0.9, "mrr": 0.8, "restored_from": "collection metadata"}
    loaded = ValidationResult.from_dict(older)
    assert (loaded.hit_rate, loaded.mrr, loaded.probes, loaded.replay) == (0.9, 0.8, (), None)
    assert loaded.to_dict()["restored_from"] == "collection metadata"


# --- tenants and duplicates --------------------------------------------------------------------------


def test_a_probe_naming_a_tenant_is_scored_with_its_filter_and_fails_when_its_page_leaves_that_tenant(
        deps: Deps) -> None:
    """The trial's case: shipping-policy moved from tenant `default` to `vip`. Its probes name tenant `default`
    (the tenant the assistant passes): scored with the reader's filter they miss, and the tenant gate fails the
    version by probe and document although `max_regressions` allows every loss; the page is a `tenant_changed`
    warning."""
    data = yaml.safe_load(deps.settings.golden_set.read_text(encoding="utf-8"))
    for probe in data["probes"]:
        if probe["expected"] == ["shipping-policy"]:
            probe["tenant"] = "default"
    data.update(max_regressions=45, min_hit_rate=0.5, min_mrr=0.3, max_category_drop=1.0, paired_alpha=1e-9)
    deps.settings.golden_set.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    shipping = [p["id"] for p in data["probes"] if p.get("tenant")]
    assert run_reindex(deps).outcome == "promoted"
    path = deps.settings.knowledge_dir / "shipping-policy.md"
    path.write_text(path.read_text(encoding="utf-8").replace("tenant: default", "tenant: vip"), encoding="utf-8")

    result = run_reindex(deps)
    assert result.outcome == "failed" and deps.state.live_version(ALIAS).version == 1
    tenant_failures = [f for f in result.validation.failures if "(a tenant gate" in f]
    assert [f.split(" ")[1] for f in tenant_failures] == shipping
    assert all("its document shipping-policy is under tenant vip in v2 (tenant default in live v1)" in f
               for f in tenant_failures)
    record = ValidationResult.from_dict(deps.state.get_version(ALIAS, 2).validation)
    assert {p.probe: p.rank_candidate for p in record.probes if p.probe in shipping} == dict.fromkeys(shipping)
    assert [w.to_dict() for w in record.warnings] == [{
        "kind": "tenant_changed", "knowledge_key": "shipping-policy", "line": None,
        "text": "tenant default in v1 -> vip here; a reader passing tenant default no longer finds it"}]
    assert [w.kind for w in result.warnings] == ["tenant_changed"]


def test_identical_and_near_identical_copies_are_named_as_duplicates_of_their_page(deps: Deps) -> None:
    """A page copied as it is (identical chunks) and one copied under a new title (near-identical vectors): one
    warning of kind `duplicate` each, naming both documents, in the run, the version's record and status; the
    shipped pages alone have none, and a later run that leaves the copies alone keeps the warnings."""
    set_golden(deps, max_regressions=45, min_hit_rate=0.3, min_mrr=0.2, max_category_drop=1.0, paired_alpha=1e-9)
    first = run_reindex(deps)
    assert first.outcome == "promoted" and first.warnings == ()
    docs = deps.settings.knowledge_dir
    (docs / "coupon-copy.md").write_text((docs / "coupon-rules.md").read_text(encoding="utf-8"), encoding="utf-8")
    retitled = (docs / "return-policy.md").read_text(encoding="utf-8").replace("退换货政策", "退换货政策（新版）")
    (docs / "return-policy-copy.md").write_text(retitled, encoding="utf-8")

    result = run_reindex(deps)
    assert result.outcome == "promoted", result.error
    named = {(w.knowledge_key, w.other_key, w.score is not None) for w in result.warnings}
    assert named == {("coupon-copy", "coupon-rules", False), ("return-policy-copy", "return-policy", True)}
    assert result.validation.warnings == result.warnings
    assert "## Tenant changes and duplicates (2)" in Path(result.validation.report).read_text(encoding="utf-8")
    near = next(w for w in result.warnings if w.score is not None)
    assert near.score >= deps.settings.duplicate_cosine and "nearly identical" in near.text
    assert {(w.knowledge_key, w.other_key) for w in status_view(deps).warnings} == {
        ("coupon-copy", "coupon-rules"), ("return-policy-copy", "return-policy")}

    edit(deps, "payment-guide", "补充：支持数字人民币。")
    again = run_reindex(deps)
    assert again.outcome == "promoted" and again.chunks.embedded < 10
    assert {(w.knowledge_key, w.other_key) for w in again.warnings} == {
        ("coupon-copy", "coupon-rules"), ("return-policy-copy", "return-policy")}
    from kb_reindex.steps.plan import plan

    quiet = plan(deps)  # nothing changed since: what live serves, its validation's warnings included
    assert quiet.no_change and {(w.knowledge_key, w.other_key) for w in quiet.warnings} == {
        ("coupon-copy", "coupon-rules"), ("return-policy-copy", "return-policy")}
