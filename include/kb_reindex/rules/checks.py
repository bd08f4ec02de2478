"""The structural checks of a version: its collection exists, its point count and IDs equal its manifest,
its dimension and distance match its record. Validation, rollback, reconcile and the page ask the same."""

from __future__ import annotations

import hashlib
import random
from kb_reindex.services.layouts import describe_layout, payload_problems, payload_text
from kb_reindex.domain.model import VersionStatus
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.manifests import ManifestRef
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.services.store import DISTANCE
from kb_reindex.domain.validation_model import Check

#: points whose payload and vector the structural check reads back (the count and IDs are checked in full)
SAMPLE_SIZE = 64


def shape_checks(deps: Deps, version: VersionRecord, manifest: list[ManifestRef]) -> tuple[list[Check], int | None]:
    """Exact count and IDs against the manifest, dimension and distance against the record: the one
    structural check, shared by validation and by rollback/reconcile (`structural_problems`).

    Returns the checks and the collection's point count (None when the collection is missing)."""
    checks: list[Check] = []

    def check(name: str, passed: bool, detail: str) -> None:
        checks.append(Check(name, bool(passed), detail))

    store = deps.store
    if not store.exists(version.collection):
        check("collection exists", False, f"{version.collection} is missing")
        return checks, None
    shape = store.shape(version.collection)
    check("point count", shape.points == len(manifest), f"{shape.points} points, manifest lists {len(manifest)}")
    missing, extra = store.id_differences(version.collection, [row.point_id for row in manifest], points=shape.points)
    check("point ids", not missing and not extra,
          f"{len(missing)} missing, {len(extra)} unexpected" + (f" (e.g. {sorted(missing or extra)[0]})" if missing or extra else ""))
    check("dimension", shape.dim == version.embed_dim, f"{shape.dim}, expected {version.embed_dim}")
    check("distance", shape.distance == version.distance == DISTANCE.value, f"{shape.distance}, expected {version.distance}")
    return checks, shape.points


def structural_problems(deps: Deps, version: VersionRecord) -> list[str]:
    """What makes a kept collection unfit to serve (empty when whole): the shape checks, without the
    golden set, for a rollback target or a live version the alias is pointed back at."""
    checks, _points = shape_checks(deps, version, deps.state.manifest_refs(version.id))
    return [c.line for c in checks if not c.passed]


def structural_checks(deps: Deps, version: VersionRecord, manifest: list[ManifestRef]) -> list[Check]:
    checks, points = shape_checks(deps, version, manifest)
    if points is None:
        return checks
    if version.status in (VersionStatus.BUILDING, VersionStatus.READY, VersionStatus.FAILED) and version.points_written != points:
        # mapped build slices only add up what each wrote; this is the count
        deps.state.update_version(version.id, points_written=points)

    store = deps.store
    picked = random.Random(version.version).sample(manifest, min(SAMPLE_SIZE, len(manifest)))
    sample = deps.state.manifest_chunks(version.id, point_ids=[row.point_id for row in picked]) if picked else []
    records = {str(r.id): r for r in store.retrieve(version.collection, [row.point_id for row in sample], vectors=True)} if sample else {}
    problems: list[str] = []
    for row in sample:
        record = records.get(row.point_id)
        if record is None:
            problems.append(f"{row.point_id}: not found")
            continue
        payload = record.payload or {}
        # every layout keeps the engine's fields flat; the text and the consumer's fields are the layout's
        malformed = payload_problems(payload, version.payload_layout)
        if malformed:
            problems.append(f"{row.point_id}: {'; '.join(malformed)} ({describe_layout(version.payload_layout)} layout)")
            continue
        if hashlib.sha256(str(payload_text(payload, version.payload_layout)).encode("utf-8")).hexdigest() != row.chunk_hash:
            problems.append(f"{row.point_id}: text does not match its chunk hash")
        if (payload["knowledge_key"], payload["chunk_index"], payload["version"], payload["embed_model"]) != (
            row.knowledge_key, row.chunk_index, version.version, version.embed_model
        ):
            problems.append(f"{row.point_id}: payload key/index/version/model disagree with the manifest")
        if record.vector is None or len(record.vector) != version.embed_dim:
            problems.append(f"{row.point_id}: vector missing or of the wrong size")
    checks.append(Check("payload sample", not problems,
                        f"{len(sample)} sampled" + (f"; {problems[0]}" if problems else ", all well-formed")))
    return checks
