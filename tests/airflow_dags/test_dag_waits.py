"""A DAG task that waits gives its worker slot back between looks (kb_reindex.airflow.waiting): `plan` waiting
for another run's reindex lock (KB_LOCK_WAIT) and `validate` waiting for Qdrant to index a new version
(KB_INDEX_WAIT_S) are `up_for_reschedule`, not running, until their next look; then the run goes on as if it had
never waited. Airflow records each such return in its task_reschedule table, which is what is asserted."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import settings_for
from test_dag_lock import run_dag

from kb_reindex.rules.locking import reindex_lock_name
from kb_reindex.services.runtime import open_deps
from kb_reindex.services.state.locks import default_lock_owner
from kb_reindex.services.state.store import StateStore

ALIAS = "mall_knowledge"

pytestmark = pytest.mark.airflow


def reschedules(task_id: str, dag_id: str = "knowledge_reindex") -> list[tuple[float, float]]:
    """(seconds the try ran, seconds until its next look) of each return of `task_id` to the scheduler, newest
    DAG run of `dag_id`."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.taskreschedule import TaskReschedule
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        run_id = session.scalar(select(DagRun.run_id).where(DagRun.dag_id == dag_id)
                                .order_by(DagRun.id.desc()).limit(1))
        rows = session.execute(
            select(TaskReschedule.start_date, TaskReschedule.end_date, TaskReschedule.reschedule_date)
            .join(TaskInstance, TaskInstance.id == TaskReschedule.ti_id)
            .where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id,
                   TaskInstance.task_id == task_id)
            .order_by(TaskReschedule.id)).all()
    return [((end - start).total_seconds(), (again - end).total_seconds()) for start, end, again in rows]


def when(condition: Callable[[], bool], then: Callable[[], None], timeout_s: float = 120) -> threading.Thread:
    """In the background: `then()` once `condition()` holds (or after the timeout, so the run never hangs)."""
    import airflow.dag_processing.dagbag  # noqa: F401  imported here first: two threads importing Airflow's
    # models at once deadlock on the import lock (seen)

    condition()

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not condition():
            time.sleep(0.2)
        then()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_plan_waits_for_another_runs_lock_off_its_slot_then_builds(project: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   airflow_db: None) -> None:
    """A CLI run of this process holds the lock; the DAG's plan looks, returns its slot (up_for_reschedule,
    next look ~10 s later), and once the lock is let go takes it and the run promotes."""
    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    monkeypatch.setenv("KB_LOCK_WAIT", "120")
    state = StateStore(settings_for(project).state_url)  # the state DB alone: local Qdrant takes one client
    try:
        state.acquire_lock(reindex_lock_name(ALIAS), owner=default_lock_owner(), ttl_s=600)
        owner = state.lock_held_by(reindex_lock_name(ALIAS))
        releaser = when(lambda: bool(reschedules("plan")),
                        lambda: state.release_lock(reindex_lock_name(ALIAS), owner=owner or ""))
        ok, states = run_dag("knowledge_reindex")
        releaser.join(5)
        assert ok, states
        assert state.live_version(ALIAS) is not None
    finally:
        state.dispose()
    waits = reschedules("plan")
    assert waits, "plan never gave its slot back"
    ran, gap = waits[0]
    assert ran < 10 and 8 <= gap <= 11, waits  # it looked, then was off its slot until the next look


def test_validate_waits_for_qdrant_to_index_off_its_slot_then_promotes(project: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       airflow_db: None) -> None:
    """Our Qdrant-protocol server reports the new collection yellow with nothing indexed until released;
    validate waits rescheduled (KB_INDEX_WAIT_S=120), then validates and the alias moves."""
    from kb_reindex.testing.qdrant_server import FakeQdrantServer

    with FakeQdrantServer(tmp_path / "qdrant") as qdrant:
        monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
        monkeypatch.setenv("KB_QDRANT_URL", qdrant.url)
        monkeypatch.setenv("KB_INDEX_WAIT_S", "120")
        qdrant.hold_indexing(1_000_000)
        releaser = when(lambda: bool(reschedules("validate")), lambda: qdrant.hold_indexing(0))
        ok, states = run_dag("knowledge_reindex")
        releaser.join(5)
        assert ok, states
        with open_deps(settings_for(project, KB_QDRANT_URL=qdrant.url)) as deps:
            live = deps.state.live_version(ALIAS)
            assert live is not None and live.version == 1
    waits = reschedules("validate")
    assert waits and 8 <= waits[0][1] <= 11, waits


def test_a_shadow_promotion_waits_for_a_reindexs_lock_off_on_calls_slot_then_promotes(
        project: Path, monkeypatch: pytest.MonkeyPatch, airflow_db: None) -> None:
    """The shadow promotion validates and moves under the reindex lock, so it waits for a build that holds it; on
    on-call's lane (a couple of slots, shared with rollbacks) that wait returns the slot between looks, as plan's
    does, and once the lock is let go it promotes."""
    from kb_reindex.cli import main

    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    monkeypatch.setenv("KB_LOCK_WAIT", "120")
    assert main(["run", "-q"]) == 0  # v1 live
    assert main(["migrate", "--embedder", "hashing", "--model", "hashing-ngram-v4", "--dim", "512", "--no-promote",
                 "-q"]) == 0  # v2: a shadow of another model
    state = StateStore(settings_for(project).state_url)
    try:
        state.acquire_lock(reindex_lock_name(ALIAS), owner=default_lock_owner(), ttl_s=600)
        owner = state.lock_held_by(reindex_lock_name(ALIAS))
        releaser = when(lambda: bool(reschedules("promote_shadow", "knowledge_promote_shadow")),
                        lambda: state.release_lock(reindex_lock_name(ALIAS), owner=owner or ""))
        ok, states = run_dag("knowledge_promote_shadow", {"version": 2, "reason": "bge trial", "confirm": True,
                                                          "live_version": 1})
        releaser.join(5)
        assert ok, states
        live = state.live_version(ALIAS)
        assert live is not None and live.version == 2
    finally:
        state.dispose()
    waits = reschedules("promote_shadow", "knowledge_promote_shadow")
    assert waits, "the shadow promotion never gave its slot back"
    assert 8 <= waits[0][1] <= 11, waits
