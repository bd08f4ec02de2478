"""The plan and the build as typed values: what the plan step decided, which version creating it made,
and what filling that version did.

They are frozen dataclasses. A dict appears only where JSON or XCom carries one: `to_dict()` gives the keys
`kb-reindex plan --json` prints and the DAG tasks hand each other (unchanged from when these were dicts),
`from_dict()` reads them back (tolerating a plan written before a key existed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from kb_reindex.domain.model import RunKind
from kb_reindex.domain.validation_model import ContentWarning

#: how many document keys of each kind a plan names (the counts are always whole)
DOC_KEYS_SHOWN = 50


@dataclass(frozen=True)
class DocCounts:
    """Documents against live's manifest: added, changed (another content hash), unchanged, removed."""

    added: int = 0
    changed: int = 0
    unchanged: int = 0
    removed: int = 0

    @property
    def current(self) -> int:
        """The documents of the corpus as it is now (removed ones are not)."""
        return self.added + self.changed + self.unchanged

    def to_dict(self) -> dict[str, int]:
        return {"added": self.added, "changed": self.changed, "unchanged": self.unchanged, "removed": self.removed}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DocCounts:
        return cls(added=int(data["added"]), changed=int(data["changed"]), unchanged=int(data["unchanged"]),
                   removed=int(data["removed"]))


@dataclass(frozen=True)
class DocKeys:
    """The first `DOC_KEYS_SHOWN` knowledge keys added, changed and removed (for the operator to read)."""

    added: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    @classmethod
    def first(cls, *, added: Iterable[str], changed: Iterable[str], removed: Iterable[str]) -> DocKeys:
        return cls(added=tuple(added)[:DOC_KEYS_SHOWN], changed=tuple(changed)[:DOC_KEYS_SHOWN],
                   removed=tuple(removed)[:DOC_KEYS_SHOWN])

    def to_dict(self) -> dict[str, list[str]]:
        return {"added": list(self.added), "changed": list(self.changed), "removed": list(self.removed)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DocKeys:
        return cls(added=tuple(data["added"]), changed=tuple(data["changed"]), removed=tuple(data["removed"]))


@dataclass(frozen=True)
class DocChanges:
    """What a version's plan added, changed and removed against the version it was planned on (its base):
    the counts, and the first `DOC_KEYS_SHOWN` keys of each. Recorded with the version; the page lists it."""

    docs: DocCounts
    doc_keys: DocKeys

    def to_dict(self) -> dict[str, Any]:
        return {"docs": self.docs.to_dict(), "doc_keys": self.doc_keys.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DocChanges:
        return cls(docs=DocCounts.from_dict(data["docs"]), doc_keys=DocKeys.from_dict(data["doc_keys"]))


@dataclass(frozen=True)
class ChunkCounts:
    """The chunks of the corpus: `embedded` are to be embedded, `reused` have their vector copied from live."""

    total: int = 0
    embedded: int = 0
    reused: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"total": self.total, "embedded": self.embedded, "reused": self.reused}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ChunkCounts:
        return cls(total=int(data["total"]), embedded=int(data["embedded"]), reused=int(data["reused"]))


class AuditMode(StrEnum):
    """How live was audited: every manifest ID looked up, or a random sample of them (`kb_reindex.rules.audit`)."""

    FULL = "full"
    SAMPLE = "sample"


@dataclass(frozen=True)
class AuditResult:
    """An audit of a version's collection against its manifest (`kb_reindex.rules.audit`): points `missing` (listed,
    not found) and `orphans` (found, not listed), and their share of the manifest and of the collection.
    `sampled`: how many manifest IDs a sampled audit looked up (None for a full one)."""

    version: int
    collection: str
    expected: int
    points: int
    missing: int
    orphans: int
    missing_ratio: float
    orphan_ratio: float
    mode: AuditMode = AuditMode.FULL
    sampled: int | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "version": self.version, "collection": self.collection, "expected": self.expected, "points": self.points,
            "missing": self.missing, "orphans": self.orphans, "missing_ratio": self.missing_ratio,
            "orphan_ratio": self.orphan_ratio, "mode": self.mode.value,
        }
        if self.sampled is not None:
            data["sampled"] = self.sampled
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AuditResult:
        return cls(version=int(data["version"]), collection=data["collection"], expected=int(data["expected"]),
                   points=int(data["points"]), missing=int(data["missing"]), orphans=int(data["orphans"]),
                   missing_ratio=float(data["missing_ratio"]), orphan_ratio=float(data["orphan_ratio"]),
                   mode=AuditMode(data.get("mode") or AuditMode.FULL), sampled=data.get("sampled"))


@dataclass(frozen=True)
class Plan:
    """What a run will build, against which live version (`base_*`), and what it counted.

    `version`, `collection` and `resumed` are set once the plan is snapshotted (`kb_reindex.steps.snapshot`):
    the version it allocated, or the unfinished one of the same plan it took over."""

    alias: str
    kind: RunKind
    fingerprint: str
    embedder: str
    embed_model: str
    embed_dim: int | None  # None: probed when the collection is created
    chunking_version: str
    embed_profile: str | None  # None while the dimension is unknown
    payload_layout: str
    base_version: int | None
    base_collection: str | None
    base_embed_model: str | None
    force_full: bool
    no_change: bool
    docs: DocCounts
    doc_keys: DocKeys
    chunks: ChunkCounts
    # newest modification time of an added or changed document: the start of source-to-searchable latency
    source_changed_at: float | None = None
    notes: tuple[str, ...] = ()
    audit: AuditResult | None = None  # the audit of live a run's plan made (`kb_reindex.rules.audit`)
    version: int | None = None
    collection: str | None = None
    resumed: bool = False
    #: what the plan's files hold that no check judges: shown on stderr, in --json, in status and on the page
    warnings: tuple[ContentWarning, ...] = ()

    @property
    def snapshotted(self) -> bool:
        return self.version is not None

    def with_snapshot(self, *, version: int, collection: str, resumed: bool) -> Plan:
        """This plan, naming the version its snapshot was written for."""
        return replace(self, version=version, collection=collection, resumed=resumed)

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON and XCom carry it: `audit` only when live was audited, `version`, `collection`
        and `resumed` only once snapshotted."""
        data: dict[str, Any] = {
            "alias": self.alias, "kind": self.kind.value, "fingerprint": self.fingerprint,
            "embedder": self.embedder, "embed_model": self.embed_model, "embed_dim": self.embed_dim,
            "chunking_version": self.chunking_version, "embed_profile": self.embed_profile,
            "payload_layout": self.payload_layout, "base_version": self.base_version,
            "base_collection": self.base_collection, "base_embed_model": self.base_embed_model,
            "force_full": self.force_full, "no_change": self.no_change, "docs": self.docs.to_dict(),
            "doc_keys": self.doc_keys.to_dict(), "chunks": self.chunks.to_dict(),
            "source_changed_at": self.source_changed_at, "notes": list(self.notes),
            "warnings": [w.to_dict() for w in self.warnings],
        }
        if self.audit is not None:
            data["audit"] = self.audit.to_dict()
        if self.version is not None:
            data.update(version=self.version, collection=self.collection, resumed=self.resumed)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        return cls(
            alias=data["alias"], kind=RunKind(data["kind"]), fingerprint=data["fingerprint"],
            embedder=data["embedder"], embed_model=data["embed_model"], embed_dim=data["embed_dim"],
            chunking_version=data["chunking_version"], embed_profile=data.get("embed_profile"),
            payload_layout=data.get("payload_layout") or "native", base_version=data["base_version"],
            base_collection=data["base_collection"], base_embed_model=data.get("base_embed_model"),
            force_full=bool(data["force_full"]), no_change=bool(data["no_change"]),
            docs=DocCounts.from_dict(data["docs"]),
            doc_keys=DocKeys.from_dict(data.get("doc_keys") or {"added": [], "changed": [], "removed": []}),
            chunks=ChunkCounts.from_dict(data["chunks"]), source_changed_at=data.get("source_changed_at"),
            notes=tuple(data.get("notes") or ()), audit=AuditResult.from_dict(data["audit"]) if data.get("audit") else None, version=data.get("version"),
            collection=data.get("collection"), resumed=bool(data.get("resumed", False)),
            warnings=tuple(ContentWarning.from_dict(w) for w in data.get("warnings") or ()),
        )


@dataclass(frozen=True)
class CreatedVersion:
    """The version whose collection `build.create_version` created (or found, resumed), as the build,
    validate and promote steps address it."""

    version: int
    collection: str
    resumed: bool
    embed_model: str
    embed_dim: int
    #: the points its slot still lacks (what a build writes: embedded or copied); a DAG run's path follows it
    points_to_write: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "collection": self.collection, "resumed": self.resumed,
                "embed_model": self.embed_model, "embed_dim": self.embed_dim, "points_to_write": self.points_to_write}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CreatedVersion:
        return cls(version=int(data["version"]), collection=data["collection"], resumed=bool(data["resumed"]),
                   embed_model=data["embed_model"], embed_dim=int(data["embed_dim"]),
                   points_to_write=int(data.get("points_to_write", 0)))


@dataclass(frozen=True)
class BuildResult:
    """What one `build.build` call did (a whole build, or one slice of it): points `embedded`, `copied` from
    live, `skipped` (written by an earlier attempt). `points` (the collection's count after it) and `copy_s`
    (seconds spent copying) are None when the version was already built and nothing was looked at."""

    version: int
    embedded: int
    copied: int
    skipped: int
    points: int | None = None
    copy_s: float | None = None
    #: points the slot held already from the version it was taken from (vectors not written again), and of
    #: those, the ones whose payload was rewritten (their document's title, tenant or content hash changed)
    kept: int = 0
    rewritten: int = 0

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"version": self.version, "embedded": self.embedded, "copied": self.copied,
                                "skipped": self.skipped}
        if self.kept or self.rewritten:  # built by difference in a slot (kb_reindex.rules.slots)
            data.update(kept=self.kept, rewritten=self.rewritten)
        if self.points is not None:
            data["points"] = self.points
        if self.copy_s is not None:
            data["copy_s"] = self.copy_s
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BuildResult:
        return cls(version=int(data["version"]), embedded=int(data["embedded"]), copied=int(data["copied"]),
                   skipped=int(data["skipped"]), points=data.get("points"), copy_s=data.get("copy_s"),
                   kept=int(data.get("kept", 0)), rewritten=int(data.get("rewritten", 0)))


def reuse_rate(*, total: int | None, embedded: int, reused: int) -> float | None:
    """The share of a version's `total` chunks not embedded for it (copied from live, or kept in its slot by the
    difference, which a run's copy count does not see); without a total, the share of those written that were
    copied. None when there is nothing to divide."""
    if total:
        return max(total - embedded, 0) / total
    return reused / (embedded + reused) if embedded + reused else None
