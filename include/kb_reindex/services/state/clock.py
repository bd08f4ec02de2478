"""Time as the state DB sees it: naive UTC, read from one clock a `StateStore` holds.

The real clock by default; tests give a store a `ManualClock` and move time (a lock's TTL passing, a run
presumed dead) instead of sleeping or editing rows.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Protocol


def utcnow() -> datetime:
    """Naive UTC: SQLite and MySQL DATETIME both store it without surprises."""
    return datetime.now(UTC).replace(tzinfo=None)


def utc_stamp(value: datetime) -> str:
    """A naive-UTC time as every JSON of ours writes it: ISO 8601 to the second, with `Z`."""
    return value.isoformat(timespec="seconds") + "Z"


class Clock(Protocol):
    def now(self) -> datetime:
        """Naive UTC, as stored in the state DB."""
        ...


class SystemClock:
    """The real time (the default of every store)."""

    def now(self) -> datetime:
        return utcnow()


class ManualClock:
    """A clock that stands still until moved: `advance(seconds)` or `set(when)`. Thread-safe, since a lock's
    heartbeat thread reads it too.

    Move it forward to let a TTL pass. A lock taken at a time set before this process started says its
    owner's PID was reused (`lock_owner_alive` compares the lock's time with the process's real start)."""

    def __init__(self, start: datetime | None = None) -> None:
        if start is not None and start.tzinfo is not None:
            raise ValueError(f"ManualClock start {start!r} must be naive UTC, as the state DB stores it")
        self._now = start if start is not None else utcnow()
        self._guard = threading.Lock()

    def now(self) -> datetime:
        with self._guard:
            return self._now

    def advance(self, seconds: float) -> datetime:
        with self._guard:
            self._now += timedelta(seconds=seconds)
            return self._now

    def set(self, when: datetime) -> None:
        if when.tzinfo is not None:
            raise ValueError(f"ManualClock.set({when!r}): naive UTC expected, as the state DB stores it")
        with self._guard:
            self._now = when
