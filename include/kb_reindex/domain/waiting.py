"""Waiting for something outside our hands, bounded: a reindex lock another run holds (KB_LOCK_WAIT), Qdrant
still building a new version's index (KB_INDEX_WAIT_S).

What is waited for is one `look` (is it there yet, and a line saying why not); how long is one budget. How the
time between looks passes is the only difference between the two ways we run: the CLI sleeps in its process
(`Sleeping`), a DAG task gives its worker slot back and is started again later
(`kb_reindex.airflow.waiting.Rescheduling`). Both stop at the same budget and leave the caller to raise the
same error naming what it waited for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Look:
    """What one look saw: `ready`, or `state`, one line on why not (the holder of a lock, an index's progress)."""

    ready: bool
    state: str = ""


class Waiter(Protocol):
    def until(self, look: Callable[[], Look], *, budget_s: float, poll_s: float, what: str) -> Look:
        """Look until ready or until `budget_s` is spent; the last look (not ready: the caller refuses)."""
        ...


@dataclass(frozen=True)
class Sleeping:
    """In the process: look every `poll_s` (the caller's), sleeping between looks."""

    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def until(self, look: Callable[[], Look], *, budget_s: float, poll_s: float, what: str) -> Look:
        deadline = self.clock() + budget_s
        announced = False
        while True:
            seen = look()
            if seen.ready or self.clock() >= deadline:
                if seen.ready and announced:
                    log.info("kb_reindex: %s: ready", what)
                return seen
            if not announced:
                log.info("kb_reindex: waiting up to %g s for %s: %s", budget_s, what, seen.state)
                announced = True
            self.sleep(min(poll_s, max(deadline - self.clock(), 0.0)))


def next_look(*, started: datetime, now: datetime, budget_s: float, gap_s: float) -> datetime | None:
    """When a wait that began at `started` looks again, `gap_s` after this look and never past its budget (the
    last look falls on the deadline itself); None once the budget is spent."""
    deadline = started + timedelta(seconds=budget_s)
    if now >= deadline:
        return None
    return min(now + timedelta(seconds=gap_s), deadline)
