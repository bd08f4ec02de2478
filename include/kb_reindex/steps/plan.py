"""Step 1, plan: what changed since the live version, and which vectors can be carried over.

The plan is a frozen `kb_reindex.domain.planning.Plan` (a dict only through XCom: `Plan.to_dict`). A plan that
builds writes its snapshot into the state DB (`kb_reindex.steps.snapshot`): the manifest, the texts of the chunks
to embed and the flagged lines; every later step reads that, never the knowledge folder. `prepare` itself writes nothing but, when asked
(`record`), the file hashes that let the next plan over unchanged files read none of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kb_reindex.domain.names import shortened
from kb_reindex.rules.alias import drift_advice
from kb_reindex.rules.audit import audit_live
from kb_reindex.rules.content_warnings import content_warnings, warn
from kb_reindex.services.chunking import chunking_version
from kb_reindex.services.config import DEFAULT_DIMS, model_or_default
from kb_reindex.services.corpus import (Carried, CorpusScan, DocumentInfo, KnownDocument, KnownFiles, cache_root,
                                        LookAgain, feed_listing, looked_again, quick_fingerprint,
                                        scan_corpus)
from kb_reindex.services.screen import Flag, ScoreMemory, Screen, screen_for
from kb_reindex.services.embedding import check_model_served
from kb_reindex.domain.errors import ConfigError, DimensionMismatch, StateDriftError
from kb_reindex.steps.golden import check_golden_set
from kb_reindex.services.layouts import embedding_profile, layout_spec, version_profile
from kb_reindex.rules.manifest import Prepared
from kb_reindex.domain.model import RunKind
from kb_reindex.domain.planning import AuditResult, ChunkCounts, DocCounts, DocKeys, Plan
from kb_reindex.domain.validation_model import ValidationResult
from kb_reindex.services.sources import SourceListing, as_source, knowledge_key_for, list_source
from kb_reindex.services.state.manifests import FileHash, ManifestDocument
from kb_reindex.steps.replay import load_replay_gate
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.services.store import DISTANCE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """The embedding model the version is built with; `dim` None: probed when its collection is created."""

    embedder: str
    model: str
    dim: int | None


@dataclass(frozen=True)
class Recipe:
    """How the version to build makes its points: the model, the chunking and the payload layout."""

    target: Target
    chunking_version: str
    payload_layout: str


def check_live_consistency(deps: Deps, *, audit_run_id: str | None = None
                           ) -> tuple[VersionRecord | None, AuditResult | None]:
    """Qdrant's alias and the state DB must tell the same story before anything is built on it: (live, its audit).
    `audit_run_id`: given, live is audited ID by ID and the audit recorded for that run (`audit.audit_live`);
    the audit is None when not asked for, or when nothing is live to audit."""
    alias = deps.settings.alias
    live = deps.state.live_version(alias)
    target = deps.store.alias_target(alias)
    expected = live.collection if live else None
    if target != expected:
        raise StateDriftError(f"nothing was changed: {drift_advice(deps, target, live)}")
    audit = None
    if live is not None:
        missing = 0
        if audit_run_id:
            audit = audit_live(deps, live, run_id=audit_run_id)
            points, missing = audit.points, audit.missing
        else:
            points = deps.store.count(live.collection) if deps.store.exists(live.collection) else 0
        if points == live.points_expected and missing:
            raise StateDriftError(
                f"live collection {live.collection} lacks {missing} of the points its manifest lists (and holds as "
                f"many others); a plan built on it could copy missing vectors. Run "
                f"`kb-reindex validate --version {live.version}` and rebuild with `kb-reindex run --force-full`"
            )
        if points != live.points_expected:
            raise StateDriftError(
                f"live collection {live.collection} holds {points} points but its manifest lists "
                f"{live.points_expected}; a plan built on it could copy missing vectors. Run "
                f"`kb-reindex validate --version {live.version}` and rebuild with `kb-reindex run --force-full`"
            )
    return live, audit


def prepare(
    deps: Deps,
    *,
    force_full: bool = False,
    kind: RunKind | str = RunKind.REINDEX,
    embedder: str | None = None,
    model: str | None = None,
    dim: int | None = None,
    layout: str | None = None,
    layout_from: str = "--layout",
    audit_run_id: str | None = None,
    record: bool = False,
    changed: Sequence[str] | None = None,
) -> Prepared:
    """`layout`: the payload layout of the version to build, given explicitly (`--layout`, a `payload_layout`
    Param); default live's (`choose_layout`).
    `layout_from`: where `layout` was given, as an error about it names it (a Param, a flag).
    `audit_run_id`: a run is planning (not a look): live is audited and the audit recorded for it.
    `record`: write the file hashes read (a writing step; `kb-reindex plan` is read-only).
    `changed`: a change feed, the names that changed since the last plan read the source (the watcher's event,
    `run --changed`): those are looked at and the others taken as recorded, instead of listing the source
    (`corpus.feed_listing`); None, or a feed that cannot be used: the source is listed."""
    settings = deps.settings
    kind = RunKind(kind)
    explicit = layout_spec(layout, layout_where=layout_from) if layout else None
    live, audit = check_live_consistency(deps, audit_run_id=audit_run_id)
    layout, notes = choose_layout(settings.payload_layout, live, explicit)
    target = choose_model(deps, kind, live, embedder=embedder, model=model, dim=dim)
    recipe = Recipe(target=target, chunking_version=chunking_version(settings.chunk_size, settings.chunk_overlap),
                    payload_layout=layout)
    files = None  # the source listed once per plan: the quick look and the scan read the same listing
    again = None  # with a change feed: a document taken from the record is looked at again before it is read
    recorded = None  # the file hashes the last plan recorded, read once
    if (kind is RunKind.REINDEX and not force_full and live is not None
            and live.chunking_version == recipe.chunking_version and live.payload_layout == layout):
        recorded = deps.state.file_hashes(cache_root(deps.knowledge, settings.default_tenant))
        files, again = _listing(deps, recorded, changed)
        unchanged = _unchanged_from_hashes(deps, live, recipe, notes=notes, audit=audit, record=record,
                                           files=files, recorded=recorded)
        if unchanged is not None:
            return unchanged
    elif changed is not None:
        log.info("kb_reindex: the change feed (%d name(s)) is not used: this plan reads every file (%s)",
                 len(changed), "forced" if force_full else "nothing live" if live is None else
                 "a migration" if kind is not RunKind.REINDEX else "live is cut or laid out another way")
    screen = screen_for(settings.instruction_screen, target.embedder)
    # live's documents, read once: the flags carried, the documents taken unread, the difference, the manifest
    live_documents = deps.state.manifest_documents(live.id) if live is not None else []
    carried = carried_flags(deps, live, screen, live_documents)
    profile = _vector_profile(deps, live, recipe, kind)
    # live's unchanged documents are taken unread only where their vectors will be reused as they are
    known = (known_files(deps, live, recipe, carried, live_documents, recorded=recorded)
             if kind is RunKind.REINDEX and not force_full and _same_vectors(live, profile) else None)
    scan = _scan(deps, record=record, screen=screen, carried=carried, known=known, files=files, again=again)
    return _plan_scan(deps, scan, live, live_documents, recipe, profile, kind=kind, force_full=force_full,
                      notes=notes, audit=audit)


def _listing(deps: Deps, recorded: dict[str, FileHash], changed: Sequence[str] | None
             ) -> tuple[SourceListing, LookAgain | None]:
    """The source's listing: from the change feed when there is one it can be taken from (with the look a
    document taken from the record gets before it is read: `corpus.looked_again`), else listed."""
    if changed is not None:
        fed = feed_listing(deps.knowledge, recorded, changed)
        if fed is not None:
            names = set(changed)
            log.info("kb_reindex: the change feed named %d file(s): looked at them; the other %d as the last plan "
                     "recorded them (no listing of the source)", len(names),
                     sum(1 for f in fed[0] if f.source not in names))
            return fed, looked_again(deps.knowledge, names)
        log.info("kb_reindex: the change feed (%d name(s): %s) cannot be taken alone (nothing recorded yet, or "
                 "a name that is a link, a folder, out of the source, or neither there nor recorded): listing the "
                 "source", len(changed), ", ".join(shortened(name, 60) for name in sorted(changed)[:5]))
    return list_source(as_source(deps.knowledge)), None


def _same_vectors(live: VersionRecord | None, profile: str | None) -> bool:
    """The version to build has live's embedding profile: live's vectors can be reused (none crosses profiles)."""
    return live is not None and profile is not None and profile == version_profile(live)


def choose_model(deps: Deps, kind: RunKind, live: VersionRecord | None, *, embedder: str | None,
                 model: str | None, dim: int | None) -> Target:
    """A reindex over a live version keeps live's model (a differing configured one is reported); a
    migration or a first build takes the one asked for, checked to be served and of the asked dimension."""
    settings = deps.settings
    if kind is RunKind.REINDEX and live is not None:
        if (settings.embedder, settings.embed_model) != (live.embedder, live.embed_model):
            log.warning(
                "kb_reindex: configured model %s/%s differs from the live model %s/%s; this reindex keeps the "
                "live model. Change models with `kb-reindex migrate` or the knowledge_model_migration DAG",
                settings.embedder, settings.embed_model, live.embedder, live.embed_model,
            )
        return Target(live.embedder, live.embed_model, live.embed_dim)
    embedder = embedder or settings.embedder
    # a migration's empty model is its embedder's default; a first build uses the configured model
    model = model_or_default(embedder, model) if kind is RunKind.MIGRATION else (model or settings.embed_model)
    # before anything is built or named after the model; Ollama is asked here for migrations only (a
    # first build probes the dimension when it creates its collection)
    answered = check_model_served(settings, embedder=embedder, model=model, headers=deps.ollama_headers,
                                  ask_server=kind is RunKind.MIGRATION)
    same_model = (embedder, model) == (settings.embedder, settings.embed_model)
    asked = "the migration's dimension (--dim, the dimension Param)" if dim is not None else "KB_EMBED_DIM"
    dim = dim if dim is not None else (settings.embed_dim if same_model else None)
    if dim is not None and answered is not None and dim != answered:
        raise DimensionMismatch(
            f"{embedder} model {model!r} answers {answered}-d vectors, but {asked} asks for {dim}: nothing was "
            f"built. Leave the dimension empty (it is probed), set it to {answered}, or choose a model that "
            f"answers {dim}-d vectors"
        )
    return Target(embedder, model, dim if dim is not None else DEFAULT_DIMS.get(embedder))


def _unchanged_from_hashes(deps: Deps, live: VersionRecord, recipe: Recipe, *, notes: list[str],
                           audit: AuditResult | None, record: bool, files: SourceListing,
                           recorded: dict[str, FileHash]) -> Prepared | None:
    """The no-change plan when the recorded file hashes (reading only files touched since) give live's
    fingerprint; None: the corpus is scanned."""
    settings = deps.settings
    root = cache_root(deps.knowledge, settings.default_tenant)
    quick = quick_fingerprint(deps.knowledge, recorded, max_bytes=settings.max_doc_bytes,
                              default_tenant=settings.default_tenant, listed=files)
    if quick is None or quick.fingerprint != live.corpus_fingerprint:
        return None
    check_golden_set(settings.golden_set, set(quick.keys))
    if record and quick.rehashed:
        deps.state.record_file_hashes(root, quick.rehashed, replace_all=False)
    plan = _no_change_plan(settings.alias, live, len(quick.keys), recipe.target, notes=notes, audit=audit)
    snapshot = deps.state.snapshot(live.id)  # the same files as live's: its plan's and validation's warnings stand
    plan = replace(plan, warnings=warn(settings.alias, content_warnings(snapshot.flagged if snapshot else [])
                                       + ValidationResult.from_dict(live.validation or {}).warnings))
    return Prepared(plan=plan, scan=None, live=live)


def carried_flags(deps: Deps, live: VersionRecord | None, screen: Screen,
                  live_documents: list[ManifestDocument]) -> Carried | None:
    """Live's documents with the lines its plan flagged, when live was judged by this very screen: the scan
    judges only the documents that changed since. None (judge every document): nothing live, another screen
    (new weights, another mode), or no snapshot of live's plan to read them from."""
    if live is None or ((live.validation or {}).get("screen") or {}).get("version") != screen.version:
        return None
    snapshot = deps.state.snapshot(live.id)
    if snapshot is None:
        return None
    by_key: dict[str, list[Flag]] = {}
    for f in snapshot.flagged:
        key = f.get("knowledge_key") or knowledge_key_for(f["source"])
        by_key.setdefault(key, []).append(Flag(f["line"], f["text"], f.get("why", "")))
    return {d.knowledge_key: (d.content_hash, tuple(by_key.get(d.knowledge_key, ()))) for d in live_documents}


def known_files(deps: Deps, live: VersionRecord | None, recipe: Recipe, carried: Carried | None,
                live_documents: list[ManifestDocument], *,
                recorded: dict[str, FileHash] | None = None) -> KnownFiles | None:
    """Live's documents as its manifest's documents hold them (facts, chunk count; not their chunk rows), for a
    scan that reads only the files changed since (`corpus.KnownFiles`); None (every file read): nothing live,
    live cut another way, or its flagged lines not carried (another screen judged it, or its plan's snapshot
    is gone)."""
    if live is None or carried is None or live.chunking_version != recipe.chunking_version:
        return None
    # live's document row begins with the facts a DocumentInfo holds, in its order (a row per document: made cheaply)
    documents = {d.source: KnownDocument(DocumentInfo._make(d[:6]), d.chunk_count, carried[d.knowledge_key][1])
                 for d in live_documents if d.knowledge_key in carried}  # else: not as live's plan judged it, read
    if recorded is None:
        recorded = deps.state.file_hashes(cache_root(deps.knowledge, deps.settings.default_tenant))
    return KnownFiles(documents=documents, recorded=recorded)


class _Recall:
    """The state DB's kept screen scores, read and never written (a plan that records nothing: a preview)."""

    def __init__(self, memory: ScoreMemory) -> None:
        self._memory = memory

    def recall_scores(self, classifier: str, digests: Sequence[str]) -> dict[str, float]:
        return self._memory.recall_scores(classifier, digests)

    def remember_scores(self, classifier: str, scores: dict[str, float]) -> None:
        return None


def _scan(deps: Deps, *, record: bool, screen: Screen | None = None, carried: Carried | None = None,
          known: KnownFiles | None = None, files: SourceListing | None = None,
          again: LookAgain | None = None) -> CorpusScan:
    """Every document and chunk of the knowledge folder (the file hashes recorded when asked), with the
    golden set and its replay gate checked against them; `screen` judges the documents `carried` lacks;
    `known` the documents not read again (unchanged since live's plan read them)."""
    settings = deps.settings
    recorded: dict[str, Any] | None = {} if record else None
    started = time.perf_counter()
    judged_before = screen.judged_documents if screen else 0
    embedded_before = screen.classifier.embedded if screen and screen.classifier else 0
    scan = scan_corpus(deps.knowledge, max_bytes=settings.max_doc_bytes, chunk_size=settings.chunk_size,
                       overlap=settings.chunk_overlap, hashes=recorded, default_tenant=settings.default_tenant,
                       screen=screen, carried=carried, memory=deps.state if record else _Recall(deps.state),
                       known=known, files=files, again=again)
    if screen is not None:
        embedded = screen.classifier.embedded - embedded_before if screen.classifier else 0
        log.info("kb_reindex: scanned %d documents in %.2fs, %d of them read (the others unchanged since live's "
                 "plan read them); the instruction screen (%s) judged %d of them (the others are live's unchanged), "
                 "embedding %d line(s) no plan had judged before",
                 len(scan.documents), time.perf_counter() - started, scan.read, screen.version,
                 screen.judged_documents - judged_before, embedded)
    if recorded:
        root = cache_root(deps.knowledge, settings.default_tenant)
        if known is None:
            deps.state.record_file_hashes(root, recorded, replace_all=True)
        else:  # what differs from the hashes read before this plan, and the files gone since: an edit's rows
            changed = {source: e for source, e in recorded.items() if known.recorded.get(source) != e}
            deps.state.record_file_hashes(root, changed, replace_all=False,
                                          forget=set(known.recorded) - set(recorded))
    # only the plan checks the golden set against today's files: a rollback to an older version must
    # not be blocked by probes that name documents added since
    check_golden_set(settings.golden_set, {d.knowledge_key for d in scan.infos})
    load_replay_gate(settings.golden_set)  # its `replay:` thresholds too, before any version exists
    return scan


def _vector_profile(deps: Deps, live: VersionRecord | None, recipe: Recipe, kind: RunKind) -> str | None:
    """The embedding profile of the vectors to build; a dimension still to be probed is the live one when
    the model is live's (a model answers one dimension), else unknown (None) until the collection is created.
    A migration to the profile live serves changes nothing and is refused."""
    target, cv = recipe.target, recipe.chunking_version
    same_model_as_live = live is not None and (live.embedder, live.embed_model) == (target.embedder, target.model)
    dim = target.dim if target.dim is not None else (
        live.embed_dim if live is not None and same_model_as_live else None)
    profile = None if dim is None else embedding_profile(
        embedder=target.embedder, model=target.model, dim=dim, distance=DISTANCE.value, chunking_version=cv)
    if kind is RunKind.MIGRATION and live is not None and profile == version_profile(live):
        raise ConfigError(
            f"{deps.settings.alias} v{live.version} already serves embedding profile {profile} ({target.embedder}/"
            f"{target.model}, {dim}-d, {cv}): a migration to it would change nothing. To change only the payload "
            "layout, run `kb-reindex run --layout <layout>` (or the knowledge_reindex DAG's payload_layout Param; "
            "vectors are copied)"
        )
    return profile


def reuse_map(deps: Deps, live: VersionRecord, scan: CorpusScan) -> dict[str, str]:
    """chunk_hash -> a point of live holding it, for the chunks of the documents the scan read, looked up by hash
    (the `(version_id, chunk_hash)` index): an edit reads its changed documents' rows, not live's whole
    manifest. The known documents' chunks are live's rows themselves (`KnownDocument`): reused, not mapped."""
    wanted = {c.chunk_hash for c in scan.read_chunks()}
    return {chunk_hash: point_id
            for chunk_hash, (_version, point_id) in deps.state.chunks_by_hash([live.id], wanted).items()}


@dataclass(frozen=True)
class _Diff:
    """The documents of a scan against live's manifest (knowledge key -> content hash)."""

    added: list[str]
    changed: list[str]
    unchanged: int  # counted, not listed: every document of the corpus but an edit's few
    removed: list[str]

    @classmethod
    def of(cls, keys: dict[str, str], live_docs: dict[str, str]) -> _Diff:
        added: list[str] = []
        changed: list[str] = []
        unchanged = 0
        for key, content_hash in keys.items():
            was = live_docs.get(key)
            if was is None:
                added.append(key)
            elif was != content_hash:
                changed.append(key)
            else:
                unchanged += 1
        removed = [] if len(keys) - len(added) == len(live_docs) else [k for k in live_docs if k not in keys]
        return cls(added=sorted(added), changed=sorted(changed), unchanged=unchanged, removed=sorted(removed))

    @property
    def counts(self) -> DocCounts:
        return DocCounts(added=len(self.added), changed=len(self.changed), unchanged=self.unchanged,
                         removed=len(self.removed))


def _plan_scan(deps: Deps, scan: CorpusScan, live: VersionRecord | None, live_documents: list[ManifestDocument],
               recipe: Recipe, profile: str | None, *, kind: RunKind, force_full: bool, notes: list[str],
               audit: AuditResult | None) -> Prepared:
    """The plan of a scanned corpus: what changed against live's manifest (`live_documents`), and which of
    live's vectors the chunks to build can copy (none across embedding profiles, none when forced).
    `profile`: the embedding profile of the vectors to build (`_vector_profile`)."""
    settings = deps.settings
    documents = scan.infos
    total = scan.chunk_total
    no_change = (
        kind is RunKind.REINDEX
        and not force_full
        and live is not None
        and live.corpus_fingerprint == scan.fingerprint
        and live.chunking_version == recipe.chunking_version
        and live.payload_layout == recipe.payload_layout  # a new layout is a new version, its vectors copied
    )
    live_docs: dict[str, str] = {}
    reuse: dict[str, str] = {}
    if live is not None:
        live_docs = {d.knowledge_key: d.content_hash for d in live_documents}
        # nothing will be built when nothing changed: the routine no-op never reads live's chunk rows
        if _same_vectors(live, profile) and not force_full and kind is RunKind.REINDEX and not no_change:
            reuse = reuse_map(deps, live, scan)

    diff = _Diff.of({d.knowledge_key: d.content_hash for d in documents}, live_docs)
    # no change: the same files cut the same way, so every chunk is one of live's; the known documents' chunks
    # are live's rows, each reused (`prepare` takes documents unread only when live's vectors are reusable)
    reused = total if no_change else scan.reused_chunks(reuse)
    touched_keys = set(diff.added) | set(diff.changed)
    # when the newest of them was written, as the listing said (no document is looked at again)
    changed_at = max((scan.mtimes[d.source] / 1e9 for d in documents
                      if d.knowledge_key in touched_keys and d.source in scan.mtimes), default=None)

    target = recipe.target
    plan = Plan(
        alias=settings.alias, kind=kind, fingerprint=scan.fingerprint, embedder=target.embedder,
        embed_model=target.model, embed_dim=target.dim, chunking_version=recipe.chunking_version,
        embed_profile=profile, payload_layout=recipe.payload_layout,
        base_version=live.version if live else None, base_collection=live.collection if live else None,
        base_embed_model=live.embed_model if live else None, force_full=force_full, no_change=no_change,
        docs=diff.counts, doc_keys=DocKeys.first(added=diff.added, changed=diff.changed, removed=diff.removed),
        chunks=ChunkCounts(total=total, embedded=total - reused, reused=reused),
        source_changed_at=changed_at, notes=tuple(notes), audit=audit,
        warnings=warn(settings.alias, content_warnings(scan.flagged_lines())),
    )
    return Prepared(plan=plan, scan=scan, reuse=reuse, live=live, live_documents=live_documents)


def choose_layout(configured: str, live: VersionRecord | None, explicit: str | None) -> tuple[str, list[str]]:
    """(layout of the version to build, notes). Live's layout is kept as live's model is: a reindex or a
    migration without an explicit layout keeps what the assistant reads now. KB_PAYLOAD_LAYOUT is the layout
    of a first build; a differing one is reported, never obeyed, once a version serves."""
    if explicit is not None:
        return explicit, []
    if live is None:
        return configured, []
    notes = []
    if configured != live.payload_layout:
        notes.append(
            f"KB_PAYLOAD_LAYOUT={configured} differs from the layout live v{live.version} serves "
            f"({live.payload_layout}); kept {live.payload_layout}, as a reindex keeps live's layout. To change it: "
            f"`kb-reindex run --layout {configured}` (or the payload_layout Param of knowledge_reindex)"
        )
        log.warning("kb_reindex: %s", notes[0])
    return live.payload_layout, notes


def _no_change_plan(alias: str, live: VersionRecord, docs: int, target: Target, *, notes: list[str],
                    audit: AuditResult | None) -> Plan:
    """The plan of an unchanged corpus recognised from the recorded file hashes: every chunk is live's."""
    return Plan(
        alias=alias, kind=RunKind.REINDEX, fingerprint=live.corpus_fingerprint, embedder=target.embedder,
        embed_model=target.model, embed_dim=target.dim, chunking_version=live.chunking_version,
        embed_profile=version_profile(live), payload_layout=live.payload_layout,
        base_version=live.version, base_collection=live.collection, base_embed_model=live.embed_model,
        force_full=False, no_change=True, docs=DocCounts(unchanged=docs), doc_keys=DocKeys(),
        chunks=ChunkCounts(total=live.points_expected, embedded=0, reused=live.points_expected),
        source_changed_at=None, notes=tuple(notes), audit=audit,
    )


def plan(deps: Deps, **options: Any) -> Plan:
    return prepare_logged(deps, **options).plan


def prepare_logged(deps: Deps, **options: Any) -> Prepared:
    """`prepare`, with the one-line summary an operator reads first in the log."""
    prepared = prepare(deps, **options)
    p = prepared.plan
    log.info(
        "kb_reindex: plan for %s: docs +%d ~%d =%d -%d; chunks %d (embed %d, reuse %d)%s",
        p.alias, p.docs.added, p.docs.changed, p.docs.unchanged, p.docs.removed,
        p.chunks.total, p.chunks.embedded, p.chunks.reused, "; no change" if p.no_change else "",
    )
    return prepared
