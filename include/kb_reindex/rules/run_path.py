"""Which path a DAG run of a reindex or a migration takes once its version is created: one task, or the mapped
slices. Decided here once, from the version's points still to write after its slot was prepared.

- **small** (`small_run`): at most `KB_SMALL_RUN_POINTS` points to write and no more than one build slice of
  them. One task runs build, validate, promote and cleanup: the same steps, records, fencing and lock as the
  mapped path, without five task starts (each a process that imports Airflow and our stores).
- **mapped** (`build_slices`, `build` per slice, `validate`, `promote`, `cleanup`): everything else. Slices
  write at once (the write pool), and a validation waiting for Qdrant's index gives its worker slot back.
"""

from __future__ import annotations

from enum import StrEnum


class RunPath(StrEnum):
    SMALL = "small_run"
    MAPPED = "build_slices"


def run_path(*, points_to_write: int, small_run_points: int, slice_size: int) -> RunPath:
    """`points_to_write`: the version's expected points less those its slot already holds (kept from the
    version it held, or written by an earlier attempt of this run)."""
    if small_run_points > 0 and points_to_write <= min(small_run_points, slice_size):
        return RunPath.SMALL
    return RunPath.MAPPED
