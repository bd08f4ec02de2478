"""Whole runs for the CLI: the same step functions the DAG tasks call, chained in one process.

Every run is recorded (kind, outcome, counters, duration). A failure leaves the alias where it was;
the result says what failed and why.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypedDict

from kb_reindex.build import BuildCounts, build, create_version
from kb_reindex.errors import AliasFrozen, Failure, KbError, LockHeldError, classify
from kb_reindex.fence import Fence
from kb_reindex.freeze import FROZEN, frozen_view
from kb_reindex.locking import reindex_lock_name
from kb_reindex.plan import prepare_logged as make_plan
from kb_reindex.planning import Plan
from kb_reindex.promote import promote
from kb_reindex.replay import summary as replay_summary
from kb_reindex.retention import cleanup
from kb_reindex.rollback import RollbackResult, rollback
from kb_reindex.runtime import Deps, StateDeps, new_run_id
from kb_reindex.snapshot import snapshot_plan
from kb_reindex.state import default_lock_owner
from kb_reindex.store import describe_qdrant_failure
from kb_reindex.validate import validate
from kb_reindex.validation_model import ValidationResult

log = logging.getLogger(__name__)


@contextmanager
def exclusive(deps: Deps, *, run_id: str | None = None) -> Iterator[str]:
    """The alias's reindex lock, taken by every command that builds or changes state (run, migrate, reconcile,
    drop, gc, validate): waited for up to KB_LOCK_WAIT seconds, then refused by name. Not by a rollback: it
    needs only the short alias lock of the move, so a build of hours never delays it."""
    settings = deps.settings
    with deps.state.lock(reindex_lock_name(settings.alias), owner=default_lock_owner(run_id),
                         ttl_s=settings.lock_ttl_s, wait_s=settings.lock_wait_s) as owner:
        yield owner


def ensure_lock_held(deps: Deps, owner: str) -> None:
    """Before anything the readers see moves: a lock broken by on-call (or lost) stops this run here."""
    if not deps.state.holds_lock(reindex_lock_name(deps.settings.alias), owner=owner):
        raise LockHeldError(
            f"this run no longer holds the lock on {deps.settings.alias} (broken with `kb-reindex unlock`, or "
            "expired and taken); nothing was promoted"
        )


def empty_result(outcome: str = "failed") -> dict[str, Any]:
    return {
        "outcome": outcome,
        "version": None,
        "collection": None,
        "docs": {"added": 0, "changed": 0, "unchanged": 0, "removed": 0},
        "chunks": chunk_counts(None, BuildCounts()),
        "validation": None,
        "error": None,
        "error_kind": None,
    }


def chunk_counts(plan: Plan | dict[str, Any] | None, done: BuildCounts) -> dict[str, int]:
    """What this run did (`embedded`, `copied`, `skipped` as already written by an earlier attempt),
    beside what the plan expected (`planned_embed`, `planned_reuse`): a resumed or failed run differs."""
    planned = plan["chunks"] if plan else {"total": 0, "embedded": 0, "reused": 0}
    return {"total": planned["total"], "embedded": done.embedded, "copied": done.copied, "skipped": done.skipped,
            "planned_embed": planned["embedded"], "planned_reuse": planned["reused"]}


class BuiltCounters(TypedDict):
    """The run record's chunk columns, passed to `finish_run` as keywords."""

    chunks_embedded: int
    chunks_reused: int


def built_counters(done: BuildCounts) -> BuiltCounters:
    """The run record's chunk columns: `chunks_embedded` embedded and `chunks_reused` copied by this run."""
    return {"chunks_embedded": done.embedded, "chunks_reused": done.copied}


def no_change_counters(plan: Plan | dict[str, Any]) -> dict[str, Any]:
    """What a run that found nothing to build records, from the CLI and the DAG alike: no chunk was
    embedded or reused, because nothing was built."""
    return {"docs_unchanged": plan["docs"]["unchanged"], "chunks_total": plan["chunks"]["total"]}


def run_counters(plan: Plan | dict[str, Any]) -> dict[str, Any]:
    from datetime import UTC, datetime

    docs, chunks = plan["docs"], plan["chunks"]
    changed_at = plan.get("source_changed_at")
    return {
        "source_changed_at": datetime.fromtimestamp(changed_at, UTC).replace(tzinfo=None) if changed_at else None,
        "docs_added": docs["added"], "docs_changed": docs["changed"], "docs_unchanged": docs["unchanged"],
        "docs_removed": docs["removed"], "chunks_total": chunks["total"],
    }


def run_reindex(
    deps: Deps,
    *,
    force_full: bool = False,
    dry_run: bool = False,
    run_id: str | None = None,
    trigger: str = "cli",
    kind: str = "reindex",
    embedder: str | None = None,
    model: str | None = None,
    dim: int | None = None,
    promote_version: bool = True,
    min_hit_rate: float | None = None,
    min_mrr: float | None = None,
    layout: str | None = None,
) -> dict[str, Any]:
    """plan -> create version -> build -> validate -> promote -> cleanup, under the reindex lock."""
    alias = deps.settings.alias
    run_id = run_id or new_run_id(kind)
    result = empty_result()
    done = BuildCounts()
    deps.state.start_run(run_id=run_id, alias=alias, kind=kind, trigger=trigger)
    try:
        with exclusive(deps, run_id=run_id) as owner:
            deps.state.fail_orphaned_runs(alias, current=run_id)
            # the plan reads the files once and snapshots what the other steps need in the state DB
            prepared = make_plan(deps, force_full=force_full or kind == "migration", kind=kind,
                                 embedder=embedder, model=model, dim=dim, layout=layout, audit_run_id=run_id,
                                 record=True)
            p = prepared.plan
            result.update(docs=p["docs"], chunks=chunk_counts(p, done), plan=p, notes=p.get("notes", []))
            if p.get("audit"):
                result["audit"] = p["audit"]
            counters = run_counters(p)
            if p["no_change"]:
                result.update(outcome="no_change", version=p["base_version"], collection=p["base_collection"])
                deps.state.finish_run(run_id, outcome="no_change", version=p["base_version"], **no_change_counters(p))
                return result
            if dry_run:
                result["outcome"] = "dry_run"
                deps.state.finish_run(run_id, outcome="dry_run", **counters)
                return result
            result["plan"] = p = snapshot_plan(deps, prepared, run_id=run_id)
            # the snapshot holds what the next steps need: the scan (at 100k chunks, tens of MB) goes
            del prepared
            created = create_version(deps, p, run_id=run_id)
            result.update(version=created["version"], collection=created["collection"])
            deps.state.update_run(run_id, version=created["version"])
            fence = Fence(reindex_lock_name(alias), owner)
            built = build(deps, created["version"], run_id=run_id, counts=done, fence=fence)
            result["build"] = built.to_dict()
            result["chunks"] = chunk_counts(p, done)
            checked = validate(deps, created["version"], min_hit_rate=min_hit_rate, min_mrr=min_mrr)
            result["validation"] = validation_summary(checked)
            if promote_version:
                ensure_lock_held(deps, owner)
                try:
                    promoted = promote(deps, created["version"], run_id=run_id, fence=fence)
                    result["outcome"] = "promoted"
                    if promoted.get("lowered_thresholds"):  # said at promotion: later reindexes will fail
                        result["lowered_thresholds"] = promoted["lowered_thresholds"]
                except AliasFrozen as frozen:  # built and validated; kept ready until unfreeze
                    result.update(outcome=FROZEN, frozen=frozen_view(deps, frozen))
            else:
                result["outcome"] = "shadow"
            result["cleanup"] = cleanup(deps).to_dict()
    except Exception as exc:
        failure = failure_of(exc, deps)
        if not failure.expected:
            log.exception("kb_reindex: unexpected error")
        result.update(outcome="failed", error=failure.message, error_kind=failure.kind)
        if "plan" in result:
            result["chunks"] = chunk_counts(result["plan"], done)
        if failure.kind != "state_unreachable":
            _record_failure(deps, result, run_id, failure, done)
        log.error("kb_reindex: %s run %s failed: %s", kind, run_id, failure.message)
        return result
    deps.state.finish_run(run_id, outcome=result["outcome"], version=result["version"], **counters,
                          **built_counters(done))
    return result


def failure_of(exc: BaseException, deps: Deps | StateDeps) -> Failure:
    """errors.classify with this deployment's state DB and Qdrant server named."""
    store = getattr(deps, "store", None)
    return classify(exc, state_url=deps.settings.state_url,
                    qdrant=lambda e: describe_qdrant_failure(e, deps.settings, store.client if store else None))


def _record_failure(deps: Deps, result: dict[str, Any], run_id: str, failure: Failure, done: BuildCounts) -> None:
    """The failed run's record, and the version's validation if it got that far. A state DB lost meanwhile
    leaves the run `running`: the next run records it as failed (it takes over the dead process's lock)."""
    try:
        if result.get("version") is not None:
            v = deps.state.get_version(deps.settings.alias, result["version"])
            if v is not None and v.validation:
                result["validation"] = validation_summary(v.validation)
        deps.state.finish_run(run_id, outcome="failed", error=failure.message, version=result.get("version"),
                              **built_counters(done))
    except Exception as exc:  # reported in one line; the run's own failure is what is returned
        lost = failure_of(exc, deps)
        if lost.expected:
            log.error("kb_reindex: run %s could not be recorded as failed: %s", run_id, lost.message)
        else:
            raise


def validation_summary(result: dict[str, Any] | ValidationResult) -> dict[str, Any]:
    """What a run's JSON and the CLI carry of a validation: a fresh result, or a version's stored record."""
    return {
        "passed": result["passed"],
        "hit_rate": result["hit_rate"],
        "mrr": result["mrr"],
        "regressions": result["regressions"],
        "live_hit_rate": result.get("live_hit_rate"),
        "live_mrr": result.get("live_mrr"),
        "failures": result["failures"],
        "report": result.get("report"),
        "by_category": result.get("by_category"),
        "paired": result.get("paired"),
        "replay": replay_summary(result.get("replay")),
    }


def run_rollback(deps: Deps, *, reason: str, to_version: int | None = None, run_id: str | None = None,
                 trigger: str = "cli", revalidate: bool = True, action: str = "rollback",
                 expected_live: int | None = None) -> RollbackResult:
    """A recorded rollback (`rollback.rollback`): no reindex lock, so a build in flight never delays it."""
    alias = deps.settings.alias
    run_id = run_id or new_run_id("rollback")
    deps.state.start_run(run_id=run_id, alias=alias, kind="rollback", trigger=trigger)
    try:
        result = rollback(deps, reason=reason, to_version=to_version, run_id=run_id, revalidate=revalidate,
                          action=action, expected_live=expected_live)
    except KbError as exc:
        deps.state.finish_run(run_id, outcome="failed", error=str(exc))
        raise
    deps.state.finish_run(run_id, outcome="rolled_back", version=result.to_version)
    return result
