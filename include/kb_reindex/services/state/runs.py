"""Run records: one row per run (CLI or DAG), its counters, outcome and duration."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

import sqlalchemy as sa

from kb_reindex.services.state.schema import runs

if TYPE_CHECKING:
    from kb_reindex.services.state.clock import Clock



class RunCounterColumns(TypedDict, total=False):
    """kb_runs columns `finish_run` writes beside the outcome: the version built and the run's figures (a key
    left out is not written)."""

    version: int | None
    source_changed_at: datetime | None
    docs_added: int
    docs_changed: int
    docs_unchanged: int
    docs_removed: int
    chunks_total: int
    chunks_embedded: int
    chunks_reused: int

@dataclass(frozen=True)
class RunRecord:
    """One row of `kb_runs`: a run (CLI or DAG), its counters, outcome and duration."""

    run_id: str
    alias: str
    kind: str
    trigger: str
    outcome: str
    version: int | None
    docs_added: int
    docs_changed: int
    docs_unchanged: int
    docs_removed: int
    chunks_total: int
    chunks_embedded: int
    chunks_reused: int
    duration_s: float | None
    source_changed_at: datetime | None
    error: str | None
    started_at: datetime
    finished_at: datetime | None

    def to_dict(self) -> dict[str, Any]:
        """The row's columns by name, as `get_run` returned them before it was typed."""
        return asdict(self)


class RunsMixin:
    """Run rows of `StateStore`."""

    engine: sa.Engine
    clock: Clock

    # --- runs -----------------------------------------------------------------------------------

    def start_run(self, *, run_id: str, alias: str, kind: str, trigger: str) -> None:
        """Idempotent: a retried plan task or a rerun with the same id restarts the record."""
        now = self.clock.now()
        with self.engine.begin() as conn:
            exists = conn.execute(sa.select(runs.c.run_id).where(runs.c.run_id == run_id)).first()
            values = {"alias": alias, "kind": kind, "trigger": trigger, "outcome": "running", "started_at": now,
                      "finished_at": None, "error": None, "chunks_embedded": 0, "chunks_reused": 0}
            if exists:
                conn.execute(runs.update().where(runs.c.run_id == run_id).values(**values))
            else:
                conn.execute(runs.insert().values(run_id=run_id, **values))

    def update_run(self, run_id: str, **columns: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(runs.update().where(runs.c.run_id == run_id).values(**columns))

    def add_run_chunks(self, run_id: str, *, embedded: int, reused: int) -> None:
        """Count what a build of this run wrote: `chunks_embedded` embedded, `chunks_reused` copied from live.
        Added, not set: mapped build slices and retried tasks each add what they wrote."""
        with self.engine.begin() as conn:
            conn.execute(runs.update().where(runs.c.run_id == run_id).values(
                chunks_embedded=runs.c.chunks_embedded + embedded, chunks_reused=runs.c.chunks_reused + reused))

    def finish_run(self, run_id: str, *, outcome: str, error: str | None = None,
                   **counters: Unpack[RunCounterColumns]) -> None:
        now = self.clock.now()
        with self.engine.begin() as conn:
            started = conn.execute(sa.select(runs.c.started_at).where(runs.c.run_id == run_id)).scalar()
            duration = (now - started).total_seconds() if started else None
            conn.execute(
                runs.update().where(runs.c.run_id == run_id).values(
                    outcome=outcome, error=error[:4000] if error else None, finished_at=now, duration_s=duration, **counters
                )
            )
            alias = conn.execute(sa.select(runs.c.alias).where(runs.c.run_id == run_id)).scalar()
        if alias is not None:
            from kb_reindex.services import metrics

            metrics.run_finished(alias=alias, outcome=outcome, duration_s=duration,
                                 embedded=counters.get("chunks_embedded", 0) or 0,
                                 reused=counters.get("chunks_reused", 0) or 0, total=counters.get("chunks_total", 0) or 0)

    def fail_orphaned_runs(self, alias: str, *, current: str, error: str | None = None) -> list[str]:
        """Runs of `alias` still `running` with a version, other than `current`: called under the alias's reindex
        lock, which a run holds from before it creates a version to its end, so none of them is working any more
        (its process died, or lost the state DB and could not record its end). Recorded as failed; their
        building versions are resumed by the next run whose plan matches. `error`: why, when not that (a
        retirement ends them)."""
        now = self.clock.now()
        error = error or (f"did not finish: its process ended without recording an outcome (stopped, or it lost the "
                          f"state DB); found by run {current}, which resumes its version if it plans the same")
        with self.engine.begin() as conn:
            orphaned = [row.run_id for row in conn.execute(sa.select(runs.c.run_id, runs.c.version).where(
                runs.c.alias == alias, runs.c.outcome == "running", runs.c.version.is_not(None),
                runs.c.run_id != current))]
            for run_id in orphaned:
                conn.execute(runs.update().where(runs.c.run_id == run_id, runs.c.outcome == "running").values(
                    outcome="failed", finished_at=now, error=error[:4000]))
        return orphaned

    def get_run(self, run_id: str) -> RunRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(runs).where(runs.c.run_id == run_id)).mappings().first()
        return RunRecord(**row) if row else None

    def list_runs(self, alias: str, *, limit: int = 50) -> list[RunRecord]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(runs).where(runs.c.alias == alias).order_by(runs.c.started_at.desc()).limit(limit)
            ).mappings().all()
        return [RunRecord(**row) for row in rows]
