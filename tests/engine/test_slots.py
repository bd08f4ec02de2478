"""The version model (kb_reindex.rules.slots): versions live in three rotating slots per embedding profile, a build
writes only what differs from the exact version its slot holds, an older kept version comes back by a restore
that embeds nothing. Counted at the Qdrant test server, where the vectors arrive and leave."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from qdrant_client import QdrantClient

from conftest import settings_for, write_doc
from kb_reindex.domain.errors import RollbackRefused
from kb_reindex.rules.checks import structural_problems
from kb_reindex.run.pipeline import run_reindex
from kb_reindex.run.runs import run_rollback
from kb_reindex.run.status import status_view
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.store import StateStore
from kb_reindex.services.store import KnowledgeStore
from kb_reindex.steps.restore import restore_version
from kb_reindex.testing.qdrant_server import FakeQdrantServer

ALIAS = "mall_knowledge"


def edit(deps: Deps, key: str, extra: str) -> None:
    path = deps.settings.knowledge_dir / f"{key}.md"
    path.write_text(path.read_text(encoding="utf-8") + f"\n\n{extra}\n", encoding="utf-8")


def appendix(settings: Any, pages: int = 40) -> None:
    """Pages no probe asks about, so the collection is larger than the payload sample (64 points)."""
    import random

    rng = random.Random(7)
    words = ["仓库", "盘点", "批次", "条码", "货架", "入库", "出库", "周转", "库位", "托盘", "拣货", "复核"]
    for n in range(pages):
        body = "\n\n".join(f"## 第{s}节\n\n" + "".join(rng.choice(words) for _ in range(60)) + f"（附录{n}-{s}）"
                            for s in range(4))
        write_doc(settings.root, f"appendix-{n:02d}", f"# 仓储附录 {n}\n\n{body}\n")


@pytest.fixture
def wire(settings: Any, tmp_path: Path) -> Any:
    """Deps over the Qdrant test server (with the appendix pages), and the server (its vector counts)."""
    appendix(settings)
    server = FakeQdrantServer(tmp_path / "qdrant-server").start()
    client = QdrantClient(url=server.url, timeout=30)
    state = StateStore(settings.state_url)
    deps = Deps(settings=replace(settings, qdrant_url=server.url, qdrant_path=None), state=state,
                store=KnowledgeStore(client))
    yield deps, server
    state.dispose()
    client.close()
    server.stop()


def points_of(deps: Deps, version: int) -> int:
    record = deps.state.get_version(ALIAS, version)
    assert record is not None
    return record.points_expected


def test_an_edit_moves_what_changed_not_the_collection(wire: Any) -> None:
    deps, server = wire
    assert run_reindex(deps).outcome == "promoted"
    total = points_of(deps, 1)
    for n, key in enumerate(["coupon-rules", "shipping-policy", "payment-guide"]):  # three slots in use
        edit(deps, key, f"补充{n}：本条为测试新增。")
        assert run_reindex(deps).outcome == "promoted"
    collections = {deps.state.get_version(ALIAS, v).collection for v in (2, 3, 4)}
    assert len(collections) == 3 and deps.state.get_version(ALIAS, 1).collection not in collections
    edit(deps, "coupon-rules", "补充四：再加一句。")
    server.vector_counts(reset=True)
    result = run_reindex(deps)
    assert result.outcome == "promoted", result.error
    counts = server.vector_counts()
    v5 = deps.state.get_version(ALIAS, 5)
    # v5 went into v2's slot: its difference from v2 is the three edits since, not the collection
    assert v5.slot_base == 2
    build = result.build
    assert build.kept > total // 2 and build.embedded + build.copied < total // 4
    moved = counts["written"] + counts["read"]
    written = build.embedded + build.copied
    assert moved <= 3 * written + 2 * 64 + 10, counts  # the payload sample reads back 64 vectors at most
    assert moved < total, f"{counts} for a collection of {total}"
    assert not structural_problems(deps, v5)


def test_the_slot_a_build_takes_is_never_live_nor_the_rollback_target(wire: Any) -> None:
    deps, _server = wire
    assert run_reindex(deps).outcome == "promoted"
    for n in range(4):
        edit(deps, "coupon-rules", f"补充{n}。")
        assert run_reindex(deps).outcome == "promoted"
        live = deps.state.live_version(ALIAS)
        previous = deps.state.get_version(ALIAS, live.version - 1)
        assert live.collection != previous.collection
        assert deps.store.exists(previous.collection), "the rollback target resides in its slot: one move away"
        assert not structural_problems(deps, previous)
    slots = {row.collection for row in deps.state.slots(ALIAS)}
    assert len(slots) == 3


def test_a_killed_build_resumes_from_its_base_and_a_new_plan_empties_the_half_applied_slot(
        wire: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    deps, _server = wire
    assert run_reindex(deps).outcome == "promoted"
    for n in range(3):
        edit(deps, "shipping-policy", f"补充{n}。")
        assert run_reindex(deps).outcome == "promoted"
    edit(deps, "coupon-rules", "补充：中途失败的这一版。")
    original = Deps.embedder_for

    def dying(self: Deps, version: Any) -> Any:
        embedder = original(self, version)

        def embed(texts: Any) -> Any:
            raise RuntimeError("killed")

        embedder.embed = embed
        return embedder

    monkeypatch.setattr(Deps, "embedder_for", dying)
    failed = run_reindex(deps)
    assert failed.outcome == "failed"
    v5 = deps.state.get_version(ALIAS, 5)
    assert v5.slot_base == 2 and deps.state.slot(v5.collection).holds_exact is None
    monkeypatch.undo()
    resumed = run_reindex(deps)  # the same plan: resumed in its slot, from its base
    assert resumed.outcome == "promoted" and resumed.version == 5, resumed.error
    assert deps.state.slot(v5.collection).holds_exact is not None

    # a build that dies half-way, then another plan: the slot is emptied, never taken for complete
    edit(deps, "payment-guide", "补充：又一版，中途失败。")
    monkeypatch.setattr(Deps, "embedder_for", dying)
    assert run_reindex(deps).outcome == "failed"
    half = deps.state.get_version(ALIAS, 6)
    monkeypatch.undo()
    edit(deps, "payment-guide", "补充：计划变了。")
    monkeypatch.setattr(
        "kb_reindex.steps.retention.cleanup", lambda deps: None, raising=False)  # keep v6 where it is
    result = run_reindex(deps)
    assert result.outcome == "promoted", result.error
    v7 = deps.state.get_version(ALIAS, 7)
    assert v7.collection == half.collection and v7.slot_base is None, "the half-applied slot was emptied"
    assert not structural_problems(deps, v7)


def test_an_older_kept_version_is_restored_without_embedding_then_one_move_away(wire: Any) -> None:
    deps, server = wire
    deps.settings = replace(deps.settings, keep_versions=3)
    assert run_reindex(deps).outcome == "promoted"
    texts = ["补充一：退货需保留原包装。", "补充二：周末不发货。", "补充三：支持分期付款。", "补充四：积分可抵运费。"]
    for key, text in zip(["return-policy", "shipping-policy", "payment-guide", "member-rules"], texts, strict=True):
        edit(deps, key, text)
        assert run_reindex(deps).outcome == "promoted"
    v2 = deps.state.get_version(ALIAS, 2)
    assert v2.status == "retired" and not deps.store.exists(v2.collection), "v2 gave its slot to a newer build"
    view = status_view(deps).to_dict()
    away = {r["version"]: r for r in view["residence"]}
    assert away[4]["one_move_away"] and not away[2]["one_move_away"] and away[2]["restore_points"] == v2.points_expected
    with pytest.raises(RollbackRefused, match="restore --version 2"):
        run_rollback(deps, reason="test", to_version=2)

    calls = {"texts": 0}
    original = Deps.embedder_for

    def counting(self: Deps, version: Any) -> Any:
        embedder = original(self, version)
        embed = embedder.embed

        def counted(texts: Any) -> Any:
            calls["texts"] += len(texts)
            return embed(texts)

        embedder.embed = counted
        return embedder

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Deps, "embedder_for", counting)
        server.vector_counts(reset=True)
        restored = restore_version(deps, 2)
    assert calls["texts"] == 0 and restored.written > 0 and restored.kept > 0
    assert server.vector_counts()["written"] < v2.points_expected
    v2 = deps.state.get_version(ALIAS, 2)
    assert deps.store.exists(v2.collection) and not structural_problems(deps, v2)
    moved = run_rollback(deps, reason="v2 answers right", to_version=2)
    assert moved.to_version == 2 and deps.store.alias_target(ALIAS) == v2.collection
    served = " ".join(str(r.payload) for r in deps.store.client.scroll(ALIAS, limit=1000)[0])
    assert "退货需保留原包装" in served and "周末不发货" not in served, "v2 holds its own edit, not v3's"


def test_a_rollback_checked_before_a_build_took_its_slot_moves_nothing(wire: Any) -> None:
    """The move re-reads where the target resides under the alias lock: a slot given to a build meanwhile
    is never put behind the alias."""
    from kb_reindex.rules.alias import switch_alias

    deps, _server = wire
    assert run_reindex(deps).outcome == "promoted"
    for n in range(3):
        edit(deps, "coupon-rules", f"补充{n}。")
        assert run_reindex(deps).outcome == "promoted"
    stale = deps.state.get_version(ALIAS, 2)  # resident now, checked by a rollback
    edit(deps, "coupon-rules", "补充：再一版。")
    assert run_reindex(deps).outcome == "promoted"  # v5 takes v2's slot
    live = deps.state.live_version(ALIAS)
    with pytest.raises(Exception, match="no longer resides"):
        switch_alias(deps, stale, expected_from=live.collection, action="rollback", run_id=None, reason="test")
    assert deps.store.alias_target(ALIAS) == live.collection


def test_disk_stays_three_slots_and_a_vault_however_many_versions_are_kept(wire: Any) -> None:
    deps, _server = wire
    deps.settings = replace(deps.settings, keep_versions=8)
    assert run_reindex(deps).outcome == "promoted"
    total = points_of(deps, 1)
    for n in range(8):
        edit(deps, "coupon-rules", f"补充{n}：测试。")
        assert run_reindex(deps).outcome == "promoted"
    names = deps.store.collection_names()
    stored = sum(deps.store.count(name) for name in names)
    assert len([r for r in deps.state.slots(ALIAS)]) == 3
    assert stored <= 3 * total + 8 * 5, (stored, total)
    assert {v.status for v in deps.state.list_versions(ALIAS)} <= {"live", "retired"}


def test_local_mode_runs_the_same_model(settings: Any, tmp_path: Path) -> None:
    """The embedded default: the same slots and difference (local mode reloads each collection at a process
    start, so its per-process cost stays with the collection; the work per edit does not)."""
    local = settings_for(settings.root)
    client = QdrantClient(path=str(tmp_path / "q"))
    state = StateStore(local.state_url)
    deps = Deps(settings=local, state=state, store=KnowledgeStore(client))
    try:
        assert run_reindex(deps).outcome == "promoted"
        for n in range(4):
            edit(deps, "coupon-rules", f"补充{n}。")
            result = run_reindex(deps)
            assert result.outcome == "promoted", result.error
        assert result.build.kept > 0 and len(deps.state.slots(ALIAS)) == 3
    finally:
        state.dispose()
        client.close()


def test_a_restore_with_every_slot_protected_writes_one_more_slot_that_no_build_takes_while_its_version_is_kept(wire: Any) -> None:
    """Live, the version rolled away from, its rollback target and a frozen build kept ready protect every
    slot: a restore then writes into one more. That slot is never taken for a build while its version is
    kept; once retention deletes that version it is free again. The build kept ready holds its slot until the
    first run that promotes after the unfreeze supersedes it (it would put older text back); then the alias is
    back to three slots and the vault, at most three times the live collection."""

    deps, _server = wire
    assert run_reindex(deps).outcome == "promoted"
    for n in range(3):
        edit(deps, "coupon-rules", f"补充{n}：以最新公告为准。")
        assert run_reindex(deps).outcome == "promoted"  # v2..v4; v1 gave its slot away
    assert deps.state.get_version(ALIAS, 1).status == "retired"
    run_rollback(deps, reason="v4 answers wrong", to_version=3)
    deps.state.freeze(ALIAS, reason="rollback drill", by="on-call")
    edit(deps, "shipping-policy", "补充：周末不发货。")
    assert run_reindex(deps).outcome != "promoted" and deps.state.live_version(ALIAS).version == 3
    assert deps.state.get_version(ALIAS, 5).status == "ready"

    def slots() -> list[str]:
        return sorted(c for c in deps.store.collection_names() if "__s" in c)

    protected = slots()  # live v3, v4 rolled away from, v2 its rollback target, v5 kept ready
    restored = restore_version(deps, 1)
    assert restored.written > 0 and len(slots()) == len(protected) + 1, (protected, slots())
    v1 = deps.state.get_version(ALIAS, 1)
    assert deps.store.exists(v1.collection) and not structural_problems(deps, v1)

    deps.state.unfreeze(ALIAS, by="on-call")
    holder = v1.collection
    for n in range(6):
        edit(deps, "payment-guide", f"补充{n}：支持分期付款。")
        assert run_reindex(deps).outcome == "promoted"
        v1 = deps.state.get_version(ALIAS, 1)
        if v1.status != "deleted":
            assert deps.store.exists(holder), f"edit {n}: v1 is kept ({v1.status}), its slot was taken"
    assert v1.status == "deleted"
    v5 = deps.state.get_version(ALIAS, 5)
    assert v5.status != "ready" and "superseded by v6, promoted after it" in (v5.error or ""), v5
    assert len(slots()) == 3, slots()
    live = deps.state.live_version(ALIAS)
    stored = sum(deps.store.count(c) for c in deps.store.collection_names())
    vault = sum(deps.store.count(c) for c in deps.store.collection_names() if "__vault" in c)
    assert stored - vault <= 3 * live.points_expected, (stored, vault, live.points_expected)
