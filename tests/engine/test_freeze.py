"""The product's freeze (issue 20 item 3): after a rollback nothing may quietly promote the bad change again.
Also: a reindex keeps live's payload layout (item 6), a dimension the embedder does not answer is refused at
plan time (item 12), and a validated version that never reached the alias is picked up by the next run of
its plan (issue 21 item 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kb_reindex.run.pipeline import run_reindex
from kb_reindex.run.runs import run_rollback
from kb_reindex.services.embedding import HashingEmbedder
from kb_reindex.domain.errors import AliasFrozen, ConfigError, DimensionMismatch, LockHeldError
from kb_reindex.rules.locking import alias_lock_name
from kb_reindex.run.pipeline import promote_shadow
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.store import StateStore
from kb_reindex.services.state.schema import metadata
from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer
from kb_reindex.testing.qdrant_server import QdrantServerProcess, start_process
from kb_reindex.run.status import history, status_view

from conftest import PATTERNS_SCREEN

ALIAS = "mall_knowledge"
CLI = Path(sys.executable).with_name("kb-reindex")


def edit(root: Path, key: str = "return-policy", extra: str = "\n\n退货期限改为30天。\n") -> None:
    path = root / "knowledge" / "docs" / f"{key}.md"
    path.write_text(path.read_text(encoding="utf-8") + extra, encoding="utf-8")


def statuses(deps: Deps) -> dict[int, str]:
    return {v.version: v.status for v in deps.state.list_versions(ALIAS)}


# --- the state API, on SQLite and MariaDB -------------------------------------------------------------


@pytest.fixture(params=["sqlite", "mysql"])
def state_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "mysql":
        return request.getfixturevalue("mysql_url")
    return f"sqlite:///{tmp_path / 'state.db'}"


def test_freeze_unfreeze_and_status_on_sqlite_and_mysql(state_url: str) -> None:
    state = StateStore(state_url)
    try:
        assert state.freeze_status(ALIAS) is None
        frozen = state.freeze(ALIAS, reason="wrong refund period went live", by="oncall@host")
        assert (frozen.alias, frozen.reason, frozen.set_by) == (ALIAS, "wrong refund period went live", "oncall@host")
        assert state.freeze_status(ALIAS) == frozen
        assert state.freeze_status("other_alias") is None, "a freeze is per alias"
        # freezing again keeps the freeze in force as it was (its reason, who, when)
        assert state.freeze(ALIAS, reason="again", by="someone-else") == frozen
        with pytest.raises(ConfigError, match="needs a reason"):
            state.freeze("other_alias", reason="  ", by="x")
        assert state.unfreeze(ALIAS, by="lead@host") == frozen
        assert state.freeze_status(ALIAS) is None and state.unfreeze(ALIAS, by="lead@host") is None
        events = list(state.freeze_events(ALIAS))
        assert [(e.action, e.by) for e in events] == [("freeze", "oncall@host"), ("unfreeze", "lead@host")]
        assert state.lock_held_by(alias_lock_name(ALIAS)) is None, "the alias lock is let go"
    finally:
        state.dispose()


def test_an_older_state_db_gains_the_freeze_table_and_reads_as_not_frozen(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine_ = sa.create_engine(url)
    metadata.create_all(engine_, tables=[t for t in metadata.sorted_tables if t.name != "kb_freezes"])
    engine_.dispose()
    reader = StateStore(url, create=False)  # read-only: creates nothing, sees no freeze
    assert reader.freeze_status(ALIAS) is None and list(reader.freeze_events(ALIAS)) == []
    assert "kb_freezes" not in sa.inspect(reader.engine).get_table_names()
    # `kb-reindex freeze` opens the state DB as state-only commands do (never creating a DB): it adds the table
    assert reader.freeze(ALIAS, reason="before the upgrade", by="oncall").reason == "before the upgrade"
    assert reader.unfreeze(ALIAS, by="oncall") is not None
    reader.dispose()
    writer = StateStore(url)  # a writing open upgrades it as well
    assert "kb_freezes" in sa.inspect(writer.engine).get_table_names()
    assert writer.freeze(ALIAS, reason="r", by="b").reason == "r"
    writer.dispose()


def test_a_freeze_waits_for_an_alias_move_in_progress(tmp_path: Path) -> None:
    """The freeze is taken under the alias lock the moves hold: once it returns, no move checked before it
    can still land."""
    state = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    state.acquire_lock(alias_lock_name(ALIAS), owner="promoting-run@elsewhere:1:x:y", ttl_s=60)
    with pytest.raises(LockHeldError):
        state.freeze(ALIAS, reason="hold", by="oncall", wait_s=0.2)
    assert state.freeze_status(ALIAS) is None
    state.release_lock(alias_lock_name(ALIAS), owner="promoting-run@elsewhere:1:x:y")
    assert state.freeze(ALIAS, reason="hold", by="oncall", wait_s=0.2).reason == "hold"
    state.dispose()


# --- every forward move is held, rollbacks are not -----------------------------------------------------


def test_a_frozen_alias_builds_but_promotes_nothing_until_unfrozen(deps: Deps) -> None:
    assert run_reindex(deps).outcome == "promoted"
    deps.state.freeze(ALIAS, reason="refund period incident", by="oncall@host")
    edit(deps.settings.root)

    result = run_reindex(deps)
    assert (result.outcome, result.version, result.error) == ("frozen", 2, None)
    message = result.frozen.message
    assert message.startswith(f"{ALIAS} is frozen since ") and "by oncall@host: refund period incident" in message
    assert "v2 built and kept unpromoted; `kb-reindex unfreeze` then `kb-reindex promote --version 2`" in message
    assert result.validation.passed
    assert statuses(deps) == {1: "live", 2: "ready"} and deps.store.alias_target(ALIAS).endswith("__s1")
    assert deps.state.list_runs(ALIAS, limit=1)[0].outcome == "frozen"

    # a migration and an explicit shadow promotion are held the same way
    migrated = run_reindex(deps, kind="migration", embedder="hashing", model="hashing-freeze-v2")
    assert migrated.outcome == "frozen" and statuses(deps)[migrated.version] == "ready"
    with pytest.raises(AliasFrozen, match="promote --version 2"):
        promote_shadow(deps, 2, expected_live=1)
    assert deps.store.alias_target(ALIAS).endswith("__s1")

    status = status_view(deps).to_dict()
    assert status["freeze"]["reason"] == "refund period incident" and status["freeze"]["set_by"] == "oncall@host"
    deps.state.unfreeze(ALIAS, by="lead@host")
    assert status_view(deps).to_dict()["freeze"] is None
    assert promote_shadow(deps, 2, expected_live=1).version == 2 and deps.store.alias_target(ALIAS).endswith("__s2")
    assert [e.action for e in history(deps)] == ["promote", "freeze", "unfreeze", "promote"]


def test_while_frozen_only_the_newest_kept_version_waits_and_its_slot_is_brought_by_the_difference(deps: Deps) -> None:
    """Pages saved again and again while frozen (the watcher's runs during an incident): each newer version kept
    ready supersedes the one kept before it, so the next build takes that slot by the difference instead of a new
    slot filled with a full copy per save; after unfreeze the run that promotes supersedes the last one."""
    assert run_reindex(deps).outcome == "promoted"
    deps.state.freeze(ALIAS, reason="refund period incident", by="oncall@host")
    kept = []
    for n in range(3):
        edit(deps.settings.root, extra=f"\n\n退货期限改为{30 + n}天。\n")
        result = run_reindex(deps)
        assert result.outcome == "frozen", result
        kept.append(result)
    v2, v3, v4 = kept
    assert [r.superseded for r in kept] == [(), (v2.version,), (v3.version,)]
    now = statuses(deps)
    assert (now[1], now[4]) == ("live", "ready") and now[2] != "ready" and now[3] != "ready", now
    by_number = {v.version: v for v in deps.state.list_versions(ALIAS)}
    assert by_number[2].error == "not promoted: superseded by v3, kept while frozen too: only the newest waits (kb-reindex)"
    # v4 took the slot v2 left, from v2's points: what differs is written, nothing copied whole
    assert v4.collection == v2.collection and v4.build is not None
    assert v4.build.copied + v4.build.embedded < v4.build.points // 2, v4.build
    assert len([c for c in deps.store.collection_names() if "__s" in c]) == 3
    deps.state.unfreeze(ALIAS, by="lead@host")
    edit(deps.settings.root, key="shipping-policy", extra="\n\n偏远地区另加 2 天。\n")
    served = run_reindex(deps)
    assert served.outcome == "promoted" and served.superseded == (v4.version,), served
    assert statuses(deps)[4] != "ready"


def test_a_rollback_runs_while_frozen_and_rollback_freeze_sets_the_freeze(project: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from kb_reindex.cli import main

    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))

    def cli(*argv: str) -> tuple[int, dict[str, Any]]:
        code = main([*argv, "--json", "-q"])
        return code, json.loads(capsys.readouterr().out)

    assert cli("run")[1]["outcome"] == "promoted"
    edit(project)
    assert cli("run")[1]["version"] == 2
    code, back = cli("rollback", "--reason", "30-day refund text is wrong", "--freeze", "--yes")
    assert code == 0 and back["to_version"] == 1
    assert back["freeze"]["reason"] == "rollback: 30-day refund text is wrong"
    # the same folder, a reindex forced to rebuild, and a migration: none puts the change back
    code, again = cli("run", "--force-full")
    assert (code, again["outcome"]) == (0, "frozen") and "kb-reindex unfreeze" in again["frozen"]["message"]
    code, status = cli("status")
    assert status["live"]["version"] == 1 and status["freeze"]["set_by"]
    code, human = main(["status"]), capsys.readouterr().out
    assert "FROZEN: mall_knowledge is frozen since" in human
    # a rollback is never held: back and forth while frozen
    assert cli("rollback", "--reason", "check v2 once more", "--to-version", "2", "--yes")[1]["to_version"] == 2
    assert cli("rollback", "--reason", "no, v1", "--to-version", "1", "--yes")[1]["to_version"] == 1
    code, lifted = cli("unfreeze")
    assert code == 0 and lifted["was_frozen"] and lifted["unpromoted"] == [3]
    actions = [e["action"] for e in cli("history")[1]["events"]]
    assert actions == ["promote", "promote", "freeze", "rollback", "rollback", "rollback", "unfreeze"]
    code, frozen = cli("freeze", "--reason", "audit")
    assert code == 0 and not frozen["already_frozen"] and frozen["reason"] == "audit"
    assert cli("freeze", "--reason", "other")[1]["already_frozen"]


def test_a_freeze_set_mid_run_by_another_process_stops_its_promotion(project: Path, tmp_path: Path) -> None:
    """`kb-reindex freeze` from another process while a `kb-reindex run` builds (its embedder held): the run
    still validates its version, then finds the freeze under the alias lock and promotes nothing."""
    gate = threading.Event()
    gate.set()
    hashing = HashingEmbedder(model="bge-m3", dim=1024)

    def held_embed(_model: str, text: str) -> list[float]:
        gate.wait(60)
        return hashing.embed_one(text)

    with FakeOllamaServer([FakeModel(name="bge-m3", dim=1024, embed=held_embed)]) as ollama:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KB_") or k.startswith("KB_TEST_")}
        env.update(KB_PROJECT_ROOT=str(project), KB_EMBEDDER="ollama", OLLAMA_HOST=ollama.url, **PATTERNS_SCREEN)
        first = subprocess.run([str(CLI), "run", "--json", "-q"], env=env, capture_output=True, text=True, timeout=120)
        assert json.loads(first.stdout)["outcome"] == "promoted", first.stderr[-2000:]
        edit(project)
        gate.clear()
        requests_before = ollama.embed_requests
        runner = subprocess.Popen([str(CLI), "run", "--json", "-q"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            deadline = 120.0
            start = time.monotonic()
            while ollama.embed_requests == requests_before:  # the build is embedding, held by the gate
                assert runner.poll() is None, runner.communicate()[1][-2000:]
                assert time.monotonic() - start < deadline, "the build never started"
                time.sleep(0.05)
            frozen = subprocess.run([str(CLI), "freeze", "--reason", "mid-run", "--json", "-q"], env=env,
                                    capture_output=True, text=True, timeout=120)
            assert frozen.returncode == 0, frozen.stderr[-2000:]
        finally:
            gate.set()
        out, err = runner.communicate(timeout=120)
    result = json.loads(out)
    assert (result["outcome"], result["version"]) == ("frozen", 2), err[-2000:]
    assert "by " in result["frozen"]["message"] and ": mid-run;" in result["frozen"]["message"]
    state = StateStore(f"sqlite:///{project / '.kb' / 'state.db'}", create=False)
    try:
        assert state.live_version(ALIAS).version == 1 and state.get_version(ALIAS, 2).status == "ready"
    finally:
        state.dispose()


def test_the_dags_honour_the_freeze(project: Path, monkeypatch: pytest.MonkeyPatch, airflow_db: None) -> None:
    """knowledge_rollback freezes by default; knowledge_reindex then builds, skips `promote` saying why (no
    Asset event, no watch) and ends `frozen`; cleanup still runs."""
    from test_dags import asset_events_of_last_run, cli_versions, run_dag

    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    cli_versions(project, 2)
    ok, states = run_dag(None, "knowledge_rollback", {"reason": "bad coupon text", "confirm": True, "live_version": 2})
    assert ok, states
    from kb_reindex.services.config import Settings
    from kb_reindex.services.runtime import open_deps

    with open_deps(Settings.from_env()) as deps:
        freeze = deps.state.freeze_status(ALIAS)
        assert freeze is not None and freeze.reason == "rollback: bad coupon text"
        # under who triggered the run (`airflow dags test` records its own user, dag_test), with the run
        assert freeze.set_by.startswith("dag_test (knowledge_rollback airflow:knowledge_rollback:")
        assert deps.state.alias_events(ALIAS)[-1].moved_by == "dag_test"
    ok, states = run_dag(None, "knowledge_reindex", {"force_full_rebuild": True})
    assert ok, states
    assert states["validate"] == "success" and states["promote"] == "skipped"
    assert states["cleanup"] == "success"
    assert asset_events_of_last_run() == []
    with open_deps(Settings.from_env()) as deps:
        assert deps.state.live_version(ALIAS).version == 1
        assert statuses(deps)[3] == "ready"
        assert deps.state.list_runs(ALIAS, limit=1)[0].outcome == "frozen"


# --- a reindex keeps live's payload layout ---------------------------------------------------------------


@pytest.fixture
def local_deps(settings: Any) -> Iterator[Deps]:
    """Local-mode Qdrant only, for what does not depend on how Qdrant is reached (the suite's time)."""
    from kb_reindex.services.store import KnowledgeStore
    from qdrant_client import QdrantClient

    client = QdrantClient(":memory:")
    state = StateStore(settings.state_url)
    yield Deps(settings=settings, state=state, store=KnowledgeStore(client))
    state.dispose()
    client.close()


def test_a_reindex_keeps_the_layout_a_migration_set(local_deps: Deps) -> None:
    deps = local_deps
    assert run_reindex(deps).outcome == "promoted"
    migrated = run_reindex(deps, kind="migration", embedder="hashing", model="hashing-layout-v2",
                                  layout="llamaindex")
    assert migrated.outcome == "promoted", migrated.error
    assert deps.state.live_version(ALIAS).payload_layout == "llamaindex"

    # KB_PAYLOAD_LAYOUT says native (the default): reported, not obeyed
    assert deps.settings.payload_layout == "native"
    edit(deps.settings.root)
    kept = run_reindex(deps)
    assert kept.outcome == "promoted", kept.error
    assert deps.state.get_version(ALIAS, kept.version).payload_layout == "llamaindex"
    assert kept.chunks.embedded < kept.chunks.total, "live's vectors are copied"
    assert any("KB_PAYLOAD_LAYOUT=native differs from the layout live v2 serves (llamaindex); kept llamaindex" in n
               for n in kept.plan.notes), kept.plan.notes
    assert run_reindex(deps).outcome == "no_change", "an unchanged folder is no change"

    # changing it is explicit
    changed = run_reindex(deps, layout="native")
    assert changed.outcome == "promoted" and changed.chunks.embedded == 0
    assert deps.state.live_version(ALIAS).payload_layout == "native"


def test_cli_run_layout_changes_it_and_a_differing_setting_is_reported(project: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from kb_reindex.cli import main

    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    assert main(["run", "--layout", "llamaindex", "-q"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("KB_PAYLOAD_LAYOUT", "native")
    edit(project)
    assert main(["run", "-q"]) == 0
    out = capsys.readouterr().out
    assert "note: KB_PAYLOAD_LAYOUT=native differs from the layout live v1 serves (llamaindex)" in out
    assert main(["status", "--json", "-q"]) == 0
    assert json.loads(capsys.readouterr().out)["live"]["payload_layout"] == "llamaindex"


# --- a dimension the embedder does not answer is refused at plan time -----------------------------------


def test_a_migration_asking_a_dimension_the_server_does_not_answer_is_refused_at_plan(local_deps: Deps) -> None:
    deps = local_deps
    assert run_reindex(deps).outcome == "promoted"
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=1024)]) as ollama:
        settings = replace(deps.settings, ollama_host=ollama.url)
        result = run_reindex(replace(deps, settings=settings), kind="migration", embedder="ollama",
                                    model="bge-m3", dim=768)
        requests = ollama.embed_requests
    assert (result.outcome, result.error_kind, result.version) == ("failed", "config", None)
    assert "model 'bge-m3' answers 1024-d vectors, but the migration's dimension" in result.error
    assert "asks for 768" in result.error
    assert requests == 1, "one probe, nothing embedded"
    assert statuses(deps) == {1: "live"}, "no version was created"


def test_a_dimension_mismatch_is_not_retried_by_airflow(local_deps: Deps) -> None:
    deps = local_deps
    from airflow.sdk.exceptions import AirflowFailException
    from kb_reindex.airflow.tasks import PERMANENT, step

    assert issubclass(DimensionMismatch, PERMANENT) and issubclass(AliasFrozen, PERMANENT)
    deps.state.start_run(run_id="r1", alias=ALIAS, kind="migration", trigger="airflow")
    with pytest.raises(AirflowFailException, match="answers 1024-d"), step(deps, "r1"):
        raise DimensionMismatch("ollama model 'bge-m3' answers 1024-d vectors, but ... asks for 768")
    assert deps.state.get_run("r1").outcome == "failed"


# --- a validated version that never reached the alias is picked up ----------------------------------------


@pytest.fixture
def qdrant_process(tmp_path: Path) -> Iterator[QdrantServerProcess]:
    process = start_process(tmp_path / "qdrant-server")
    try:
        yield process
    finally:
        process.stop()


def test_a_version_qdrant_refused_to_serve_is_promoted_by_the_next_run_embedding_nothing(
        project: Path, qdrant_process: QdrantServerProcess) -> None:
    hashing = HashingEmbedder(model="bge-m3", dim=1024)
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=1024, embed=lambda _m, t: hashing.embed_one(t))]) as ollama:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KB_") or k.startswith("KB_TEST_")}
        env.update(KB_PROJECT_ROOT=str(project), KB_QDRANT_URL=qdrant_process.url, KB_EMBEDDER="ollama",
                   OLLAMA_HOST=ollama.url, **PATTERNS_SCREEN)

        def cli(*argv: str) -> dict[str, Any]:
            done = subprocess.run([str(CLI), *argv, "--json", "-q"], env=env, capture_output=True, text=True,
                                  timeout=180)
            assert done.stdout.strip(), done.stderr[-2000:]
            return json.loads(done.stdout)

        assert cli("run")["outcome"] == "promoted"
        edit(project)
        qdrant_process.add_fault("update_aliases", status=503, count=None)
        texts_before = ollama.embedded_texts
        refused = cli("run")
        refused_texts = ollama.embedded_texts - texts_before
        assert refused["outcome"] == "failed" and refused["version"] == 2 and "503" in refused["error"]
        assert refused["validation"]["passed"] and refused["chunks"]["embedded"] > 0
        qdrant_process.clear_faults()
        texts_before = ollama.embedded_texts
        again = cli("run")
        again_texts = ollama.embedded_texts - texts_before
    assert (again["outcome"], again["version"]) == ("promoted", 2), again.get("error")
    assert again["chunks"]["embedded"] == 0 and again["validation"]["passed"]
    # the embedder saw only validation's golden queries again, as many as in the refused run: no chunk
    assert again_texts == refused_texts - refused["chunks"]["embedded"]
    versions = {v["version"]: v["status"] for v in cli("status")["versions"]}
    assert versions == {1: "retired", 2: "live"}, "no new version, no leaked collection"


def test_a_ready_version_whose_base_is_no_longer_live_is_not_picked_up(local_deps: Deps) -> None:
    deps = local_deps
    assert run_reindex(deps).outcome == "promoted"
    edit(deps.settings.root, "coupon-rules", "\n\n补充：仅限线上。\n")
    assert run_reindex(deps).version == 2
    edit(deps.settings.root)
    shadow = run_reindex(deps, promote_version=False)
    assert (shadow.outcome, shadow.version) == ("shadow", 3)
    # the same plan: picked up, nothing embedded, no new version
    picked = run_reindex(deps)
    assert (picked.outcome, picked.version, picked.chunks.embedded) == ("promoted", 3, 0)
    # v4 planned on v3 and kept ready; then v3 is rolled back: v4's base is not live, v4 is not taken
    edit(deps.settings.root, "coupon-rules", "\n\n补充：不可转让。\n")
    assert run_reindex(deps, promote_version=False).version == 4
    run_rollback(deps, reason="v3 is wrong")
    after = run_reindex(deps)
    assert after.outcome == "promoted" and after.version == 5
    assert deps.state.get_version(ALIAS, 4).status == "ready"
