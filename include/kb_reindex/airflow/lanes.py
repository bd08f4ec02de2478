"""On-call's lane: rollbacks and shadow promotions never queue behind builds.

Two Airflow features make the lane, each set where the deployment starts (scripts/airflow.sh, the compose
stack), read from the environment of the process that parses the DAG files:

- a Celery queue of its own (`KB_ONCALL_QUEUE`, `kb_oncall` under `make airflow` with Celery), served by a
  worker that takes nothing else; unset: Airflow's default queue (a deployment without that worker never
  sends a task where nobody takes it). The local executor has no queues: it ignores this.
- a pool of its own (`KB_ONCALL_POOL`, `kb_oncall`, `KB_ONCALL_SLOTS` slots) with `default_pool` sized so that
  every other task together leaves those slots of the executor's parallelism free: `default_pool` holds
  parallelism minus the on-call slots minus the build pools' slots (`pool_sizes`). Unset: `default_pool`,
  nothing reserved.

Both with the highest `priority_weight` (absolute): when a slot frees, on-call's task is the next queued.
This module imports no Airflow: the scripts size the pools with it (`python -m kb_reindex.airflow.lanes`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NotRequired, TypedDict

from kb_reindex.domain.errors import ConfigError
from kb_reindex.services.config import env_int

ONCALL_QUEUE_ENV = "KB_ONCALL_QUEUE"
ONCALL_POOL_ENV = "KB_ONCALL_POOL"
ONCALL_SLOTS_ENV = "KB_ONCALL_SLOTS"
PARALLELISM_ENV = "AIRFLOW__CORE__PARALLELISM"
#: Airflow's own defaults: [core] parallelism and the pool every task without one takes
DEFAULT_PARALLELISM = 32
DEFAULT_POOL = "default_pool"
DEFAULT_ONCALL_SLOTS = 2
#: above any weight Airflow's default rule (downstream) gives a task of a knowledge base's DAGs
ONCALL_PRIORITY = 10_000
#: the description a pool this module sized carries (the scheduler listener keeps those in step)
SIZED_BY = "kb-reindex"


class OnCallTaskArgs(TypedDict):
    """The `@task` arguments that put a task on on-call's lane."""

    pool: str
    priority_weight: int
    weight_rule: str
    queue: NotRequired[str]


@dataclass(frozen=True)
class OnCallLane:
    """Where on-call's tasks run: their pool, their Celery queue (None: Airflow's default) and their weight."""

    pool: str = DEFAULT_POOL
    queue: str | None = None

    def task_args(self) -> OnCallTaskArgs:
        """The `@task` arguments of a task on this lane."""
        args = OnCallTaskArgs(pool=self.pool, priority_weight=ONCALL_PRIORITY, weight_rule="absolute")
        if self.queue:
            args["queue"] = self.queue
        return args


def oncall_lane(env: Mapping[str, str] | None = None) -> OnCallLane:
    env = os.environ if env is None else env
    return OnCallLane(pool=env.get(ONCALL_POOL_ENV, "").strip() or DEFAULT_POOL,
                      queue=env.get(ONCALL_QUEUE_ENV, "").strip() or None)


@dataclass(frozen=True)
class PoolSize:
    name: str
    slots: int
    description: str


def pool_sizes(builds: Iterable[tuple[str, int]], *, parallelism: int, oncall_pool: str,
               oncall_slots: int) -> list[PoolSize]:
    """Every pool the deployment sets: each build pool, and with a pool of on-call's own that pool and
    `default_pool`, sized so that all other tasks together leave `oncall_slots` of `parallelism` free."""
    builds = list(builds)
    sized = [PoolSize(name, slots, f"Qdrant writes of kb-reindex (KB_BUILD_PARALLELISM) [{SIZED_BY}]")
             for name, slots in builds]
    if oncall_pool == DEFAULT_POOL:
        return sized
    rest = parallelism - oncall_slots - sum(slots for _name, slots in builds)
    if rest < 1:
        raise ConfigError(f"{PARALLELISM_ENV}={parallelism} leaves no slot for the tasks in default_pool once "
                          f"{ONCALL_SLOTS_ENV}={oncall_slots} on-call slot(s) and the build pools' "
                          f"{sum(s for _n, s in builds)} are kept: raise it to at least "
                          f"{parallelism - rest + 1}")
    return [*sized,
            PoolSize(oncall_pool, oncall_slots, f"on-call's rollbacks and shadow promotions ({ONCALL_SLOTS_ENV}) "
                                                f"[{SIZED_BY}]"),
            PoolSize(DEFAULT_POOL, rest, f"{PARALLELISM_ENV} minus the on-call and build pools: the on-call "
                                         f"slots stay free for on-call [{SIZED_BY}]")]


def deployment_pools(env: Mapping[str, str] | None = None) -> list[PoolSize]:
    """`pool_sizes` of the deployment the environment describes: its registry's build pools."""
    from kb_reindex.services.registry import load_registry

    env = os.environ if env is None else env
    registry = load_registry(env)
    for message in registry.errors:
        print(f"kb-reindex: configuration error: {message}", file=sys.stderr)
    builds = [(kb.pool, kb.settings(env).build_parallelism) for kb in registry.bases]
    return pool_sizes(builds, parallelism=env_int(env, PARALLELISM_ENV, DEFAULT_PARALLELISM, minimum=1),
                      oncall_pool=oncall_lane(env).pool,
                      oncall_slots=env_int(env, ONCALL_SLOTS_ENV, DEFAULT_ONCALL_SLOTS, minimum=1))


def pools_import_json(pools: Iterable[PoolSize]) -> str:
    """The pools as `airflow pools import <file>` reads them: every pool set by one Airflow process, not one
    `airflow pools set` process (~3 s of start each) per pool."""
    return json.dumps({p.name: {"slots": p.slots, "description": p.description, "include_deferred": False}
                       for p in pools}, ensure_ascii=False, indent=1)


def main(argv: list[str] | None = None) -> None:
    """`python -m kb_reindex.airflow.lanes`: one line `<pool> <slots> <description>` per pool to set; with
    `--json` the file `airflow pools import` reads, for the scripts (`make airflow`, `make demo`, the compose
    init); a refusal names the mistake (exit 2)."""
    as_json = (sys.argv[1:] if argv is None else argv) == ["--json"]
    try:
        pools = deployment_pools()
        if as_json:
            print(pools_import_json(pools))
        for pool in () if as_json else pools:
            print(pool.name, pool.slots, pool.description)
    except ConfigError as exc:
        print(f"kb-reindex: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
