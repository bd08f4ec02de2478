"""What serves now, every version, held locks, metrics and the alias history: read-only typed views.

`kb-reindex status` / `history` and the Knowledge index page read these. Each view is a frozen dataclass;
`to_dict()` is the JSON edge (`status --json`, the page's /api/status), with the keys those have always had.
`status_view` reads the state DB and Qdrant; `state_only_view` the state DB alone (the page, while a build
holds the local Qdrant store), Qdrant's numbers left None.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any

from kb_reindex.steps import querylog
from kb_reindex.rules.alias import drift_advice, has_served, moved_from, rollback_target
from kb_reindex.rules.audit import AuditView, audit_view
from kb_reindex.rules.freeze import FreezeView, freeze_view
from kb_reindex.rules.slots import own_name
from kb_reindex.services.layouts import version_profile
from kb_reindex.rules.locking import alias_lock_name, reindex_lock_name
from kb_reindex.steps.querylog import QueryLogView
from kb_reindex.rules.content_warnings import content_warnings
from kb_reindex.steps.review import FlaggedInContext, ServedLines, kept_as, review_lines, served_lines
from kb_reindex.domain.planning import DocChanges, reuse_rate
from kb_reindex.domain.validation_model import ContentWarning
from kb_reindex.domain.model import SUCCEEDED, RunKind, RunOutcome, VersionStatus
from kb_reindex.services.runtime import Deps, StateDeps
from kb_reindex.services.state.history import AliasEvent, PinRecord
from kb_reindex.services.state.locks import LockRecord, is_dag_run_owner
from kb_reindex.services.state.dag_runs import dag_run_of, missing_pool_waits
from kb_reindex.rules.run_problems import last_run_problem
from kb_reindex.services.state.runs import RunRecord
from kb_reindex.services.state.versions import QdrantSnapshotRef, VersionRecord
from kb_reindex.services.state.clock import utc_stamp, utcnow

#: statuses whose collection must exist in Qdrant, holding what its manifest lists
KEPT = (VersionStatus.LIVE, VersionStatus.READY, VersionStatus.RETIRED)
#: the run kinds the metrics count (builds; rollbacks and promotions are not)
BUILDS = (RunKind.REINDEX, RunKind.MIGRATION)


@dataclass(frozen=True)
class PinView:
    """Why a version is pinned (kept by retention), by whom and when."""

    reason: str
    by: str
    at: str


@dataclass(frozen=True)
class VersionRow:
    """One version as status and the page show it; `points` and `collection_config` are Qdrant's (None when its
    collection is missing, or when Qdrant could not be read)."""

    version: int
    collection: str
    status: str
    kind: str
    points: int | None
    points_expected: int
    points_written: int
    embedder: str
    embed_model: str
    dim: int
    payload_layout: str
    embed_profile: Any
    hit_rate: float | None
    mrr: float | None
    created_at: str
    #: first put behind the alias (a rollback to it keeps this); `live_since` the latest move to live
    promoted_at: str | None
    live_since: str | None
    rollback_target: bool
    #: where a rollback may go (served before, kept)
    rollback_allowed: bool
    #: ready and never served: only a promotion may put it live
    shadow: bool
    #: why such a version is kept, from its run: `held` for a person (content loss), `frozen` (built while the
    #: alias was frozen), else `shadow` (a migration not promoted); None for any other version
    kept: str | None
    serving: bool
    error: str | None
    run_id: str | None
    #: the settings it was created with (collection metadata); None for a dropped or older collection
    collection_config: Any
    snapshot: QdrantSnapshotRef | None
    pinned: bool
    pin: PinView | None
    #: what its files held that no check judges (instruction-like lines, tenant changes, duplicates), as its
    #: validation recorded them
    warnings: tuple[ContentWarning, ...] = ()
    #: the documents its plan added, changed and removed against its base (None: not recorded)
    changes: DocChanges | None = None
    #: kept, but residing in no slot (a newer build took it): a rollback to it restores it first, writing up to
    #: `points_expected` points and embedding none (kb_reindex.rules.slots)
    evicted: bool = False
    #: held for a person: the new instruction-like lines that hold it, each in the lines around it
    review: tuple[FlaggedInContext, ...] = ()

    @property
    def one_move_away(self) -> bool:
        return self.rollback_allowed and not self.evicted and self.points is not None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "one_move_away": self.one_move_away,
                "restore_points": self.points_expected if self.evicted else 0}


@dataclass(frozen=True)
class LiveVersion:
    """The live version's identity, as status heads it."""

    version: int
    collection: str
    points: int | None
    embed_model: str
    dim: int
    embedder: str
    payload_layout: str
    embed_profile: Any

    @classmethod
    def of(cls, row: VersionRow) -> LiveVersion:
        return cls(version=row.version, collection=row.collection, points=row.points, embed_model=row.embed_model,
                   dim=row.dim, embedder=row.embedder, payload_layout=row.payload_layout,
                   embed_profile=row.embed_profile)


@dataclass(frozen=True)
class LockRow:
    """A held lock; `owner_alive` in words ("yes", "no", "unknown (another host)", or a DAG run's rule)."""

    name: str
    owner: str
    since: str
    expires: str
    expired: bool
    owner_alive: str

    @property
    def owner_gone(self) -> bool:
        """Held, unexpired, by a process known to be gone: the next command takes it over."""
        return self.owner_alive == "no" and not self.expired


@dataclass(frozen=True)
class Metrics:
    """The run metrics status reports (of the last 200 reindex and migration runs)."""

    runs: int
    run_success_rate: float | None
    last_run_duration_s: float | None
    last_changed_chunks: int | None
    last_embedding_reuse_rate: float | None
    failed_runs: int
    alias_switch_failures: int
    embedding_failures: int
    ready_unpromoted_age_s: float | None
    last_source_to_searchable_s: float | None


@dataclass(frozen=True)
class StatusView:
    """`kb-reindex status` and the page's status: what serves, every version, locks, problems and notes."""

    alias: str
    serving_collection: str | None
    live: LiveVersion | None
    rollback_target: int | None
    freeze: FreezeView | None
    pinned: tuple[int, ...]
    audit: AuditView | None
    versions: tuple[VersionRow, ...]
    locks: tuple[LockRow, ...]
    problems: tuple[str, ...]
    notes: tuple[str, ...]
    metrics: Metrics
    query_log: QueryLogView
    #: the newest run failed or was held: the alias still serves what it did, and the knowledge is not fresh
    last_run_problem: str | None = None
    #: the instruction-like lines live serves, and who let them through (None: none)
    served_instructions: ServedLines | None = None
    #: a rollback put live live: the version it moved away from, kept (going there again undoes it)
    rolled_back_from: int | None = None

    @property
    def warnings(self) -> tuple[ContentWarning, ...]:
        """What live serves that no check judges (instruction-like lines, tenant changes, duplicates): shown to
        on-call."""
        return self.live_row.warnings if self.live_row else ()

    @property
    def live_row(self) -> VersionRow | None:
        return self.version(self.live.version) if self.live else None

    def version(self, number: int) -> VersionRow | None:
        return next((v for v in self.versions if v.version == number), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "alias": self.alias,
            "serving_collection": self.serving_collection,
            "live": asdict(self.live) if self.live else None,
            "rollback_target": self.rollback_target,
            "freeze": self.freeze.to_dict() if self.freeze else None,
            "pinned": list(self.pinned),
            "audit": asdict(self.audit) if self.audit else None,
            "versions": [v.to_dict() for v in self.versions],
            "locks": [asdict(lock) for lock in self.locks],
            "problems": list(self.problems),
            "notes": list(self.notes),
            "metrics": asdict(self.metrics),
            "query_log": asdict(self.query_log),
            "warnings": [w.to_dict() for w in self.warnings],
            "last_run_problem": self.last_run_problem,
            "served_instructions": self.served_instructions.to_dict() if self.served_instructions else None,
            "rolled_back_from": self.rolled_back_from,
            "residence": [{"version": v.version, "one_move_away": v.one_move_away,
                           "restore_points": v.points_expected if v.evicted else 0}
                          for v in self.versions if v.rollback_allowed],
        }


@dataclass(frozen=True)
class HistoryEvent:
    """An alias move, a lock broken or taken over, or a freeze/unfreeze."""

    at: str
    action: str
    from_version: int | None
    to_version: int | None
    from_collection: str | None
    to_collection: str | None
    run_id: str | None
    reason: str | None
    #: who moved the alias (the Airflow user who triggered it, the CLI's login user); None: a scheduled run
    by: str | None = None

    @classmethod
    def move(cls, event: AliasEvent) -> HistoryEvent:
        return cls(at=utc_stamp(event.at), action=event.action, from_version=event.from_version,
                   to_version=event.to_version, from_collection=event.from_collection,
                   to_collection=event.to_collection, run_id=event.run_id, reason=event.reason, by=event.moved_by)

    @classmethod
    def note(cls, at: datetime, action: str, reason: str, by: str | None = None) -> HistoryEvent:
        """An event that moved no alias (a lock broken, a freeze): what, when, why and by whom."""
        return cls(at=utc_stamp(at), action=action, from_version=None, to_version=None, from_collection=None,
                   to_collection=None, run_id=None, reason=reason, by=by)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- the views ---------------------------------------------------------------------------------------------


def status_view(deps: Deps) -> StatusView:
    """What serves now, every version, held locks, and whether Qdrant agrees with the state DB."""
    alias = deps.settings.alias
    store = deps.store
    live, serving, promotion_in_progress = _consistent_view(deps)
    target = rollback_target(deps) if live else None
    collections = store.collection_names()
    pins = deps.state.active_pins(alias)
    versions = []
    for record in deps.state.list_versions(alias):
        exists = record.collection in collections and record.status != VersionStatus.DELETED
        kept = kept_as(deps.state, record)
        versions.append(replace(version_row(
            record, target=target, pins=pins, serving=serving,
            points=store.count(record.collection) if exists else None,
            collection_config=store.collection_metadata(record.collection).get("collection_config") if exists else None,
            kept=kept), evicted=not exists and record.collection == own_name(record),
            review=review_lines(deps.state, record, live) if kept == "held" else ()))
    problems, notes = [], []
    if serving != (live.collection if live else None):
        if promotion_in_progress:
            notes.append(f"promotion in progress: alias {alias} is moving to {serving or 'nothing'}; "
                         "run `kb-reindex status` again in a moment")
        else:
            problems.append(drift_advice(deps, serving, live))
    problems += _collection_problems(versions)
    problems += deps.settings.ignored_problems
    evicted = [v for v in versions if v.evicted and v.status in KEPT]
    if evicted:
        notes.append("kept, residing in no slot (a rollback to them restores first, embedding nothing): "
                     + ", ".join(f"v{v.version} ({v.points_expected} points to write)" for v in evicted)
                     + "; `kb-reindex restore --version N`")
    serving_row = next((v for v in versions if v.serving), None)
    blocked = [w for w in (serving_row.warnings if serving_row else ()) if w.kind == "instruction"]
    if blocked and deps.settings.instruction_policy == "block":
        # allowed to serve (a rollback is never refused for its content), never silent
        problems.append(f"live v{serving_row.version if serving_row else '?'} serves {len(blocked)} instruction-like "
                        f"line(s) KB_INSTRUCTION_POLICY=block refuses (first: {blocked[0].knowledge_key} line "
                        f"{blocked[0].line}: {blocked[0].text[:80]!r}); take them out of the page and run a reindex")
    audit = live_audit(deps, live)
    if audit and (audit.missing or audit.orphans):
        problems.append(f"the audit of live v{audit.version} at {audit.at} found {audit.missing} missing "
                        f"({audit.missing_ratio:.2%}) and {audit.orphans} orphan point(s) ({audit.orphan_ratio:.2%}) "
                        "against its manifest")
    locks = lock_rows(deps)
    notes += _lock_notes(locks)
    problems += pool_problems(deps, locks)
    return StatusView(
        alias=alias, serving_collection=serving, live=_live(versions, live),
        rollback_target=target.version if target else None, freeze=freeze_view(deps), pinned=tuple(sorted(pins)),
        audit=audit, versions=tuple(versions), locks=locks, problems=tuple(problems), notes=tuple(notes),
        metrics=metrics(deps), query_log=querylog.summary(deps), last_run_problem=last_run_problem(deps.state, alias),
        served_instructions=served_lines(deps.state, alias, live), rolled_back_from=_rolled_back_from(deps, live))


def state_only_view(deps: StateDeps) -> StatusView:
    """status_view without Qdrant: what the state DB records, Qdrant's numbers left None, no drift checked."""
    alias = deps.settings.alias
    live = deps.state.live_version(alias)
    target = rollback_target(deps) if live else None  # type: ignore[arg-type]  # reads only the state DB
    pins = deps.state.active_pins(alias)
    versions = []
    for v in deps.state.list_versions(alias):
        kept = kept_as(deps.state, v)
        versions.append(replace(version_row(v, target=target, pins=pins, serving=None, points=None,
                                            collection_config=None, kept=kept),
                                review=review_lines(deps.state, v, live) if kept == "held" else ()))
    locks = lock_rows(deps)
    return StatusView(
        alias=alias, serving_collection=None, live=_live(versions, live),
        rollback_target=target.version if target else None, freeze=freeze_view(deps), pinned=tuple(sorted(pins)),
        audit=None, versions=tuple(versions), locks=locks,
        problems=tuple(pool_problems(deps, locks)), notes=tuple(_lock_notes(locks)), metrics=metrics(deps),
        last_run_problem=last_run_problem(deps.state, alias),
        query_log=querylog.summary(deps), served_instructions=served_lines(deps.state, alias, live),
        rolled_back_from=_rolled_back_from(deps, live))


def _rolled_back_from(deps: Deps | StateDeps, live: VersionRecord | None) -> int | None:
    left = moved_from(deps, live, by_rollback=True) if live else None  # type: ignore[arg-type]  # the state DB only
    return left.version if left is not None else None


def pool_problems(deps: Deps | StateDeps, locks: tuple[LockRow, ...]) -> list[str]:
    """A DAG run of this alias (one holding its lock, or one its run records say is still going) with a task
    waiting in a pool Airflow does not have: it would wait for ever, holding the lock, and Airflow says so only in
    the scheduler's log. Asked of Airflow's metadata DB where this process can reach it (beside an Airflow
    install, the page's api-server); elsewhere nothing is said."""
    owners = [held.owner.rpartition("@")[0] for held in locks if is_dag_run_owner(held.owner)]
    going = [r.run_id for r in deps.state.list_runs(deps.settings.alias, limit=10) if r.finished_at is None]
    refs = list(dict.fromkeys(ref for ref in map(dag_run_of, [*owners, *going]) if ref is not None))
    return [f"task {w.task_id} of {w.dag_id} run {w.run_id} waits in pool {w.pool}, which Airflow does not have: "
            f"it never runs until the pool exists. Create it (`airflow pools set {w.pool} <slots> kb-reindex`; "
            "`make airflow` and the compose init set kb-reindex's pools at start, and the scheduler's kb-reindex "
            "listener when a run starts: is the plugin loaded?)"
            for w in missing_pool_waits(refs) or ()]


def _lock_notes(locks: tuple[LockRow, ...]) -> list[str]:
    """A lock whose holder is gone, named from the state DB alone: on-call needs it most while Qdrant is busy."""
    return [f"lock {held.name} is held by {held.owner}, whose process is gone: the next command takes it over"
            for held in locks if held.owner_gone]


def _live(versions: list[VersionRow], live: VersionRecord | None) -> LiveVersion | None:
    return LiveVersion.of(next(v for v in versions if v.version == live.version)) if live is not None else None


def _collection_problems(versions: list[VersionRow]) -> list[str]:
    """Kept versions whose collection Qdrant lacks, or holds with another point count than the manifest."""
    problems = []
    for v in versions:
        if v.status not in KEPT or v.evicted:
            continue
        if v.points is None:
            problems.append(f"v{v.version} ({v.collection}) is {v.status} in the state DB, but Qdrant has no "
                            "such collection (dropped by hand, or by kb-reindex working with another state DB): "
                            + ("rebuild with `kb-reindex run --force-full`" if v.status == VersionStatus.LIVE else
                               f"`kb-reindex drop --version {v.version}` records it as deleted"))
        elif v.points != v.points_expected:
            problems.append(f"v{v.version} ({v.collection}) holds {v.points} points, manifest lists "
                            f"{v.points_expected}")
    return problems


def _consistent_view(deps: Deps, *, attempts: int = 6, pause_s: float = 0.25) -> tuple[VersionRecord | None, str | None, bool]:
    """(live in the state DB, collection behind the alias, promotion in progress).

    A promotion moves the alias, then writes the state, under the alias lock: read half-way, the two
    disagree for a moment. Both are read, then the state again; a disagreement while the alias lock is
    held by a live process is re-read a few times and, if it lasts, reported as a promotion in progress."""
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
                       if row.name == alias_lock_name(alias) and not row.expired), None)
        moving = not stable or (holder is not None and row_alive(holder))
        if not moving:
            return live, serving, False
        if attempt < attempts - 1:
            time.sleep(pause_s)
    return live, serving, moving


def row_alive(row: LockRecord) -> bool:
    """A lock row whose owner may still be working: alive here, or on another host within its TTL."""
    return row.owner_alive is not False


def _owner_alive(row: LockRecord) -> str:
    if is_dag_run_owner(row.owner) and row.owner_alive is None:
        return "DAG run: alive while its tasks renew the lock"
    return {True: "yes", False: "no", None: "unknown (another host)"}[row.owner_alive]


def lock_rows(deps: Deps | StateDeps) -> tuple[LockRow, ...]:
    """Held locks for status and the page; a DAG run's is alive while Airflow runs it (where it can be asked),
    else while its tasks renew it (no PID to ask)."""
    return tuple(
        LockRow(name=row.name, owner=row.owner, since=utc_stamp(row.acquired_at),
                expires=utc_stamp(row.expires_at), expired=row.expired, owner_alive=_owner_alive(row))
        for row in deps.state.list_locks(subject=deps.settings.alias))


KEPT_NOTES = {"held": "held for a person, never served", "frozen": "built while frozen, never served",
              "shadow": "shadow, never served"}


def version_row(v: VersionRecord, *, target: VersionRecord | None, pins: dict[int, PinRecord],
                serving: str | None, points: int | None, collection_config: Any, kept: str | None = None) -> VersionRow:
    """One version as status and the page show it (Qdrant's `points`, `collection_config` and `kept_as` given)."""
    served = has_served(v)
    validation = v.validation or {}
    return VersionRow(
        version=v.version, collection=v.collection, status=v.status, kind=v.kind,
        points=points, points_expected=v.points_expected, points_written=v.points_written,
        embedder=v.embedder, embed_model=v.embed_model, dim=v.embed_dim,
        payload_layout=v.payload_layout, embed_profile=version_profile(v),
        hit_rate=validation.get("hit_rate"), mrr=validation.get("mrr"),
        created_at=utc_stamp(v.created_at), promoted_at=utc_stamp(v.promoted_at) if v.promoted_at else None,
        live_since=utc_stamp(v.serving_since) if v.serving_since else None,
        rollback_target=bool(target and target.id == v.id),
        rollback_allowed=v.status in (VersionStatus.RETIRED, VersionStatus.READY) and served,
        shadow=v.status == VersionStatus.READY and not served, kept=kept,
        serving=v.collection == serving, error=v.error, run_id=v.run_id,
        collection_config=collection_config, snapshot=v.snapshot_view(),
        pinned=v.version in pins, pin=pin_view(pins.get(v.version)),
        warnings=content_warnings(validation.get("flagged_instructions") or ())
        + tuple(ContentWarning.from_dict(w) for w in validation.get("warnings") or ()),
        changes=DocChanges.from_dict(v.doc_changes) if v.doc_changes else None,
    )


def pin_view(pin: PinRecord | None) -> PinView | None:
    """A version's pin as status and the page show it."""
    if pin is None:
        return None
    return PinView(reason=pin.reason, by=pin.pinned_by, at=utc_stamp(pin.pinned_at))


def live_audit(deps: Deps, live: VersionRecord | None) -> AuditView | None:
    """The newest audit of the version live now (an audit of an earlier live version is history)."""
    found = audit_view(deps.state.last_audit(deps.settings.alias))
    if found is None or live is None or found.version != live.version:
        return None
    return found


@dataclass(frozen=True)
class LastPromotion:
    """The newest promotion as the metrics count it: chunks embedded and reused for what went live, when its
    source changed and when it went live; `points` the version's (what it did not embed it reused: copied from
    live, or kept in its slot by the difference, which the run's copy count does not see)."""

    embedded: int
    reused: int
    source_changed_at: datetime | None
    at: datetime | None
    points: int | None = None

    @property
    def reuse_rate(self) -> float | None:
        """The share of the version's chunks not embedded for it."""
        rate = reuse_rate(total=self.points, embedded=self.embedded, reused=self.reused)
        return None if rate is None else round(rate, 4)


#: alias events that put a newly built version live (a run's promotion, a shadow's or a held version's later)
PROMOTIONS = frozenset({"promote", "migrate"})


def last_promotion(deps: Deps | StateDeps, runs: list[RunRecord]) -> LastPromotion | None:
    """The newest promotion: a build run's own (its counts, as before), or a shadow (or held) version put live
    later by `promote` or the page, counted by what built that version (its record's counts, its build
    run's source change) up to the alias move."""
    alias = deps.settings.alias
    event = next((e for e in reversed(deps.state.alias_events(alias)) if e.action in PROMOTIONS), None)
    if event is None:
        return None
    run = next((r for r in runs if r.run_id == event.run_id), None)
    if run is not None and run.kind in BUILDS and run.outcome == RunOutcome.PROMOTED:
        built = deps.state.get_version(alias, run.version) if run.version is not None else None
        return LastPromotion(embedded=run.chunks_embedded, reused=run.chunks_reused,
                             source_changed_at=run.source_changed_at, at=run.finished_at,
                             points=built.points_expected if built else None)
    version = deps.state.get_version(alias, event.to_version) if event.to_version is not None else None
    if version is None:
        return None
    build = deps.state.get_run(version.run_id) if version.run_id else None
    # what its build run embedded (the version's own count is the plan's: it cannot see vectors taken from a slot)
    embedded = build.chunks_embedded if build is not None and build.chunks_embedded is not None else version.chunks_embedded
    return LastPromotion(embedded=embedded, reused=version.chunks_reused,
                         source_changed_at=build.source_changed_at if build else None, at=event.at,
                         points=version.points_expected)


def metrics(deps: Deps | StateDeps) -> Metrics:
    """Success rate, duration and reuse of the builds, failures by cause, and how long changes take to serve
    (the last promotion: a run's, or a shadow's put live later)."""
    runs = [r for r in deps.state.list_runs(deps.settings.alias, limit=200) if r.kind in BUILDS]
    finished = [r for r in runs if r.outcome != RunOutcome.RUNNING]
    succeeded = [r for r in finished if r.outcome in SUCCEEDED]
    last = last_promotion(deps, finished)
    ready = deps.state.list_versions(deps.settings.alias, statuses=[VersionStatus.READY])
    newest_ready = max((v.ready_at or v.updated_at for v in ready), default=None)
    latency = None
    if last and last.source_changed_at and last.at:
        latency = round((last.at - last.source_changed_at).total_seconds(), 3)
    errors = [r.error for r in finished if r.error]
    return Metrics(
        runs=len(finished),
        run_success_rate=round(len(succeeded) / len(finished), 4) if finished else None,
        last_run_duration_s=(round(finished[0].duration_s, 3)
                             if finished and finished[0].duration_s is not None else None),
        last_changed_chunks=last.embedded if last else None,
        last_embedding_reuse_rate=last.reuse_rate if last else None,
        failed_runs=sum(1 for r in finished if r.outcome == RunOutcome.FAILED),
        alias_switch_failures=sum(1 for e in errors if "alias moved" in e),
        embedding_failures=sum(1 for e in errors if "Ollama" in e or "embedder" in e),
        ready_unpromoted_age_s=round((utcnow() - newest_ready).total_seconds(), 1) if newest_ready else None,
        last_source_to_searchable_s=latency,
    )


def history(deps: Deps | StateDeps) -> list[HistoryEvent]:
    """Every alias move, every lock broken by on-call or taken over from a dead process, every freeze and
    unfreeze, and every retirement (its collections dropped, its undo), in time order."""
    alias = deps.settings.alias
    events = [(e.at, HistoryEvent.move(e)) for e in deps.state.alias_events(alias)]
    events += [(e.at, HistoryEvent.note(e.at, "unlock" if e.action == "unlock" else "lock-takeover",
                                        f"{e.name} held by {e.owner}, broken by {e.by}: {e.reason}"))
               for e in deps.state.lock_events(names=[reindex_lock_name(alias), alias_lock_name(alias)])]
    events += [(e.at, HistoryEvent.note(e.at, e.action, f"by {e.by}: {e.reason}", by=e.by))
               for e in deps.state.freeze_events(alias)]
    events += [(e.at, HistoryEvent.note(e.at, e.action, f"by {e.by}: {e.reason}", by=e.by))
               for e in deps.state.retirement_events(alias)]
    return [event for _, event in sorted(events, key=lambda pair: pair[0])]
