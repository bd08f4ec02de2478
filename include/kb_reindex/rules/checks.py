"""The structural checks of a version: its collection exists, its point count and IDs equal its manifest,
its dimension and distance match its record. Validation, rollback, reconcile and the page ask the same."""

from __future__ import annotations

import hashlib
import random
from typing import TYPE_CHECKING, Any, NamedTuple

from kb_reindex.services.layouts import describe_layout, payload_problems, payload_text
from kb_reindex.domain.model import VersionStatus
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.services.store import DISTANCE
from kb_reindex.domain.validation_model import Check

if TYPE_CHECKING:  # the types alone: importing a rule never imports Qdrant's client
    from kb_reindex.services.runtime import Deps, StepDeps
    from kb_reindex.services.state.ports import ShapeState

#: points whose payload and vector the structural check reads back (the count and IDs are checked in full)
SAMPLE_SIZE = 64
#: of a version built by difference: the points it wrote whose payload and vector are all read back (beyond
#: this many, a sample of this size), and the IDs it kept that are looked up besides the count
CHANGED_CHECKED = 1024
KEPT_LOOKED_UP = 1024


class Difference(NamedTuple):
    """A version built by difference (`by_difference`): the base its slot held exactly, the IDs it added and
    dropped, how many points it kept, and a sample of the kept IDs (by manifest position) to look up."""

    base: VersionRecord
    added: list[str]
    dropped: list[str]
    kept: int
    kept_sample: list[str]


def by_difference(deps: StepDeps[ShapeState], version: VersionRecord, size: int | None = None) -> Difference | None:
    """The `Difference` of a version being built in a slot that held its base exactly; None when it was built
    whole (or its base is gone). `size`: the version's manifest size, when the caller has it."""
    if version.slot_base is None or version.status not in (VersionStatus.BUILDING, VersionStatus.FAILED):
        return None
    base = deps.state.get_version(version.alias, version.slot_base)
    if base is None:
        return None
    added = [row.point_id for row in deps.state.added_chunks(version.id, base.id)]
    dropped = [row.point_id for row in deps.state.dropped_chunks(version.id, base.id)]
    size = deps.state.manifest_size(version.id) if size is None else size
    # seeded apart from the payload sample's positions (`structural_checks`), so the two look at other points
    positions = random.Random(f"kept:{version.version}").sample(range(size), min(KEPT_LOOKED_UP, size))
    return Difference(base, added, dropped, size - len(added), deps.state.kept_sample(version.id, base.id, positions))


def shape_checks(deps: StepDeps[ShapeState], version: VersionRecord, size: int, diff: Difference | None = None
                 ) -> tuple[list[Check], int | None]:
    """Exact count and IDs against the manifest (of `size` chunks), dimension and distance against the
    record: the one structural check, shared by validation and by rollback/reconcile (`structural_problems`).
    `diff`: the version's `by_difference`, when the caller has it (else found here).

    Returns the checks and the collection's point count (None when the collection is missing)."""
    checks: list[Check] = []

    def check(name: str, passed: bool, detail: str) -> None:
        checks.append(Check(name, bool(passed), detail))

    store = deps.store
    if not store.exists(version.collection):
        check("collection exists", False, f"{version.collection} is missing")
        return checks, None
    shape = store.shape(version.collection)
    check("point count", shape.points == size, f"{shape.points} points, manifest lists {size}")
    missing, extra, how = _id_differences(deps, version, size, points=shape.points,
                                          diff=diff if diff is not None else by_difference(deps, version, size))
    check("point ids", not missing and not extra,
          f"{len(missing)} missing, {len(extra)} unexpected" + (f" (e.g. {sorted(missing or extra)[0]})" if missing or extra else "")
          + how)
    check("dimension", shape.dim == version.embed_dim, f"{shape.dim}, expected {version.embed_dim}")
    check("distance", shape.distance == version.distance == DISTANCE.value, f"{shape.distance}, expected {version.distance}")
    return checks, shape.points


def _id_differences(deps: StepDeps[ShapeState], version: VersionRecord, size: int, *, points: int,
                    diff: Difference | None) -> tuple[set[str], set[str], str]:
    """IDs the collection lacks and holds beyond the manifest, and how that was found.

    A version built by difference in a slot that held its base exactly (checked when the base was validated):
    every point it added is looked up, every point it dropped must be gone, a sample of what it kept is looked
    up, and the count must equal the manifest's. The slot then holds exactly the manifest: it held the base,
    lost what was dropped and gained what was added; with as many points as the manifest, nothing else is
    there. Any doubt, or any other version: every ID is looked up (`id_differences`)."""
    store = deps.store
    if diff is not None and points == size:
        added, dropped = diff.added, diff.dropped
        looked = added + diff.kept_sample
        found: set[str] = set()
        for start in range(0, len(looked), 1024):
            found.update(str(r.id) for r in store.retrieve(version.collection, looked[start:start + 1024], payload=False))
        gone: set[str] = set()
        for start in range(0, len(dropped), 1024):
            gone.update(str(r.id) for r in store.retrieve(version.collection, dropped[start:start + 1024], payload=False))
        if found == set(looked) and not gone:
            return set(), set(), (f"; by difference from v{version.slot_base}: {len(added)} added and "
                                  f"{len(diff.kept_sample)} of {diff.kept} kept found, {len(dropped)} dropped gone")
    expected = [ref.point_id for ref in deps.state.iter_manifest_refs(version.id)]
    missing, extra = store.id_differences(version.collection, expected, points=points)
    return missing, extra, ""


def structural_problems(deps: StepDeps[ShapeState], version: VersionRecord) -> list[str]:
    """What makes a kept collection unfit to serve (empty when whole): the shape checks, without the
    golden set, for a rollback target or a live version the alias is pointed back at."""
    checks, _points = shape_checks(deps, version, deps.state.manifest_size(version.id))
    return [c.line for c in checks if not c.passed]


def structural_checks(deps: Deps, version: VersionRecord) -> list[Check]:
    """The shape checks, then a sample of points read back whole (payload, text against its hash, vector):
    chosen by manifest position, and every point this build wrote up to CHANGED_CHECKED."""
    size = deps.state.manifest_size(version.id)
    diff = by_difference(deps, version, size)  # read once: the IDs' check and the sample's
    checks, points = shape_checks(deps, version, size, diff)
    if points is None:
        return checks
    if version.status in (VersionStatus.BUILDING, VersionStatus.READY, VersionStatus.FAILED) and version.points_written != points:
        # mapped build slices only add up what each wrote; this is the count
        deps.state.update_version(version.id, points_written=points)

    store = deps.store
    sample = deps.state.manifest_at(version.id, random.Random(version.version).sample(range(size), min(SAMPLE_SIZE, size)))
    written: set[str] = set()
    if diff is not None:  # what this build wrote: read back in full (a sample beyond CHANGED_CHECKED)
        added = diff.added
        written = set(random.Random(version.version).sample(added, min(CHANGED_CHECKED, len(added))))
        have = {row.point_id for row in sample}
        missing_rows = sorted(written - have)
        for start in range(0, len(missing_rows), 1024):
            sample += deps.state.manifest_chunks(version.id, point_ids=missing_rows[start:start + 1024])
    records: dict[str, Any] = {}
    for start in range(0, len(sample), 1024):
        records.update({str(r.id): r for r in store.retrieve(version.collection,
                                                             [row.point_id for row in sample[start:start + 1024]],
                                                             vectors=True)})
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
        # `version` is the version that wrote the point: this one for what it wrote, another for a point its
        # slot kept (an earlier one; a later one in a restored version)
        wrote = payload["version"] == version.version or (
            row.point_id not in written and isinstance(payload["version"], int) and version.slot_base is not None)
        if (payload["knowledge_key"], payload["chunk_index"], payload["embed_model"]) != (
            row.knowledge_key, row.chunk_index, version.embed_model
        ) or not wrote:
            problems.append(f"{row.point_id}: payload key/index/version/model disagree with the manifest")
        if record.vector is None or len(record.vector) != version.embed_dim:
            problems.append(f"{row.point_id}: vector missing or of the wrong size")
    checks.append(Check("payload sample", not problems,
                        f"{len(sample)} sampled" + (f" ({len(written)} of those written by this build)" if written else "")
                        + (f"; {problems[0]}" if problems else ", all well-formed")))
    if all(c.passed for c in checks):  # its slot now holds exactly this version: the next build's base
        deps.state.mark_slot_exact(version_id=version.id, collection=version.collection)
        if version.status == VersionStatus.BUILDING:
            # as a full audit: once promoted, the next run's audit of live samples instead of looking up every ID
            deps.state.record_audit(alias=version.alias, version=version.version, collection=version.collection,
                                    run_id=version.run_id, expected=size, points=points, missing=0,
                                    orphans=0)
    return checks
