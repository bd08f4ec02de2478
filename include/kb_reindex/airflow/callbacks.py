"""The failure callback of the reindex and migration runs: a task that failed for good (not between retries),
or a run that failed as a whole (marked failed in the UI, timed out), ends the run, so its reindex lock is
let go and the next run or `gc` need not wait for KB_LOCK_TTL. Nothing depends on it firing: the lock's
liveness check asks Airflow about the run as well, and the lock expires by its TTL."""

from __future__ import annotations

import logging
from typing import Any

from kb_reindex.run import dag_lock
from kb_reindex.airflow.connections import state_url
from kb_reindex.services.state.dag_runs import kb_run_id
from kb_reindex.services.registry import select_knowledge_base
from kb_reindex.services.runtime import StateDeps
from kb_reindex.services.state.store import StateStore

log = logging.getLogger(__name__)


def release_run_lock(context: Any, kb: str | None = None) -> None:
    """`on_failure_callback` of every task of a reindex or migration run of knowledge base `kb`, and of the run
    itself."""
    try:
        dag_run = context.get("dag_run")
        dag_id = context["dag"].dag_id if context.get("dag") is not None else dag_run.dag_id
        run_id = kb_run_id(dag_id, context.get("run_id") or dag_run.run_id)
        # the state DB alone: the other settings (Qdrant, Ollama) may be what failed
        state = StateStore(state_url(), create=False)
        try:
            dag_lock.release(StateDeps(settings=select_knowledge_base(kb).settings(on_call=True), state=state), run_id)
        finally:
            state.dispose()
        log.info("kb_reindex: run %s failed; its lock is released", run_id)
    except Exception as exc:  # a callback cannot fail the run further; the lock expires by TTL
        log.warning("kb_reindex: could not release the failed run's lock (it expires after KB_LOCK_TTL): %s", exc)
