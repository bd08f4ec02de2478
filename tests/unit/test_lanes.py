"""On-call's lane (kb_reindex.airflow.lanes): its pool and queue from the environment, and the pools sized so that
every task but on-call's together leaves the on-call slots of the executor's parallelism free."""

from __future__ import annotations

import pytest

from kb_reindex.airflow.lanes import ONCALL_PRIORITY, OnCallLane, oncall_lane, pool_sizes
from kb_reindex.domain.errors import ConfigError


def test_the_lane_is_the_environments_and_off_by_default() -> None:
    assert oncall_lane({}) == OnCallLane(pool="default_pool", queue=None)
    assert oncall_lane({}).task_args() == {"pool": "default_pool", "priority_weight": ONCALL_PRIORITY,
                                           "weight_rule": "absolute"}, "no queue named: Airflow's default one"
    lane = oncall_lane({"KB_ONCALL_POOL": "kb_oncall", "KB_ONCALL_QUEUE": " kb_oncall "})
    assert lane.task_args() == {"pool": "kb_oncall", "queue": "kb_oncall", "priority_weight": ONCALL_PRIORITY,
                                "weight_rule": "absolute"}


def test_default_pool_leaves_the_on_call_slots_of_the_parallelism_free() -> None:
    sized = pool_sizes([("kb_qdrant_writes__shop", 2), ("kb_qdrant_writes__wiki", 1)], parallelism=32,
                       oncall_pool="kb_oncall", oncall_slots=2)
    slots = {p.name: p.slots for p in sized}
    assert slots == {"kb_qdrant_writes__shop": 2, "kb_qdrant_writes__wiki": 1, "kb_oncall": 2, "default_pool": 27}
    # every task off the lane runs in default_pool or a build pool: together they fill at most this
    assert slots["default_pool"] + 2 + 1 == 32 - slots["kb_oncall"]
    assert all("kb-reindex" in p.description for p in sized)


def test_without_a_pool_of_its_own_only_the_build_pools_are_set() -> None:
    assert [p.name for p in pool_sizes([("kb_qdrant_writes", 1)], parallelism=32, oncall_pool="default_pool",
                                       oncall_slots=2)] == ["kb_qdrant_writes"]


def test_a_parallelism_too_small_for_the_reserve_is_refused_naming_what_to_raise() -> None:
    with pytest.raises(ConfigError, match=r"AIRFLOW__CORE__PARALLELISM=4 leaves no slot .* KB_ONCALL_SLOTS=2 .* "
                                          r"raise it to at least 5"):
        pool_sizes([("a", 1), ("b", 1)], parallelism=4, oncall_pool="kb_oncall", oncall_slots=2)
