"""The alias's reindex lock held by an Airflow DAG run, across the processes of its tasks.

A CLI run holds `reindex:<alias>` in one process, judged alive by its PID. A DAG run's tasks are separate
processes (often on separate workers), so its owner names the run, not a process: `<run_id>@airflow-dag-run`.
`plan` takes it (waiting up to KB_LOCK_WAIT, its worker slot free between looks, then refusing with the holder's
name), every later task renews
it (a long build renews it all along, from a heartbeat thread), and `cleanup` or the run's failure callback
releases it. Its liveness is its renewal: a run that dies stops renewing and its lock expires after
KB_LOCK_TTL, after which `gc`, cleanup or another run may take it and reclaim the run's version.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kb_reindex.domain.errors import LockLostError
from kb_reindex.rules.locking import reindex_lock_name
from kb_reindex.services.state.locks import DAG_RUN_OWNER

log = logging.getLogger(__name__)


def dag_run_owner(run_id: str) -> str:
    """The same owner for every task and every try of one run: a retried task renews, never competes."""
    return f"{run_id[:254 - len(DAG_RUN_OWNER)]}@{DAG_RUN_OWNER}"


def take(deps: Any, run_id: str) -> str:
    """`plan`: take the alias's reindex lock for the whole run (a retried plan takes it again as its own)."""
    owner = dag_run_owner(run_id)
    settings = deps.settings
    deps.state.acquire_lock(reindex_lock_name(settings.alias), owner=owner, ttl_s=settings.lock_ttl_s,
                            wait_s=settings.lock_wait_s, waiter=deps.waiter)
    log.info("kb_reindex: run %s holds the lock on %s (expires in %d s unless renewed)", run_id, settings.alias,
             settings.lock_ttl_s)
    return owner


def renew(deps: Any, run_id: str) -> str:
    """Push the run's lock out by KB_LOCK_TTL; a lock no longer the run's stops the task (nothing is written
    into a version that `gc` may already treat as abandoned)."""
    owner = dag_run_owner(run_id)
    alias = deps.settings.alias
    if not deps.state.renew_lock(reindex_lock_name(alias), owner=owner, ttl_s=deps.settings.lock_ttl_s):
        holder = deps.state.lock_held_by(reindex_lock_name(alias))
        raise LockLostError(
            f"DAG run {run_id} no longer holds the lock on {alias} (broken with `kb-reindex unlock`, or expired "
            f"after KB_LOCK_TTL={deps.settings.lock_ttl_s} s without renewal"
            + (f" and taken by {holder}" if holder else "") + "); trigger a new run"
        )
    return owner


def release(deps: Any, run_id: str) -> None:
    """Let go of the run's lock (only its own: a lock taken over by someone else stays theirs)."""
    deps.state.release_lock(reindex_lock_name(deps.settings.alias), owner=dag_run_owner(run_id))


@contextmanager
def held(deps: Any, run_id: str) -> Iterator[str]:
    """A task of the run: renew now, then every third of KB_LOCK_TTL while the body works, so a build
    longer than the TTL is never taken for abandoned while its run lives."""
    owner = renew(deps, run_id)
    with deps.state.renewing(reindex_lock_name(deps.settings.alias), owner=owner, ttl_s=deps.settings.lock_ttl_s):
        yield owner
