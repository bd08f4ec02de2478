"""Whole runs for the CLI: the same step functions the DAG tasks call, chained in one process.

Every run is recorded (kind, outcome, counters, duration). A failure leaves the alias where it was;
the result says what failed and why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypedDict

from kb_reindex import querylog
from kb_reindex.alias import drift_advice, has_served, rollback_target
from kb_reindex.build import BuildCounts, build, create_version
from kb_reindex.errors import AliasFrozen, Failure, KbError, LockHeldError, classify
from kb_reindex.fence import Fence
from kb_reindex.freeze import FROZEN, freeze_view, frozen_view
from kb_reindex.layouts import version_profile
from kb_reindex.locking import reindex_lock_name
from kb_reindex.plan import prepare_logged as make_plan
from kb_reindex.promote import promote
from kb_reindex.replay import summary as replay_summary
from kb_reindex.retention import cleanup
from kb_reindex.rollback import RollbackResult, rollback
from kb_reindex.runtime import Deps, StateDeps, new_run_id
from kb_reindex.snapshot import snapshot_plan
from kb_reindex.state import VersionRecord, default_lock_owner
from kb_reindex.store import describe_qdrant_failure
from kb_reindex.validate import validate

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


def chunk_counts(plan: dict[str, Any] | None, done: BuildCounts) -> dict[str, int]:
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


def no_change_counters(plan: dict[str, Any]) -> dict[str, Any]:
    """What a run that found nothing to build records, from the CLI and the DAG alike: no chunk was
    embedded or reused, because nothing was built."""
    return {"docs_unchanged": plan["docs"]["unchanged"], "chunks_total": plan["chunks"]["total"]}


def run_counters(plan: dict[str, Any]) -> dict[str, Any]:
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
            p.update(snapshot_plan(deps, prepared, run_id=run_id))
            # the snapshot holds what the next steps need: the scan (at 100k chunks, tens of MB) goes
            del prepared
            created = create_version(deps, p, run_id=run_id)
            result.update(version=created["version"], collection=created["collection"])
            deps.state.update_run(run_id, version=created["version"])
            fence = Fence(reindex_lock_name(alias), owner)
            built = build(deps, created["version"], run_id=run_id, counts=done, fence=fence)
            result["build"] = built
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


def validation_summary(result: dict[str, Any]) -> dict[str, Any]:
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


def _consistent_view(deps: Deps, *, attempts: int = 6, pause_s: float = 0.25) -> tuple[VersionRecord | None, str | None, bool]:
    """(live in the state DB, collection behind the alias, promotion in progress).

    A promotion moves the alias, then writes the state, under the alias lock: read half-way, the two
    disagree for a moment. Both are read, then the state again; a disagreement while the alias lock is
    held by a live process is re-read a few times and, if it lasts, reported as a promotion in progress."""
    from kb_reindex.locking import alias_lock_name

    alias = deps.settings.alias
    live, serving, moving = None, None, False
    for attempt in range(attempts):
        live = deps.state.live_version(alias)
        serving = deps.store.alias_target(alias)
        again = deps.state.live_version(alias)
        stable = (live.id if live else None) == (again.id if again else None)
        live = again
        if stable and serving == (live.collection if live else None):
            return live, serving, False
        holder = next((row for row in deps.state.list_locks(subject=alias)
                       if row["name"] == alias_lock_name(alias) and not row["expired"]), None)
        moving = not stable or (holder is not None and row_alive(holder))
        if not moving:
            return live, serving, False
        if attempt < attempts - 1:
            time.sleep(pause_s)
    return live, serving, moving


def row_alive(row: dict[str, Any]) -> bool:
    """A lock row whose owner may still be working: alive here, or on another host within its TTL."""
    return row["owner_alive"] is not False


def lock_view(deps: Deps) -> list[dict[str, Any]]:
    """Held locks for status and the page; a DAG run's is alive while Airflow runs it (where it can be asked),
    else while its tasks renew it (no PID to ask)."""
    from kb_reindex.state import is_dag_run_owner

    return [
        {"name": row["name"], "owner": row["owner"], "since": row["acquired_at"].isoformat(timespec="seconds") + "Z",
         "expires": row["expires_at"].isoformat(timespec="seconds") + "Z", "expired": row["expired"],
         "owner_alive": ("DAG run: alive while its tasks renew the lock"
                         if is_dag_run_owner(row["owner"]) and row["owner_alive"] is None
                         else {True: "yes", False: "no", None: "unknown (another host)"}[row["owner_alive"]])}
        for row in deps.state.list_locks(subject=deps.settings.alias)
    ]


def status(deps: Deps) -> dict[str, Any]:
    """What serves now, every version, held locks, and whether Qdrant agrees with the state DB."""
    alias = deps.settings.alias
    store = deps.store
    live, serving, promotion_in_progress = _consistent_view(deps)
    target = rollback_target(deps) if live else None
    collections = store.collection_names()
    pins = deps.state.active_pins(alias)
    versions = []
    for record in deps.state.list_versions(alias):
        exists = record.collection in collections and record.status != "deleted"
        versions.append(version_row(
            record, target=target, pins=pins, serving=serving,
            points=store.count(record.collection) if exists else None,
            collection_config=store.collection_metadata(record.collection).get("collection_config") if exists else None))
    problems, notes = [], []
    if serving != (live.collection if live else None):
        if promotion_in_progress:
            notes.append(f"promotion in progress: alias {alias} is moving to {serving or 'nothing'}; "
                         "run `kb-reindex status` again in a moment")
        else:
            problems.append(drift_advice(deps, serving, live))
    for v in versions:
        if v["status"] not in ("live", "ready", "retired"):
            continue
        if v["points"] is None:
            problems.append(f"v{v['version']} ({v['collection']}) is {v['status']} in the state DB, but Qdrant has no "
                            "such collection (dropped by hand, or by kb-reindex working with another state DB): "
                            + ("rebuild with `kb-reindex run --force-full`" if v["status"] == "live" else
                               f"`kb-reindex drop --version {v['version']}` records it as deleted"))
        elif v["points"] != v["points_expected"]:
            problems.append(f"v{v['version']} ({v['collection']}) holds {v['points']} points, manifest lists "
                            f"{v['points_expected']}")
    audit = live_audit(deps, live)
    if audit and (audit["missing"] or audit["orphans"]):
        problems.append(f"the audit of live v{audit['version']} at {audit['at']} found {audit['missing']} missing "
                        f"({audit['missing_ratio']:.2%}) and {audit['orphans']} orphan point(s) ({audit['orphan_ratio']:.2%}) "
                        "against its manifest")
    locks = lock_view(deps)
    for held in locks:
        if held["owner_alive"] == "no" and not held["expired"]:
            notes.append(f"lock {held['name']} is held by {held['owner']}, whose process is gone: the next command "
                         "takes it over")
    live_info = None
    if live is not None:
        row = next(v for v in versions if v["version"] == live.version)
        live_info = {k: row[k] for k in ("version", "collection", "points", "embed_model", "dim", "embedder",
                                         "payload_layout", "embed_profile")}
    return {
        "alias": alias,
        "serving_collection": serving,
        "live": live_info,
        "rollback_target": target.version if target else None,
        "freeze": freeze_view(deps),
        "pinned": sorted(pins),
        "audit": audit,
        "versions": versions,
        "locks": locks,
        "problems": problems,
        "notes": notes,
        "metrics": metrics(deps),
        "query_log": querylog.summary(deps),
    }


def version_row(v: VersionRecord, *, target: VersionRecord | None, pins: dict[int, dict[str, Any]],
                serving: str | None, points: int | None, collection_config: Any) -> dict[str, Any]:
    """One version as status and the page show it; `points` and `collection_config` are Qdrant's (None when
    its collection is missing, or when Qdrant could not be read)."""
    return {
        "version": v.version, "collection": v.collection, "status": v.status, "kind": v.kind,
        "points": points, "points_expected": v.points_expected, "points_written": v.points_written,
        "embedder": v.embedder, "embed_model": v.embed_model, "dim": v.embed_dim,
        "payload_layout": v.payload_layout, "embed_profile": version_profile(v),
        "hit_rate": (v.validation or {}).get("hit_rate"), "mrr": (v.validation or {}).get("mrr"),
        "created_at": v.created_at.isoformat(timespec="seconds") + "Z",
        "promoted_at": v.promoted_at.isoformat(timespec="seconds") + "Z" if v.promoted_at else None,
        "rollback_target": bool(target and target.id == v.id),
        # where a rollback may go (served before, kept), and a shadow that only a promotion may put live
        "rollback_allowed": v.status in ("retired", "ready") and has_served(v),
        "shadow": v.status == "ready" and not has_served(v),
        "serving": v.collection == serving,
        "error": v.error,
        "run_id": v.run_id,
        # the settings it was created with (collection metadata); None for a dropped or older collection
        "collection_config": collection_config,
        "snapshot": (v.validation or {}).get("snapshot"),
        **pin_view(pins.get(v.version)),
    }


def pin_view(pin: dict[str, Any] | None) -> dict[str, Any]:
    """A version's pin as status and the page show it."""
    if pin is None:
        return {"pinned": False, "pin": None}
    return {"pinned": True, "pin": {"reason": pin["reason"], "by": pin["pinned_by"],
                                    "at": pin["pinned_at"].isoformat(timespec="seconds") + "Z"}}


def live_audit(deps: Deps, live: VersionRecord | None) -> dict[str, Any] | None:
    """The newest audit of the version live now (an audit of an earlier live version is history)."""
    from kb_reindex.audit import audit_view

    found = audit_view(deps.state.last_audit(deps.settings.alias))
    if found is None or live is None or found["version"] != live.version:
        return None
    return found


def metrics(deps: Deps) -> dict[str, Any]:
    runs = [r for r in deps.state.list_runs(deps.settings.alias, limit=200) if r["kind"] in ("reindex", "migration")]
    finished = [r for r in runs if r["outcome"] not in ("running",)]
    succeeded = [r for r in finished if r["outcome"] in ("promoted", "no_change", "dry_run", "shadow", FROZEN)]
    changed = [r for r in finished if r["outcome"] == "promoted"]
    last = changed[0] if changed else None
    total = (last["chunks_embedded"] + last["chunks_reused"]) if last else 0
    ready = deps.state.list_versions(deps.settings.alias, statuses=["ready"])
    from kb_reindex.state import utcnow

    newest_ready = max((v.ready_at or v.updated_at for v in ready), default=None)
    latency = None
    if last and last["source_changed_at"] and last["finished_at"]:
        latency = round((last["finished_at"] - last["source_changed_at"]).total_seconds(), 3)
    return {
        "runs": len(finished),
        "run_success_rate": round(len(succeeded) / len(finished), 4) if finished else None,
        "last_run_duration_s": round(finished[0]["duration_s"], 3) if finished and finished[0]["duration_s"] is not None else None,
        "last_changed_chunks": last["chunks_embedded"] if last else None,
        "last_embedding_reuse_rate": round(last["chunks_reused"] / total, 4) if last and total else None,
        "failed_runs": sum(1 for r in finished if r["outcome"] == "failed"),
        "alias_switch_failures": sum(1 for r in finished if r["error"] and "alias moved" in r["error"]),
        "embedding_failures": sum(1 for r in finished if r["error"] and ("Ollama" in r["error"] or "embedder" in r["error"])),
        "ready_unpromoted_age_s": round((utcnow() - newest_ready).total_seconds(), 1) if newest_ready else None,
        "last_source_to_searchable_s": latency,
    }


def history(deps: Deps | StateDeps) -> list[dict[str, Any]]:
    """Every alias move, every lock broken by on-call or taken over from a dead process, and every freeze
    and unfreeze, in time order."""
    from kb_reindex.locking import alias_lock_name

    alias = deps.settings.alias
    moves = [
        {"at": e["at"], "action": e["action"], "from_version": e["from_version"],
         "to_version": e["to_version"], "from_collection": e["from_collection"], "to_collection": e["to_collection"],
         "run_id": e["run_id"], "reason": e["reason"]}
        for e in deps.state.alias_events(alias)
    ]
    locks = [
        {"at": e["at"], "action": "unlock" if e["action"] == "unlock" else "lock-takeover", "from_version": None,
         "to_version": None, "from_collection": None, "to_collection": None, "run_id": None,
         "reason": f"{e['name']} held by {e['owner']}, broken by {e['by']}: {e['reason']}"}
        for e in deps.state.lock_events(names=[reindex_lock_name(alias), alias_lock_name(alias)])
    ]
    freezes = [
        {"at": e["at"], "action": e["action"], "from_version": None, "to_version": None, "from_collection": None,
         "to_collection": None, "run_id": None, "reason": f"by {e['by']}: {e['reason']}"}
        for e in deps.state.freeze_events(alias)
    ]
    events = sorted(moves + locks + freezes, key=lambda e: e["at"])
    return [{**e, "at": e["at"].isoformat(timespec="seconds") + "Z"} for e in events]
