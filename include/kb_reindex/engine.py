"""The status views (what serves, versions, locks, metrics, history), and the names the CLI, the benchmarks
and the tests have always called for whole runs: a run is `kb_reindex.pipeline`'s step sequence, recorded by
`kb_reindex.runs`.
"""

from __future__ import annotations

import time
from typing import Any

from kb_reindex import querylog
from kb_reindex.alias import drift_advice, has_served, rollback_target
from kb_reindex.freeze import FROZEN, freeze_view
from kb_reindex.layouts import version_profile
from kb_reindex.locking import reindex_lock_name
from kb_reindex.pipeline import RunResult, chunk_counts, empty_result, run_reindex, validation_summary
from kb_reindex.runs import exclusive, failure_of, run_rollback
from kb_reindex.runtime import Deps, StateDeps
from kb_reindex.state import VersionRecord

__all__ = ["RunResult", "chunk_counts", "empty_result", "exclusive", "failure_of", "history", "lock_view",
           "metrics", "run_reindex", "run_rollback", "status", "validation_summary", "version_row"]


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
