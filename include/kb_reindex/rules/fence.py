"""Fencing: a run writes into its version, and moves the alias, only while it still holds the alias's
reindex lock. A process stopped past KB_LOCK_TTL (SIGSTOP, a VM paused, a long GC) loses its lock to the
next run, which may resume the same version; when it continues, its next write batch is refused here
before it reaches Qdrant, and the version is left to the run that holds the lock now."""

from __future__ import annotations

from dataclasses import dataclass

from kb_reindex.domain.errors import FencedError
from kb_reindex.services.state.ports import LockReads


@dataclass(frozen=True)
class Fence:
    """The lock a run's writes depend on: `lock` (e.g. `reindex:mall_knowledge`) held by `owner`."""

    lock: str
    owner: str

    def check(self, state: LockReads, *, before: str) -> None:
        """One indexed SELECT; raises `FencedError` naming what was not done when the lock is not ours."""
        if state.holds_lock(self.lock, owner=self.owner):
            return
        holder = state.lock_held_by(self.lock)
        raise FencedError(
            f"this run ({self.owner}) no longer holds the lock {self.lock!r}"
            + (f" (held by {holder} now)" if holder else "")
            + f": it expired (the process was stopped or stalled past KB_LOCK_TTL) or on-call broke it. "
            f"Stopped before {before}; nothing more is written by this run, and its version is left to the run "
            "that holds the lock (`kb-reindex history` records the takeover)"
        )
