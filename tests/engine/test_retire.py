"""Retiring a knowledge base (issue 39 item 4): `steps.retire` ends its reindexing (a build in progress loses its
lock and is fenced, its run and version recorded failed), records who retired it, when and why, keeps or drops
its alias and collections, and is safe to repeat and to undo; afterwards nothing plans it, moves its alias, or
stands in for its entry (`run.bases`)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kb_reindex.domain.errors import ConfigError
from kb_reindex.rules.locking import reindex_lock_name
from kb_reindex.run.bases import bases_view, on_call_base
from kb_reindex.run.pipeline import run_reindex
from kb_reindex.run.runs import run_rollback
from kb_reindex.run.status import history
from kb_reindex.services.registry import load_registry
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.store import StateStore
from kb_reindex.steps.retire import retire, unretire

ALIAS = "mall_knowledge"
BY = "oncall@host"


def edit(root: Path, key: str = "return-policy", extra: str = "\n\n退货期限改为30天。\n") -> None:
    path = root / "knowledge" / "docs" / f"{key}.md"
    path.write_text(path.read_text(encoding="utf-8") + extra, encoding="utf-8")


def statuses(deps: Deps) -> dict[int, str]:
    return {v.version: v.status for v in deps.state.list_versions(ALIAS)}


def test_retire_fences_a_build_in_progress_and_keeps_what_serves(deps: Deps, monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_reindex(deps).outcome == "promoted"
    edit(deps.settings.root, "coupon-rules", "\n\n优惠券不可转让。\n")
    assert run_reindex(deps).outcome == "promoted"
    live = deps.store.alias_target(ALIAS)
    edit(deps.settings.root)
    # a build in progress: it holds the reindex lock and waits inside its first write batch
    writing, release = threading.Event(), threading.Event()
    real_upsert = deps.store.upsert

    def held_upsert(name, points):
        writing.set()
        assert release.wait(60)
        return real_upsert(name, points)

    monkeypatch.setattr(deps.store, "upsert", held_upsert)
    results: dict[str, object] = {}
    build = threading.Thread(target=lambda: results.update(run=run_reindex(deps)))
    build.start()
    try:
        assert writing.wait(60), "the build never wrote"
        holder = deps.state.lock_held_by(reindex_lock_name(ALIAS))
        running = [r.run_id for r in deps.state.list_runs(ALIAS) if r.outcome == "running"]
        assert holder is not None and len(running) == 1 and holder.startswith(running[0])

        retired = retire(deps, reason="the shop closed", by=BY)
    finally:
        release.set()
        build.join(120)
    assert (retired.already, retired.lock_taken, retired.failed_runs, retired.failed_versions) == (
        False, holder, (running[0],), (3,))
    assert deps.state.lock_held_by(reindex_lock_name(ALIAS)) is None, "the lock was released"
    # the build was fenced: it failed without promoting, and its lock stayed gone
    run = results["run"]
    assert run.outcome == "failed" and run.error is not None and "no longer holds the lock" in run.error, run.error
    assert deps.state.get_run(running[0]).outcome == "failed"
    assert deps.state.lock_held_by(reindex_lock_name(ALIAS)) is None
    # recorded; the alias and its collections kept: the assistant keeps reading v1
    recorded = deps.state.retirement(ALIAS)
    assert (recorded.reason, recorded.retired_by, recorded.dropped_at) == ("the shop closed", BY, None)
    assert deps.store.alias_target(ALIAS) == live and statuses(deps) == {1: "retired", 2: "live", 3: "failed"}
    assert retired.dropped is None and "the assistant keeps reading what was live" in retired.message
    assert [e.action for e in history(deps)][-2:] == ["retire", "unlock"]  # recorded first, then the lock taken

    # nothing plans it or moves its alias any more, each refusal naming the retirement and its undo
    refused = run_reindex(deps)
    assert refused.outcome == "failed" and f"was retired by {BY}" in refused.error, refused.error
    assert "`kb-reindex retire --undo`" in refused.error
    assert statuses(deps) == {1: "retired", 2: "live", 3: "failed"}
    with pytest.raises(ConfigError, match="was retired by oncall@host .*the shop closed"):
        run_rollback(deps, reason="x", to_version=1, expected_live=2, revalidate=False)
    assert deps.store.alias_target(ALIAS) == live

    # a rerun says it was already retired and changes nothing
    again = retire(deps, reason="another reason", by="someone-else")
    assert again.already and again.retirement == recorded and again.lock_taken is None and not again.failed_runs
    assert "was already retired by oncall@host" in again.message
    # undone: it builds again, resuming nothing it should not
    assert unretire(deps, by=BY) == recorded and deps.state.retirement(ALIAS) is None
    assert run_reindex(deps).outcome == "promoted"


def test_drop_collections_drops_the_alias_and_every_collection_of_it_and_nothing_else(deps: Deps) -> None:
    assert run_reindex(deps).outcome == "promoted"
    edit(deps.settings.root)
    assert run_reindex(deps).outcome == "promoted"
    edit(deps.settings.root, "coupon-rules", "\n\n优惠券不可转让。\n")
    assert run_reindex(deps).outcome == "promoted"
    edit(deps.settings.root, "coupon-rules", "\n\n优惠券过期不补。\n")
    assert run_reindex(deps).outcome == "promoted"  # the fourth takes the first slot back: a vault keeps its vectors
    ours = {n for n in deps.store.collection_names() if n.startswith(f"{ALIAS}__")}
    assert len(ours) == 4 and any("__vault" in n for n in ours), ours
    # an alias whose name starts with ours, and a collection of it, are not ours
    deps.store.create_collection(f"{ALIAS}_old__hashing-ngram-v1__s1", dim=256)

    retired = retire(deps, reason="merged into the help centre", by=BY, drop_collections=True)
    assert retired.dropped is not None and set(retired.dropped.collections) == ours
    assert deps.store.collection_names() == {f"{ALIAS}_old__hashing-ngram-v1__s1"}
    assert deps.store.alias_target(ALIAS) is None and retired.dropped.alias_was is not None
    # the state rows stay as history: every version deleted, no slot left, the drop recorded
    assert set(statuses(deps).values()) == {"deleted"} and deps.state.live_version(ALIAS) is None
    assert deps.state.slots(ALIAS, role=None) == [] and len(deps.state.list_runs(ALIAS)) == 4
    assert deps.state.retirement(ALIAS).dropped_by == BY
    assert "dropped: the alias mall_knowledge" in retired.message

    # a rerun drops nothing more and fails nothing
    again = retire(deps, reason="merged", by=BY, drop_collections=True)
    assert again.already and again.dropped is not None and again.dropped.collections == ()
    assert again.retirement.dropped_at == deps.state.retirement(ALIAS).dropped_at
    # undone, the next run builds a first version again
    unretire(deps, by=BY)
    rebuilt = run_reindex(deps)
    assert rebuilt.outcome == "promoted" and rebuilt.version == 5
    assert deps.store.alias_target(ALIAS) == rebuilt.collection


REGISTRY = """knowledge_bases:
  mall_knowledge:
    source: docs
    golden_set: golden.yaml
  seller_rules:
    source: seller/docs
    golden_set: seller/golden.yaml
"""


def test_a_retired_knowledge_base_has_no_stand_in_and_its_listed_entry_is_refused(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    registry_file = project / "knowledge" / "registry.yaml"
    registry_file.write_text(REGISTRY, encoding="utf-8")
    monkeypatch.setenv("KB_REGISTRY", "knowledge/registry.yaml")
    registry = load_registry()
    state_url = registry.get("seller_rules").settings().state_url
    state = StateStore(state_url)
    try:
        state.record_entry(registry.get("seller_rules").recorded())
        state.retire("seller_rules", reason="sellers moved to the new portal", by=BY)
    finally:
        state.dispose()

    # listed and loading: refused everywhere the state DB is read, naming the entry, who, when and the undo
    with pytest.raises(ConfigError) as refused:
        on_call_base(registry, "seller_rules", state_url)
    message = str(refused.value)
    assert f"{registry_file}: knowledge base 'seller_rules' was retired by {BY} at " in message
    assert "(sellers moved to the new portal)" in message and f"Remove its entry from {registry_file}" in message
    assert "`kb-reindex --kb seller_rules retire --undo`" in message
    assert on_call_base(registry, "seller_rules", state_url, retired=True).alias == "seller_rules"  # retire itself
    view = bases_view(registry, state_url)
    assert [b.alias for b in view.bases] == [ALIAS] and view.refused == (message,)

    # removed from the registry: no stand-in from its recorded entry any more
    registry_file.write_text(REGISTRY.split("  seller_rules:")[0], encoding="utf-8")
    registry = load_registry()
    with pytest.raises(ConfigError, match="knowledge base 'seller_rules' was retired by") as gone:
        on_call_base(registry, "seller_rules", state_url)
    assert "Remove its entry" not in str(gone.value) and "Undo the retirement with" in str(gone.value)
    assert bases_view(registry, state_url).refused == ()
    # a name never registered is still refused as unknown
    with pytest.raises(ConfigError, match="knowledge base 'nope' is not in the registry"):
        on_call_base(registry, "nope", state_url)
