"""Metrics through Airflow's Stats (StatsD or OpenTelemetry, whichever the deployment enables).

Outside Airflow (the CLI, where Airflow is not imported) there is no metrics backend and these calls do nothing; the same numbers
are always available from `kb-reindex status --json`.
"""

from __future__ import annotations

import logging
import sys

from kb_reindex.domain.planning import reuse_rate

log = logging.getLogger(__name__)
PREFIX = "kb_reindex"


def _stats():  # Airflow's Stats facade, or None
    # Only where Airflow already runs this code: importing it from the CLI costs seconds and writes an
    # airflow.cfg, for metrics that would go nowhere.
    if "airflow.sdk" not in sys.modules:
        return None
    try:
        from airflow.sdk.observability.stats import Stats
    except Exception:  # no Airflow here: metrics are optional
        return None
    return Stats


def incr(name: str, count: int = 1, *, alias: str) -> None:
    stats = _stats()
    if stats is not None:
        stats.incr(f"{PREFIX}.{name}", count, tags={"alias": alias})


def gauge(name: str, value: float, *, alias: str) -> None:
    stats = _stats()
    if stats is not None:
        stats.gauge(f"{PREFIX}.{name}", value, tags={"alias": alias})


def run_finished(*, alias: str, outcome: str, duration_s: float | None, embedded: int = 0, reused: int = 0,
                 total: int = 0) -> None:
    """One call per finished run: outcome counter, duration, changed chunks and reuse rate (the share of the
    version's `total` chunks not embedded: copied from live or kept in its slot; without a total, of those
    written)."""
    incr(f"run.{outcome}", alias=alias)
    if duration_s is not None:
        gauge("run.duration_s", duration_s, alias=alias)
    if outcome == "promoted":
        gauge("chunks.changed", embedded, alias=alias)
        rate = reuse_rate(total=total, embedded=embedded, reused=reused)
        if rate is not None:
            gauge("embedding.reuse_rate", rate, alias=alias)
