"""The bodies of the DAG tasks: Airflow Connections in, the engine's step functions, small dicts out.

DAG files import this module inside their tasks, so parsing a DAG never imports Qdrant or pandas.
Failures that a retry cannot fix (validation, compare-and-swap, drift, bad input) become
AirflowFailException; transient ones (embedder or Qdrant hiccups) are raised as they are, for retries.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from kb_reindex.config import Settings, split_ollama_hosts, state_url_from_env
from kb_reindex.errors import (
    PERMANENT,
    AliasFrozen,
    AliasMovedError,
    ConfigError,
    KbError,
    StateUnreachable,
    StoreError,
    classify,
)
from kb_reindex.planning import Plan
from kb_reindex.runtime import Deps, open_deps

if TYPE_CHECKING:
    from kb_reindex.engine import BuiltCounters
    from kb_reindex.state import VersionRecord

log = logging.getLogger(__name__)

QDRANT_CONN_ID = "qdrant_default"
STATE_CONN_ID = "kb_state"
OLLAMA_CONN_ID = "ollama_default"
POOL = "kb_qdrant_writes"


def _connection(conn_id: str) -> Any | None:
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        return None


def state_url_from_connection(conn: Any) -> str:
    """`kb_state` as a SQLAlchemy URL: MySQL through pymysql, PostgreSQL through psycopg, or a SQLite file
    named by host/schema."""
    from sqlalchemy.engine import URL

    if conn.conn_type in ("mysql", "mariadb"):
        return URL.create(
            "mysql+pymysql", username=conn.login or None, password=conn.password or None,
            host=conn.host or "127.0.0.1", port=conn.port or 3306, database=conn.schema or None,
            query={"charset": "utf8mb4"},
        ).render_as_string(hide_password=False)
    if conn.conn_type in ("postgres", "postgresql"):
        return URL.create(
            "postgresql+psycopg", username=conn.login or None, password=conn.password or None,
            host=conn.host or "127.0.0.1", port=conn.port or 5432, database=conn.schema or None,
        ).render_as_string(hide_password=False)
    if conn.conn_type == "sqlite":
        if not (conn.host or conn.schema):
            raise ConfigError(f"connection {STATE_CONN_ID} (sqlite) names no database file: set its host to the path")
        return f"sqlite:///{conn.host or conn.schema}"
    raise ConfigError(f"connection {STATE_CONN_ID} has type {conn.conn_type!r}; use mysql, postgres or sqlite")


def ollama_from_connection(conn: Any) -> tuple[str, dict[str, str] | None]:
    """`ollama_default` as OLLAMA_HOST and headers. Its host may list several servers, comma-separated
    (`ollama-a,ollama-b:11435,https://ollama-c`): an entry without a scheme gets the Connection's schema
    (http), one without a port the Connection's port (11434); the password goes to every server."""
    hosts = []
    for entry in (part.strip() for part in (conn.host or "127.0.0.1").split(",")):
        if entry and "://" not in entry:
            has_port = re.fullmatch(r"[^:\[\]]+:\d+|\[[^\]]+\]:\d+", entry) is not None
            entry = f"{conn.schema or 'http'}://{entry}" + ("" if has_port else f":{conn.port or 11434}")
        hosts.append(entry)
    host = ",".join(hosts)
    split_ollama_hosts(host, source=f"connection {OLLAMA_CONN_ID}: host")
    headers = {"Authorization": f"Bearer {conn.password}"} if conn.password else None
    return host, headers


def qdrant_overrides(conn: Any, *, root: Any) -> dict[str, Any]:
    """`qdrant_default` as Settings fields, so `store.make_client` builds the client as for the CLI.

    The mapping is the provider's `QdrantHook.get_conn` (host, port, password as API key; extras url,
    grpc_port, prefer_gprc, https, prefix) plus what the hook drops: `timeout` (its client would wait the
    client's 5 s default, too short for a bulk upsert or a snapshot), the correctly spelt `prefer_grpc`, and
    `collection_config`. Calling the hook would build a second client the settings could not reach."""
    from kb_reindex.collection_config import load_collection_config

    extra = conn.extra_dejson or {}
    where = f"connection {QDRANT_CONN_ID}"

    def flag(*names: str) -> bool | None:
        for name in names:
            value = extra.get(name)
            if value is None or value == "":
                continue
            if isinstance(value, bool):
                return value
            if str(value).strip().lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).strip().lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{where}: extra {name}={value!r} is not a boolean (true/false)")
        return None

    def whole(name: str, default: int, *, minimum: int, maximum: int | None = None) -> int:
        value = extra.get(name)
        if value is None or value == "":
            return default
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: extra {name}={value!r} is not an integer") from None
        if number < minimum or (maximum is not None and number > maximum):
            raise ConfigError(f"{where}: extra {name}={number} must be between {minimum} and {maximum or 'any'}")
        return number

    url = str(extra.get("url") or "").strip() or None
    overrides: dict[str, Any] = {
        "qdrant_url": url,
        "qdrant_host": None if url else (conn.host or "localhost"),
        "qdrant_port": conn.port or 6333,
        "qdrant_path": None,
        "qdrant_api_key": conn.password or None,
        "qdrant_https": flag("https"),
        "qdrant_prefix": str(extra.get("prefix") or "").strip().strip("/") or None,
        "qdrant_prefer_grpc": bool(flag("prefer_grpc", "prefer_gprc")),
        "qdrant_grpc_port": whole("grpc_port", 6334, minimum=1, maximum=65535),
        "qdrant_timeout_s": whole("timeout", 60, minimum=1),
    }
    if extra.get("collection_config") not in (None, ""):
        overrides["collection_config"] = load_collection_config(
            extra["collection_config"], source=f"{where}: extra collection_config", root=root)
    return overrides


def task_settings() -> tuple[Settings, dict[str, str] | None]:
    """Settings from the environment, overridden by the Connections that are defined; Ollama's headers.
    Checked once the Connections apply: `qdrant_default` may be what makes Qdrant a server."""
    import os

    from kb_reindex.config import project_root

    overrides: dict[str, Any] = {}
    headers = None
    if (state_conn := _connection(STATE_CONN_ID)) is not None:
        overrides["state_url"] = state_url_from_connection(state_conn)
    if (ollama_conn := _connection(OLLAMA_CONN_ID)) is not None:
        overrides["ollama_host"], headers = ollama_from_connection(ollama_conn)
    if (qdrant_conn := _connection(QDRANT_CONN_ID)) is not None:
        overrides.update(qdrant_overrides(qdrant_conn, root=project_root(os.environ)))
    return Settings.from_env(**overrides), headers


@contextmanager
def task_deps() -> Iterator[Deps]:
    settings, headers = task_settings()
    with open_deps(settings) as deps:
        deps.ollama_headers = headers
        yield deps


@contextmanager
def task_step(run_id: str) -> Iterator[Deps]:
    """`task_deps` inside `step`, under the run's reindex lock (renewed now and all along the step): an error
    while opening the stores (Qdrant down, a bad Connection) is decided like one in the step's body: recorded
    on the run when final, a permanent one not retried."""
    from kb_reindex import dag_lock

    stack = ExitStack()
    try:
        deps = stack.enter_context(task_deps())
    except KbError as exc:
        stack.close()
        _opening_failed(run_id, exc)
        raise
    with stack, step(deps, run_id), dag_lock.held(deps, run_id):
        yield deps


def release_run_lock(context: Any) -> None:
    """The run's failure callback (every task's `on_failure_callback`, called once a task fails for good, not
    between retries, and the DAG's, called when the run fails as a whole): let go of the run's reindex lock,
    so the next run or `gc` need not wait for its TTL."""
    from kb_reindex import dag_lock
    from kb_reindex.config import Settings
    from kb_reindex.state import StateStore

    try:
        dag_run = context.get("dag_run")
        dag_id = context["dag"].dag_id if context.get("dag") is not None else dag_run.dag_id
        run_id = f"airflow__{dag_id}__{context.get('run_id') or dag_run.run_id}"
        state = StateStore(_state_url(), create=False)
        try:
            dag_lock.release(_LockDeps(Settings.from_env(), state), run_id)
        finally:
            state.dispose()
        log.info("kb_reindex: run %s failed; its lock is released", run_id)
    except Exception as exc:  # a callback cannot fail the run further; the lock expires by TTL
        log.warning("kb_reindex: could not release the failed run's lock (it expires after KB_LOCK_TTL): %s", exc)


class _LockDeps:
    """What `dag_lock` needs: the settings (alias, TTL) and the state DB, without opening Qdrant."""

    def __init__(self, settings: Settings, state: Any) -> None:
        self.settings, self.state = settings, state


def _state_url() -> str:
    """The state DB alone, as `task_settings` finds it: other settings may be what failed."""
    if (state_conn := _connection(STATE_CONN_ID)) is not None:
        return state_url_from_connection(state_conn)
    return state_url_from_env()


def _opening_failed(run_id: str, exc: KbError) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    permanent = not classify(exc).transient
    if permanent or _last_try():
        try:
            from kb_reindex.state import StateStore

            state = StateStore(_state_url(), create=False)
            try:
                state.finish_run(run_id, outcome="failed", error=str(exc))
            finally:
                state.dispose()
        except KbError as unrecorded:  # the state DB itself is what failed: Airflow's log is the record
            log.warning("kb_reindex: run %s failed and could not be recorded: %s", run_id, unrecorded)
    if permanent:
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from None


def _last_try() -> bool:
    """True when Airflow will not retry this task again (a retried step's run is still in progress)."""
    from airflow.sdk import get_current_context

    try:
        ti = get_current_context()["ti"]
        return ti.try_number > ti.max_tries
    except Exception:  # outside a task context: treat as final
        return True


@contextmanager
def step(deps: Deps, run_id: str) -> Iterator[None]:
    """Record the run as failed (when it really ends) and decide whether Airflow should retry."""
    from airflow.sdk.exceptions import AirflowFailException

    try:
        yield
    except KbError as exc:
        from kb_reindex import metrics
        from kb_reindex.errors import EmbeddingError

        permanent = not classify(exc).transient
        if permanent or _last_try():
            deps.state.finish_run(run_id, outcome="failed", error=str(exc))
        if isinstance(exc, AliasMovedError):
            metrics.incr("alias_switch.failures", alias=deps.settings.alias)
        if isinstance(exc, EmbeddingError):
            metrics.incr("embedding.batch_failures", alias=deps.settings.alias)
        if permanent:
            raise AirflowFailException(f"{type(exc).__name__}: {exc}") from None
        raise
    except Exception as exc:
        from kb_reindex.engine import failure_of

        failure = failure_of(exc, deps)
        if failure.kind == "state_unreachable":  # nothing to record it in: the next run does (lock takeover)
            raise StateUnreachable(failure.message) from None
        if _last_try():
            deps.state.finish_run(run_id, outcome="failed", error=failure.message)
        if failure.expected:  # Qdrant unreachable: one line in the task's log, and a retry
            raise StoreError(failure.message) from None
        raise


# --- knowledge_reindex & knowledge_model_migration ---------------------------------------------------


def plan_task(*, run_id: str, kind: str = "reindex", force_full: bool = False, embedder: str | None = None,
              model: str | None = None, dim: int | None = None, layout: str | None = None,
              dry_run: bool = False) -> dict[str, Any]:
    """The only task that reads the knowledge folder: a plan that builds writes its snapshot (version,
    manifest, texts to embed) into the state DB, and the plan dict names the version (`version`)."""
    from kb_reindex import dag_lock
    from kb_reindex.plan import prepare_logged
    from kb_reindex.snapshot import snapshot_plan

    with task_deps() as deps:
        deps.state.start_run(run_id=run_id, alias=deps.settings.alias, kind=kind, trigger="airflow")
        with step(deps, run_id):
            # the run's reindex lock, held until cleanup (or the failure callback) lets it go
            dag_lock.take(deps, run_id)
            deps.state.fail_orphaned_runs(deps.settings.alias, current=run_id)
            prepared = prepare_logged(deps, force_full=force_full or kind == "migration", kind=kind,
                                      embedder=embedder, model=model, dim=dim, layout=layout,
                                      layout_from="Param payload_layout",
                                      audit_run_id=run_id, record=True)
            plan = prepared.plan
            if not plan.no_change and not dry_run:
                plan = snapshot_plan(deps, prepared, run_id=run_id)
            return plan.to_dict()


def should_build_task(*, plan: dict[str, Any], dry_run: bool, run_id: str) -> bool:
    """False ends the run here (short-circuit): nothing changed, or only a dry run was asked for."""
    from kb_reindex import dag_lock
    from kb_reindex.engine import no_change_counters, run_counters

    with task_deps() as deps:
        dag_lock.renew(deps, run_id)
        if not plan["no_change"] and not dry_run:
            return True
        outcome = "no_change" if plan["no_change"] else "dry_run"
        counters = no_change_counters(plan) if plan["no_change"] else run_counters(plan)
        deps.state.finish_run(run_id, outcome=outcome, version=plan["base_version"], **counters)
        log.info("kb_reindex: %s; nothing is built", outcome)
        if dry_run:  # nothing else of this run writes (cleanup skips a dry run); a no-change run's cleanup does
            dag_lock.release(deps, run_id)
    return False


def create_version_task(*, plan: dict[str, Any], run_id: str) -> dict[str, Any]:
    from kb_reindex.build import create_version

    with task_step(run_id) as deps:
        created = create_version(deps, Plan.from_dict(plan), run_id=run_id)
        deps.state.update_run(run_id, version=created.version)
        return created.to_dict()


def build_slices_task(*, version: dict[str, Any], slice_size: int, run_id: str | None = None) -> list[dict[str, Any]]:
    """(offset, limit) windows over the version's manifest, for dynamic task mapping of the build."""
    from kb_reindex import dag_lock

    with task_deps() as deps:
        if run_id is not None:
            dag_lock.renew(deps, run_id)
        total = _recorded_version(deps, version["version"]).points_expected
    return [{"version": version["version"], "offset": start, "limit": slice_size}
            for start in range(0, max(total, 1), slice_size)]


def run_fence(deps: Deps, run_id: str) -> Any:
    """The DAG run's lock, which every write batch and the promotion of the run check it still holds."""
    from kb_reindex.dag_lock import dag_run_owner
    from kb_reindex.fence import Fence
    from kb_reindex.locking import reindex_lock_name

    return Fence(reindex_lock_name(deps.settings.alias), dag_run_owner(run_id))


def build_task(*, version: dict[str, Any], run_id: str, window: tuple[int, int] | None = None) -> dict[str, Any]:
    from kb_reindex.build import build

    with task_step(run_id) as deps:
        return build(deps, version["version"], run_id=run_id, window=window, fence=run_fence(deps, run_id)).to_dict()


def validate_task(*, version: dict[str, Any], run_id: str, min_hit_rate: float | None = None,
                  min_mrr: float | None = None) -> dict[str, Any]:
    from kb_reindex.engine import validation_summary
    from kb_reindex.validate import validate

    with task_step(run_id) as deps:
        return validation_summary(validate(deps, version["version"], min_hit_rate=min_hit_rate, min_mrr=min_mrr))


def promote_task(*, plan: dict[str, Any], version: dict[str, Any], run_id: str) -> dict[str, Any]:
    """Move the alias and announce it on the alias Asset. A version already live moved nothing: the task is
    skipped (no Asset event; `cleanup` still runs), unless this very run moved it in an attempt that died
    before reporting. A frozen alias moves nothing either: the run ends `frozen`, the task is skipped."""
    from airflow.sdk.exceptions import AirflowSkipException

    from kb_reindex.engine import run_counters
    from kb_reindex.promote import promote

    skip = None
    with task_step(run_id) as deps:
        try:
            result = promote(deps, version["version"], run_id=run_id, fence=run_fence(deps, run_id))
        except AliasFrozen as frozen:
            skip = hold_frozen(deps, frozen, plan=plan, version=version, run_id=run_id)
        else:
            moved_by_this_run = not result["already_live"] or _last_move_by(deps, version["version"]) == run_id
            deps.state.finish_run(run_id, outcome="promoted" if moved_by_this_run else "no_change",
                                  version=version["version"], **run_counters(plan), **_built_so_far(deps, run_id))
            if moved_by_this_run:
                record = _recorded_version(deps, version["version"])
                previous = (result["previous_version"] if not result["already_live"]
                            else _last_move_from(deps, record.version))
                announce_alias_move(deps, action="migrate" if record.kind == "migration" else "promote",
                                    version=record, previous_version=previous)
            else:
                skip = f"v{version['version']} is already live: the alias did not move"
    if skip is not None:  # outside `step`: a skip is not a failure to record
        raise AirflowSkipException(skip)
    return result


def hold_frozen(deps: Deps, frozen: AliasFrozen, *, plan: dict[str, Any], version: dict[str, Any],
                run_id: str) -> str:
    """The alias is frozen: the run ends `frozen` (the version kept ready) and the task is to be skipped,
    not failed: no Asset event, no watch; cleanup still runs. The message says why and what lifts it."""
    from kb_reindex.engine import run_counters
    from kb_reindex.freeze import FROZEN, frozen_view

    deps.state.finish_run(run_id, outcome=FROZEN, version=version["version"], **run_counters(plan),
                          **_built_so_far(deps, run_id))
    return str(frozen_view(deps, frozen)["message"])


def _last_move(deps: Deps, version_number: int) -> dict[str, Any] | None:
    moves = [e for e in deps.state.alias_events(deps.settings.alias) if e["to_version"] == version_number]
    return moves[-1] if moves else None


def _last_move_by(deps: Deps, version_number: int) -> str | None:
    move = _last_move(deps, version_number)
    return move["run_id"] if move else None


def _last_move_from(deps: Deps, version_number: int) -> int | None:
    move = _last_move(deps, version_number)
    return move["from_version"] if move else None


def alias_move_extra(*, alias: str, action: str, version: Any, previous_version: int | None) -> dict[str, Any]:
    """What an Asset event of the alias says moved: consumers (a cache warmer, an evaluation DAG) need not
    ask the state DB which collection, model and dimension now serve, nor how its payloads look."""
    from kb_reindex.layouts import version_profile

    return {"alias": alias, "action": action, "version": version.version, "collection": version.collection,
            "model": version.embed_model, "dimension": version.embed_dim, "previous_version": previous_version,
            "payload_layout": version.payload_layout, "embed_profile": version_profile(version)}


def announce_alias_move(deps: Deps, *, action: str, version: Any, previous_version: int | None) -> dict[str, Any]:
    """Set the `extra` of this task's outlet event for the alias Asset (emitted when the task succeeds)."""
    from airflow.sdk import get_current_context

    from kb_reindex.assets import KNOWLEDGE_ALIAS

    extra = alias_move_extra(alias=deps.settings.alias, action=action, version=version,
                             previous_version=previous_version)
    get_current_context()["outlet_events"][KNOWLEDGE_ALIAS].extra = extra
    log.info("kb_reindex: alias %s moved: %s", deps.settings.alias, extra)
    return extra


def finish_shadow_task(*, plan: dict[str, Any], version: dict[str, Any], run_id: str) -> dict[str, Any]:
    from kb_reindex import dag_lock
    from kb_reindex.engine import run_counters

    with task_deps() as deps:
        dag_lock.renew(deps, run_id)
        deps.state.finish_run(run_id, outcome="shadow", version=version["version"], **run_counters(plan),
                              **_built_so_far(deps, run_id))
    return {"version": version["version"], "promoted": False}


def _recorded_version(deps: Deps, number: int) -> VersionRecord:
    """The state DB's row of this alias's version `number`; a version that is not there is a clear error."""
    record = deps.state.get_version(deps.settings.alias, number)
    if record is None:
        raise ConfigError(f"version {number} does not exist (alias {deps.settings.alias!r} in the state DB)")
    return record


def _built_so_far(deps: Deps, run_id: str) -> BuiltCounters:
    """What the build tasks of this run wrote, as they added it to the run's record (not the plan's figures)."""
    row = deps.state.get_run(run_id) or {}
    return {"chunks_embedded": row.get("chunks_embedded") or 0, "chunks_reused": row.get("chunks_reused") or 0}


def cleanup_task(*, dry_run: bool = False, run_id: str | None = None) -> dict[str, Any]:
    """Retention after any run that did not fail: a quiet knowledge base reclaims abandoned builds too.
    A dry run promised to change nothing, so it deletes nothing either. The run's last step: retention runs
    under the run's lock, then lets it go (a failed retention keeps it for its retry, or the failure callback)."""
    from kb_reindex import dag_lock
    from kb_reindex.retention import cleanup

    if dry_run:
        from airflow.sdk.exceptions import AirflowSkipException

        if run_id is not None:
            with task_deps() as deps:
                dag_lock.release(deps, run_id)
        raise AirflowSkipException("dry run: retention deletes nothing")
    with task_deps() as deps:
        if run_id is None:
            return cleanup(deps).to_dict()
        with dag_lock.held(deps, run_id):
            result = cleanup(deps).to_dict()
        dag_lock.release(deps, run_id)
        return result


def watch_task(*, promoted: dict[str, Any], run_id: str) -> dict[str, Any]:
    """The watch after `promote` (kb_reindex.watch), for KB_WATCH_MINUTES (0: skipped). An automatic rollback,
    or a regression with nowhere to go back to, fails the task without retry: on-call must hear of it."""
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

    from kb_reindex.watch import watch

    settings, _headers = task_settings()
    if settings.watch_minutes <= 0:
        raise AirflowSkipException("KB_WATCH_MINUTES is 0: no watch after the promotion")
    with task_deps() as deps:
        result = watch(deps, promoted["version"], minutes=settings.watch_minutes,
                       interval_s=settings.watch_interval_s, run_id=f"{run_id}__watch"[:255], trigger="watch")
    if result["outcome"] == "rolled_back":
        raise AirflowFailException(f"v{promoted['version']} was rolled back to v{result['to_version']} "
                                   f"automatically: {result['reason']}")
    if result["outcome"] == "regressed":
        raise AirflowFailException(f"v{promoted['version']} regressed after its promotion and could not be rolled "
                                   f"back: {'; '.join(result['signals'])}; {result['error']}")
    return result


# --- knowledge_rollback ----------------------------------------------------------------------------


def rollback_task(*, run_id: str, live_version: int | None, to_version: int | None, reason: str, confirm: bool,
                  revalidate: bool, freeze: bool = True) -> dict[str, Any]:
    """On-call's rollback from `live_version` (the version they saw serving) to `to_version` (default: the one
    before it): refused, moving nothing, if another version serves by the move. No reindex lock: it completes
    while a build runs, and that build's promotion then fails its compare-and-swap. `freeze`: set the
    product's freeze before the alias moves back (kb_reindex.freeze), so no later run promotes the bad change
    again; the result says so."""
    from airflow.sdk.exceptions import AirflowFailException

    from kb_reindex.engine import run_rollback

    if not confirm:
        raise AirflowFailException("rollback not confirmed: set the 'confirm' param to true; nothing changed")
    if live_version is None:
        raise AirflowFailException("name the version you saw serving (the 'live_version' param, from the Knowledge "
                                   "index page or `kb-reindex status`); nothing changed")
    with task_deps() as deps:
        try:
            held = _rollback_freeze(deps, run_id=run_id, reason=reason) if freeze else None
            result = run_rollback(deps, reason=reason, to_version=to_version, run_id=run_id, trigger="airflow",
                                  revalidate=revalidate, expected_live=live_version)
        except PERMANENT as exc:
            raise AirflowFailException(f"{type(exc).__name__}: {exc}") from None
        target = deps.state.get_version(deps.settings.alias, result.to_version)
        announce_alias_move(deps, action="rollback", version=target, previous_version=result.from_version)
        return {**result.to_dict(), "freeze": held}


def _rollback_freeze(deps: Deps, *, run_id: str, reason: str) -> dict[str, Any]:
    from kb_reindex.freeze import freeze_for_rollback

    return freeze_for_rollback(deps, reason=reason, by=f"knowledge_rollback ({run_id})").view()


# --- knowledge_promote_shadow ------------------------------------------------------------------------


def promote_shadow_task(*, run_id: str, version: int, reason: str, confirm: bool,
                        live_version: int | None) -> dict[str, Any]:
    """Put a shadow (built, validated, never served) live on purpose: validated again against what serves
    now, under the alias's lock, and announced on the alias Asset. A retired or unknown version is refused:
    a version that served goes back through a rollback. Moves only from `live_version`, the version on-call
    saw serving (None: only when nothing serves)."""
    from airflow.sdk.exceptions import AirflowFailException

    from kb_reindex import engine
    from kb_reindex.promote import promote_shadow

    if not confirm:
        raise AirflowFailException("promotion not confirmed: set the 'confirm' param to true; nothing changed")
    if not reason or not reason.strip():
        raise AirflowFailException("a promotion needs a reason (it is recorded in the alias history)")
    with task_deps() as deps:
        deps.state.start_run(run_id=run_id, alias=deps.settings.alias, kind="promote", trigger="airflow")
        with step(deps, run_id), engine.exclusive(deps, run_id=run_id):
            result = promote_shadow(deps, version, expected_live=live_version, run_id=run_id, reason=reason.strip())
        deps.state.finish_run(run_id, outcome="promoted", version=version)
        record = _recorded_version(deps, version)
        announce_alias_move(deps, action="migrate" if record.kind == "migration" else "promote", version=record,
                            previous_version=result["previous_version"])
        return result
