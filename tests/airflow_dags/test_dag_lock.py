"""A DAG run holds the alias's reindex lock from plan to cleanup, as a CLI run does for its whole process.

Its owner names the run (`<run_id>@airflow-dag-run`), not a process: the run's tasks renew it, cleanup or the
failure callback lets it go, and a run that dies leaves a lock that expires after KB_LOCK_TTL. A build longer
than the TTL is never taken for abandoned: `gc` from another process waits for it or refuses by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import PATTERNS_SCREEN, REPO, settings_for
from kb_reindex.run import dag_lock
from kb_reindex.run.pipeline import run_reindex
from kb_reindex.run.runs import exclusive
from kb_reindex.steps.build import create_version
from kb_reindex.services.config import Settings
from kb_reindex.domain.errors import ConfigError, LockHeldError, LockLostError
from kb_reindex.rules.locking import reindex_lock_name, run_is_active
from kb_reindex.run.pipeline import plan_and_snapshot
from kb_reindex.steps.retention import cleanup
from kb_reindex.services.runtime import Deps, open_deps
from kb_reindex.services.state.locks import LockRecord
from kb_reindex.services.state.clock import ManualClock, utcnow
from kb_reindex.run.status import history, status_view

BIN = Path(sys.executable).parent
ALIAS = "mall_knowledge"


def held_locks(settings: Settings) -> list[LockRecord]:
    with open_deps(settings) as deps:
        return deps.state.list_locks(subject=ALIAS)


# --- the lock's life, step by step (no Airflow: the functions the tasks call) ------------------------------


def test_a_dead_dag_runs_lock_expires_after_its_ttl_and_gc_then_reclaims_its_build(deps: Deps) -> None:
    from dataclasses import replace

    deps.settings = replace(deps.settings, lock_wait_s=0)  # a refusal at once, not after 30 s
    deps.state.clock = ManualClock()  # time moves only when the test moves it
    run_id = "airflow__knowledge_reindex__manual__dead"
    deps.state.start_run(run_id=run_id, alias=ALIAS, kind="reindex", trigger="airflow")
    owner = dag_lock.take(deps, run_id)
    assert owner == f"{run_id}@airflow-dag-run"  # the run, not a process: its tasks run in many
    planned = plan_and_snapshot(deps, run_id=run_id)
    created = create_version(deps, planned, run_id=run_id)
    assert run_is_active(deps, run_id)
    # another process meets it: the CLI's refusal names the DAG run and how to break the lock
    with pytest.raises(LockHeldError) as refused:
        with exclusive(deps):
            pass
    assert run_id in str(refused.value) and "Airflow DAG run" in str(refused.value)
    assert "kb-reindex unlock" in str(refused.value)
    held = next(row for row in status_view(deps).to_dict()["locks"] if row["name"] == reindex_lock_name(ALIAS))
    assert held["owner"] == owner and held["owner_alive"].startswith("DAG run")
    # a retried task renews the same owner; cleanup under another lock leaves the live run's build alone
    assert dag_lock.renew(deps, run_id) == owner
    cleanup(deps)
    assert deps.state.get_version(ALIAS, created.version).status == "building"

    # the run dies: nothing renews its lock, and KB_LOCK_TTL passes (the store's clock moved, no sleep)
    deps.state.clock.advance(deps.settings.lock_ttl_s - 1)
    assert run_is_active(deps, run_id), "a second before its TTL the lock still holds"
    deps.state.clock.advance(2)
    assert not run_is_active(deps, run_id)
    with exclusive(deps):  # `gc` takes the expired lock and reclaims the abandoned build
        result = cleanup(deps)
    assert [d.version for d in result.deleted] == [created.version]
    assert not deps.store.exists(created.collection)
    # the dead run's task, come back late, finds its lock gone and stops for good
    with pytest.raises(LockLostError, match="no longer holds the lock"):
        dag_lock.renew(deps, run_id)


def test_build_parallelism_above_one_needs_a_qdrant_server(project: Path) -> None:
    assert settings_for(project).build_parallelism == 1
    with pytest.raises(ConfigError, match=r"KB_BUILD_PARALLELISM=3 needs a Qdrant server .*local mode"):
        settings_for(project, KB_BUILD_PARALLELISM="3")
    assert settings_for(project, KB_BUILD_PARALLELISM="3", KB_QDRANT_URL="http://qdrant:6333").build_parallelism == 3
    with pytest.raises(ConfigError, match="KB_BUILD_PARALLELISM=0 must be at least 1"):
        settings_for(project, KB_BUILD_PARALLELISM="0")
    done = subprocess.run([sys.executable, "-m", "kb_reindex.services.config"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KB_PROJECT_ROOT": str(project), "KB_BUILD_PARALLELISM": "2"})
    assert done.returncode == 2 and "KB_BUILD_PARALLELISM=2 needs a Qdrant server" in done.stderr
    assert "Traceback" not in done.stderr


# --- under dag.test(): the tasks take, renew and release it ------------------------------------------------


def run_dag(dag_id: str, conf: dict | None = None):
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils.state import DagRunState

    dag = DagBag(dag_folder=str(REPO / "dags" / f"{dag_id}.py")).get_dag(dag_id)
    dag_run = dag.test(run_conf=conf or {})
    states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
    return dag_run.state == DagRunState.SUCCESS, states


@pytest.fixture
def dag_env(project: Path, monkeypatch: pytest.MonkeyPatch, airflow_db: None) -> Path:
    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    monkeypatch.setenv("KB_LOCK_WAIT", "0")
    return project


@pytest.mark.airflow
def test_dag_run_holds_the_lock_from_plan_to_cleanup_and_lets_it_go(dag_env: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from kb_reindex.run import pipeline as promote_module  # the names the pipeline steps call
    from kb_reindex.run import pipeline as retention_module

    seen: dict[str, object] = {}
    real_promote, real_cleanup = promote_module.promote, retention_module.cleanup

    def promote_and_look(deps, version_number, *, run_id=None, fence=None):
        seen["promote"] = deps.state.lock_held_by(reindex_lock_name(ALIAS))
        with pytest.raises(LockHeldError) as refused:  # a CLI command meanwhile is refused, naming the DAG run
            with exclusive(deps):
                pass
        seen["refusal"] = str(refused.value)
        return real_promote(deps, version_number, run_id=run_id, fence=fence)

    def cleanup_and_look(deps):
        seen["cleanup"] = deps.state.lock_held_by(reindex_lock_name(ALIAS))
        return real_cleanup(deps)

    monkeypatch.setattr(promote_module, "promote", promote_and_look)
    monkeypatch.setattr(retention_module, "cleanup", cleanup_and_look)
    ok, states = run_dag("knowledge_reindex")
    assert ok, states
    assert str(seen["promote"]).startswith("airflow:knowledge_reindex:") and \
        str(seen["promote"]).endswith("@airflow-dag-run")
    assert seen["cleanup"] == seen["promote"]  # cleanup runs under the run's own lock
    assert "another run is working on mall_knowledge: airflow:knowledge_reindex:" in str(seen["refusal"])
    assert held_locks(settings_for(dag_env)) == []  # released after success

    # nothing changed: cleanup still runs under the run's lock, then lets it go
    seen.clear()
    ok, states = run_dag("knowledge_reindex")
    assert ok and states["create_version"] == "skipped" and states["cleanup"] == "success"
    assert str(seen["cleanup"]).endswith("@airflow-dag-run")
    assert held_locks(settings_for(dag_env)) == []

    # a dry run lets it go where it stops (cleanup skips a dry run)
    ok, states = run_dag("knowledge_reindex", {"dry_run": True})
    assert ok and states["cleanup"] == "skipped"
    assert held_locks(settings_for(dag_env)) == []


@pytest.mark.airflow
def test_failed_dag_run_releases_its_lock_through_the_failure_callback(dag_env: Path) -> None:
    assert run_dag("knowledge_reindex")[0]
    (dag_env / "knowledge" / "docs" / "return-policy.md").write_text("# 退换货政策\n\n维护中。\n", encoding="utf-8")
    ok, states = run_dag("knowledge_reindex")
    assert not ok and states["validate"] == "failed"
    assert held_locks(settings_for(dag_env)) == []  # the next run or `gc` need not wait for the TTL
    with open_deps(settings_for(dag_env)) as deps:
        failed = deps.state.get_version(ALIAS, 2)
        assert failed.status == "failed" and not run_is_active(deps, failed.run_id)


# --- a build longer than the TTL, and `gc` from another process during it ------------------------------------


@pytest.mark.airflow
def test_build_longer_than_the_ttl_is_never_dropped_by_a_concurrent_gc(dag_env: Path, tmp_path: Path) -> None:
    """KB_LOCK_TTL=10 s; the build is held at Ollama until the lock has lived past its TTL (renewed by the build
    task's heartbeat). `gc` in another process then refuses at once (KB_LOCK_WAIT=0), naming the run, or waits
    for it (KB_LOCK_WAIT=120) and finds the version live: it is never dropped."""
    from kb_reindex.services.embedding import HashingEmbedder
    from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer
    from kb_reindex.testing.qdrant_server import FakeQdrantServer

    hashing = HashingEmbedder(model="bge-m3", dim=1024)
    gate, arrived = threading.Event(), threading.Event()

    def held_at_the_gate(_model: str, text: str) -> list[float]:
        arrived.set()
        gate.wait(120)
        return hashing.embed_one(text)

    ttl = 10
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=1024, embed=held_at_the_gate)]) as ollama, \
            FakeQdrantServer(tmp_path / "qdrant") as qdrant:
        env = {**os.environ, "KB_PROJECT_ROOT": str(dag_env), "KB_EMBEDDER": "ollama", "OLLAMA_HOST": ollama.url,
               "KB_EMBED_DIM": "1024", "KB_QDRANT_URL": qdrant.url, "KB_LOCK_TTL": str(ttl),
               "KB_OLLAMA_TIMEOUT": "120", **PATTERNS_SCREEN}
        settings = Settings.from_env(env)
        script = ("import sys; from airflow.dag_processing.dagbag import DagBag\n"
                  f"dag = DagBag(dag_folder={str(REPO / 'dags' / 'knowledge_reindex.py')!r}).get_dag('knowledge_reindex')\n"
                  "run = dag.test()\n"
                  "print('DAG-RUN-STATE', run.state)\n")
        dag_run = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        try:
            assert arrived.wait(180), "the build never reached Ollama"
            held_since = time.monotonic()
            with open_deps(settings) as deps:
                building = deps.state.list_versions(ALIAS, statuses=["building"])
                assert [v.version for v in building] == [1]
                run_id = building[0].run_id
                row = next(r for r in deps.state.list_locks(subject=ALIAS) if r.name == reindex_lock_name(ALIAS))
            assert row.owner == f"{run_id}@airflow-dag-run"
            # the build is held past the TTL: what earlier tasks renewed has run out, only the build's heartbeat
            # keeps the lock
            time.sleep(max(0.0, held_since + ttl + 2 - time.monotonic()))
            with open_deps(settings) as deps:
                row = next(r for r in deps.state.list_locks(subject=ALIAS) if r.name == reindex_lock_name(ALIAS))
                assert row.owner == f"{run_id}@airflow-dag-run" and not row.expired, row
                assert (utcnow() - row.acquired_at).total_seconds() > ttl
                assert run_is_active(deps, run_id)

            gc = [str(BIN / "kb-reindex"), "gc", "--json", "-q"]
            refused = subprocess.run(gc, env={**env, "KB_LOCK_WAIT": "0"}, capture_output=True, text=True, timeout=120)
            assert refused.returncode != 0
            answer = json.loads(refused.stdout)
            assert f"another run is working on {ALIAS}: {run_id}@airflow-dag-run" in answer["error"]
            assert "Airflow DAG run" in answer["error"] and "kb-reindex unlock" in answer["error"]

            waiting = subprocess.Popen(gc, env={**env, "KB_LOCK_WAIT": "120"}, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
            with open_deps(settings) as deps:
                assert deps.state.get_version(ALIAS, 1).status == "building"
                assert deps.store.exists(deps.state.get_version(ALIAS, 1).collection)
        finally:
            gate.set()
        out, _ = dag_run.communicate(timeout=300)
        assert "DAG-RUN-STATE success" in out, out[-4000:]
        gc_out, gc_err = waiting.communicate(timeout=180)
        assert waiting.returncode == 0, gc_err[-2000:]
        assert json.loads(gc_out)["deleted"] == []
        with open_deps(settings) as deps:
            live = deps.state.live_version(ALIAS)
            assert live is not None and live.version == 1 and deps.store.exists(live.collection)
            assert deps.state.list_locks(subject=ALIAS) == []


# --- a DAG run that Airflow no longer runs (marked failed in the UI): its lock is dead at once ---------------


def test_the_lock_of_a_dag_run_airflow_reports_failed_is_taken_over_at_once(
        deps: Deps, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No callback fired (the UI's "mark failed" runs none): the next run asks Airflow's metadata DB, finds
    the run failed, takes its lock over at once and records it; while the run runs, it is refused."""
    from dataclasses import replace

    import sqlalchemy as sa

    metadata = sa.create_engine(f"sqlite:///{tmp_path / 'airflow.db'}")
    with metadata.begin() as conn:
        conn.execute(sa.text("CREATE TABLE dag_run (dag_id TEXT, run_id TEXT, state TEXT)"))
        conn.execute(sa.text("INSERT INTO dag_run VALUES ('knowledge_reindex', 'manual__2026-11-30', 'running')"))
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", str(metadata.url))
    deps.settings = replace(deps.settings, lock_wait_s=0)
    run_id = "airflow__knowledge_reindex__manual__2026-11-30"
    deps.state.start_run(run_id=run_id, alias=ALIAS, kind="reindex", trigger="airflow")
    dag_lock.take(deps, run_id)
    held = next(row for row in status_view(deps).to_dict()["locks"] if row["name"] == reindex_lock_name(ALIAS))
    assert held["owner_alive"] == "yes", "Airflow says the run runs"
    with pytest.raises(LockHeldError, match="an Airflow DAG run that Airflow reports running"):
        with exclusive(deps):
            pass

    with metadata.begin() as conn:  # on-call marks the run failed in the UI: no task callback fires
        conn.execute(sa.text("UPDATE dag_run SET state = 'failed'"))
    assert next(row for row in status_view(deps).to_dict()["locks"])["owner_alive"] == "no"
    result = run_reindex(deps)
    assert result.outcome in ("promoted", "no_change"), result
    assert deps.state.get_run(run_id).outcome == "failed"
    takeover = [e for e in history(deps) if e.action == "lock-takeover"]
    assert len(takeover) == 1 and "its DAG run is failed in Airflow, no longer running" in takeover[0].reason
    assert run_id in takeover[0].reason


def test_inside_a_task_a_dag_run_the_task_sdk_reports_failed_is_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan task asks through the Task SDK (no metadata DB in a task), which answers its own
    `DagRunState(str, Enum)`: its str() is "DagRunState.FAILED", not "failed". A run on-call marked failed is dead
    (its lock taken over at once, as from the CLI), a running one alive; found by the real scheduler, where a
    plan after a run marked failed waited out the lock's TTL."""
    import types

    from airflow.sdk.api.datamodels._generated import DagRunState

    from kb_reindex.services.state.dag_runs import dag_run_alive

    answers = {"manual__a": DagRunState.FAILED, "manual__b": DagRunState.RUNNING, "manual__c": DagRunState.SUCCESS}
    runner = types.ModuleType("airflow.sdk.execution_time.task_runner")
    runner.SUPERVISOR_COMMS = object()  # type: ignore[attr-defined]
    runner.RuntimeTaskInstance = types.SimpleNamespace(  # type: ignore[attr-defined]
        get_dagrun_state=lambda dag_id, run_id: answers[run_id])
    monkeypatch.setitem(sys.modules, "airflow.sdk.execution_time.task_runner", runner)
    monkeypatch.delenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", raising=False)
    assert dag_run_alive("airflow:knowledge_reindex:manual__a") == (False, "failed")
    assert dag_run_alive("airflow:knowledge_reindex:manual__b") == (True, "running")
    assert dag_run_alive("airflow:knowledge_reindex:manual__c") == (False, "success")
