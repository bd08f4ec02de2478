"""The audit of live against its manifest, taken by every run before it plans.

A point deleted by hand, or one written by something else, is found here rather than by a customer.
IDs only: the manifest's point IDs are looked up in Qdrant in batches without vectors or payloads, and
the orphans (points the manifest does not list) follow from the exact count, as every ID found is one
of the collection's and IDs are unique. Nothing is scrolled, so a healthy collection costs a lookup per
1,024 points.
"""

from __future__ import annotations

import logging
from typing import Any

from kb_reindex.runtime import Deps
from kb_reindex.state import VersionRecord

log = logging.getLogger(__name__)

BATCH = 1024


def audit_version(deps: Deps, version: VersionRecord) -> dict[str, Any]:
    """Counts and ratios of missing and orphan points of `version`'s collection against its manifest."""
    store = deps.store
    expected = [ref.point_id for ref in deps.state.iter_manifest_refs(version.id)]
    exists = store.exists(version.collection)
    points = store.count(version.collection) if exists else 0
    found = 0
    if exists:
        for start in range(0, len(expected), BATCH):
            found += len(store.retrieve(version.collection, expected[start:start + BATCH], payload=False))
    missing = len(expected) - found
    orphans = max(points - found, 0)
    return {
        "version": version.version, "collection": version.collection, "expected": len(expected),
        "points": points, "missing": missing, "orphans": orphans,
        "missing_ratio": round(missing / len(expected), 6) if expected else 0.0,
        "orphan_ratio": round(orphans / points, 6) if points else 0.0,
    }


def audit_live(deps: Deps, live: VersionRecord, *, run_id: str | None) -> dict[str, Any]:
    """Audit live and record it in the state DB (`kb-reindex status` shows the newest)."""
    found = audit_version(deps, live)
    deps.state.record_audit(alias=deps.settings.alias, version=live.version, collection=live.collection,
                            run_id=run_id, expected=found["expected"], points=found["points"],
                            missing=found["missing"], orphans=found["orphans"])
    level = logging.WARNING if found["missing"] or found["orphans"] else logging.INFO
    log.log(level, "kb_reindex: audit of live v%d (%s): %d points, manifest lists %d; %d missing, %d orphan(s)",
            live.version, live.collection, found["points"], found["expected"], found["missing"], found["orphans"])
    return found


def audit_view(row: dict[str, Any] | None) -> dict[str, Any] | None:
    """The newest recorded audit as `status` shows it."""
    if row is None:
        return None
    return {
        "version": row["version"], "collection": row["collection"], "run_id": row["run_id"],
        "at": row["at"].isoformat(timespec="seconds") + "Z", "expected": row["expected"], "points": row["points"],
        "missing": row["missing"], "orphans": row["orphans"],
        "missing_ratio": round(row["missing"] / row["expected"], 6) if row["expected"] else 0.0,
        "orphan_ratio": round(row["orphans"] / row["points"], 6) if row["points"] else 0.0,
    }
