"""The DAGs of a registry (KB_REGISTRY): each knowledge base gets its five DAGs from the same factory, in the
registry's order, with its alias's tag, schedule, pool and Asset; a refused entry loses only its own DAGs and
is named in Airflow's import errors; parsing reads the registry and nothing heavier; and a knowledge base's
reindex runs end to end under dag.test(), announcing its own alias."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.airflow
SHOP, SELLER = "mall_knowledge", "seller_rules"
KINDS = ("knowledge_reindex", "knowledge_watch", "knowledge_rollback", "knowledge_model_migration",
         "knowledge_promote_shadow")


@pytest.fixture
def registry_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    project = tmp_path / "project"
    shutil.copytree(REPO / "knowledge", project / "knowledge")
    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    monkeypatch.setenv("KB_REGISTRY", "knowledge/registry.yaml")
    return project


def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags"))


def test_each_knowledge_base_gets_its_own_dags(airflow_db: None, registry_project: Path) -> None:
    bag = dagbag()
    assert bag.import_errors == {}
    assert sorted(bag.dag_ids) == sorted(f"{kind}__{kb}" for kind in KINDS for kb in (SHOP, SELLER))
    for kb in (SHOP, SELLER):
        dags = {kind: bag.dags[f"{kind}__{kb}"] for kind in KINDS}
        for kind, dag in dags.items():
            assert f"kb:{kb}" in dag.tags and dag.doc_md
            if kind == "knowledge_watch":  # started by its own alias's promotions
                assert [a.uri for a in dag.timetable.asset_condition.objects] == [f"qdrant://{kb}/"]
                assert [o for t in dag.tasks for o in t.outlets] == []
            else:  # the tasks that move the alias: a reindex's or a migration's promote and small_run (two paths)
                movers = 2 if kind in ("knowledge_reindex", "knowledge_model_migration") else 1
                assert [o.uri for t in dag.tasks for o in t.outlets] == [f"qdrant://{kb}/"] * movers, kind
        reindex = dags["knowledge_reindex"]
        assert {t.pool for t in reindex.tasks
                if t.task_id in ("create_version", "small_run", "build", "promote", "cleanup")} == {
            f"kb_qdrant_writes__{kb}"}
        rollback = dags["knowledge_rollback"]
        assert rollback.get_task("rollback").pool == "default_pool" and rollback.is_paused_upon_creation is False
        assert dags["knowledge_promote_shadow"].is_paused_upon_creation is False
    # each its own schedule: the shop's the environment's default, the sellers' triggered only
    assert bag.dags[f"knowledge_reindex__{SHOP}"].timetable.expression == "0 0 * * *"
    assert bag.dags[f"knowledge_reindex__{SELLER}"].schedule is None


def test_on_calls_tasks_run_on_their_own_lane_and_builds_never_on_it(airflow_db: None, registry_project: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With the lane `make airflow` and the compose stack set (KB_ONCALL_POOL, KB_ONCALL_QUEUE): the rollback and
    the shadow promotion in on-call's pool and queue with the highest weight; no task of a build there."""
    from kb_reindex.airflow.lanes import ONCALL_PRIORITY

    monkeypatch.setenv("KB_ONCALL_POOL", "kb_oncall")
    monkeypatch.setenv("KB_ONCALL_QUEUE", "kb_oncall")
    bag = dagbag()
    assert bag.import_errors == {}
    for kb in (SHOP, SELLER):
        for dag_id, task_id in ((f"knowledge_rollback__{kb}", "rollback"),
                                (f"knowledge_promote_shadow__{kb}", "promote_shadow")):
            t = bag.dags[dag_id].get_task(task_id)
            assert (t.pool, t.queue, t.priority_weight, t.weight_rule) == (
                "kb_oncall", "kb_oncall", ONCALL_PRIORITY, "absolute"), dag_id
        others = [t for kind in ("knowledge_reindex", "knowledge_model_migration", "knowledge_watch")
                  for t in bag.dags[f"{kind}__{kb}"].tasks]
        assert others and all(t.pool != "kb_oncall" and t.queue != "kb_oncall" for t in others)
        assert max(t.priority_weight for t in others) < ONCALL_PRIORITY


@pytest.mark.parametrize(("line", "error"), [
    ("shedule: '@hourly'", "shedule: unknown key"),
    # a value Airflow's cron timetable cannot compute: before, the DAG parsed without an error and never ran on time
    ("schedule: '@hourlly'", "schedule: '@hourlly' is not a cron expression"),
])
def test_a_refused_entry_keeps_the_others_and_is_named_in_the_import_errors(airflow_db: None, registry_project: Path,
                                                                           line: str, error: str) -> None:
    registry = registry_project / "knowledge" / "registry.yaml"
    registry.write_text(registry.read_text(encoding="utf-8") + f"  wiki:\n    source: wiki\n    {line}\n",
                        encoding="utf-8")
    bag = dagbag()
    # the refused entry keeps on-call's rollback DAG alone, its doc saying why
    assert sorted(bag.dag_ids) == sorted([*(f"{kind}__{kb}" for kind in KINDS for kb in (SHOP, SELLER)),
                                          "knowledge_rollback__wiki"])
    [(where, import_error)] = bag.import_errors.items()
    assert where.endswith("dags/knowledge_registry.py")
    assert f"registry.yaml: knowledge base 'wiki': {error}" in import_error
    rollback = bag.dags["knowledge_rollback__wiki"]
    assert "kb:wiki" in rollback.tags and rollback.is_paused_upon_creation is False
    assert rollback.doc_md.startswith("**Its registry entry is refused") and error in rollback.doc_md


def test_a_retired_entrys_tasks_refuse_without_retry_and_removed_its_dags_are_gone(airflow_db: None,
                                                                                   registry_project: Path) -> None:
    """A DAG file reads no state DB, so a retired entry still listed keeps its DAGs until it is removed (what the
    refusal says to do); their tasks refuse it, e.g. on-call's rollback, without a retry. Removed, its DAGs go and
    none stands in for it."""
    from airflow.sdk.exceptions import AirflowFailException

    from kb_reindex.airflow.tasks import rollback_task
    from kb_reindex.services.registry import load_registry
    from kb_reindex.services.state.store import StateStore

    state = StateStore(load_registry().get(SELLER).settings().state_url)
    try:
        state.retire(SELLER, reason="sellers moved to the new portal", by="oncall")
    finally:
        state.dispose()
    with pytest.raises(AirflowFailException, match="knowledge base 'seller_rules' was retired by oncall at .*retire --undo"):
        rollback_task(kb=SELLER, run_id="airflow:knowledge_rollback__seller_rules:manual_1", live_version=1,
                      to_version=None, reason="bad page", confirm=True, revalidate=False)
    registry = registry_project / "knowledge" / "registry.yaml"
    registry.write_text(registry.read_text(encoding="utf-8").split("  seller_rules:")[0], encoding="utf-8")
    bag = dagbag()
    assert bag.import_errors == {} and sorted(bag.dag_ids) == sorted(f"{kind}__{SHOP}" for kind in KINDS)


def test_an_entry_removed_before_it_was_retired_keeps_its_rollback_dag_until_it_is(airflow_db: None,
                                                                                   registry_project: Path) -> None:
    """The sellers' entry served (recorded in the state DB), then was deleted from the registry without a
    `retire`: what it serves still needs on-call's way back, so the rollback DAG's file reads the recorded entries
    and keeps `knowledge_rollback__seller_rules` (its doc says why), the sellers' other DAGs gone. Retired, it goes;
    the retirement undone, it is back."""
    from kb_reindex.services.registry import load_registry
    from kb_reindex.services.state.store import StateStore

    shipped = load_registry()
    state = StateStore(shipped.get(SELLER).settings().state_url)
    try:
        state.record_entry(shipped.get(SELLER).recorded())
        registry = registry_project / "knowledge" / "registry.yaml"
        registry.write_text(registry.read_text(encoding="utf-8").split("  seller_rules:")[0], encoding="utf-8")
        bag = dagbag()
        assert bag.import_errors == {}
        assert sorted(bag.dag_ids) == sorted([*(f"{kind}__{SHOP}" for kind in KINDS), f"knowledge_rollback__{SELLER}"])
        rollback = bag.dags[f"knowledge_rollback__{SELLER}"]
        assert rollback.doc_md.startswith("**Its registry entry is no longer in the registry, so this is its only DAG "
                                          "until it is retired:** knowledge base 'seller_rules' is no longer in")
        assert f"kb:{SELLER}" in rollback.tags and rollback.is_paused_upon_creation is False
        state.retire(SELLER, reason="sellers moved to the new portal", by="oncall")
        assert sorted(dagbag().dag_ids) == sorted(f"{kind}__{SHOP}" for kind in KINDS)
        state.undo_retirement(SELLER, by="oncall")  # undone: on-call's way back is there again
        assert f"knowledge_rollback__{SELLER}" in dagbag().dag_ids
    finally:
        state.dispose()


def test_a_state_db_that_cannot_be_read_costs_a_parse_only_the_removed_entries_stand_ins(
        airflow_db: None, registry_project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state DB server that is down (nothing listens on its port) is waited on for at most the bounded connect,
    and the registry's DAGs all stay."""
    monkeypatch.setenv("KB_STATE_URL", "postgresql+psycopg://postgres@127.0.0.1:9/kb_state")
    bag = dagbag()
    assert bag.import_errors == {}
    assert sorted(bag.dag_ids) == sorted(f"{kind}__{kb}" for kind in KINDS for kb in (SHOP, SELLER))


def test_parsing_the_registrys_dags_imports_nothing_heavy(registry_project: Path) -> None:
    code = (
        "import sys, importlib.util\n"
        f"for name in {list(KINDS) + ['knowledge_registry']!r}:\n"
        f"    spec = importlib.util.spec_from_file_location(name, {str(REPO / 'dags')!r} + '/' + name + '.py')\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "heavy = [m for m in ('qdrant_client', 'pandas', 'ollama', 'kb_reindex.run.pipeline',\n"
        "                     'kb_reindex.services.state.store') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1:] in ([""], []), done.stdout


def test_a_knowledge_bases_reindex_runs_end_to_end_and_announces_its_alias(airflow_db: None,
                                                                          registry_project: Path) -> None:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState
    from sqlalchemy import select

    dag_id = f"knowledge_reindex__{SELLER}"
    dag = DagBag(dag_folder=str(REPO / "dags" / "knowledge_reindex.py")).get_dag(dag_id)
    run = dag.test()
    assert run.state == DagRunState.SUCCESS, {ti.task_id: ti.state for ti in run.get_task_instances()}
    with create_session() as session:
        events = session.execute(select(AssetModel.uri, AssetEvent.extra).join(
            AssetModel, AssetModel.id == AssetEvent.asset_id).where(AssetEvent.source_run_id == run.run_id)).all()
    assert [(uri, extra["alias"], extra["version"]) for uri, extra in events] == [(f"qdrant://{SELLER}/", SELLER, 1)]
    # only the sellers' store and alias were touched; the run is recorded under its DAG's own run id
    assert sorted(p.name for p in (registry_project / ".kb" / "qdrant").iterdir()) == [SELLER]
    from kb_reindex.services.registry import select_knowledge_base
    from kb_reindex.services.state.store import StateStore

    settings = select_knowledge_base(SELLER).settings()
    state = StateStore(settings.state_url, create=False)
    try:
        assert state.list_runs(SELLER, limit=1)[0].run_id == f"airflow:{dag_id}:{run.run_id}"
        assert state.list_runs(SHOP) == []
        # its plan recorded the entry it ran with: what its rollback acts from once the entry stops loading
        kept, entry = state.recorded_entry(SELLER), select_knowledge_base(SELLER).recorded()
        assert kept is not None and (kept.registry, kept.schedule, dict(kept.env)) == (entry.registry, None,
                                                                                      dict(entry.env))
    finally:
        state.dispose()
    from kb_reindex.airflow.connections import task_base, task_settings

    registry = registry_project / "knowledge" / "registry.yaml"
    registry.write_text(registry.read_text(encoding="utf-8").replace("    schedule: null", "    schedul: null"),
                        encoding="utf-8")
    base = task_base(SELLER, on_call=True)
    assert "schedul: unknown key" in (base.problem or "") and base.recorded_at is not None
    on_call, _headers = task_settings(SELLER, on_call=True)
    assert (on_call.alias, on_call.qdrant_path) == (SELLER, settings.qdrant_path), "the store it served from"


def test_each_watched_source_schedules_its_reindex_on_its_time_schedule_or_a_change(
        airflow_db: None, registry_project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Watching on (KB_SOURCE_POLL_S > 0): each knowledge base's reindex runs on its own time schedule OR an event
    of its own source's watcher, starts unpaused; an entry's `source_poll_s: 0` keeps it on time alone; a
    knowledge base with no time schedule runs on source changes only."""
    from airflow.sdk import AssetOrTimeSchedule

    monkeypatch.setenv("KB_SOURCE_POLL_S", "7")
    registry = registry_project / "knowledge" / "registry.yaml"
    registry.write_text(registry.read_text(encoding="utf-8") + "  unwatched:\n    source: docs\n"
                        "    source_poll_s: 0\n", encoding="utf-8")
    bag = dagbag()
    assert bag.import_errors == {}
    shop = bag.dags[f"knowledge_reindex__{SHOP}"]
    assert isinstance(shop.timetable, AssetOrTimeSchedule) and shop.timetable.timetable.expression == "0 0 * * *"
    assert shop.is_paused_upon_creation is False
    (asset,) = shop.timetable.asset_condition.objects
    assert asset.name == f"kb_source_{SHOP}"
    assert asset.uri == (registry_project / "knowledge" / "docs").resolve().as_uri()
    (watcher,) = asset.watchers
    assert watcher.trigger.serialize() == ("kb_reindex.airflow.triggers.SourceChangeTrigger",
                                           {"kb": SHOP, "alias": SHOP, "poll_s": 7.0, "quiet_s": 1.0})
    seller = bag.dags[f"knowledge_reindex__{SELLER}"]  # `schedule: null`: its source's changes alone
    assert not isinstance(seller.timetable, AssetOrTimeSchedule)
    assert [a.name for a in seller.timetable.asset_condition.objects] == [f"kb_source_{SELLER}"]
    unwatched = bag.dags["knowledge_reindex__unwatched"]
    assert unwatched.timetable.expression == "0 0 * * *" and unwatched.is_paused_upon_creation is None
    # what the README says of `make airflow`: which DAGs start unpaused and which paused
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    assert "DAGs start paused" not in readme
    assert ("Every `knowledge_reindex__*` whose source is watched (the default, `KB_SOURCE_POLL_S` 15) starts unpaused"
            in readme and "only `knowledge_model_migration__*` (and a reindex with `source_poll_s: 0`) starts paused"
            in readme)
    for kind in ("knowledge_reindex", "knowledge_rollback", "knowledge_promote_shadow", "knowledge_watch"):
        assert bag.dags[f"{kind}__{SHOP}"].is_paused_upon_creation is False, kind
    # a fresh install: the scheduler's first run of each, as its serialized DAG computes it (issue #39: a watched
    # reindex with a time schedule also ran the latest tick at once, a second run that found nothing to change)
    from airflow.serialization.serialized_objects import DagSerialization

    now = datetime.now(UTC)
    first = {name: DagSerialization.from_dict(DagSerialization.to_dict(bag.dags[name]))
             .next_dagrun_info(last_automated_run_info=None).run_after
             for name in (f"knowledge_reindex__{SHOP}", "knowledge_reindex__unwatched")}
    assert first[f"knowledge_reindex__{SHOP}"] > now, "the watcher builds the first version; the schedule waits"
    assert first["knowledge_reindex__unwatched"] <= now, "no watcher: the latest tick builds the first version"
    assert bag.dags[f"knowledge_model_migration__{SHOP}"].is_paused_upon_creation is None  # Airflow's default: paused
