"""The names of the alias's two locks (the reindex lock a run holds from plan to cleanup, the short alias
lock of every move), whether a run still holds its lock, and who an operator is."""

from __future__ import annotations

import getpass
import socket
from typing import TYPE_CHECKING

from kb_reindex.services.state.locks import lock_owner_alive

if TYPE_CHECKING:  # the types alone: importing a rule never imports Qdrant's client
    from kb_reindex.services.runtime import StepDeps
    from kb_reindex.services.state.ports import LockReads


def reindex_lock_name(alias: str) -> str:
    return f"reindex:{alias}"


def run_is_active(deps: StepDeps[LockReads], run_id: str) -> bool:
    """A run still working (or retrying); its version must not be taken or deleted.

    Decided by the alias's reindex lock alone: a CLI run holds it for as long as its process lives, a DAG run
    from `plan` until `cleanup` or its failure callback, renewed by every task (a long build all along). A run
    that died stops renewing: its lock expires after KB_LOCK_TTL (at once for a dead process on this host)."""
    holder = deps.state.lock_held_by(reindex_lock_name(deps.settings.alias))
    if holder is None or holder.rpartition("@")[0] != run_id:
        return False
    return lock_owner_alive(holder) is not False


def alias_lock_name(alias: str) -> str:
    return f"alias:{alias}"


def pin_by() -> str:
    """Who pins: the login user on this host (recorded with the pin)."""
    try:
        user = getpass.getuser()
    except Exception:  # no login name in some containers; the host still says where
        user = "unknown"
    return f"{user}@{socket.gethostname()}"
