"""Whether the Airflow DAG run that holds a lock (`<run_id>@airflow-dag-run`) is still running, asked of
Airflow where this process can reach it: inside a task through the Task SDK's execution API; elsewhere
(the api-server of the Knowledge index page, the CLI beside an Airflow install) in the metadata DB named by
AIRFLOW__DATABASE__SQL_ALCHEMY_CONN or $AIRFLOW_HOME/airflow.cfg, or else the engine of an Airflow already
imported in this process. A run Airflow reports finished (on-call marked it failed in the UI, say) is dead:
its lock is taken over at once. Unknown (no Airflow here, the run not found, Airflow not answering): None,
and the lock is freed only by its renewal stopping (KB_LOCK_TTL). Never imports Airflow itself."""

from __future__ import annotations

import configparser
import functools
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

log = logging.getLogger(__name__)

#: a kb run id of a DAG run is `airflow:<dag_id>:<run_id>` (`kb_run_id`): a DAG id never holds `:`, so the first
#: one after the prefix ends it, whatever the DAG id (`knowledge_reindex__shop`) or the run id (`manual__2026-...`)
RUN_ID_PREFIX = "airflow:"
#: the ids written before there were DAG ids with `__` (`airflow__<dag_id>__<run_id>`), still read back
LEGACY_RUN_ID_PREFIX = "airflow__"
#: DAG run states in which its tasks may still renew the lock
RUNNING_STATES = frozenset({"queued", "running"})
#: the states Airflow ends a DAG run in
FINISHED_STATES = frozenset({"success", "failed"})


@dataclass(frozen=True)
class DagRunRef:
    dag_id: str
    run_id: str


def kb_run_id(dag_id: str, dag_run_id: str) -> str:
    """The id a DAG run is recorded under in the state DB: unique across DAGs and runs, read back by `dag_run_of`."""
    if ":" in dag_id:
        raise ValueError(f"DAG id {dag_id!r} holds ':', which Airflow refuses and a kb run id cannot carry")
    return f"{RUN_ID_PREFIX}{dag_id}:{dag_run_id}"


def dag_run_of(kb_run_id: str) -> DagRunRef | None:
    """The DAG run a kb run id (`airflow:<dag_id>:<airflow run id>`, or the legacy `airflow__<dag_id>__<run id>`
    of a DAG id without `__`) names; None for any other id."""
    if kb_run_id.startswith(RUN_ID_PREFIX):
        dag_id, sep, run_id = kb_run_id[len(RUN_ID_PREFIX):].partition(":")
    elif kb_run_id.startswith(LEGACY_RUN_ID_PREFIX):
        dag_id, sep, run_id = kb_run_id[len(LEGACY_RUN_ID_PREFIX):].partition("__")
    else:
        return None
    return DagRunRef(dag_id, run_id) if sep and dag_id and run_id else None


def dag_run_state(ref: DagRunRef) -> str | None:
    """Airflow's state of the DAG run, or None where this process cannot tell."""
    try:
        runner = sys.modules.get("airflow.sdk.execution_time.task_runner")
        if runner is not None and getattr(runner, "SUPERVISOR_COMMS", None) is not None:
            state = runner.RuntimeTaskInstance.get_dagrun_state(ref.dag_id, ref.run_id)
            # the Task SDK answers its `DagRunState(str, Enum)`, whose str() is "DagRunState.FAILED": its value
            return None if state is None else str(getattr(state, "value", state))
        url = metadata_db_url()
        settings = sys.modules.get("airflow.settings")
        engine = _engine(url) if url else getattr(settings, "engine", None) if settings is not None else None
        return _query(engine, ref) if engine is not None else None
    except Exception as exc:  # unknown is a safe answer: the TTL still frees the lock
        log.info("kb_reindex: could not ask Airflow about DAG run %s of %s: %s", ref.run_id, ref.dag_id,
                 str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return None


def metadata_db_url() -> str | None:
    """The Airflow metadata DB configured for this environment, without importing Airflow."""
    url = os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN")
    if url:
        return url
    home = os.environ.get("AIRFLOW_HOME")
    cfg = Path(home) / "airflow.cfg" if home else None
    if cfg is None or not cfg.is_file():
        return None
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.read(cfg, encoding="utf-8")
    return parser.get("database", "sql_alchemy_conn", fallback=None) or None


@functools.lru_cache(maxsize=4)
def _engine(url: str) -> sa.Engine:
    return sa.create_engine(url, pool_pre_ping=True)


def _query(engine: sa.Engine, ref: DagRunRef) -> str | None:
    with engine.connect() as conn:
        state = conn.execute(sa.text("SELECT state FROM dag_run WHERE dag_id = :dag_id AND run_id = :run_id"),
                             {"dag_id": ref.dag_id, "run_id": ref.run_id}).scalar()
    return str(state) if state is not None else None


@dataclass(frozen=True)
class PoolWait:
    """A task of a DAG run that waits in a pool Airflow does not have: the scheduler leaves it `scheduled` for
    ever and says so only in its own log, while the run holds the alias's lock."""

    dag_id: str
    run_id: str
    task_id: str
    pool: str


def missing_pool_waits(refs: list[DagRunRef]) -> list[PoolWait] | None:
    """The task instances of these DAG runs that wait in a pool the metadata DB has no row for (`slot_pool`);
    None where this process cannot ask (no metadata DB here, or it did not answer): the CLI beside an Airflow
    install and the page's api-server can. Never imports Airflow."""
    if not refs:
        return []
    try:
        url = metadata_db_url()
        settings = sys.modules.get("airflow.settings")
        engine = _engine(url) if url else getattr(settings, "engine", None) if settings is not None else None
        if engine is None:
            return None
        waits: list[PoolWait] = []
        query = sa.text("SELECT ti.task_id, ti.pool FROM task_instance ti WHERE ti.dag_id = :dag_id AND "
                        "ti.run_id = :run_id AND ti.state IN ('scheduled', 'queued') AND NOT EXISTS "
                        "(SELECT 1 FROM slot_pool p WHERE p.pool = ti.pool) ORDER BY ti.task_id")
        with engine.connect() as conn:
            for ref in refs:
                rows = conn.execute(query, {"dag_id": ref.dag_id, "run_id": ref.run_id}).all()
                waits += [PoolWait(ref.dag_id, ref.run_id, str(task_id), str(pool)) for task_id, pool in rows]
        return waits
    except Exception as exc:  # unknown: said in the log; status then names nothing it could not see
        log.info("kb_reindex: could not ask Airflow about the pools of %d DAG run(s): %s", len(refs),
                 str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return None


def dag_run_alive(kb_run_id: str) -> tuple[bool | None, str | None]:
    """(alive, Airflow's state): False only for a run Airflow reports finished."""
    ref = dag_run_of(kb_run_id)
    if ref is None:
        return None, None
    state = dag_run_state(ref)
    if state is None:
        return None, None
    return (False if state in FINISHED_STATES else True if state in RUNNING_STATES else None), state
