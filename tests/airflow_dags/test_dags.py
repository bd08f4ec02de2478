"""The DAGs: DagBag integrity, and `dag.test()` end to end on the embedded default."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PATTERNS_SCREEN, REPO, force_status

pytestmark = pytest.mark.airflow
DAG_IDS = {"knowledge_reindex", "knowledge_watch", "knowledge_rollback", "knowledge_model_migration",
           "knowledge_promote_shadow"}


@pytest.fixture(scope="session")
def dagbag(airflow_db: None):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags"))


def test_dagbag_has_no_import_errors_and_every_dag_is_documented(dagbag) -> None:
    assert dagbag.import_errors == {}
    assert set(dagbag.dag_ids) == DAG_IDS
    for dag_id in DAG_IDS:
        dag = dagbag.get_dag(dag_id)
        assert dag.doc_md and len(dag.doc_md) > 200, dag_id
        assert dag.tags and "knowledge" in dag.tags
        assert dag.max_active_runs == 1
        assert not dag.catchup


def test_every_param_of_every_dag_is_described(dagbag) -> None:
    """The trigger form is what on-call reads under pressure: each field says what it does."""
    for dag_id in DAG_IDS:
        for name, param in dagbag.get_dag(dag_id).params.items():
            assert len(param.description or "") > 15, (dag_id, name)
            assert param.schema.get("title") and param.schema.get("section"), (dag_id, name)


def test_migration_model_follows_the_embedder(dagbag) -> None:
    from kb_reindex.services.config import DEFAULT_MODELS

    params = dagbag.get_dag("knowledge_model_migration").params
    assert params["model"] is None  # empty: the embedder's default
    description = params.get_param("model").description
    assert all(model in description for model in DEFAULT_MODELS.values())
    # the form offers every embedder, e5 (the embedded default) among them
    assert set(params.get_param("embedder").schema["enum"]) == {"e5", "hashing", "ollama"}


def test_reindex_dag_shape(dagbag) -> None:
    dag = dagbag.get_dag("knowledge_reindex")
    assert dag.schedule == "@daily" and dag.timetable.expression == "0 0 * * *"
    assert set(dag.params) >= {"force_full_rebuild", "dry_run"}
    order = ["plan", "has_changes", "create_version", "path", "small_run", "build_slices", "build", "validate",
             "promote", "cleanup"]
    assert set(order) == set(dag.task_ids)
    for task_id in ("create_version", "small_run", "build", "promote", "cleanup"):
        assert dag.get_task(task_id).pool == "kb_qdrant_writes"
    # transient steps retry; validation failures raise AirflowFailException, which never retries
    assert dag.get_task("build").retries >= 1 and dag.get_task("validate").retries >= 1
    assert [o.uri for o in dag.get_task("promote").outlets] == ["qdrant://mall_knowledge/"]
    assert dag.get_task("validate").upstream_task_ids >= {"build", "create_version"}
    assert [o.uri for o in dag.get_task("small_run").outlets] == ["qdrant://mall_knowledge/"]
    assert dag.get_task("path").downstream_task_ids == {"small_run", "build_slices", "cleanup"}
    assert dag.get_task("cleanup").upstream_task_ids == {"promote", "path"}, "the run ends at its promotion's retention"


def test_the_watch_is_a_dag_of_its_own_started_by_each_promotion(dagbag) -> None:
    """knowledge_watch runs on the alias Asset the promotions update, unpaused, one watch at a time: a sensor in
    reschedule mode that holds no worker slot (and no Qdrant write slot) between its looks."""
    dag = dagbag.get_dag("knowledge_watch")
    assert [asset.uri for asset in dag.timetable.asset_condition.objects] == ["qdrant://mall_knowledge/"]
    assert dag.is_paused_upon_creation is False and dag.max_active_runs == 1
    (watch,) = dag.tasks
    assert (watch.task_id, watch.mode, watch.pool) == ("watch", "reschedule", "default_pool")
    assert watch.retries >= 1 and watch.poke_interval == 60  # KB_WATCH_INTERVAL_S


def test_rollback_migration_and_shadow_promotion_are_manual(dagbag) -> None:
    for dag_id in ("knowledge_rollback", "knowledge_model_migration", "knowledge_promote_shadow"):
        assert type(dagbag.get_dag(dag_id).timetable).__name__ == "NullTimetable"
    assert set(dagbag.get_dag("knowledge_rollback").params) == {"live_version", "reason", "to_version", "confirm",
                                                                "revalidate", "freeze"}
    assert dagbag.get_dag("knowledge_rollback").params["freeze"] is True, "a rollback freezes unless told not to"
    assert set(dagbag.get_dag("knowledge_model_migration").params) >= {"embedder", "model", "dimension", "promote",
                                                                       "payload_layout"}
    assert set(dagbag.get_dag("knowledge_promote_shadow").params) == {"version", "live_version", "reason", "confirm"}
    # on-call's DAGs run from the first minute of a fresh install; the rollback never queues behind build slices
    for dag_id in ("knowledge_rollback", "knowledge_promote_shadow"):
        assert dagbag.get_dag(dag_id).is_paused_upon_creation is False
    assert dagbag.get_dag("knowledge_rollback").get_task("rollback").pool != "kb_qdrant_writes"
    for dag_id in ("knowledge_reindex", "knowledge_model_migration"):  # a run failed as a whole lets its lock go
        assert dagbag.get_dag(dag_id).on_failure_callback is not None
    for dag_id, task_id in (("knowledge_reindex", "promote"), ("knowledge_model_migration", "promote"),
                            ("knowledge_rollback", "rollback"), ("knowledge_promote_shadow", "promote_shadow")):
        assert [o.uri for o in dagbag.get_dag(dag_id).get_task(task_id).outlets] == ["qdrant://mall_knowledge/"]


@pytest.mark.parametrize("poll", ["0", "5"])
def test_a_schedule_that_is_no_cron_takes_away_the_reindex_dag_alone_and_is_named(
        airflow_db: None, monkeypatch: pytest.MonkeyPatch, poll: str) -> None:
    """No registry, KB_REINDEX_SCHEDULE=@dayly: the reindex DAG file's import error names the variable and the
    value, and on-call's rollback and the other DAGs stay. Before, Airflow's own error named neither (unwatched),
    and a watched schedule parsed without a word and never ran on time."""
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("KB_REINDEX_SCHEDULE", "@dayly")
    monkeypatch.setenv("KB_SOURCE_POLL_S", poll)
    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert set(bag.dag_ids) == DAG_IDS - {"knowledge_reindex"}
    [(where, error)] = bag.import_errors.items()
    assert where.endswith("dags/knowledge_reindex.py")
    assert "KB_REINDEX_SCHEDULE: '@dayly' is not a cron expression" in error, error
    assert bag.get_dag("knowledge_rollback").is_paused_upon_creation is False


def test_parsing_a_dag_does_not_import_heavy_libraries() -> None:
    code = (
        "import sys, importlib.util\n"
        "for name in ['knowledge_reindex', 'knowledge_rollback', 'knowledge_model_migration', "
        "'knowledge_promote_shadow']:\n"
        f"    spec = importlib.util.spec_from_file_location(name, {str(REPO / 'dags')!r} + '/' + name + '.py')\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "heavy = [m for m in ('qdrant_client', 'pandas', 'ollama', 'kb_reindex.run.pipeline') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1:] in ([""], []), done.stdout


def kb(project: Path, *argv: str) -> dict:
    script = Path(sys.executable).with_name("kb-reindex")
    done = subprocess.run([str(script), *argv, "--json", "-q"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KB_PROJECT_ROOT": str(project)})
    assert done.stdout, done.stderr
    data = json.loads(done.stdout)
    assert "error" not in data or data.get("outcome") != "failed", data["error"]
    return data


@pytest.fixture
def dag_env(project: Path, monkeypatch: pytest.MonkeyPatch, airflow_db: None) -> Path:
    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    return project


LAST_RUN: dict[str, str] = {}


def run_dag(dagbag, dag_id: str, conf: dict | None = None):
    from airflow.utils.state import DagRunState

    from airflow.dag_processing.dagbag import DagBag

    # a DAG object of its own per run: running tasks in-process, dag.test() leaves a run's conf in its tasks'
    # params, and the next run of the same object would inherit it (seen: a dry run's `dry_run`)
    dag = DagBag(dag_folder=str(REPO / "dags" / f"{dag_id}.py")).get_dag(dag_id)
    dag_run = dag.test(run_conf=conf or {})
    LAST_RUN.update(dag_id=dag_id, run_id=dag_run.run_id)
    states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
    return dag_run.state == DagRunState.SUCCESS, states


def asset_events_of_last_run() -> list[dict]:
    """The alias Asset's events the last `run_dag` emitted, as Airflow's metadata DB holds them."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(AssetModel.uri, AssetEvent.extra, AssetEvent.source_task_id)
            .join(AssetModel, AssetModel.id == AssetEvent.asset_id)
            .where(AssetEvent.source_dag_id == LAST_RUN["dag_id"], AssetEvent.source_run_id == LAST_RUN["run_id"])
        ).all()
    return [{"uri": uri, "extra": extra, "task": task} for uri, extra, task in rows]


def alias_extra(project: Path, action: str, version: int, previous: int | None, *, watched: bool = False) -> dict:
    """The `extra` consumers get: what serves now and what it replaced; `watched`: a run's promotion, which
    says what knowledge_watch needs (the run's watch_minutes, empty here, and the run: the last `run_dag`)."""
    row = {v["version"]: v for v in kb(project, "status")["versions"]}[version]
    extra = {"alias": "mall_knowledge", "action": action, "version": version, "collection": row["collection"],
             "model": row["embed_model"], "dimension": row["dim"], "previous_version": previous,
             "payload_layout": row["payload_layout"], "embed_profile": row["embed_profile"]}
    if watched:
        extra["watch"] = {"minutes": None, "run_id": f"airflow:{LAST_RUN['dag_id']}:{LAST_RUN['run_id']}"}
    return extra


def test_reindex_dag_end_to_end_then_no_change(dagbag, dag_env: Path) -> None:
    ok, states = run_dag(dagbag, "knowledge_reindex")
    assert ok, states
    status = kb(dag_env, "status")
    assert status["live"]["version"] == 1
    history = kb(dag_env, "history")["events"]
    assert history[0]["run_id"].startswith("airflow:knowledge_reindex:")
    assert asset_events_of_last_run() == [{"uri": "qdrant://mall_knowledge/", "task": "promote",
                                           "extra": alias_extra(dag_env, "promote", 1, None, watched=True)}]

    ok, states = run_dag(dagbag, "knowledge_reindex")
    assert ok
    assert states["has_changes"] == "success" and states["create_version"] == "skipped"
    assert states["promote"] == "skipped" and states["cleanup"] == "success"
    assert asset_events_of_last_run() == []  # nothing moved, nothing announced
    assert kb(dag_env, "status")["live"]["version"] == 1
    # recorded as the CLI records a no-op: nothing embedded, nothing reused, because nothing was built
    from kb_reindex.run.pipeline import run_reindex
    from kb_reindex.services.config import Settings
    from kb_reindex.services.runtime import open_deps

    with open_deps(Settings.from_env({"KB_PROJECT_ROOT": str(dag_env)})) as deps:
        first, last = deps.state.list_runs(deps.settings.alias, limit=2)[::-1]
        # the mapped build tasks added what they wrote to the run's record: every chunk, once
        assert first.outcome == "promoted" and (first.chunks_embedded, first.chunks_reused) == \
            (first.chunks_total, 0)
        assert last.outcome == "no_change" and last.chunks_total > 0
        assert (last.chunks_embedded, last.chunks_reused) == (0, 0)
        assert run_reindex(deps).outcome == "no_change"
        cli = deps.state.list_runs(deps.settings.alias, limit=1)[0]
        assert {k: getattr(cli, k) for k in ("chunks_total", "chunks_embedded", "chunks_reused", "docs_unchanged")} == \
            {k: getattr(last, k) for k in ("chunks_total", "chunks_embedded", "chunks_reused", "docs_unchanged")}


def test_status_and_the_page_name_a_task_waiting_in_a_pool_airflow_does_not_have(dagbag, dag_env: Path) -> None:
    """A DAG run holding the alias's lock whose next task waits in a pool that does not exist (a deployment without
    our plugin's listener, which creates kb-reindex's pools): Airflow leaves it `scheduled` for ever and says so
    only in the scheduler's log. `status` (the CLI beside the Airflow install, as on-call runs it) and the page's
    status name the task and the pool; with the pool there, nothing is said."""
    from airflow.models.pool import Pool
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import update

    from kb_reindex.rules.locking import reindex_lock_name
    from kb_reindex.services.config import Settings
    from kb_reindex.services.state.locks import DAG_RUN_OWNER
    from kb_reindex.services.state.store import StateStore

    ok, states = run_dag(dagbag, "knowledge_reindex")
    assert ok, states
    dag_id, run_id = LAST_RUN["dag_id"], LAST_RUN["run_id"]
    where = (TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id, TaskInstance.task_id == "create_version")
    state = StateStore(Settings.from_env({"KB_PROJECT_ROOT": str(dag_env)}).state_url)
    lock = reindex_lock_name("mall_knowledge")
    owner = f"airflow:{dag_id}:{run_id}@{DAG_RUN_OWNER}"
    try:
        with create_session() as session:
            session.execute(update(TaskInstance).where(*where).values(state="scheduled", pool="kb_qdrant_writes__gone"))
        state.acquire_lock(lock, owner=owner, ttl_s=600)
        problems = kb(dag_env, "status")["problems"]
        assert [p for p in problems if "pool" in p] == [
            f"task create_version of {dag_id} run {run_id} waits in pool kb_qdrant_writes__gone, which Airflow does not "
            "have: it never runs until the pool exists. Create it (`airflow pools set kb_qdrant_writes__gone <slots> "
            "kb-reindex`; `make airflow` and the compose init set kb-reindex's pools at start, and the scheduler's "
            "kb-reindex listener when a run starts: is the plugin loaded?)"]
        with create_session() as session:
            session.add(Pool(pool="kb_qdrant_writes__gone", slots=1, description="test", include_deferred=False))
        assert [p for p in kb(dag_env, "status")["problems"] if "pool" in p] == []
    finally:
        state.release_lock(lock, owner=owner)
        state.dispose()
        with create_session() as session:
            session.execute(update(TaskInstance).where(*where).values(state="success", pool="kb_qdrant_writes"))
            session.query(Pool).filter(Pool.pool == "kb_qdrant_writes__gone").delete()


def test_a_small_plan_runs_in_one_task_and_a_larger_one_in_the_mapped_slices(dagbag, dag_env: Path) -> None:
    """Issue #41: a plan with at most `small_run_points` points to write builds, validates, promotes and cleans
    up in `small_run` (the same records, the Asset event, the lock let go); one point more takes the slices."""
    ok, states = run_dag(dagbag, "knowledge_reindex", {"small_run_points": 100_000})
    assert ok, states
    assert (states["path"], states["small_run"]) == ("success", "success"), states
    assert {t: states[t] for t in ("build_slices", "build", "validate", "promote", "cleanup")} == dict.fromkeys(
        ("build_slices", "build", "validate", "promote", "cleanup"), "skipped"), states
    status = kb(dag_env, "status")
    assert status["live"]["version"] == 1 and status["locks"] == [], status["locks"]
    assert asset_events_of_last_run() == [{"uri": "qdrant://mall_knowledge/", "task": "small_run",
                                           "extra": alias_extra(dag_env, "promote", 1, None, watched=True)}]
    assert kb(dag_env, "history")["events"][0]["run_id"].startswith("airflow:knowledge_reindex:")

    # one page edited, more points to write than the run allows for one task
    page = dag_env / "knowledge" / "docs" / "return-policy.md"
    page.write_text(page.read_text(encoding="utf-8") + "\n\n## 补充\n\n会员退货可延长至三十天。\n", encoding="utf-8")
    ok, states = run_dag(dagbag, "knowledge_reindex", {"small_run_points": 1})
    assert ok, states
    assert states["small_run"] == "skipped" and states["promote"] == "success" and states["cleanup"] == "success"
    assert kb(dag_env, "status")["live"]["version"] == 2

    page.write_text(page.read_text(encoding="utf-8") + "\n会员积分退货时一并退回。\n", encoding="utf-8")
    ok, states = run_dag(dagbag, "knowledge_reindex")  # KB_SMALL_RUN_POINTS=0 here (tests/conftest.py): mapped
    assert ok and states["small_run"] == "skipped" and states["promote"] == "success", states
    ok, states = run_dag(dagbag, "knowledge_reindex", {"small_run_points": 100_000})  # nothing changed
    assert ok and states["create_version"] == "skipped" and states["small_run"] == "skipped", states
    assert states["cleanup"] == "success", "a run with nothing to build still applies retention and lets its lock go"
    assert kb(dag_env, "status")["locks"] == []


def test_reindex_dag_failed_validation_keeps_the_alias(dagbag, dag_env: Path) -> None:
    assert run_dag(dagbag, "knowledge_reindex")[0]
    (dag_env / "knowledge" / "docs" / "return-policy.md").write_text("# 退换货政策\n\n维护中。\n", encoding="utf-8")
    ok, states = run_dag(dagbag, "knowledge_reindex")
    assert not ok and states["validate"] == "failed" and states["promote"] in ("upstream_failed", None)
    assert states["cleanup"] == "upstream_failed"  # a failure is looked at before anything is reclaimed
    status = kb(dag_env, "status")
    assert status["live"]["version"] == 1
    assert {v["version"]: v["status"] for v in status["versions"]}[2] == "failed"
    assert asset_events_of_last_run() == []


def test_reindex_dag_with_nothing_to_change_still_reclaims_abandoned_builds(dagbag, dag_env: Path) -> None:
    """Seen: cleanup sat behind the no-change short-circuit, so a quiet knowledge base kept failed builds."""
    assert run_dag(dagbag, "knowledge_reindex")[0]
    doc = dag_env / "knowledge" / "docs" / "return-policy.md"
    original = doc.read_text(encoding="utf-8")
    doc.write_text("# 退换货政策\n\n维护中。\n", encoding="utf-8")
    assert not run_dag(dagbag, "knowledge_reindex")[0]
    assert {v["version"]: v["status"] for v in kb(dag_env, "status")["versions"]}[2] == "failed"
    doc.write_text(original, encoding="utf-8")  # the bad edit reverted: nothing differs from live

    ok, states = run_dag(dagbag, "knowledge_reindex")
    assert ok, states
    assert states["create_version"] == "skipped" and states["cleanup"] == "success"
    versions = {v["version"]: v["status"] for v in kb(dag_env, "status")["versions"]}
    assert versions == {1: "live", 2: "deleted"}

    ok, states = run_dag(dagbag, "knowledge_reindex", {"dry_run": True})
    assert ok and states["cleanup"] == "skipped"  # a dry run changes nothing, retention included


def test_promote_that_finds_its_version_already_live_emits_no_asset_event(dagbag, dag_env: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process promoted the version first: this run moved nothing, so it announces nothing,
    and cleanup still runs."""
    assert run_dag(dagbag, "knowledge_reindex")[0]
    path = dag_env / "knowledge" / "docs" / "coupon-rules.md"
    path.write_text(path.read_text(encoding="utf-8") + "\n\n补充：仅限线上。\n", encoding="utf-8")
    from kb_reindex.run import pipeline

    real_promote = pipeline.promote

    def promoted_first_by_someone_else(deps, version_number, *, run_id=None, fence=None):
        real_promote(deps, version_number, run_id="cli__someone-else")
        return real_promote(deps, version_number, run_id=run_id, fence=fence)

    monkeypatch.setattr(pipeline, "promote", promoted_first_by_someone_else)
    ok, states = run_dag(dagbag, "knowledge_reindex")
    assert ok, states
    assert states["promote"] == "skipped" and states["cleanup"] == "success"
    assert kb(dag_env, "status")["live"]["version"] == 2
    assert asset_events_of_last_run() == []


def cli_versions(project: Path, count: int) -> None:
    """`count` promoted versions through the CLI path (same engine, no Airflow)."""
    from kb_reindex.run.pipeline import run_reindex
    from kb_reindex.services.config import Settings
    from kb_reindex.services.runtime import open_deps

    for n in range(count):
        if n:
            path = project / "knowledge" / "docs" / "coupon-rules.md"
            path.write_text(path.read_text(encoding="utf-8") + f"\n\n补充条款{n}：仅限线上使用。\n", encoding="utf-8")
        with open_deps(Settings.from_env()) as deps:
            assert run_reindex(deps).outcome == "promoted"


def test_rollback_dag_to_previous_and_to_chosen_version(dagbag, dag_env: Path) -> None:
    cli_versions(dag_env, 3)
    ok, states = run_dag(dagbag, "knowledge_rollback", {"reason": "stale", "confirm": True, "live_version": 2})
    assert not ok and kb(dag_env, "status")["live"]["version"] == 3, "confirmed against v2 while v3 serves"
    ok, states = run_dag(dagbag, "knowledge_rollback", {"reason": "bad coupon text", "confirm": True,
                                                        "live_version": 3})
    assert ok, states
    assert kb(dag_env, "status")["live"]["version"] == 2
    assert [e["extra"] for e in asset_events_of_last_run()] == [alias_extra(dag_env, "rollback", 2, 3)]
    ok, _ = run_dag(dagbag, "knowledge_rollback", {"reason": "further back", "confirm": True, "to_version": 1,
                                                      "revalidate": False, "live_version": 2})
    assert ok
    status = kb(dag_env, "status")
    assert status["live"]["version"] == 1
    events = kb(dag_env, "history")["events"]
    assert [e["action"] for e in events[-2:]] == ["rollback", "rollback"]
    assert events[-1]["reason"] == "further back" and events[-1]["run_id"].startswith("airflow:knowledge_rollback:")


def test_a_typo_in_a_setting_the_rollback_does_not_read_never_stops_it(dag_env: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bad day: a deploy set KB_CHUNK_SIZE=10 and KB_KEEP_VERSIONS=abc. The reindex refuses by name; on-call's
    rollback DAG still parses and moves the alias back, its log naming each mistake it left out; `status` shows
    them as problems beside what serves."""
    cli_versions(dag_env, 2)
    monkeypatch.setenv("KB_CHUNK_SIZE", "10")
    monkeypatch.setenv("KB_KEEP_VERSIONS", "abc")
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert "knowledge_rollback" in bag.dag_ids and "knowledge_reindex" not in bag.dag_ids
    assert "KB_CHUNK_SIZE=10 must be at least 50" in bag.import_errors[str(REPO / "dags" / "knowledge_reindex.py")]
    ok, states = run_dag(bag, "knowledge_rollback", {"reason": "bad deploy", "confirm": True, "live_version": 2})
    assert ok, states
    status = kb(dag_env, "status")
    assert status["live"]["version"] == 1
    assert sorted(p.split(" (left out here")[0] for p in status["problems"]) == [
        "KB_CHUNK_SIZE=10 must be at least 50", "KB_KEEP_VERSIONS='abc' is not an integer"]


def test_rollback_dag_refuses_without_confirm_or_with_a_failed_target(dagbag, dag_env: Path) -> None:
    cli_versions(dag_env, 2)
    ok, states = run_dag(dagbag, "knowledge_rollback", {"reason": "no confirm", "confirm": False})
    assert not ok and states["rollback"] == "failed"
    assert kb(dag_env, "status")["live"]["version"] == 2
    assert asset_events_of_last_run() == []

    from kb_reindex.services.config import Settings
    from kb_reindex.services.state.store import StateStore

    state = StateStore(Settings.from_env().state_url)
    force_status(state, state.get_version("mall_knowledge", 1).id, "failed")
    state.dispose()
    ok, states = run_dag(dagbag, "knowledge_rollback", {"reason": "to failed", "confirm": True, "to_version": 1,
                                                        "live_version": 2})
    assert not ok
    assert kb(dag_env, "status")["live"]["version"] == 2


def test_migration_dag_with_promote_and_as_shadow(dagbag, dag_env: Path) -> None:
    cli_versions(dag_env, 1)
    ok, states = run_dag(dagbag, "knowledge_model_migration",
                         {"embedder": "hashing", "model": "hashing-ngram-v4", "dimension": 512, "promote": False})
    assert ok, states
    # the same run as a reindex: promote off keeps a shadow (the promote task skipped: no event, no watch); cleanup
    assert states["promote"] == "skipped" and states["cleanup"] == "success"
    assert "build_slices" in states, "the migration maps its build over slices as the reindex does"
    status = kb(dag_env, "status")
    assert status["live"]["version"] == 1
    assert {v["version"]: v["status"] for v in status["versions"]}[2] == "ready"

    ok, states = run_dag(dagbag, "knowledge_model_migration",
                         {"embedder": "hashing", "model": "hashing-ngram-v5", "dimension": 768, "promote": True,
                          "payload_layout": "langchain"})
    assert ok, states
    live = kb(dag_env, "status")["live"]
    assert (live["version"], live["embed_model"], live["dim"], live["payload_layout"]) == (
        3, "hashing-ngram-v5", 768, "langchain")
    assert kb(dag_env, "history")["events"][-1]["action"] == "migrate"
    assert [e["extra"] for e in asset_events_of_last_run()] == [alias_extra(dag_env, "migrate", 3, 1, watched=True)]
    assert alias_extra(dag_env, "migrate", 3, 1)["model"] == "hashing-ngram-v5"


def test_promote_shadow_dag_promotes_a_shadow_and_refuses_a_retired_or_unknown_version(dagbag, dag_env: Path) -> None:
    cli_versions(dag_env, 2)  # v1 retired (served), v2 live
    ok, states = run_dag(dagbag, "knowledge_model_migration",
                         {"embedder": "hashing", "model": "hashing-ngram-v4", "dimension": 512, "promote": False})
    assert ok, states
    assert {v["version"]: v["shadow"] for v in kb(dag_env, "status")["versions"]} == {1: False, 2: False, 3: True}

    for conf in ({"version": 1, "reason": "retired: a rollback's job", "confirm": True},
                 {"version": 9, "reason": "unknown", "confirm": True},
                 {"version": 3, "reason": "not confirmed", "confirm": False}):
        ok, states = run_dag(dagbag, "knowledge_promote_shadow", conf)
        assert not ok and states["promote_shadow"] == "failed", conf
        assert kb(dag_env, "status")["live"]["version"] == 2 and asset_events_of_last_run() == []

    ok, states = run_dag(dagbag, "knowledge_promote_shadow", {"version": 3, "reason": "bge trial", "confirm": True,
                                                              "live_version": 2})
    assert ok, states
    live = kb(dag_env, "status")["live"]
    assert (live["version"], live["embed_model"], live["dim"]) == (3, "hashing-ngram-v4", 512)
    last = kb(dag_env, "history")["events"][-1]
    assert (last["action"], last["from_version"], last["reason"]) == ("migrate", 2, "bge trial")
    assert last["run_id"].startswith("airflow:knowledge_promote_shadow:")
    assert [e["extra"] for e in asset_events_of_last_run()] == [alias_extra(dag_env, "migrate", 3, 2)]
    # it served now: from here on a rollback may return to it, and it is no shadow any more
    ok, _ = run_dag(dagbag, "knowledge_promote_shadow", {"version": 3, "reason": "again", "confirm": True})
    assert not ok


def test_migration_dag_refuses_a_model_the_embedder_cannot_serve_and_defaults_to_its_own(dagbag, dag_env: Path) -> None:
    """Seen: embedder hashing with the form's old default bge-m3 built `mall_knowledge__bge-m3__v5` from
    hashing vectors."""
    cli_versions(dag_env, 1)
    ok, states = run_dag(dagbag, "knowledge_model_migration", {"embedder": "hashing", "model": "bge-m3", "promote": True})
    assert not ok and states["plan"] == "failed" and states["create_version"] in ("upstream_failed", None)
    assert [v["version"] for v in kb(dag_env, "status")["versions"]] == [1]

    ok, states = run_dag(dagbag, "knowledge_model_migration",
                         {"embedder": "hashing", "model": None, "dimension": 512, "promote": False})
    assert ok, states
    shadow = {v["version"]: v for v in kb(dag_env, "status")["versions"]}[2]
    assert (shadow["embed_model"], shadow["collection"]) == ("hashing-ngram-v1", "mall_knowledge__hashing-ngram-v1__s2")


def test_reindex_dag_uses_airflow_connections(dagbag, dag_env: Path, mysql_url: str, monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """kb_state on the real MariaDB, ollama_default on our Ollama server over HTTP, qdrant_default on our
    Qdrant-protocol server over REST (the Connection's host, port and API key, mapped as the QdrantHook does)."""
    from urllib.parse import urlsplit

    from kb_reindex.services.embedding import HashingEmbedder
    from kb_reindex.services.state.store import StateStore
    from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer
    from kb_reindex.testing.qdrant_server import FakeQdrantServer

    embedder = HashingEmbedder(model="bge-m3", dim=1024)
    db = urlsplit(mysql_url)
    with FakeOllamaServer([FakeModel(name="bge-m3", dim=1024, embed=lambda _m, t: embedder.embed_one(t))]) as ollama, \
            FakeQdrantServer(tmp_path / "qdrant-behind-connection", api_key="s3cr3t-key") as qdrant:
        port = urlsplit(ollama.url).port
        monkeypatch.setenv("AIRFLOW_CONN_KB_STATE", f"mysql://{db.username}@{db.hostname}:{db.port}{db.path}")
        monkeypatch.setenv("AIRFLOW_CONN_OLLAMA_DEFAULT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("AIRFLOW_CONN_QDRANT_DEFAULT",
                           f"qdrant://:s3cr3t-key@127.0.0.1:{urlsplit(qdrant.url).port}?https=false")
        monkeypatch.setenv("KB_EMBEDDER", "ollama")
        monkeypatch.setenv("KB_INSTRUCTION_SCREEN", PATTERNS_SCREEN["KB_INSTRUCTION_SCREEN"])
        monkeypatch.setenv("OLLAMA_HOST", "http://127.0.0.1:9")  # the Connection must win over this
        ok, states = run_dag(dagbag, "knowledge_reindex")
        assert ok, states
        assert ollama.embedded_texts > 0
        assert {"create_collection", "upsert", "update_aliases"} <= {r.op for r in qdrant.requests()}
        assert all(r.status == 200 for r in qdrant.requests()), "every request carried the Connection's key"
    state = StateStore(mysql_url)
    try:
        live = state.live_version("mall_knowledge")
        assert live is not None and (live.embedder, live.embed_model, live.embed_dim) == ("ollama", "bge-m3", 1024)
    finally:
        state.dispose()
    assert not (dag_env / ".kb" / "state.db").exists(), "the kb_state Connection replaced the SQLite default"


def test_the_page_runs_in_airflows_api_server_and_rolls_back_as_the_signed_in_user(airflow_db: None, project: Path,
                                                                                  tmp_path: Path) -> None:
    """The plugin in a real `airflow api-server`: the page is mounted and linked under Browse, every route
    is behind Airflow's login, and its rollback button triggers knowledge_rollback through Airflow's API
    with the login cookie (`_token`)."""
    import signal
    import socket
    import time
    from urllib.parse import quote

    import httpx

    airflow = str(Path(sys.executable).with_name("airflow"))
    done = subprocess.run([airflow, "dags", "reserialize"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert kb(project, "run")["outcome"] == "promoted"  # v1 and its validation report, for the report route
    rules = project / "knowledge" / "docs" / "coupon-rules.md"
    rules.write_text(rules.read_text(encoding="utf-8") + "\n\n补充：限时活动。\n", encoding="utf-8")
    assert kb(project, "run")["outcome"] == "promoted"  # v2 live: v1 is where the rollback button goes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "KB_PROJECT_ROOT": str(project), "KB_AIRFLOW_API_URL": base}
    log = (tmp_path / "api-server.log").open("w")
    server = subprocess.Popen([airflow, "api-server", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (tmp_path / "api-server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{base}/api/v2/monitor/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "api-server did not start in 180 s"
            time.sleep(1)
        passwords = json.loads((Path(os.environ["AIRFLOW_HOME"]) / "simple_auth_manager_passwords.json.generated")
                               .read_text(encoding="utf-8"))
        user, password = next(iter(passwords.items()))
        token = httpx.post(f"{base}/auth/token", json={"username": user, "password": password}).json()["access_token"]
        bearer = {"Authorization": f"Bearer {token}"}

        routes = [("GET", "ui"), ("GET", "api/status"), ("GET", "reports/v1/validation.html"),
                  ("GET", "reports/v1/validation.csv")]
        for method, route in routes:
            url = f"{base}/knowledge-index/{route}"
            anonymous = httpx.request(method, url)
            if route != "api/status":  # a browser (the page, a report link) is sent to the login, and back after
                assert anonymous.status_code == 307, anonymous.text
                login = anonymous.headers["location"]
                assert login.startswith("/auth/login?next=") and quote(url, safe="") in login
                assert httpx.get(f"{base}{login}").status_code == 200
            else:
                assert anonymous.status_code == 401, (route, anonymous.text)
            signed_in = httpx.request(method, url, cookies={"_token": token})
            assert signed_in.status_code == 200, (route, signed_in.text)
        page = httpx.get(f"{base}/knowledge-index/ui", cookies={"_token": token}).text
        assert "Knowledge index" in page
        page_token = re.search(r'<meta name="kb-page-token" content="([0-9a-f]+)">', page).group(1)
        plugins = httpx.get(f"{base}/api/v2/plugins", headers=bearer).json()["plugins"]
        ours = next(p for p in plugins if p["name"] == "knowledge_index")
        assert ours["external_views"][0]["href"] == "knowledge-index/ui"
        assert ours["external_views"][0]["category"] == "browse"

        rollback = f"{base}/knowledge-index/api/rollback"
        assert httpx.post(rollback, json={"reason": "check"}).status_code == 401
        asked = {"to_version": 1, "reason": "api-server check", "live_version": 2}
        # what another site's page can make a signed-in browser send: refused, nothing triggered or paused
        host = base.split("://", 1)[1].split("/", 1)[0]
        own = {"Origin": f"http://{host}", "X-KB-Page-Token": page_token}
        paused = httpx.get(f"{base}/api/v2/dags/knowledge_reindex", headers=bearer).json()["is_paused"]
        runs_before = httpx.get(f"{base}/api/v2/dags/knowledge_rollback/dagRuns", headers=bearer).json()["total_entries"]
        for route, body in ((rollback, asked), (f"{base}/knowledge-index/api/reindex-paused", {"paused": not paused})):
            for headers, content, status in (
                    ({**own, "Origin": "http://evil.example", "Content-Type": "text/plain"}, json.dumps(body), 415),
                    ({**own, "Content-Type": "application/x-www-form-urlencoded"}, "paused=true", 415),
                    ({**own, "Origin": "http://evil.example", "Content-Type": "application/json"}, json.dumps(body),
                     403),
                    ({"Origin": own["Origin"], "Content-Type": "application/json"}, json.dumps(body), 403)):
                refused = httpx.post(route, content=content, headers=headers, cookies={"_token": token})
                assert refused.status_code == status, (route, headers, refused.text)
        runs_after = httpx.get(f"{base}/api/v2/dags/knowledge_rollback/dagRuns", headers=bearer).json()["total_entries"]
        assert runs_after == runs_before, "a refused request created a rollback run"
        assert httpx.get(f"{base}/api/v2/dags/knowledge_reindex", headers=bearer).json()["is_paused"] == paused
        # the page unpauses the on-call DAG (paused on a fresh install unless it starts unpaused) when asked to
        triggered = httpx.post(rollback, json={**asked, "unpause": True}, cookies={"_token": token}, headers=own)
        assert triggered.status_code == 200, triggered.text
        run_id = triggered.json()["dag_run_id"]
        runs = f"{base}/api/v2/dags/knowledge_rollback/dagRuns"
        run = httpx.get(f"{runs}/{quote(run_id, safe='')}", headers=bearer).json()
        assert run["conf"] == {"to_version": 1, "reason": "api-server check", "confirm": True, "live_version": 2}
        assert httpx.get(f"{base}/api/v2/dags/knowledge_rollback", headers=bearer).json()["is_paused"] is False
        httpx.delete(f"{runs}/{quote(run_id, safe='')}", headers=bearer)  # no scheduler here to run it
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def test_reindex_schedule_may_be_off_and_the_retry_delay_set(tmp_path: Path) -> None:
    """KB_REINDEX_SCHEDULE empty: triggered runs only (unpausing starts no run); KB_RETRY_DELAY_S: the first retry's
    delay (a test stack, or an operator, shortens the minute)."""
    code = ("import runpy; dag = runpy.run_path({!r})['knowledge_reindex']; d = dag() if callable(dag) else dag; "
            "print(type(d.timetable).__name__, d.default_args['retry_delay'].total_seconds())").format(str(REPO / "dags" / "knowledge_reindex.py"))
    env = {**os.environ, "KB_REINDEX_SCHEDULE": "", "KB_RETRY_DELAY_S": "2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["NullTimetable", "2.0"], done.stdout
