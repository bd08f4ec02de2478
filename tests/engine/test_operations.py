"""Operator workflows through the engine: rollback, model migration, history, retention, MySQL state."""

from __future__ import annotations


import pytest
from conftest import force_status
from kb_reindex.run.pipeline import run_reindex
from kb_reindex.run.runs import run_rollback
from kb_reindex.rules.alias import rollback_target
from kb_reindex.rules.checks import structural_problems
from kb_reindex.domain.errors import ConfigError, RollbackRefused
from kb_reindex.reader import search_knowledge
from kb_reindex.steps.retention import cleanup, retention_victims
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.store import StateStore
from kb_reindex.services.store import KnowledgeStore
from kb_reindex.steps.validate import validate
from kb_reindex.run.status import history
from qdrant_client import QdrantClient

ALIAS = "mall_knowledge"
SHAPE_CHECKS = ("collection exists", "point count", "point ids", "dimension", "distance")


def edit(deps: Deps, key: str, extra: str) -> None:
    path = deps.settings.knowledge_dir / f"{key}.md"
    path.write_text(path.read_text(encoding="utf-8") + f"\n\n{extra}\n", encoding="utf-8")


def three_versions(deps: Deps) -> None:
    assert run_reindex(deps).outcome == "promoted"
    edit(deps, "coupon-rules", "补充一：优惠券不可兑换现金。")
    assert run_reindex(deps).outcome == "promoted"
    edit(deps, "shipping-policy", "补充二：大件商品送货上门。")
    assert run_reindex(deps).outcome == "promoted"


def test_rollback_to_previous_then_to_a_chosen_version(deps: Deps) -> None:
    three_versions(deps)
    assert rollback_target(deps).version == 2
    result = run_rollback(deps, reason="bad shipping text")
    assert (result.from_version, result.to_version, result.outcome) == (3, 2, "rolled_back")
    assert result.validation is not None and result.validation.passed
    assert deps.store.alias_target(ALIAS) == result.collection
    assert deps.state.get_version(ALIAS, 3).status == "retired"
    assert deps.store.exists(deps.state.get_version(ALIAS, 3).collection)

    chosen = run_rollback(deps, reason="back to the first", to_version=1)
    assert chosen.to_version == 1
    events = history(deps)
    assert [e.action for e in events] == ["promote", "promote", "promote", "rollback", "rollback"]
    assert events[-1].reason == "back to the first" and events[-1].from_version == 2


def test_a_rollback_keeps_the_targets_first_promotion_and_stamps_when_it_is_live_again(deps: Deps) -> None:
    """v2 was promoted once; a rollback from v3 puts it live again: `promoted_at` stays the first promotion
    (the page and status show it), `live_since` is the rollback's time (the watch window counts from it)."""
    from kb_reindex.run.status import status_view
    from kb_reindex.services.state.clock import utc_stamp

    three_versions(deps)
    before = deps.state.get_version(ALIAS, 2)
    assert before.promoted_at is not None and before.live_since == before.promoted_at
    run_rollback(deps, reason="bad shipping text")
    after = deps.state.get_version(ALIAS, 2)
    assert after.status == "live" and after.promoted_at == before.promoted_at
    assert after.live_since is not None and after.live_since > before.promoted_at
    assert after.serving_since == after.live_since
    row = next(v for v in status_view(deps).versions if v.version == 2)
    assert (row.promoted_at, row.live_since) == (utc_stamp(before.promoted_at), utc_stamp(after.live_since))


@pytest.mark.parametrize("damage", ["missing", "failed", "deleted", "short"])
def test_rollback_refuses_a_broken_target_and_nothing_moves(deps: Deps, damage: str) -> None:
    three_versions(deps)
    target = deps.state.get_version(ALIAS, 2)
    if damage == "missing":
        deps.store.delete_collection(target.collection)
    elif damage in ("failed", "deleted"):
        force_status(deps.state, target.id, damage)
    else:
        points, _ = deps.store.client.scroll(target.collection, limit=1)
        deps.store.client.delete(target.collection, points_selector=[points[0].id])
    refusal = {"missing": "not whole: collection exists", "failed": "is failed", "deleted": "is deleted",
               "short": "not whole: point count"}[damage]
    with pytest.raises(RollbackRefused, match=refusal):
        run_rollback(deps, reason="test", to_version=2)
    if damage == "short":  # rollback's structural check is validation's: the same failure, in the same words
        problems = structural_problems(deps, target)
        checked = validate(deps, 2, compare_live=False, raise_on_failure=False, record=False)
        assert problems and problems == [f for f in checked.failures if f.split(":")[0] in SHAPE_CHECKS]
    assert deps.state.live_version(ALIAS).version == 3
    assert deps.store.alias_target(ALIAS) == deps.state.get_version(ALIAS, 3).collection


def test_rollback_needs_a_reason_and_a_known_target(deps: Deps) -> None:
    three_versions(deps)
    with pytest.raises(RollbackRefused, match="reason"):
        run_rollback(deps, reason="  ")
    with pytest.raises(RollbackRefused, match="no version 9"):
        run_rollback(deps, reason="x", to_version=9)
    with pytest.raises(RollbackRefused, match="already live"):
        run_rollback(deps, reason="x", to_version=3)


def test_reindex_after_rollback_plans_against_the_rolled_back_version(deps: Deps) -> None:
    three_versions(deps)
    run_rollback(deps, reason="revert shipping")
    result = run_reindex(deps)
    # the files still hold the change of v3: it is rebuilt on top of v2, visibly, not silently re-promoted as v3
    assert result.outcome == "promoted" and result.version == 4
    assert result.plan.base_version == 2
    assert result.docs.changed == 1


def test_migration_to_another_dimension_with_promote(deps: Deps) -> None:
    first = run_reindex(deps)
    result = run_reindex(deps, kind="migration", embedder="hashing", model="hashing-ngram-v2", dim=384, min_hit_rate=0.85)
    assert result.outcome == "promoted", result.error
    assert result.chunks.copied == 0 and result.chunks.embedded == first.chunks.total
    assert result.collection == f"{ALIAS}__hashing-ngram-v2__s2"
    live = deps.state.live_version(ALIAS)
    assert (live.embed_model, live.embed_dim, live.kind) == ("hashing-ngram-v2", 384, "migration")
    assert deps.store.shape(result.collection).dim == 384
    assert history(deps)[-1].action == "migrate"
    validation = deps.state.get_version(ALIAS, 2).validation
    assert validation["compared_as"] == "side_by_side" and validation["regressions"] == 0
    assert all("rank_live" in p and "rank_candidate" in p for p in validation["probes"])

    # later reindexes keep the live model, whatever the configured default says
    edit(deps, "coupon-rules", "补充：新人券仅限首单。")
    again = run_reindex(deps)
    assert again.outcome == "promoted"
    assert deps.state.get_version(ALIAS, 3).embed_model == "hashing-ngram-v2"
    assert again.chunks.copied > 0

    # the reader embeds with the live model and refuses a caller on another one
    found = search_knowledge(deps, "优惠券可以叠加使用吗", k=2)
    assert found.embed_model == "hashing-ngram-v2" and found.results
    with pytest.raises(ConfigError, match="serves 'hashing-ngram-v2'"):
        search_knowledge(deps, "退货", expect_model="hashing-ngram-v1")
    with pytest.raises(ConfigError, match="384-d"):
        search_knowledge(deps, "退货", expect_dim=1024)


def test_shadow_migration_is_built_validated_and_kept(deps: Deps) -> None:
    first = run_reindex(deps)
    shadow = run_reindex(deps, kind="migration", embedder="hashing", model="hashing-ngram-v3", dim=512,
                                promote_version=False)
    assert shadow.outcome == "shadow"
    assert deps.store.alias_target(ALIAS) == first.collection
    assert deps.state.get_version(ALIAS, 2).status == "ready"
    cleanup(deps)
    assert deps.state.get_version(ALIAS, 2).status == "ready" and deps.store.exists(shadow.collection)


def test_retention_keeps_live_newest_retired_and_rollback_target(deps: Deps) -> None:
    deps.settings = deps.settings.__class__(**{**deps.settings.__dict__, "keep_versions": 0})
    three_versions(deps)
    edit(deps, "payment-guide", "补充三：支持数字人民币。")
    assert run_reindex(deps).version == 4  # its cleanup already ran with keep=0
    statuses = {v.version: v.status for v in deps.state.list_versions(ALIAS)}
    assert statuses == {4: "live", 3: "retired", 2: "deleted", 1: "deleted"}
    # roll back to v3, then v4 is the newest retired and v3 live: nothing else may go
    run_rollback(deps, reason="test")
    cleanup(deps)
    statuses = {v.version: v.status for v in deps.state.list_versions(ALIAS)}
    assert statuses[3] == "live" and statuses[4] == "retired"
    for version in (3, 4):
        assert deps.store.exists(deps.state.get_version(ALIAS, version).collection)
    # manifests of deleted versions are kept for audit
    assert deps.state.manifest_chunks(deps.state.get_version(ALIAS, 1).id)


def test_retention_victims_never_include_protected_versions(deps: Deps) -> None:
    three_versions(deps)
    versions = deps.state.list_versions(ALIAS)
    target = rollback_target(deps)
    victims = retention_victims(versions, keep=0, protected={target.id})
    assert {v.version for v in victims} == {1}
    assert all(v.status != "live" for v in victims)
    # KB_KEEP_VERSIONS counts retired versions besides live and the rollback target (v2), as documented:
    # keep=1 keeps v1 too, and a pin is kept on top of it
    live = deps.state.live_version(ALIAS)
    assert retention_victims(versions, keep=1, protected={live.id, target.id}) == []
    assert [v.version for v in retention_victims(versions, keep=0, protected={live.id, target.id})] == [1]
    # no rollback target: keep=1 is the newest retired one (v2)
    assert [v.version for v in retention_victims(versions, keep=1, protected={live.id})] == [1]


def test_full_run_with_state_on_mysql(settings, mysql_url: str) -> None:
    mysql_settings = settings.__class__(**{**settings.__dict__, "state_url": mysql_url})
    state = StateStore(mysql_url)
    deps = Deps(settings=mysql_settings, state=state, store=KnowledgeStore(QdrantClient(":memory:")))
    try:
        three_versions(deps)
        assert run_reindex(deps).outcome == "no_change"
        run_rollback(deps, reason="mysql")
        assert state.live_version(ALIAS).version == 2
        assert [e.action for e in state.alias_events(ALIAS)][-1] == "rollback"
    finally:
        state.dispose()


def test_failed_build_versions_are_dropped_by_gc(deps: Deps, monkeypatch: pytest.MonkeyPatch) -> None:
    run_reindex(deps)
    edit(deps, "coupon-rules", "补充：测试。")

    def broken(self, version):
        raise RuntimeError("embedder down")

    monkeypatch.setattr(Deps, "embedder_for", broken)
    assert run_reindex(deps).outcome == "failed"
    failed = deps.state.get_version(ALIAS, 2)
    assert failed.status == "failed" and deps.store.exists(failed.collection)
    monkeypatch.undo()
    result = cleanup(deps)
    assert [d.version for d in result.deleted] == [2]
    # v2 resides nowhere now; its slot stays, for the next build to take (three slots rotate per profile)
    assert not deps.store.exists(deps.state.get_version(ALIAS, 2).collection)
    assert deps.state.live_version(ALIAS).version == 1


def test_shadow_version_is_dropped_only_explicitly_and_live_or_target_never(deps: Deps) -> None:
    from kb_reindex.domain.errors import KbError
    from kb_reindex.steps.retention import drop_version

    three_versions(deps)
    shadow = run_reindex(deps, kind="migration", embedder="hashing", model="hashing-ngram-v9", dim=512,
                                promote_version=False)
    with pytest.raises(KbError, match="is live"):
        drop_version(deps, 3)
    with pytest.raises(KbError, match="rollback target"):
        drop_version(deps, 2)
    dropped = drop_version(deps, shadow.version)
    assert dropped.collection_dropped and not deps.store.exists(shadow.collection)
    assert deps.state.get_version(ALIAS, shadow.version).status == "deleted"


def test_rollback_is_not_blocked_by_a_golden_set_naming_newer_documents(deps: Deps) -> None:
    from conftest import write_doc

    run_reindex(deps)
    write_doc(deps.settings.root, "gift-card", "# 礼品卡\n\n## 使用\n\n礼品卡结算时可抵扣全部金额。\n")
    golden = deps.settings.golden_set
    golden.write_text(golden.read_text(encoding="utf-8")
                      + "  - id: gift-card-use\n    query: 礼品卡怎么用\n    expected: [gift-card]\n", encoding="utf-8")
    assert run_reindex(deps).outcome == "promoted"
    result = run_rollback(deps, reason="gift card text is wrong")
    assert result.to_version == 1 and deps.state.live_version(ALIAS).version == 1
    assert result.to_dict()["validation"]["passed"] is None and "gift-card" in result.to_dict()["validation"]["error"]
    assert deps.state.get_version(ALIAS, 1).status == "live"


def test_after_a_rollback_the_default_target_is_not_the_version_rolled_away_from(deps: Deps) -> None:
    three_versions(deps)
    run_rollback(deps, reason="v3 bad")
    assert rollback_target(deps).version == 1
    run_rollback(deps, reason="v2 bad too")
    assert deps.state.live_version(ALIAS).version == 1


def test_fixing_the_golden_set_after_a_failed_validation_resumes_without_embedding(deps: Deps,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    run_reindex(deps)
    edit(deps, "coupon-rules", "补充：券不可转让。")
    golden = deps.settings.golden_set
    data = yaml.safe_load(golden.read_text(encoding="utf-8"))
    good = yaml.safe_dump(data, allow_unicode=True)
    data["min_mrr"] = 1.0  # an impossible bar
    golden.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    failed = run_reindex(deps)
    assert failed.outcome == "failed" and deps.state.get_version(ALIAS, 2).failed_step == "validate"
    golden.write_text(good, encoding="utf-8")

    calls = {"texts": 0}
    original = Deps.embedder_for

    def counting(self: Deps, version):
        embedder = original(self, version)
        embed = embedder.embed

        def counted(texts):
            calls["texts"] += sum(1 for t in texts if "补充：券不可转让" in t)
            return embed(texts)

        embedder.embed = counted
        return embedder

    monkeypatch.setattr(Deps, "embedder_for", counting)
    again = run_reindex(deps)
    assert again.outcome == "promoted" and again.version == 2
    assert calls["texts"] == 0, "the changed chunk was not embedded a second time"


def test_gc_drops_a_build_abandoned_by_a_run_that_ended(deps: Deps) -> None:
    from kb_reindex.steps.build import create_version
    from kb_reindex.run.pipeline import plan_and_snapshot

    run_reindex(deps)
    edit(deps, "coupon-rules", "补充：测试。")
    from kb_reindex.run import dag_lock

    deps.state.start_run(run_id="crashed", alias=ALIAS, kind="reindex", trigger="airflow")
    dag_lock.take(deps, "crashed")  # a DAG run holds the alias's lock from its plan until it ends
    create_version(deps, plan_and_snapshot(deps, run_id="crashed"), run_id="crashed")
    assert deps.state.get_version(ALIAS, 2).status == "building"
    cleanup(deps)
    assert deps.state.get_version(ALIAS, 2).status == "building", "its run may still be retrying"
    deps.state.finish_run("crashed", outcome="failed", error="worker lost")
    dag_lock.release(deps, "crashed")  # its failure callback
    result = cleanup(deps)
    assert [d.version for d in result.deleted] == [2]
    assert not deps.store.exists(deps.state.get_version(ALIAS, 2).collection)  # its slot stays for the next build


def test_a_rollback_moves_nothing_when_another_version_goes_live_between_its_check_and_its_move(
        deps: Deps, monkeypatch: pytest.MonkeyPatch) -> None:
    """On-call confirmed v2 -> v1; while the rollback scores v1, a shadow v3 is promoted. The confirmed live
    version is checked by the compare-and-swap under the alias lock, not by a read before: nothing moves,
    and the error says what serves now."""
    import kb_reindex.run.runs as rollback_module  # the recorded rollback scores its target
    from kb_reindex.domain.errors import AliasMovedError
    from kb_reindex.run.pipeline import promote_shadow

    assert run_reindex(deps).outcome == "promoted"
    edit(deps, "coupon-rules", "补充一：优惠券不可兑换现金。")
    assert run_reindex(deps).outcome == "promoted"
    edit(deps, "shipping-policy", "补充二：大件商品送货上门。")
    assert run_reindex(deps, promote_version=False).outcome == "shadow"
    scores = rollback_module.validate
    promoted: list[int] = []

    def scoring_while_v3_is_promoted(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not promoted:
            promoted.append(0)
            promoted[0] = promote_shadow(deps, 3, expected_live=2, reason="meanwhile").version
        return scores(*args, **kwargs)

    monkeypatch.setattr(rollback_module, "validate", scoring_while_v3_is_promoted)
    with pytest.raises(AliasMovedError) as refused:
        run_rollback(deps, reason="v2 is bad", expected_live=2, to_version=1)
    assert str(refused.value).startswith(f"{ALIAS} serves v3 now, not v2 (which you confirmed): nothing was rolled back")
    assert promoted == [3] and deps.state.live_version(ALIAS).version == 3
    assert deps.store.alias_target(ALIAS) == deps.state.get_version(ALIAS, 3).collection
    assert deps.state.get_version(ALIAS, 1).status == "retired"
    assert [e.action for e in history(deps)] == ["promote", "promote", "promote"]
    # and a stale confirmation is refused before anything is scored
    with pytest.raises(AliasMovedError, match="serves v3 now, not v2 .which you confirmed.: nothing was rolled back"):
        run_rollback(deps, reason="v2 is bad", expected_live=2)



def test_a_lock_left_by_a_gone_process_is_named_with_or_without_qdrant(deps: Deps) -> None:
    """The note that a lock's holder is gone (the next command takes it over) comes from the state DB alone: the
    page's state-only view (Qdrant busy or unavailable, when on-call most needs it) names it as `status` does."""
    from kb_reindex.services.state.locks import default_lock_owner
    from kb_reindex.rules.locking import reindex_lock_name
    from kb_reindex.run.status import state_only_view, status_view
    from kb_reindex.services.runtime import StateDeps

    run_reindex(deps)
    deps.state.acquire_lock(reindex_lock_name(ALIAS), owner=default_lock_owner(pid=999999), ttl_s=3600)
    state_only = state_only_view(StateDeps(settings=deps.settings, state=deps.state))
    for view in (status_view(deps), state_only):
        assert any(":999999:" in note and "whose process is gone" in note for note in view.notes), view.notes
