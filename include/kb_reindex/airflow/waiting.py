"""How a DAG task waits (kb_reindex.domain.waiting): it looks once, and when what it waits for is not there yet
it gives its worker slot back, as a sensor in reschedule mode does: `AirflowRescheduleException` marks the
try `up_for_reschedule` and the scheduler starts it again at the next look. The budget counts from this try's
first look (Airflow's first reschedule of the try), so a wait spread over many starts stops where the CLI's
sleeping wait stops, and the caller refuses with the same error.

A task started again re-runs what came before its wait: `plan` restarts its run record and tries the lock,
`validate` restores the HNSW setting and asks Qdrant again; all of it idempotent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from airflow.sdk import get_current_context
from airflow.sdk.exceptions import AirflowRescheduleException

from kb_reindex.domain.waiting import Look, Sleeping, Waiter, next_look

log = logging.getLogger(__name__)

#: seconds between two looks of a rescheduled wait: a task start costs a few seconds of a worker, so looks are
#: sparser than the CLI's; at most a third of KB_LOCK_TTL, which renews the run's lock at each start
RESCHEDULE_GAP_S = 10.0


@dataclass(frozen=True)
class Rescheduling:
    #: this try's first look (UTC)
    started: datetime
    gap_s: float = RESCHEDULE_GAP_S

    def until(self, look: Callable[[], Look], *, budget_s: float, poll_s: float, what: str) -> Look:
        seen = look()
        if seen.ready:
            return seen
        now = datetime.now(UTC)
        at = next_look(started=self.started, now=now, budget_s=budget_s, gap_s=self.gap_s)
        if at is None:
            return seen
        log.info("kb_reindex: waiting for %s (%.0f of %g s so far): %s; the worker slot is free until the next "
                 "look at %s UTC", what, (now - self.started).total_seconds(), budget_s, seen.state,
                 f"{at:%H:%M:%S}")
        raise AirflowRescheduleException(at)


def rescheduling(*, lock_ttl_s: float) -> Waiter:
    """The waiter of the calling task's try; outside a task (a task body called directly) the sleeping one."""
    try:
        context = get_current_context()
    except RuntimeError:
        return Sleeping()
    first = context["ti"].get_first_reschedule_date(context)
    return Rescheduling(started=first or datetime.now(UTC), gap_s=min(RESCHEDULE_GAP_S, lock_ttl_s / 3))
