"""A bounded wait (kb_reindex.domain.waiting): the CLI's sleeping wait and a DAG task's rescheduled wait look at
the same thing and stop at the same budget; neither looks past it, both hand the last look back for the caller
to refuse with."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from airflow.sdk.exceptions import AirflowRescheduleException

from kb_reindex.airflow.waiting import Rescheduling
from kb_reindex.domain.waiting import Look, Sleeping, next_look

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def test_next_look_is_one_gap_later_never_past_the_budget_and_none_once_spent() -> None:
    assert next_look(started=T0, now=T0, budget_s=30, gap_s=10) == T0 + timedelta(seconds=10)
    assert next_look(started=T0, now=T0 + timedelta(seconds=25), budget_s=30, gap_s=10) == T0 + timedelta(seconds=30)
    assert next_look(started=T0, now=T0 + timedelta(seconds=30), budget_s=30, gap_s=10) is None
    assert next_look(started=T0, now=T0, budget_s=0, gap_s=10) is None  # KB_LOCK_WAIT=0: refuse at once


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_sleeping_looks_each_poll_until_ready() -> None:
    time = FakeTime()
    answers = iter([Look(False, "held by a"), Look(False, "held by a"), Look(True)])
    seen = Sleeping(clock=time.clock, sleep=time.sleep).until(lambda: next(answers), budget_s=30, poll_s=0.5,
                                                              what="the lock")
    assert seen.ready and time.slept == [0.5, 0.5]


def test_sleeping_stops_at_the_budget_with_the_last_look() -> None:
    time = FakeTime()
    looks = []

    def look() -> Look:
        looks.append(time.now)
        return Look(False, f"held at {time.now:g}")

    seen = Sleeping(clock=time.clock, sleep=time.sleep).until(look, budget_s=1.2, poll_s=0.5, what="the lock")
    assert not seen.ready and seen.state == "held at 1.2"
    assert looks == [0.0, 0.5, 1.0, 1.2]  # the last look on the deadline itself, none after it


def test_a_rescheduled_wait_gives_the_slot_back_until_its_budget_then_hands_back_the_last_look() -> None:
    now = datetime.now(UTC)
    waiting = Rescheduling(started=now - timedelta(seconds=5), gap_s=10)
    with pytest.raises(AirflowRescheduleException) as again:
        waiting.until(lambda: Look(False, "held by run r1"), budget_s=30, poll_s=0.25, what="the lock")
    at = again.value.reschedule_date
    assert now + timedelta(seconds=9) <= at <= now + timedelta(seconds=11)
    # near the deadline: the next look is the deadline itself
    late = Rescheduling(started=now - timedelta(seconds=27), gap_s=10)
    with pytest.raises(AirflowRescheduleException) as last:
        late.until(lambda: Look(False, "held"), budget_s=30, poll_s=0.25, what="the lock")
    assert abs((last.value.reschedule_date - (late.started + timedelta(seconds=30))).total_seconds()) < 0.01
    spent = Rescheduling(started=now - timedelta(seconds=31), gap_s=10)
    assert spent.until(lambda: Look(False, "held by run r1"), budget_s=30, poll_s=0.25, what="the lock") == \
        Look(False, "held by run r1")
    assert spent.until(lambda: Look(True), budget_s=30, poll_s=0.25, what="the lock").ready  # ready: no wait
