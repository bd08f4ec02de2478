"""The scheduler's listener (the plugin's `listeners`): every pool a knowledge base's DAG run needs exists before
its first task is scheduled. A registry entry added while Airflow runs gets its DAGs at the next parse, and its
first run starts within seconds (its source's watcher): its build pool `kb_qdrant_writes__<alias>` was never
set by `make airflow` or the compose init, and Airflow leaves a task of a pool that does not exist `scheduled`
for ever (a warning in the scheduler's log alone), its run holding the alias's lock. So when such a run starts,
the pools its task instances name that kb-reindex sizes (kb_reindex.airflow.lanes: the build pools, on-call's,
and default_pool kept below the parallelism) and that are missing are created, in the scheduler's own session
(committed with the run's start). A pool that cannot be created is an error in the scheduler's log naming it
and what to run; a pool not of kb-reindex is left to Airflow.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.listeners import hookimpl

from kb_reindex.airflow.lanes import DEFAULT_POOL, SIZED_BY, PoolSize, deployment_pools

log = logging.getLogger(__name__)


def missing_pools(wanted: set[str], existing: set[str], sizes: list[PoolSize]) -> list[PoolSize]:
    """Of the pools the deployment sizes, those a run's tasks name and Airflow lacks."""
    return [size for size in sizes if size.name in wanted - existing]


@hookimpl
def on_dag_run_running(dag_run: Any, msg: str) -> None:
    """A DAG run started (the scheduler, inside its session): create the kb-reindex pools its tasks miss."""
    try:
        ensure_pools(dag_run)
    except Exception:  # the scheduler goes on whatever a listener does; this says what to do by hand
        log.exception("kb_reindex: the pools of %s %s could not be checked or created; set them with "
                      "`python -m kb_reindex.airflow.lanes` and `airflow pools set` (scripts/airflow.sh)",
                      dag_run.dag_id, dag_run.run_id)


def ensure_pools(dag_run: Any) -> list[str]:
    from airflow.models.pool import Pool
    from airflow.models.taskinstance import TaskInstance
    from sqlalchemy import select
    from sqlalchemy.orm import object_session

    session = object_session(dag_run)
    if session is None:
        return []
    wanted = set(session.scalars(select(TaskInstance.pool).where(TaskInstance.dag_id == dag_run.dag_id,
                                                                  TaskInstance.run_id == dag_run.run_id)))
    existing = {name for name in session.scalars(select(Pool.pool).where(Pool.pool.in_(wanted))) if name}
    if not wanted - existing:
        return []
    sizes = deployment_pools()
    created = []
    for size in missing_pools(wanted, existing, sizes):
        session.add(Pool(pool=size.name, slots=size.slots, description=size.description, include_deferred=False))
        created.append(size.name)
        log.warning("kb_reindex: pool %s did not exist (a knowledge base added while Airflow runs): created with "
                    "%d slot(s) for %s", size.name, size.slots, dag_run.dag_id)
    default = next((size for size in sizes if size.name == DEFAULT_POOL), None)
    pool = session.scalar(select(Pool).where(Pool.pool == DEFAULT_POOL)) if created and default else None
    if pool is not None and default is not None and SIZED_BY in (pool.description or ""):
        pool.slots = default.slots  # the new build pool's slots come out of default_pool: on-call's stay free
    still = sorted(wanted - existing - set(created) - {DEFAULT_POOL})
    if still:
        log.error("kb_reindex: %s %s names pool(s) %s, which do not exist and are not kb-reindex's: its tasks "
                  "wait until they are created (airflow pools set)", dag_run.dag_id, dag_run.run_id, ", ".join(still))
    return created
