"""The run recorder: every run (CLI or DAG, reindex, migration, rollback, promotion) is one row of the state
DB, started, counted and finished here, and a failure is recorded through `errors.classify`, the one error
policy. Also the alias's reindex lock a CLI run holds (`exclusive`) and the recorded rollback, which the
watch calls too (so this module sits below the pipeline and the watch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import cast
from datetime import UTC, datetime
from kb_reindex.services import metrics
from kb_reindex.domain.errors import AliasMovedError, EmbeddingError, Failure, KbError, LockHeldError, classify
from kb_reindex.rules.locking import reindex_lock_name
from kb_reindex.domain.model import RunKind, RunOutcome
from kb_reindex.domain.planning import Plan
from kb_reindex.domain.validation_model import ContentWarning
from kb_reindex.rules.content_warnings import content_warnings
from kb_reindex.steps.rollback import Rescore, RollbackResult, check_rollback, rollback
from kb_reindex.services.runtime import Deps, StateDeps, new_run_id
from kb_reindex.services.state.runs import RunCounterColumns
from kb_reindex.services.state.store import StateStore
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.services.state.locks import default_lock_owner
from kb_reindex.services.store import describe_qdrant_failure
from kb_reindex.steps.validate import validate

log = logging.getLogger(__name__)


@contextmanager
def exclusive(deps: Deps, *, run_id: str | None = None) -> Iterator[str]:
    """The alias's reindex lock, taken by every command that builds or changes state (run, migrate, reconcile,
    drop, gc, validate): waited for up to KB_LOCK_WAIT seconds, then refused by name. Not by a rollback: it
    needs only the short alias lock of the move, so a build of hours never delays it. The wait passes as
    `deps.waiter` passes it: asleep in the CLI, off its worker slot in a DAG task that asked for that."""
    settings = deps.settings
    with deps.state.lock(reindex_lock_name(settings.alias), owner=default_lock_owner(run_id),
                         ttl_s=settings.lock_ttl_s, wait_s=settings.lock_wait_s, waiter=deps.waiter) as owner:
        yield owner


def ensure_lock_held(deps: Deps, owner: str) -> None:
    """Before anything the readers see moves: a lock broken by on-call (or lost) stops this run here."""
    if not deps.state.holds_lock(reindex_lock_name(deps.settings.alias), owner=owner):
        raise LockHeldError(
            f"this run no longer holds the lock on {deps.settings.alias} (broken with `kb-reindex unlock`, or "
            "expired and taken); nothing was promoted"
        )


def failure_of(exc: BaseException, deps: Deps | StateDeps) -> Failure:
    """errors.classify with this deployment's state DB and Qdrant server named."""
    store = getattr(deps, "store", None)
    return classify(exc, state_url=deps.settings.state_url,
                    qdrant=lambda e: describe_qdrant_failure(e, deps.settings, store.client if store else None))


@dataclass(frozen=True)
class RunCounters:
    """The run record's figures `finish_run` writes; a field left None is not written (`as_columns()`)."""

    source_changed_at: datetime | None = None
    docs_added: int | None = None
    docs_changed: int | None = None
    docs_unchanged: int | None = None
    docs_removed: int | None = None
    chunks_total: int | None = None
    chunks_embedded: int | None = None
    chunks_reused: int | None = None

    def as_columns(self) -> RunCounterColumns:
        """The `finish_run` keywords: the run table's columns that are set."""
        return cast(RunCounterColumns, {name: value for name, value in vars(self).items() if value is not None})


def run_counters(plan: Plan, built: RunCounters | None = None) -> RunCounters:
    """The run record's plan columns: documents added/changed/unchanged/removed, chunks, when the source changed;
    with `built`, what the build steps wrote."""
    docs, changed_at = plan.docs, plan.source_changed_at
    return RunCounters(
        source_changed_at=datetime.fromtimestamp(changed_at, UTC).replace(tzinfo=None) if changed_at else None,
        docs_added=docs.added, docs_changed=docs.changed, docs_unchanged=docs.unchanged, docs_removed=docs.removed,
        chunks_total=plan.chunks.total, chunks_embedded=built.chunks_embedded if built else None,
        chunks_reused=built.chunks_reused if built else None)


def no_change_counters(plan: Plan) -> RunCounters:
    """What a run that found nothing to build records, from the CLI and the DAG alike: no chunk was
    embedded or reused, because nothing was built."""
    return RunCounters(docs_unchanged=plan.docs.unchanged, chunks_total=plan.chunks.total)


@dataclass(frozen=True)
class Recorder:
    """One run's row: `start`, then exactly one of `finish` or `fail`. The chunk counts are what the build
    steps of this run added to the row as they wrote (`add_run_chunks`), in one process or in many tasks.
    `judge` is errors.classify bound to this deployment (`failure_of`); `Recorder.of` makes one from deps."""

    state: StateStore
    run_id: str
    alias: str | None = None
    judge: Callable[[BaseException], Failure] = classify

    @classmethod
    def of(cls, deps: Deps | StateDeps, run_id: str) -> Recorder:
        return cls(deps.state, run_id, deps.settings.alias, lambda exc: failure_of(exc, deps))

    def start(self, kind: RunKind, trigger: str) -> None:
        assert self.alias is not None, "a run is started for an alias"
        self.state.start_run(run_id=self.run_id, alias=self.alias, kind=kind, trigger=trigger)

    def version(self, number: int) -> None:
        """The version this run builds: a run that dies now is found by the next (`fail_orphaned_runs`)."""
        self.state.update_run(self.run_id, version=number)

    def built(self) -> RunCounters:
        """What the build steps of this run wrote, as they added it to the run's record."""
        row = self.state.get_run(self.run_id)
        return RunCounters(chunks_embedded=row.chunks_embedded if row else 0,
                           chunks_reused=row.chunks_reused if row else 0)

    def finish(self, outcome: RunOutcome, *, version: int | None = None, plan: Plan | None = None,
               reason: str | None = None) -> None:
        """The run ended as it should: a run that built records the plan's figures and what it wrote; a run
        that found nothing to build (no change, dry run) records what the plan found unchanged. `reason`: why a
        version was kept unpromoted (held), in the run's error column where on-call reads it."""
        counters = RunCounters()
        if plan is not None and outcome == RunOutcome.NO_CHANGE and plan.no_change:
            counters = no_change_counters(plan)
        elif plan is not None:
            counters = run_counters(plan, self.built() if outcome != RunOutcome.DRY_RUN else None)
        columns = counters.as_columns()
        columns["version"] = version
        self.state.finish_run(self.run_id, outcome=outcome, error=reason, **columns)

    def fail(self, exc: BaseException, *, retry_left: bool = False, version: int | None = None) -> Failure:
        """The one failure path: classify the exception (errors.classify), log and count it, and record the run
        as failed when it really ends: always for a permanent error, for a transient one only when no retry
        follows (`retry_left`: an Airflow task that will be tried again). A state DB that is gone is not
        written to: the next run records this one as failed (it takes over the dead run's lock)."""
        failure = self.judge(exc)
        if not failure.expected:
            log.exception("kb_reindex: unexpected error", exc_info=exc)
        if isinstance(exc, AliasMovedError) and self.alias is not None:
            metrics.incr("alias_switch.failures", alias=self.alias)
        if isinstance(exc, EmbeddingError) and self.alias is not None:
            metrics.incr("embedding.batch_failures", alias=self.alias)
        final = not failure.transient or not retry_left
        if final and failure.kind != "state_unreachable":
            try:
                columns: RunCounterColumns = {"version": version} if version is not None else {}
                self.state.finish_run(self.run_id, outcome=RunOutcome.FAILED, error=failure.message, **columns)
            except Exception as lost:  # reported in one line; the run's own failure is what is returned
                unrecorded = self.judge(lost)
                if not unrecorded.expected:
                    raise
                log.error("kb_reindex: run %s could not be recorded as failed: %s", self.run_id, unrecorded.message)
        log.error("kb_reindex: run %s failed: %s", self.run_id, failure.message)
        return failure


#: kinds of what a rollback brings back besides the target's flagged lines (kind `instruction`)
MODEL_DIFFERS, LAYOUT_DIFFERS = "model_differs", "layout_differs"


def rollback_warnings(live: VersionRecord, target: VersionRecord) -> tuple[ContentWarning, ...]:
    """What a rollback from `live` to `target` brings back, for on-call to read before confirming (the CLI's
    prompt and `--json`, the DAG's result, the page's confirm dialog): every instruction-like line the
    target's validation recorded (kind `instruction`, by document and line), and, when they differ from
    live's, its embedding model (`model_differs`: readers then embed queries with it) and its payload layout
    (`layout_differs`: consumers read other payload fields). A version-wide warning names no document:
    `knowledge_key` "" and `line` 0."""
    found = list(content_warnings((target.validation or {}).get("flagged_instructions") or ()))
    same_model = (target.embedder, target.embed_model, target.embed_dim) == (live.embedder, live.embed_model,
                                                                             live.embed_dim)
    if not same_model:
        found.append(ContentWarning(
            kind=MODEL_DIFFERS, knowledge_key="", line=0,
            text=f"v{target.version} embeds with {target.embed_model} {target.embed_dim}-d ({target.embedder}), live "
                 f"v{live.version} with {live.embed_model} {live.embed_dim}-d ({live.embedder}): after the rollback "
                 f"readers embed their queries with v{target.version}'s model"))
    if target.payload_layout != live.payload_layout:
        found.append(ContentWarning(
            kind=LAYOUT_DIFFERS, knowledge_key="", line=0,
            text=f"v{target.version}'s payloads are in the {target.payload_layout} layout, live v{live.version}'s in "
                 f"the {live.payload_layout} layout: consumers that read the live layout's fields read other ones"))
    return tuple(found)


def warning_line(warning: ContentWarning) -> str:
    """One warning as the CLI and the logs say it."""
    if warning.knowledge_key:
        return f"{warning.kind}-like line in {warning.knowledge_key} line {warning.line}: {warning.text}"
    return f"{warning.kind}: {warning.text}"


def run_rollback(deps: Deps, *, reason: str, to_version: int | None = None, run_id: str | None = None,
                 trigger: str = "cli", revalidate: bool = True, action: str = "rollback",
                 expected_live: int | None = None, by: str | None = None) -> RollbackResult:
    """A recorded rollback: checked (`rollback.check_rollback`, a stale `expected_live` refused before anything
    is scored), the target scored for the record (`revalidate`), then moved (`rollback.rollback`, the
    compare-and-swap from the live version checked). No reindex lock, so a build in flight never delays it.
    `by`: who asked (the Airflow user who triggered the DAG run, the CLI's login user), recorded with the
    move. The result names what it brought back (`rollback_warnings`), each also logged once."""
    recorder = Recorder.of(deps, run_id or new_run_id(RunKind.ROLLBACK))
    recorder.start(RunKind.ROLLBACK, trigger)
    try:
        move = check_rollback(deps, reason=reason, to_version=to_version, expected_live=expected_live)
        if revalidate and deps.settings.ignored:  # a default taken for a mistake may be the golden set's, or
            # the model server's: a score from it would be a guess put on the record
            log.warning("kb_reindex: the rollback target is not scored on a golden set: %d setting(s) were left "
                        "out (%s)", len(deps.settings.ignored), "; ".join(deps.settings.ignored))
            revalidate = False
        scores = rescore(deps, move.target) if revalidate else None
        result = rollback(deps, move, run_id=recorder.run_id, action=action, scores=scores, by=by)
    except KbError as exc:
        deps.state.finish_run(recorder.run_id, outcome=RunOutcome.FAILED, error=str(exc))
        raise
    recorder.finish(RunOutcome.ROLLED_BACK, version=result.to_version)
    warnings = rollback_warnings(move.live, move.target)
    for w in warnings:
        log.warning("kb_reindex: %s: the rollback to v%d brought back: %s", deps.settings.alias, result.to_version,
                    warning_line(w))
    return replace(result, warnings=warnings)


def rescore(deps: Deps, target: VersionRecord) -> Rescore:
    """A rollback target's golden-set scores, for the record. A golden set that names newer documents, a bad
    file in the folder or an embedder outage must not stand between on-call and a structurally whole version:
    a failure to score is recorded, and the rollback goes on."""
    try:
        return Rescore.of(validate(deps, target.version, compare_live=False, raise_on_failure=False))
    except KbError as exc:
        log.warning("kb_reindex: re-scoring v%d failed (%s); rolling back anyway", target.version, exc)
        return Rescore(passed=None, error=str(exc))
