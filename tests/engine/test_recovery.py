"""Operations under concurrency and loss, as on-call meets them: held and orphaned locks, a promotion read
half-way, a lost, truncated, corrupt or stale state DB, and read-only commands pointed at the wrong place."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest


from kb_reindex.run.pipeline import run_reindex
from kb_reindex.cli import main
from kb_reindex.domain.errors import StateDriftError
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.store import StateStore
from kb_reindex.services.state.locks import default_lock_owner
from kb_reindex.run.status import status_view

ALIAS = "mall_knowledge"


@pytest.fixture
def cli_env(project: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    monkeypatch.setenv("KB_LOCK_WAIT", "0")
    return project


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict, str]:
    code = main([*argv, "--json", "-q"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def edit(project: Path, key: str = "coupon-rules", extra: str = "\n\n补充条款：优惠券不可转让。\n") -> None:
    path = project / "knowledge" / "docs" / f"{key}.md"
    path.write_text(path.read_text(encoding="utf-8") + extra, encoding="utf-8")


def state_db(project: Path) -> Path:
    return project / ".kb" / "state.db"


def remove_state_db(project: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{state_db(project)}{suffix}").unlink(missing_ok=True)


def hold_lock_in_another_process(project: Path) -> subprocess.Popen[str]:
    """A live process of this host holding the alias's lock, as a working run does."""
    code = (
        "import sys, time\n"
        "from kb_reindex.services.state.store import StateStore\n"
        "from kb_reindex.services.state.locks import default_lock_owner\n"
        f"s = StateStore({f'sqlite:///{state_db(project)}'!r})\n"
        f"s.acquire_lock('reindex:{ALIAS}', owner=default_lock_owner('cli__reindex__elsewhere'), ttl_s=3600)\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


# --- one lock discipline --------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["run"], ["migrate", "--embedder", "hashing", "--model", "hashing-ngram-v1", "--dim", "256"],
    ["reconcile"], ["reconcile", "--rebuild-state"],
    ["drop", "--version", "1"], ["gc"], ["validate"],
])
def test_every_writing_command_takes_the_alias_lock(cli_env: Path, capsys: pytest.CaptureFixture[str],
                                                    argv: list[str]) -> None:
    assert cli(capsys, "run")[0] == 0
    state = StateStore(f"sqlite:///{state_db(cli_env)}")
    holder = default_lock_owner("cli__reindex__working")
    state.acquire_lock(f"reindex:{ALIAS}", owner=holder, ttl_s=3600)
    try:
        code, out, err = cli(capsys, *argv)
    finally:
        state.release_lock(f"reindex:{ALIAS}", owner=holder)
        state.dispose()
    assert code != 0, out
    assert f"another run is working on {ALIAS}: {holder}, since" in out["error"]
    assert "reconcile" not in out["error"], "a held lock is never answered with drift advice"


def test_killed_run_leaves_a_lock_the_next_run_takes_over_at_once(cli_env: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(capsys, "run")[0] == 0
    holder = hold_lock_in_another_process(cli_env)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    edit(cli_env)
    code, out, _ = cli(capsys, "run")
    assert code == 0 and out["outcome"] == "promoted", out
    code, history, _ = cli(capsys, "history")
    takeover = [e for e in history["events"] if e["action"] == "lock-takeover"]
    assert len(takeover) == 1 and "cli__reindex__elsewhere" in takeover[0]["reason"]


def test_status_shows_a_held_lock_and_unlock_breaks_it_on_the_record(cli_env: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(capsys, "run")[0] == 0
    holder = hold_lock_in_another_process(cli_env)
    try:
        code, status, _ = cli(capsys, "status")
        assert code == 0 and not status["problems"]
        [lock] = status["locks"]
        assert lock["name"] == f"reindex:{ALIAS}" and "cli__reindex__elsewhere" in lock["owner"]
        assert lock["owner_alive"] == "yes" and not lock["expired"] and lock["since"] and lock["expires"]
        assert cli(capsys, "gc")[0] == 1
        code, out, _ = cli(capsys, "unlock", "--reason", "hung build", "--yes")
        assert code == 0 and [b["name"] for b in out["broken"]] == [f"reindex:{ALIAS}"]
        assert cli(capsys, "gc")[0] == 0
        assert cli(capsys, "status")[1]["locks"] == []
        code, history, _ = cli(capsys, "history")
        unlocks = [e for e in history["events"] if e["action"] == "unlock"]
        assert len(unlocks) == 1 and "hung build" in unlocks[0]["reason"]
    finally:
        holder.kill()
        holder.wait()


def test_a_run_whose_lock_was_broken_does_not_promote(deps: Deps, monkeypatch: pytest.MonkeyPatch) -> None:
    import kb_reindex.run.pipeline as engine_module

    real_validate = engine_module.validate

    def validate_then_on_call_breaks_the_lock(*args, **kwargs):
        result = real_validate(*args, **kwargs)
        deps.state.break_lock(f"reindex:{ALIAS}", by="on-call", reason="looked stuck")
        return result

    monkeypatch.setattr(engine_module, "validate", validate_then_on_call_breaks_the_lock)
    result = run_reindex(deps)
    assert result.outcome == "failed" and "no longer holds the lock" in result.error
    assert deps.store.alias_target(ALIAS) is None


def test_status_and_reconcile_during_a_promotion_see_no_drift(deps: Deps, monkeypatch: pytest.MonkeyPatch) -> None:
    """The window between the alias move and the state write, held open: status says a promotion is in
    progress (not drift), and reconcile waits for the promotion instead of recording half of it."""
    from kb_reindex.steps.reconcile import reconcile

    run_reindex(deps)
    edit(deps.settings.root)
    moved, release = threading.Event(), threading.Event()
    real_record = deps.state.record_switch

    def slow_record(**kwargs):
        moved.set()
        assert release.wait(30)
        return real_record(**kwargs)

    monkeypatch.setattr(deps.state, "record_switch", slow_record)
    deps.settings = replace(deps.settings, lock_wait_s=30)
    results: dict[str, object] = {}
    runner = threading.Thread(target=lambda: results.update(run=run_reindex(deps)))
    runner.start()
    assert moved.wait(60)
    assert deps.store.alias_target(ALIAS).endswith("__s2") and deps.state.live_version(ALIAS).version == 1
    status = status_view(deps).to_dict()
    assert status["problems"] == [] and any("promotion in progress" in n for n in status["notes"])
    reconciler = threading.Thread(target=lambda: results.update(reconcile=reconcile(deps)))
    reconciler.start()
    time.sleep(0.5)
    assert "reconcile" not in results, "reconcile waits for the promotion's lock"
    release.set()
    runner.join(60)
    reconciler.join(60)
    assert results["run"].outcome == "promoted"
    assert results["reconcile"].changed is False
    assert deps.state.live_version(ALIAS).version == 2
    assert [e.action for e in deps.state.alias_events(ALIAS)] == ["promote", "promote"]


# --- lose the state DB, lose nothing ----------------------------------------------------------------


def test_lost_state_db_is_rebuilt_from_qdrant_and_nothing_is_lost(cli_env: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(capsys, "run")[0] == 0
    edit(cli_env)
    code, second, _ = cli(capsys, "run")
    assert code == 0 and second["version"] == 2
    remove_state_db(cli_env)

    code, out, _ = cli(capsys, "status")
    assert code == 2 and "no state DB at" in out["error"] and "--rebuild-state" in out["error"]
    assert not state_db(cli_env).exists(), "a read-only command never creates a state DB"
    code, found, _ = cli(capsys, "query", "优惠券过期了还能恢复吗")
    assert code == 0 and found["version"] == 2 and found["results"][0]["knowledge_key"] == "coupon-rules"

    code, rebuilt, _ = cli(capsys, "reconcile", "--rebuild-state")
    assert code == 0 and rebuilt["live_version"] == 2
    assert [(v["version"], v["status"]) for v in rebuilt["rebuilt"]] == [(1, "retired"), (2, "live")]
    code, status, _ = cli(capsys, "status")
    assert code == 0 and status["problems"] == []
    assert {v["version"]: v["points"] == v["points_expected"] for v in status["versions"]} == {1: True, 2: True}
    code, again, _ = cli(capsys, "run")
    assert code == 0 and again["outcome"] == "no_change" and again["chunks"]["embedded"] == 0
    code, back, _ = cli(capsys, "rollback", "--to-version", "1", "--reason", "check the old rules", "--yes")
    assert code == 0 and back["to_version"] == 1
    code, history, _ = cli(capsys, "history")
    assert [e["action"] for e in history["events"]] == ["rebuild-state", "rollback"]


def test_truncated_state_db_leads_to_one_way_out_not_a_loop(cli_env: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(capsys, "run")[0] == 0
    remove_state_db(cli_env)
    state_db(cli_env).write_bytes(b"")  # truncated: SQLite reads it as an empty database

    code, out, _ = cli(capsys, "status")
    assert code == 2 and "reconcile --rebuild-state" in out["error"]
    code, out, _ = cli(capsys, "run")
    assert code == 1 and "reconcile --rebuild-state" in out["error"]
    code, out, _ = cli(capsys, "reconcile")
    assert code == 1 and "reconcile --rebuild-state" in out["error"]
    assert cli(capsys, "reconcile", "--rebuild-state")[0] == 0
    code, status, _ = cli(capsys, "status")
    assert code == 0 and status["live"]["version"] == 1 and status["problems"] == []
    assert cli(capsys, "run")[1]["outcome"] == "no_change"


def test_corrupt_state_db_is_one_line_and_exit_2(cli_env: Path) -> None:
    script = Path(sys.executable).with_name("kb-reindex")
    env = {**os.environ, "KB_PROJECT_ROOT": str(cli_env)}
    state_db(cli_env).parent.mkdir(parents=True)
    state_db(cli_env).write_bytes(b"not a database at all " * 400)
    for argv in (["status"], ["run"]):
        done = subprocess.run([str(script), *argv, "-q"], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
        assert str(state_db(cli_env)) in done.stderr and "not a usable database" in done.stderr


def test_stale_state_db_is_replaced_from_qdrant_only_when_asked(cli_env: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(capsys, "run")[0] == 0
    backup = cli_env / "state-backup.db"
    shutil.copy(state_db(cli_env), backup)
    edit(cli_env)
    assert cli(capsys, "run")[1]["version"] == 2
    remove_state_db(cli_env)
    shutil.copy(backup, state_db(cli_env))  # yesterday's backup: knows v1 only

    code, status, _ = cli(capsys, "status")
    assert code == 1 and any("--rebuild-state --replace" in p for p in status["problems"])
    code, out, _ = cli(capsys, "reconcile", "--rebuild-state")
    assert code == 2 and "--replace" in out["error"]
    assert cli(capsys, "reconcile", "--rebuild-state", "--replace")[0] == 0
    code, status, _ = cli(capsys, "status")
    assert code == 0 and status["live"]["version"] == 2 and status["problems"] == []
    assert cli(capsys, "run")[1]["outcome"] == "no_change"


def test_rebuild_state_of_a_collection_without_metadata_reads_its_points(deps: Deps) -> None:
    """Collections made before the metadata was written: model and chunking come from the payloads."""
    from kb_reindex.steps.reconcile import read_version

    run_reindex(deps)
    live = deps.state.live_version(ALIAS)
    deps.store.collection_metadata = lambda name: {}  # type: ignore[method-assign]
    facts = read_version(deps, live.collection)
    assert facts.problems == ()
    assert (facts.embedder, facts.embed_model, facts.chunking_version, facts.corpus_fingerprint) == (
        live.embedder, live.embed_model, live.chunking_version, live.corpus_fingerprint)
    assert len(facts.chunks) == live.points_expected


# --- read-only commands point at what exists ---------------------------------------------------------


def test_read_only_commands_never_create_a_state_db_or_a_qdrant_folder(cli_env: Path,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli(capsys, "run")[0] == 0
    typo_db = cli_env / "tpyo" / "state.db"
    monkeypatch.setenv("KB_STATE_URL", f"sqlite:///{typo_db}")
    for argv in (["status"], ["history"], ["plan"]):
        code, out, _ = cli(capsys, *argv)
        assert code == 2 and f"no state DB at {typo_db}" in out["error"], argv
    assert not typo_db.parent.exists()
    monkeypatch.delenv("KB_STATE_URL")
    typo_store = cli_env / ".kb" / "qdrnat"
    monkeypatch.setenv("KB_QDRANT_PATH", str(typo_store))
    for argv in (["status"], ["plan"], ["query", "运费"]):
        code, out, _ = cli(capsys, *argv)
        assert code == 2 and f"no Qdrant store at {typo_store}" in out["error"], argv
    assert cli(capsys, "history")[0] == 0, "history needs only the state DB"
    assert not typo_store.exists()


def test_reader_answers_while_the_state_db_is_unreachable(deps: Deps) -> None:
    from kb_reindex.reader import search_knowledge
    from kb_reindex.services.runtime import ReaderDeps

    run_reindex(deps)
    reader = ReaderDeps(settings=replace(deps.settings, state_url="mysql+pymysql://nobody@127.0.0.1:1/none"),
                        store=deps.store)
    found = search_knowledge(reader, "优惠券过期了还能恢复吗", k=2)
    assert found.version == 1 and found.results[0].knowledge_key == "coupon-rules"
    with pytest.raises(Exception, match="serves 'hashing-ngram-v1'"):
        search_knowledge(reader, "运费", expect_model="bge-m3")


# --- answers ------------------------------------------------------------------------------------------


def test_drop_and_validate_of_a_deleted_version_say_so(cli_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(capsys, "run")[0] == 0
    code, shadow, _ = cli(capsys, "migrate", "--embedder", "hashing", "--model", "hashing-ngram-v1", "--dim", "256",
                          "--no-promote", "--min-hit-rate", "0", "--min-mrr", "0")
    assert code == 0 and shadow["outcome"] == "shadow"
    assert cli(capsys, "drop", "--version", str(shadow["version"]))[0] == 0
    code, again, _ = cli(capsys, "drop", "--version", str(shadow["version"]))
    assert code == 0 and again["already_deleted"] is True
    code, out, _ = cli(capsys, "validate", "--version", str(shadow["version"]))
    assert code == 2 and "was deleted" in out["error"]


def test_first_promotion_names_no_previous_version(deps: Deps, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="kb_reindex"):
        run_reindex(deps)
    assert "the first version behind mall_knowledge" in caplog.text
    assert "previous v-" not in caplog.text


def test_plan_on_a_state_db_that_knows_nothing_points_to_rebuild(deps: Deps, tmp_path: Path) -> None:
    from kb_reindex.steps.plan import plan

    run_reindex(deps)
    deps.state = StateStore(f"sqlite:///{tmp_path}/fresh.db")
    with pytest.raises(StateDriftError, match="reconcile --rebuild-state"):
        plan(deps)


# --- rollback only to versions that served; shadows go live only by promotion -------------------------


def test_rollback_never_reaches_a_shadow_that_never_served(cli_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(capsys, "run")[0] == 0
    code, shadow, _ = cli(capsys, "migrate", "--embedder", "hashing", "--model", "hashing-small", "--dim", "256",
                          "--no-promote", "--min-hit-rate", "0", "--min-mrr", "0")
    assert code == 0 and shadow["outcome"] == "shadow"
    code, status, _ = cli(capsys, "status")
    row = next(v for v in status["versions"] if v["version"] == shadow["version"])
    assert row["shadow"] and not row["rollback_allowed"]
    code, out, _ = cli(capsys, "rollback", "--to-version", str(shadow["version"]), "--reason", "x", "--yes")
    assert code != 0 and "never served" in out["error"] and f"promote --version {shadow['version']}" in out["error"]
    assert cli(capsys, "status")[1]["live"]["version"] == 1

    code, promoted, _ = cli(capsys, "promote", "--version", str(shadow["version"]), "--yes")
    assert code == 0 and promoted["dim"] == 256 and promoted["previous_version"] == 1
    code, history, _ = cli(capsys, "history")
    assert history["events"][-1]["action"] == "migrate" and "shadow" in history["events"][-1]["reason"]
    # undoing a migration is a rollback across models: allowed, v1 served before
    code, back, _ = cli(capsys, "rollback", "--reason", "undo the migration", "--yes")
    assert code == 0 and back["to_version"] == 1
    code, status, _ = cli(capsys, "status")
    assert {v["version"]: v["rollback_allowed"] for v in status["versions"]} == {1: False, shadow["version"]: True}


def test_a_rebuilt_state_knows_which_versions_served(cli_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(capsys, "run")[0] == 0
    code, shadow, _ = cli(capsys, "migrate", "--embedder", "hashing", "--model", "hashing-small", "--dim", "256",
                          "--no-promote", "--min-hit-rate", "0", "--min-mrr", "0")
    edit(cli_env)
    assert cli(capsys, "run")[1]["version"] == 3
    remove_state_db(cli_env)
    assert cli(capsys, "reconcile", "--rebuild-state")[0] == 0
    code, out, _ = cli(capsys, "rollback", "--to-version", str(shadow["version"]), "--reason", "x", "--yes")
    assert code != 0 and "never served" in out["error"]
    code, back, _ = cli(capsys, "rollback", "--to-version", "1", "--reason", "x", "--yes")
    assert code == 0 and back["to_version"] == 1


# --- found in review: ways out that must exist ----------------------------------------------------------


def test_a_deleted_alias_is_pointed_back_at_live_by_reconcile(deps: Deps) -> None:
    from qdrant_client import models

    from kb_reindex.steps.reconcile import reconcile

    run_reindex(deps)
    deps.store.client.update_collection_aliases(change_aliases_operations=[
        models.DeleteAliasOperation(delete_alias=models.DeleteAlias(alias_name=ALIAS))])
    [problem] = status_view(deps).to_dict()["problems"]
    assert "points to nothing" in problem and "kb-reindex reconcile" in problem
    outcome = reconcile(deps)
    assert outcome.changed and deps.store.alias_target(ALIAS).endswith("__s1")
    assert deps.state.alias_events(ALIAS)[-1].action == "reconcile"
    assert status_view(deps).to_dict()["problems"] == []


def test_a_shadow_that_fails_its_recheck_stays_a_shadow(cli_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Re-checked by the thresholds it was built with; a failure leaves it ready, never failed (and dropped)."""
    assert cli(capsys, "run")[0] == 0
    code, shadow, _ = cli(capsys, "migrate", "--embedder", "hashing", "--model", "hashing-small", "--dim", "64",
                          "--no-promote", "--min-hit-rate", "0", "--min-mrr", "0")
    assert code == 0
    golden = cli_env / "knowledge" / "golden.yaml"
    assert next(v for v in cli(capsys, "status")[1]["versions"] if v["version"] == shadow["version"])["shadow"]
    import yaml

    # the golden set changed since: its re-check cannot pass

    data = yaml.safe_load(golden.read_text(encoding="utf-8"))
    data["probes"] = [{**p, "expected": ["no-such-doc-anywhere"]} for p in data["probes"][:1]] + data["probes"][1:]
    golden.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    code, out, _ = cli(capsys, "promote", "--version", str(shadow["version"]), "--yes")
    assert code != 0
    row = next(v for v in cli(capsys, "status")[1]["versions"] if v["version"] == shadow["version"])
    assert row["status"] == "ready" and row["shadow"], "a failed re-check leaves the shadow as it was"
    assert cli(capsys, "gc")[0] == 0
    assert next(v for v in cli(capsys, "status")[1]["versions"] if v["version"] == shadow["version"])["points"]


def test_unlock_works_while_the_stuck_process_holds_the_local_qdrant_folder(
        cli_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qdrant_client import QdrantClient

    assert cli(capsys, "run")[0] == 0
    holder = hold_lock_in_another_process(cli_env)
    stuck = QdrantClient(path=str(cli_env / ".kb" / "qdrant"))  # as the stuck run keeps it open
    try:
        code, out, _ = cli(capsys, "unlock", "--reason", "hung", "--yes")
        assert code == 0 and [b["name"] for b in out["broken"]] == [f"reindex:{ALIAS}"]
        assert cli(capsys, "history")[0] == 0
    finally:
        stuck.close()
        holder.kill()
        holder.wait()


def test_rebuilt_state_tells_served_shadow_and_unfinished_versions_apart(
        cli_env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """After a rebuild, retention keeps what a rollback may need: served versions stay retired, a validated
    shadow stays a shadow (promotable), a build that never finished is failed and dropped."""
    monkeypatch.setenv("KB_KEEP_VERSIONS", "1")
    assert cli(capsys, "run")[0] == 0                                   # v1 served
    edit(cli_env)
    assert cli(capsys, "run")[1]["version"] == 2                        # v2 live
    code, shadow, _ = cli(capsys, "migrate", "--embedder", "hashing", "--model", "hashing-wide", "--dim", "1024",
                          "--no-promote")   # v3 shadow, good enough for the golden set's own thresholds
    from qdrant_client import QdrantClient, models

    client = QdrantClient(path=str(cli_env / ".kb" / "qdrant"))      # v4: a build that never finished
    client.create_collection(f"{ALIAS}__hashing-ngram-v1__v4", metadata={"kb_version": 4, "embed_model": "hashing-ngram-v1",
                             "chunking_version": "x", "embedder": "hashing"},
                             vectors_config=models.VectorParams(size=1024, distance=models.Distance.COSINE))
    client.close()
    remove_state_db(cli_env)
    code, rebuilt, _ = cli(capsys, "reconcile", "--rebuild-state")
    assert code == 0
    assert [(v["version"], v["status"]) for v in rebuilt["rebuilt"]] == [
        (1, "retired"), (2, "live"), (3, "ready"), (4, "failed")]
    assert cli(capsys, "gc")[0] == 0
    versions = {v["version"]: v for v in cli(capsys, "status")[1]["versions"]}
    assert versions[1]["status"] == "retired" and versions[4]["status"] == "deleted"
    code, promoted, _ = cli(capsys, "promote", "--version", "3", "--yes")
    assert code == 0 and promoted["embed_model"] == "hashing-wide"


def test_a_task_whose_stores_cannot_be_opened_is_decided_like_a_failed_step(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qdrant down when a DAG task starts: retried by Airflow (not failed for good), and on the last try the
    run is recorded failed instead of staying 'running' (outside a task context every try is the last)."""
    import socket as sockets

    from airflow.sdk.exceptions import AirflowFailException

    from kb_reindex.airflow.tasks import build_task

    state = StateStore(f"sqlite:///{state_db(project)}")
    state.start_run(run_id="airflow__r1", alias=ALIAS, kind="reindex", trigger="airflow")
    with sockets.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    monkeypatch.setenv("KB_QDRANT_URL", f"http://127.0.0.1:{port}")
    from kb_reindex.domain.errors import StoreUnreachable

    with pytest.raises(StoreUnreachable):
        build_task(version={"version": 1}, run_id="airflow__r1")
    run = state.get_run("airflow__r1")
    assert run.outcome == "failed" and f"127.0.0.1:{port}" in run.error

    monkeypatch.setenv("KB_QDRANT_COLLECTION_CONFIG", '{"hnsw_config": {"no_such_key": 1}}')
    state.start_run(run_id="airflow__r2", alias=ALIAS, kind="reindex", trigger="airflow")
    with pytest.raises(AirflowFailException, match="no_such_key"):
        build_task(version={"version": 1}, run_id="airflow__r2")
    assert state.get_run("airflow__r2").outcome == "failed"
    state.dispose()
