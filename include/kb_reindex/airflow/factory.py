"""The DAGs of every knowledge base, from one definition each: `knowledge_reindex`, `knowledge_model_migration`
(both `knowledge_dag`: the same run, differing only in kind, Params and schedule), `knowledge_watch`,
`knowledge_rollback` and `knowledge_promote_shadow`. Without KB_REGISTRY the environment's one knowledge base gets
them under these ids; with a registry each entry gets its own, `<id>__<alias>`, in the registry's order, tagged
with its alias, on its own schedule, pool and Assets (`for_each_knowledge_base`).

plan -> has_changes -> create_version -> build_slices -> build (mapped) -> validate -> promote -> cleanup. The
promotion's event on the alias Asset starts `knowledge_watch`, so a run ends at its promotion and the next change
is built while the version it promoted is watched. Each task is a thin call of kb_reindex.airflow.tasks, imported
inside the task and told which knowledge base it acts on: parsing a DAG file reads the registry and imports
the Airflow SDK and this module only, never Qdrant or pandas; the state DB only for on-call's rollback DAGs of
entries removed from the registry but never retired (`removed_bases`: a short bounded read, never the store).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import warnings
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, TypedDict

from airflow.sdk import (DAG, Asset, AssetOrTimeSchedule, AssetWatcher, CronTriggerTimetable, Param, TriggerRule, dag,
                         task)

from kb_reindex.airflow.constants import BUILD_SLICE_SIZE, alias_asset, current_run_id, triggering_user
from kb_reindex.airflow.lanes import oncall_lane
from kb_reindex.domain.errors import ConfigError
from kb_reindex.domain.model import RunKind
from kb_reindex.services.registry import KnowledgeBase, Registry, load_registry

log = logging.getLogger(__name__)
START = datetime(2026, 1, 1)


def knowledge_bases() -> tuple[KnowledgeBase, ...]:
    """The knowledge bases to make DAGs for. A registry that cannot be read gives none here: its error is the
    import error of dags/knowledge_registry.py (`check_registry`), and an entry refused keeps the others."""
    try:
        return load_registry().bases
    except ConfigError as exc:
        log.error("kb_reindex: no knowledge base DAGs: %s", exc)
        return ()


def on_call_bases() -> tuple[KnowledgeBase, ...]:
    """`knowledge_bases`, every entry refused whose alias is one Airflow takes, as a stand-in made from its alias
    alone, and every knowledge base the state DB recorded that the registry no longer lists and nobody retired,
    from its recorded entry (`removed_bases`): on-call's rollback DAG is never taken away by a typo or by an entry
    deleted before its knowledge base was retired."""
    try:
        registry = load_registry()
    except ConfigError as exc:
        log.error("kb_reindex: no knowledge base DAGs: %s", exc)
        return ()
    return registry.in_order((*registry.bases, *registry.stand_ins(), *removed_bases(registry)))


def removed_bases(registry: Registry) -> tuple[KnowledgeBase, ...]:
    """The only state DB read of a parse (on-call's DAG file alone): the recorded entries of knowledge bases not
    retired, over one connection of its own with its waits bounded (`unretired_entries`). A state DB that cannot
    be read costs only these stand-ins, said in the parse's log; every other DAG stays."""
    if registry.path is None:
        return ()
    from kb_reindex.services.config import state_url_from_env
    from kb_reindex.services.state.entries import unretired_entries

    try:
        return registry.removed(unretired_entries(state_url_from_env()))
    except Exception as exc:  # noqa: BLE001 - a parse never fails for it: the listed entries' DAGs stay
        log.error("kb_reindex: the state DB could not be read for knowledge bases removed from the registry "
                  "(their rollback DAGs are missing until it can): %s: %s", type(exc).__name__, exc)
        return ()


def check_registry() -> None:
    """Raise the registry's refusals (dags/knowledge_registry.py), so they show in Airflow's import errors."""
    load_registry().check()


def for_each_knowledge_base(make: Callable[[KnowledgeBase], DAG], *, on_call: bool = False) -> dict[str, DAG]:
    """One DAG per knowledge base, by its DAG id, for a DAG file's globals (Airflow's dynamic DAG pattern).
    `on_call`: a refused entry's too (`on_call_bases`)."""
    return {dag_.dag_id: dag_ for dag_ in map(make, on_call_bases() if on_call else knowledge_bases())}


def task_kb(kb: KnowledgeBase) -> str | None:
    """What every task of `kb`'s DAGs is told it acts on: its registry entry, or None, the environment's one."""
    return kb.alias if kb.registered else None


def tags_of(kb: KnowledgeBase, *tags: str) -> list[str]:
    return ["knowledge", "qdrant", *tags, *([f"kb:{kb.alias}"] if kb.registered else [])]


def source_asset(kb: KnowledgeBase) -> Asset | None:
    """The Asset of `kb`'s source, watched by its freshness trigger (kb_reindex.airflow.triggers), or None when
    KB_SOURCE_POLL_S (the entry's `source_poll_s`) is 0: not watched."""
    from kb_reindex.airflow.triggers import SourceChangeTrigger

    settings = kb.settings()
    if not watched(kb):
        return None
    trigger = SourceChangeTrigger(kb=task_kb(kb), alias=kb.alias, poll_s=settings.source_poll_s,
                                  quiet_s=settings.source_quiet_s)
    uri = settings.knowledge_source if settings.knowledge_remote else settings.knowledge_dir.resolve().as_uri()
    return Asset(name=f"kb_source_{kb.alias}", uri=uri,
                 watchers=[AssetWatcher(name=f"kb_source_watcher_{kb.alias}", trigger=trigger)])


def watched(kb: KnowledgeBase) -> bool:
    return kb.settings().source_poll_s > 0


def reindex_schedule(kb: KnowledgeBase) -> Any:
    """`knowledge_reindex`'s schedule: its time schedule (KB_REINDEX_SCHEDULE, the entry's `schedule`; empty:
    none) OR a change of its watched source (Airflow's asset-or-time schedule); either alone, or None: only
    triggered runs. A KB_REINDEX_SCHEDULE that is no cron is refused by name (`schedule_problem`): the DAG file's
    import error, the other DAG files untouched. Airflow's own error named neither the variable nor the value,
    and a watched schedule took it without a word and never ran on time."""
    if kb.schedule_problem:
        raise ConfigError(kb.schedule_problem)
    watched, cron = source_asset(kb), kb.schedule
    if watched is None:
        return cron
    if cron is None:
        return [watched]
    # the watcher's first event builds a fresh install's first version; the time schedule then waits for its next
    # tick (run_immediately=0, and no start_date: see start_date_of), or every fresh install started a second run
    # for the latest tick, which found nothing to change
    return AssetOrTimeSchedule(timetable=CronTriggerTimetable(cron, timezone="UTC", run_immediately=timedelta(0)),
                               assets=[watched])


def start_date_of(schedule: Any) -> datetime | None:
    """None for a watched time schedule: with a start date Airflow runs the latest tick at once whatever
    `run_immediately` says (catchup=False takes the later of the two); START for the rest (a time schedule
    alone runs its latest tick at once: a fresh install's first build with no watcher)."""
    return None if isinstance(schedule, AssetOrTimeSchedule) else START


def watch_sensor(kb: KnowledgeBase) -> Any:
    """The `watch` task's decorator: a sensor in reschedule mode, so between its looks (KB_WATCH_INTERVAL_S, as
    the parsing process's environment sets it) it holds no worker slot; its window is at most a day
    (KB_WATCH_MINUTES or the watch_minutes Param). It keeps the DAG's retries: Airflow 3.3 under load can fail a
    rescheduled sensor on a late executor event of its previous poke, and a try after this watch's own rollback
    fails again saying so (kb_reindex.airflow.tasks.watch_task), so a retry never turns it into a success; a look
    a server missed is taken again at the next poke."""
    with warnings.catch_warnings():  # the standard provider's sensor module imports a name Airflow deprecated
        warnings.filterwarnings("ignore", message=r"The `airflow\.utils\.operator_helpers\.determine_kwargs`")
        return task.sensor(mode="reschedule", poke_interval=kb.settings().watch_interval_s, timeout=25 * 3600)


def release_run_lock(context: Any, kb: str | None = None) -> None:
    """The failure callback (kb_reindex.airflow.callbacks), imported when it fires: it opens the state DB."""
    from kb_reindex.airflow.callbacks import release_run_lock as release

    release(context, kb=kb)


def retry_delay() -> timedelta:
    """KB_RETRY_DELAY_S: before a task's first retry (tests shorten it)."""
    return timedelta(seconds=int(os.environ.get("KB_RETRY_DELAY_S", "60")))


class AlwaysOnDag(TypedDict):
    dag_id: str
    schedule: Any
    start_date: datetime
    catchup: bool
    max_active_runs: int
    is_paused_upon_creation: bool
    doc_md: str | None
    tags: list[str]


def always_on_dag(kb: KnowledgeBase, base_id: str, *, schedule: Any, doc_md: str | None, tag: str) -> AlwaysOnDag:
    """What the DAGs that must work from the first minute of a fresh install share (the watch, on-call's
    rollback and shadow promotion): unpaused at creation, one run at a time, no catch-up."""
    return AlwaysOnDag(dag_id=kb.dag_id(base_id), schedule=schedule, start_date=START, catchup=False,
                       max_active_runs=1, is_paused_upon_creation=False, doc_md=doc_md, tags=tags_of(kb, tag))


def knowledge_dag(kb: KnowledgeBase, base_id: str, *, kind: RunKind, doc_md: str | None, params: dict[str, Param],
                  schedule: Any, tags: tuple[str, ...] = (), unpaused: bool = False) -> DAG:
    """The run of `kind` over knowledge base `kb` as a DAG: the same tasks for a reindex and a migration; what a
    Param a DAG lacks would say takes its default (no dry run, no forced rebuild, the golden set's thresholds,
    promotion on). `unpaused`: running from the first parse (a watched source's, so a fresh install builds alone)."""
    name, pool, release = task_kb(kb), kb.pool, functools.partial(release_run_lock, kb=task_kb(kb))

    @dag(
        dag_id=kb.dag_id(base_id),
        schedule=schedule,
        start_date=start_date_of(schedule),
        catchup=False,
        max_active_runs=1, is_paused_upon_creation=False if unpaused else None,
        # a run failed as a whole (marked failed, timed out) lets its lock go too; liveness asks Airflow as well
        on_failure_callback=release,
        doc_md=doc_md,
        tags=tags_of(kb, *tags),
        # a task that fails for good releases the run's lock; KB_RETRY_DELAY_S: before a first retry (tests shorten it)
        default_args={"retries": 2, "retry_delay": retry_delay(), "retry_exponential_backoff": True,
                      "on_failure_callback": release},
        params=copy.deepcopy(params),  # each knowledge base's DAG its own Param objects
    )
    def knowledge_run() -> None:
        # a task's arguments are XCom references while the DAG is defined, their dicts when it runs: typed Any
        @task
        def plan(params: dict | None = None, triggering_asset_events: Any = None) -> dict:
            from kb_reindex.airflow import tasks

            p = params or {}  # a run the source watcher started is told what changed (its plan lists nothing)
            return tasks.plan_task(kb=name, run_id=current_run_id(), kind=kind, force_full=p.get("force_full_rebuild", False),
                                   dry_run=p.get("dry_run", False), embedder=p.get("embedder"), model=p.get("model"),
                                   dim=p.get("dimension"), layout=p.get("payload_layout"), events=triggering_asset_events)

        # skips only the build path; cleanup follows its own trigger rule
        @task.short_circuit(ignore_downstream_trigger_rules=False)
        def has_changes(plan: Any, params: dict | None = None) -> bool:
            from kb_reindex.airflow import tasks

            return tasks.should_build_task(kb=name, plan=plan, dry_run=(params or {}).get("dry_run", False),
                                           run_id=current_run_id())

        @task(pool=pool)
        def create_version(plan: Any) -> dict:
            from kb_reindex.airflow import tasks

            return tasks.create_version_task(kb=name, plan=plan, run_id=current_run_id())

        @task
        def build_slices(version: Any, params: dict | None = None) -> list[dict]:
            from kb_reindex.airflow import tasks

            size = (params or {}).get("build_slice_size", BUILD_SLICE_SIZE)
            return tasks.build_slices_task(kb=name, version=version, slice_size=size, run_id=current_run_id())

        @task(pool=pool, retries=3)
        def build(work: dict) -> dict:
            from kb_reindex.airflow import tasks

            return tasks.build_task(kb=name, version=work, run_id=current_run_id(), window=(work["offset"], work["limit"]))

        @task
        def validate(version: Any, params: dict | None = None) -> dict:
            from kb_reindex.airflow import tasks

            p = params or {}
            return tasks.validate_task(kb=name, version=version, run_id=current_run_id(), min_hit_rate=p.get("min_hit_rate"),
                                       min_mrr=p.get("min_mrr"))

        # its event on the alias Asset starts knowledge_watch (with this run's watch_minutes)
        @task(pool=pool, outlets=[alias_asset(kb.alias)])
        def promote(plan: Any, version: Any, params: dict | None = None) -> dict:
            from kb_reindex.airflow import tasks

            p = params or {}
            return tasks.promote_task(kb=name, plan=plan, version=version, run_id=current_run_id(),
                                      promote=p.get("promote", True), watch_minutes=p.get("watch_minutes"))

        # after a promotion, a kept version or nothing to build; never after a failure
        @task(pool=pool, trigger_rule=TriggerRule.NONE_FAILED)
        def cleanup(params: dict | None = None) -> dict:
            from kb_reindex.airflow import tasks

            return tasks.cleanup_task(kb=name, dry_run=(params or {}).get("dry_run", False), run_id=current_run_id())

        path, small_run = small_run_tasks(kb, pool)
        planned = plan()
        version = create_version(planned)
        has_changes(planned) >> version
        chosen = path(version)
        chosen >> small_run(planned, version)
        slices = build_slices(version)
        chosen >> slices
        built = build.expand(work=slices)
        checked = validate(version)
        built >> checked
        finished = cleanup()
        checked >> promote(planned, version) >> finished
        chosen >> finished  # the mapped path names it; the small path skips it (small_run cleans up itself)

    return knowledge_run()


def small_run_tasks(kb: KnowledgeBase, pool: str) -> tuple[Any, Any]:
    """The branch after create_version and the one task of a small plan (kb_reindex.rules.run_path), as task
    decorators the DAG calls."""
    name = task_kb(kb)

    # one task for a small plan, the mapped slices for the rest (kb_reindex.rules.run_path); the graph shows
    # which: the path not taken is skipped
    @task.branch
    def path(version: Any, params: dict | None = None) -> list[str]:
        from kb_reindex.airflow import tasks

        p = params or {}
        return tasks.path_task(kb=name, version=version, slice_size=p.get("build_slice_size", BUILD_SLICE_SIZE),
                               small_run_points=p.get("small_run_points"))

    # build, validate, promote and cleanup of a small plan; its event on the alias Asset as promote's
    @task(pool=pool, outlets=[alias_asset(kb.alias)])
    def small_run(plan: Any, version: Any, params: dict | None = None) -> dict:
        from kb_reindex.airflow import tasks

        p = params or {}
        return tasks.small_run_task(kb=name, plan=plan, version=version, run_id=current_run_id(),
                                    promote=p.get("promote", True), watch_minutes=p.get("watch_minutes"),
                                    min_hit_rate=p.get("min_hit_rate"), min_mrr=p.get("min_mrr"))

    return path, small_run


def watch_dag(kb: KnowledgeBase, *, doc_md: str | None) -> DAG:
    """The watch after each promotion of `kb`'s reindex and migration runs, in a DAG of its own on the alias
    Asset: the promoting run ends at its promotion (max_active_runs=1 would keep the next change waiting out the
    whole window), and the version it promoted is watched here until its window ends or the alias moves on.
    Unpaused from the start: a watch asked for must happen. Other moves of the alias (rollbacks, shadows
    promoted by a person) are skipped."""
    name = task_kb(kb)

    # one watch at a time: a newer promotion's waits until this one sees the alias moved on (its next look)
    @dag(**always_on_dag(kb, "knowledge_watch", schedule=[alias_asset(kb.alias)], doc_md=doc_md, tag="watch"),
         default_args={"retries": 2, "retry_delay": retry_delay()})
    def knowledge_watch() -> None:
        @watch_sensor(kb)
        def watch(triggering_asset_events: Any = None) -> Any:
            from kb_reindex.airflow import tasks

            return tasks.watch_after_promotion(kb=name, events=triggering_asset_events, run_id=current_run_id())

        watch()

    return knowledge_watch()


def rollback_dag(kb: KnowledgeBase, *, doc_md: str | None) -> DAG:
    """On-call's rollback of `kb`'s alias: unpaused from the start, on on-call's lane (its own queue and pool,
    the highest weight: kb_reindex.airflow.lanes), never waiting for a build."""
    name = task_kb(kb)
    if kb.problem is not None:  # a refused or removed entry keeps its way back: said at the top of its DAG's doc
        # a parse makes a refused entry's stand-in from its alias alone, a removed one's from its recorded entry
        why = ("is no longer in the registry, so this is its only DAG until it is retired" if kb.recorded_at
               else "is refused, so this is its only DAG until it is fixed")
        doc_md = (f"**Its registry entry {why}:** {kb.problem}\n\n"
                  "The rollback acts from the entry as it last loaded (recorded in the state DB) or the alias alone, "
                  "and does not score the target on a golden set.\n\n" + (doc_md or ""))

    # on-call's way back must work from the first minute of a fresh install
    @dag(
        **always_on_dag(kb, "knowledge_rollback", schedule=None, doc_md=doc_md, tag="on-call"),
        params={
            "live_version": Param(None, type=["null", "integer"], minimum=1, title="Live version you saw",
                                  description="The version you saw serving; refused if another serves now.",
                                  section="Rollback"),
            "reason": Param("", type="string", minLength=1, title="Reason",
                            description="Why the rollback is needed; recorded in the alias history.",
                            section="Rollback"),
            "to_version": Param(None, type=["null", "integer"], minimum=1, title="Target version",
                                description="Empty: the version before the current one.", section="Rollback"),
            "confirm": Param(False, type="boolean", title="Confirm",
                             description="Tick to really move the alias.", section="Rollback"),
            "freeze": Param(True, type="boolean", title="Freeze the alias",
                            description="Hold every later promotion (runs, migrations, shadows) until `kb-reindex "
                                        "unfreeze`: the rolled-back change is usually still in the knowledge folder.",
                            section="Rollback"),
            "revalidate": Param(True, type="boolean", title="Score the target on the golden set",
                                description="Reported only; does not block a confirmed rollback.", section="Checks"),
        },
    )
    def knowledge_rollback() -> None:
        # on-call's lane (kb_reindex.airflow.lanes), never the build pool: a long reindex's slices fill that one
        @task(retries=0, outlets=[alias_asset(kb.alias)], **oncall_lane().task_args())
        def rollback(params: dict | None = None) -> dict:
            from kb_reindex.airflow.tasks import rollback_task

            p = params or {}
            return rollback_task(kb=name, run_id=current_run_id(), live_version=p["live_version"],
                                 to_version=p["to_version"], reason=p["reason"], confirm=p["confirm"],
                                 revalidate=p["revalidate"], freeze=p["freeze"], triggered_by=triggering_user())

        rollback()

    return knowledge_rollback()


def promote_shadow_dag(kb: KnowledgeBase, *, doc_md: str | None) -> DAG:
    """On-call's promotion of one of `kb`'s shadow versions, validated again."""
    name = task_kb(kb)

    @dag(
        **always_on_dag(kb, "knowledge_promote_shadow", schedule=None, doc_md=doc_md, tag="on-call"),
        params={
            "version": Param(None, type=["null", "integer"], minimum=1, title="Shadow version",
                             description="Number of the shadow version to serve (status `ready`, never served).",
                             section="Promotion"),
            "live_version": Param(None, type=["null", "integer"], minimum=1, title="Live version you saw",
                                  description="The version you saw serving (empty only when nothing serves); "
                                              "refused if another serves now.", section="Promotion"),
            "reason": Param("", type="string", minLength=1, title="Reason",
                            description="Why this shadow goes live now; recorded in the alias history.",
                            section="Promotion"),
            "confirm": Param(False, type="boolean", title="Confirm",
                             description="Tick to really move the alias to the shadow version.", section="Promotion"),
        },
    )
    def knowledge_promote_shadow() -> None:
        # on-call's lane, like the rollback: it opens Qdrant as any step does (a local-mode folder waits its turn)
        @task(retries=0, outlets=[alias_asset(kb.alias)], **oncall_lane().task_args())
        def promote_shadow(params: dict | None = None) -> dict:
            from kb_reindex.airflow.tasks import promote_shadow_task

            p = params or {}
            return promote_shadow_task(kb=name, run_id=current_run_id(), version=p["version"], reason=p["reason"],
                                       confirm=p["confirm"], live_version=p["live_version"],
                                       triggered_by=triggering_user())

        promote_shadow()

    return knowledge_promote_shadow()
