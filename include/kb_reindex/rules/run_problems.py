"""What on-call should read first about an alias's runs: the newest one failed or was held, so what serves is
no longer fresh. Read from the state DB alone, by `status`, `bases` and the page's list (which must not need
Qdrant's client to say it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kb_reindex.domain.model import RunOutcome, VersionStatus
from kb_reindex.services.state.clock import utc_stamp

if TYPE_CHECKING:
    from kb_reindex.services.state.store import StateStore

#: alias events by which on-call repairs the state a failed run met
REPAIRS = frozenset({"rebuild-state", "reconcile"})


def last_run_problem(state: StateStore, alias: str) -> str | None:
    """The newest run of `alias`, when it failed: which run, at which step and why. A failed run leaves the
    alias where it was, so nothing else in the status would say that the knowledge is no longer fresh."""
    # the run that ended last: one refused at start while another ran ends before that other does
    ended = [r for r in state.list_runs(alias, limit=10) if r.finished_at is not None]
    if not ended:
        return None
    run = max(ended, key=lambda r: r.finished_at or r.started_at)
    if run.outcome == RunOutcome.HELD:  # its reason names what went and what to do, until someone answered it
        held = state.get_version(alias, run.version) if run.version is not None else None
        if held is not None and held.status != VersionStatus.READY:  # promoted anyway, or kept off (keep-live)
            return None
        return f"the last {run.kind} run ({run.run_id}) held: {run.error}"
    if run.outcome != RunOutcome.FAILED:
        return None
    repaired = [e for e in state.alias_events(alias) if e.action in REPAIRS and e.at >= (run.finished_at or run.started_at)]
    if repaired:  # on-call repaired what made it fail (the state DB rebuilt, reconciled): the next run says more
        return None
    record = state.get_version(alias, run.version) if run.version is not None else None
    step = record.failed_step if record is not None and record.failed_step else None
    # every line: a refusal's first line says how many, the lines after it which document and why
    why = "; ".join(line.strip() for line in (run.error or "no error recorded").splitlines() if line.strip())
    why = why.replace(":; ", ": ")[:600]
    return (f"the last {run.kind} run failed{f' at {step}' if step else ''} ({run.run_id}, started "
            f"{utc_stamp(run.started_at)}): {why}; the alias still serves what it served before it")
