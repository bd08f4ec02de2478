"""The audit of live against its manifest, taken by every run before it plans.

A point deleted by hand, or one written by something else, is found here rather than by a customer.
IDs only: the manifest's point IDs are looked up in Qdrant in batches without vectors or payloads, and
the orphans (points the manifest does not list) follow from the exact count, as every ID found is one
of the collection's and IDs are unique. Nothing is scrolled, so a healthy collection costs a lookup per
1,024 points.

Not every run looks up every ID (at 100k points that is a second per run). In full when anything changed
since the last full audit of live (the collection, its point count, the manifest), when that audit found a
problem, or when it is older than FULL_AFTER; otherwise SAMPLE random manifest IDs plus the exact count. A
deletion changes the count (full audit at the next run); a deletion hidden by as many extra points is found
by the samples (each run checks SAMPLE / points of the IDs anew), at the latest by the daily full audit.
A sample that misses an ID turns into a full audit at once. Only full audits are recorded.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from kb_reindex.domain.planning import AuditMode, AuditResult
from kb_reindex.services.state.history import AuditRecord
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.services.state.clock import utc_stamp

if TYPE_CHECKING:  # the types alone: importing a rule never imports Qdrant's client
    from kb_reindex.services.runtime import Deps

log = logging.getLogger(__name__)

BATCH = 1024
#: manifest IDs looked up by a sampled audit
SAMPLE = 1024
#: the longest a full audit of an unchanged live collection is put off
FULL_AFTER = timedelta(hours=24)


@dataclass(frozen=True)
class AuditDecision:
    mode: AuditMode
    reason: str


@dataclass(frozen=True)
class AuditView:
    """The newest recorded audit as `status` shows it (`audit_view`)."""

    version: int
    collection: str
    run_id: str | None
    at: str
    expected: int
    points: int
    missing: int
    orphans: int
    missing_ratio: float
    orphan_ratio: float


def audit_decision(last: AuditRecord | None, live: VersionRecord, *, points: int, now: datetime,
                   full_after: timedelta = FULL_AFTER) -> AuditDecision:
    """Full or sampled, and why, from the last recorded (full) audit and live's point count now."""
    full = AuditMode.FULL
    if last is None or last.collection != live.collection or last.version != live.version:
        return AuditDecision(full, "no full audit of this live collection yet")
    if last.missing or last.orphans:
        return AuditDecision(full, f"the last audit found {last.missing} missing and {last.orphans} orphan(s)")
    if last.points != points:
        return AuditDecision(full, f"the point count changed since the last audit ({last.points} -> {points})")
    if last.expected != live.points_expected:
        return AuditDecision(full, f"the manifest changed since the last audit ({last.expected} -> "
                                   f"{live.points_expected} points)")
    if now - last.at >= full_after:
        return AuditDecision(full, f"the last full audit is older than {full_after.total_seconds() / 3600:g} h")
    return AuditDecision(AuditMode.SAMPLE, f"unchanged since the full audit at {last.at:%Y-%m-%d %H:%M:%S} UTC")


def audit_version(deps: Deps, version: VersionRecord) -> AuditResult:
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
    return AuditResult(
        version=version.version, collection=version.collection, expected=len(expected), points=points,
        missing=missing, orphans=orphans, missing_ratio=round(missing / len(expected), 6) if expected else 0.0,
        orphan_ratio=round(orphans / points, 6) if points else 0.0, mode=AuditMode.FULL,
    )


def sample_missing(deps: Deps, live: VersionRecord, *, size: int, rng: random.Random) -> tuple[int, int]:
    """(IDs looked up, IDs not found) for `size` random IDs of live's manifest."""
    total = deps.state.manifest_size(live.id)
    picked = [row.point_id for row in deps.state.manifest_at(live.id, rng.sample(range(total), min(size, total)))]
    found = len(deps.store.retrieve(live.collection, picked, payload=False)) if picked else 0
    return len(picked), len(picked) - found


def audit_live(deps: Deps, live: VersionRecord, *, run_id: str | None, sample: int = SAMPLE,
               rng: random.Random | None = None) -> AuditResult:
    """Audit live, in full or by a sample (`audit_decision`); a full audit is recorded in the state DB
    (`kb-reindex status` shows the newest)."""
    store = deps.store
    points = store.count(live.collection) if store.exists(live.collection) else 0
    decision = audit_decision(deps.state.last_audit(deps.settings.alias), live, points=points,
                              now=deps.state.clock.now())
    if decision.mode is AuditMode.SAMPLE:
        looked_up, missing = sample_missing(deps, live, size=sample, rng=rng or random.Random())
        if not missing:
            log.info("kb_reindex: audit of live v%d (%s): %d points, %s; %d random manifest IDs all found",
                     live.version, live.collection, points, decision.reason, looked_up)
            return AuditResult(version=live.version, collection=live.collection, expected=live.points_expected,
                               points=points, missing=0, orphans=0, missing_ratio=0.0, orphan_ratio=0.0,
                               mode=AuditMode.SAMPLE, sampled=looked_up)
        decision = AuditDecision(AuditMode.FULL, f"{missing} of {looked_up} sampled manifest IDs are missing")
    log.info("kb_reindex: full audit of live v%d: %s", live.version, decision.reason)
    found = audit_version(deps, live)
    deps.state.record_audit(alias=deps.settings.alias, version=live.version, collection=live.collection,
                            run_id=run_id, expected=found.expected, points=found.points,
                            missing=found.missing, orphans=found.orphans)
    level = logging.WARNING if found.missing or found.orphans else logging.INFO
    log.log(level, "kb_reindex: audit of live v%d (%s): %d points, manifest lists %d; %d missing, %d orphan(s)",
            live.version, live.collection, found.points, found.expected, found.missing, found.orphans)
    return found


def audit_view(row: AuditRecord | None) -> AuditView | None:
    """The newest recorded audit as `status` shows it."""
    if row is None:
        return None
    return AuditView(
        version=row.version, collection=row.collection, run_id=row.run_id,
        at=utc_stamp(row.at), expected=row.expected, points=row.points,
        missing=row.missing, orphans=row.orphans,
        missing_ratio=round(row.missing / row.expected, 6) if row.expected else 0.0,
        orphan_ratio=round(row.orphans / row.points, 6) if row.points else 0.0,
    )
