"""Which path a DAG run takes once its version is created (kb_reindex.rules.run_path): one task for a small plan,
the mapped slices for the rest. The boundary is inclusive; 0 turns the one-task path off; a plan of more than one
slice is mapped whatever the threshold."""

from __future__ import annotations

import pytest

from kb_reindex.rules.run_path import RunPath, run_path


@pytest.mark.parametrize(("points", "limit", "slice_size", "path"), [
    (0, 1000, 2000, RunPath.SMALL),       # nothing to write (a resumed build whose slot is full)
    (1000, 1000, 2000, RunPath.SMALL),    # at the threshold
    (1001, 1000, 2000, RunPath.MAPPED),   # one past it
    (20, 0, 2000, RunPath.MAPPED),        # 0: always mapped
    (30, 1000, 25, RunPath.MAPPED),       # more than one slice: the slices are asked for
    (25, 1000, 25, RunPath.SMALL),
])
def test_a_run_is_one_task_up_to_the_threshold_and_one_slice(points: int, limit: int, slice_size: int,
                                                              path: RunPath) -> None:
    assert run_path(points_to_write=points, small_run_points=limit, slice_size=slice_size) is path


def test_the_paths_are_the_branch_targets_the_dag_names() -> None:
    from kb_reindex.services.config import Settings

    assert (str(RunPath.SMALL), str(RunPath.MAPPED)) == ("small_run", "build_slices")
    assert Settings.from_env({}).small_run_points == 1000
    assert Settings.from_env({"KB_SMALL_RUN_POINTS": "0"}).small_run_points == 0
