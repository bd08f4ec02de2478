"""Make the state DB agree with what Qdrant holds, explicitly and on the record.

`reconcile` is for a crash between the alias move and the state write, or a manual alias change: Qdrant's
alias is what readers see, so it is the truth for which version is live. `rebuild_state` is for a lost,
empty or replaced state DB: Qdrant holds every version's points, and their payloads hold the manifest.
Both run under the alias lock a promotion holds, so they never read a promotion half-way.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kb_reindex.rules.alias import drift_advice
from kb_reindex.rules.checks import structural_problems
from kb_reindex.domain.errors import ConfigError, StateDriftError, StoreError
from kb_reindex.domain.lifecycle import DELETED, FAILED, LIVE, READY, RECONCILABLE, RETIRED
from kb_reindex.rules.locking import alias_lock_name
from kb_reindex.domain.model import RunKind, VersionStatus
from kb_reindex.services.runtime import Deps
from kb_reindex.services.sources import corpus_fingerprint
from kb_reindex.services.state.manifests import ManifestChunk, ManifestDocument
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.services.state.clock import utcnow
from kb_reindex.domain.validation_model import RestoredScores

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class ReconcileResult:
    """What `reconcile` recorded: nothing (`changed` False: state and Qdrant agree), or the live version."""

    changed: bool
    message: str
    live_version: int | None = None
    previous_version: int | None = None

    def to_dict(self) -> dict[str, Any]:
        if not self.changed:
            return {"changed": False, "message": self.message}
        return {"changed": True, "live_version": self.live_version, "previous_version": self.previous_version,
                "message": self.message}


@dataclass(frozen=True)
class RebuiltVersion:
    """One version read back from its collection by `rebuild_state`."""

    version: int
    collection: str
    status: VersionStatus
    points: int
    embed_model: str
    dim: int
    payload_layout: str
    problems: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "collection": self.collection, "status": str(self.status),
                "points": self.points, "embed_model": self.embed_model, "dim": self.dim,
                "payload_layout": self.payload_layout, "problems": list(self.problems)}


@dataclass(frozen=True)
class RebuildResult:
    """The versions `rebuild_state` recorded from Qdrant, and the one behind the alias."""

    rebuilt: tuple[RebuiltVersion, ...]
    live_version: int | None
    message: str
    changed: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"changed": self.changed, "rebuilt": [v.to_dict() for v in self.rebuilt],
                "live_version": self.live_version, "message": self.message}


#: payload fields a point of ours carries that the manifest is rebuilt from
MANIFEST_FIELDS = ("knowledge_key", "chunk_index", "chunk_hash", "content_hash", "source", "title", "category",
                   "tenant", "embed_model", "chunking_version")


def reconcile(deps: Deps, *, run_id: str | None = None) -> ReconcileResult:
    alias = deps.settings.alias
    with deps.state.lock(alias_lock_name(alias), ttl_s=300, wait_s=deps.settings.lock_wait_s):
        serving = deps.store.alias_target(alias)
        live = deps.state.live_version(alias)
        if serving == (live.collection if live else None):
            return ReconcileResult(changed=False,
                                   message=f"{alias}: state and Qdrant agree (serving {serving or 'nothing'})")
        if serving is None and live is not None:
            return _restore_missing_alias(deps, live, run_id=run_id)
        target = next((v for v in deps.state.list_versions(alias) if v.collection == serving), None)
        if serving is None or target is None or target.status == DELETED or (
                live is not None and target.version < live.version):
            # never record a version older than live as live: that is a rollback, and recorded as one
            raise StateDriftError(drift_advice(deps, serving, live))
        deps.state.record_switch(alias=alias, action="reconcile", to=target, previous=live, run_id=run_id,
                                 reason=f"alias found pointing at {serving}; state said "
                                        f"{live.collection if live else 'nothing'}", from_=RECONCILABLE)
    return ReconcileResult(changed=True, live_version=target.version,
                           previous_version=live.version if live else None,
                           message=f"{alias}: recorded v{target.version} ({serving}) as live"
                                   + (f"; v{live.version} retired" if live else ""))


def _restore_missing_alias(deps: Deps, live: VersionRecord, *, run_id: str | None) -> ReconcileResult:
    """The alias is gone (deleted by hand) while the state DB names a live version: point it back there, if
    that collection is whole, with the same compare-and-swap (from nothing) as a first promotion."""
    alias = deps.settings.alias
    problems = structural_problems(deps, live)
    if problems:
        raise StateDriftError(
            f"alias {alias} points to nothing and the live v{live.version} ({live.collection}) is not whole: "
            f"{'; '.join(problems)}. Roll back to a kept version (`kb-reindex rollback --to-version N --reason ...`)"
            " or rebuild (`kb-reindex run --force-full`)"
        )
    deps.store.swap_alias(alias, to=live.collection, expected_from=None)
    deps.state.add_alias_event(alias=alias, action="reconcile", to=live, previous=None, run_id=run_id,
                               reason=f"alias was missing; pointed back at v{live.version}, live in the state DB")
    return ReconcileResult(changed=True, live_version=live.version, previous_version=None,
                           message=f"{alias}: the alias was missing; it points at v{live.version} ({live.collection}) "
                                   "again")


# --- rebuild the state DB from Qdrant ---------------------------------------------------------------


@dataclass(frozen=True)
class VersionFacts:
    """Everything a version record and its manifest hold, as `read_version` read it back from one collection.
    `problems`: what keeps it from being a usable version (it is recorded failed, without a manifest);
    `served_at`/`validated`/`legacy`: what the collection notes of its history (`_rebuilt_status`)."""

    kind: str
    embedder: str
    embed_model: str
    embed_dim: int
    distance: str
    chunking_version: str
    corpus_fingerprint: str
    documents: tuple[ManifestDocument, ...]
    chunks: tuple[ManifestChunk, ...]
    problems: tuple[str, ...]
    served_at: datetime | None
    validated: bool
    legacy: bool
    payload_layout: str
    embed_profile: str | None
    created_at: datetime | None
    validation: RestoredScores | None


def version_collections(deps: Deps) -> list[tuple[int, str]]:
    """(N, name) of every collection holding a version: `<alias>__<model>__v<N>` (made before slots), and the
    slots `<alias>__<model>__s<k>`, whose metadata names the version they hold; oldest first."""
    alias = re.escape(deps.settings.alias)
    named = re.compile(rf"^{alias}__[a-z0-9-]+__v(\d+)$")
    slot = re.compile(rf"^{alias}__[a-z0-9-]+__s\d+$")
    found = []
    for name in deps.store.collection_names():
        if m := named.match(name):
            found.append((int(m.group(1)), name))
        elif slot.match(name):
            number = deps.store.collection_metadata(name).get("kb_version")
            if isinstance(number, int) and deps.store.count(name):
                found.append((number, name))
    return sorted(found)


def read_version(deps: Deps, name: str) -> VersionFacts:
    """Everything a version record and its manifest hold, read back from one collection.

    Model, embedder and chunking come from the collection's metadata (written at creation); collections
    made before that carry model and chunking on every point, and the embedder is told by the model name
    (the offline embedder's models are named `hashing-*`)."""
    store = deps.store
    meta = store.collection_metadata(name)
    dim = store.dimension(name)
    distance = store.shape(name).distance
    documents: dict[str, ManifestDocument] = {}  # the first point's payload fields; chunks counted in `counts`
    counts: Counter[str] = Counter()
    chunks: list[ManifestChunk] = []
    seen: dict[str, set[str]] = defaultdict(set)
    problems: list[str] = []
    for point_id, payload in store.iter_payloads(name, fields=list(MANIFEST_FIELDS)):
        absent = [f for f in ("knowledge_key", "chunk_index", "chunk_hash", "content_hash") if payload.get(f) is None]
        if absent:
            problems.append(f"point {point_id} has no {', '.join(absent)} in its payload")
            break
        key = payload["knowledge_key"]
        for field_name in ("embed_model", "chunking_version"):
            if payload.get(field_name) is not None:
                seen[field_name].add(str(payload[field_name]))
        doc = documents.setdefault(key, ManifestDocument(
            knowledge_key=key, source=payload.get("source") or f"{key}.md", title=payload.get("title") or key,
            category=payload.get("category") or "", tenant=payload.get("tenant") or "",
            content_hash=payload["content_hash"], chunk_count=0))
        if doc.content_hash != payload["content_hash"]:
            problems.append(f"document {key} has points of two contents ({doc.content_hash[:12]}, "
                            f"{payload['content_hash'][:12]})")
            break
        counts[key] += 1
        chunks.append(ManifestChunk(point_id=point_id, knowledge_key=key, source_point_id=None,
                                    chunk_index=int(payload["chunk_index"]), chunk_hash=payload["chunk_hash"]))
    for field_name in ("embed_model", "chunking_version"):
        if len(seen[field_name]) > 1:
            problems.append(f"points disagree on {field_name}: {', '.join(sorted(seen[field_name]))}")
    model = meta.get("embed_model") or next(iter(seen["embed_model"]), None)
    chunking = meta.get("chunking_version") or next(iter(seen["chunking_version"]), None)
    if not chunks:
        problems.append("it holds no points")
    if model is None or chunking is None:
        problems.append("neither its metadata nor its points name the embedding model and chunking")
    embedder = meta.get("embedder") or ("hashing" if (model or "").startswith("hashing") else "ollama")
    return VersionFacts(
        kind=meta.get("kind") or RunKind.REINDEX, embedder=embedder, embed_model=model or "unknown",
        embed_dim=dim, distance=distance, chunking_version=chunking or "unknown",
        corpus_fingerprint=corpus_fingerprint(documents.values()),
        documents=tuple(d._replace(chunk_count=counts[key]) for key, d in sorted(documents.items())),
        chunks=tuple(sorted(chunks, key=lambda c: (c.knowledge_key, c.chunk_index))),  # manifest order
        problems=tuple(problems), served_at=_served_at(meta), validated=bool(meta.get("validated")),
        legacy="kb_version" not in meta,
        # every layout keeps the manifest's fields flat; older collections were all native
        payload_layout=meta.get("payload_layout") or "native", embed_profile=meta.get("embed_profile"),
        created_at=_noted_time(meta.get("created_at")), validation=_noted_scores(meta),
    )


def _noted_time(value: Any) -> datetime | None:
    """A time kb-reindex noted on a collection (ISO, UTC, `Z`), or None (not noted, or unreadable)."""
    try:
        return datetime.fromisoformat(str(value).rstrip("Z")) if value else None
    except ValueError:
        return None


def _noted_scores(meta: dict[str, Any]) -> RestoredScores | None:
    """The golden-set scores noted on a collection when it passed validation, as the version's validation
    record holds them (the probes and reports stay with the lost state DB)."""
    if not meta.get("validated") or meta.get("hit_rate") is None:
        return None
    return RestoredScores(hit_rate=meta["hit_rate"], mrr=meta.get("mrr"),
                          restored_from="collection metadata (reconcile --rebuild-state)")


def _served_at(meta: dict[str, Any]) -> datetime | None:
    """When the collection last served behind the alias, as noted on it at each move (None: never, or made
    before the note existed)."""
    if not meta.get("served"):
        return None
    try:
        return datetime.fromisoformat(str(meta.get("last_served_at", "")).rstrip("Z"))
    except ValueError:
        return utcnow()


def _rebuilt_status(facts: VersionFacts, *, serving: bool) -> tuple[VersionStatus, str | None]:
    """(status, note) of a version rebuilt from its collection, by what the collection notes it went through:
    behind the alias -> live; served before -> retired (a rollback may return to it); validated but never
    served -> ready, a shadow only a promotion (which validates again) puts live; neither -> failed, a build
    that never finished (retention drops it). Collections made before these notes -> ready, to be promoted
    after re-validation rather than rolled back to blindly."""
    if facts.problems:
        if serving:
            raise StoreError(f"the live collection cannot give a manifest: {'; '.join(facts.problems)}")
        return FAILED, "rebuilt from Qdrant: " + "; ".join(facts.problems)
    if serving:
        return LIVE, None
    if facts.served_at is not None:
        return RETIRED, None
    if facts.validated:
        return READY, None
    if facts.legacy:
        return READY, "rebuilt from Qdrant: made before collections noted their history; promote validates it again"
    return FAILED, "rebuilt from Qdrant: never validated (a build that did not finish)"


def rebuild_state(deps: Deps, *, replace: bool = False, run_id: str | None = None) -> RebuildResult:
    """Versions, manifests and the live version of this alias, from Qdrant alone, recorded as one event.

    The live version is the alias's target; the others take their status from what their collections note
    (`_rebuilt_status`). Which version preceded live is not guessed: a rollback names its target."""
    alias = deps.settings.alias
    with deps.state.lock(alias_lock_name(alias), ttl_s=300, wait_s=deps.settings.lock_wait_s):
        known = deps.state.list_versions(alias)
        if known and not replace:
            raise ConfigError(
                f"the state DB at {deps.state.display_url} already holds {len(known)} versions of {alias}; "
                "`kb-reindex reconcile` settles an alias that moved. To replace them with what Qdrant holds, "
                "pass --replace (alias history and runs are kept)"
            )
        found = version_collections(deps)
        serving = deps.store.alias_target(alias)
        if not found:
            raise ConfigError(f"Qdrant holds no collection named {alias}__<model>__v<N>: nothing to rebuild the "
                              "state DB from (check KB_ALIAS and the Qdrant location)")
        if serving is not None and serving not in {name for _, name in found}:
            raise StateDriftError(f"alias {alias} points to {serving}, which is not a version collection of "
                                  f"{alias}; point it at one before rebuilding the state")
        read = [(number, name, read_version(deps, name)) for number, name in found]
        for _number, name, facts in read:
            if name == serving and facts.problems:
                raise StoreError(f"the live collection {name} cannot give a manifest: {'; '.join(facts.problems)}"
                                 "; nothing was recorded")
        if known:
            deps.state.forget_versions(alias)
        rebuilt: list[RebuiltVersion] = []
        live: VersionRecord | None = None
        now = utcnow()
        for number, name, facts in read:
            status, note = _rebuilt_status(facts, serving=name == serving)
            record = deps.state.insert_version(
                alias=alias, version=number, collection=name, status=status, kind=facts.kind,
                embedder=facts.embedder, embed_model=facts.embed_model, embed_dim=facts.embed_dim,
                distance=facts.distance, chunking_version=facts.chunking_version,
                corpus_fingerprint=facts.corpus_fingerprint, docs_count=len(facts.documents),
                points_expected=len(facts.chunks), points_written=len(facts.chunks),
                error=note, failed_step="rebuild" if status == FAILED else None,
                promoted_at=now if status == LIVE else facts.served_at,
                live_since=now if status == LIVE else facts.served_at,
                retired_at=(facts.served_at or now) if status == RETIRED else None,
                payload_layout=facts.payload_layout, embed_profile=facts.embed_profile,
                validation=json.dumps(facts.validation.to_dict()) if facts.validation else None,
                **({"created_at": facts.created_at} if facts.created_at else {}),
            )
            if status != FAILED:
                deps.state.write_manifest(record.id, list(facts.documents), facts.chunks)
            live = record if status == LIVE else live
            rebuilt.append(RebuiltVersion(version=number, collection=name, status=status, points=len(facts.chunks),
                                          embed_model=facts.embed_model, dim=facts.embed_dim,
                                          payload_layout=facts.payload_layout, problems=facts.problems))
        if live is not None:
            deps.state.add_alias_event(alias=alias, action="rebuild-state", to=live, previous=None, run_id=run_id,
                                       reason=f"state DB rebuilt from Qdrant: {len(rebuilt)} versions")
    log.info("kb_reindex: state of %s rebuilt from Qdrant: %d versions, live v%s", alias, len(rebuilt),
             live.version if live else "-")
    return RebuildResult(rebuilt=tuple(rebuilt), live_version=live.version if live else None,
                         message=f"{alias}: state rebuilt from Qdrant: {len(rebuilt)} versions"
                                 + (f", v{live.version} live" if live else ", nothing behind the alias"))
