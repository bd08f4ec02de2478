"""One orchestration: the step sequence plan -> create version -> build (slices) -> validate -> promote ->
watch -> cleanup, and the whole run the CLI chains from it in one process.

The DAG tasks (kb_reindex.airflow.tasks) call the same step functions, one per task, and record the run through
the same `Recorder` (kb_reindex.run.runs): a CLI run and a DAG run count and end alike. A failure leaves the alias
where it was; the result says what failed and why. On-call's promotion of a shadow is sequenced here too
(`promote_shadow`: checked, validated again, moved).
"""

from __future__ import annotations

import logging

from dataclasses import dataclass, field, replace
from typing import Any

from kb_reindex.steps.build import BuildCounts, build, create_version
from kb_reindex.steps.golden import load_golden_set
from kb_reindex.domain.errors import AliasFrozen, ConfigError
from kb_reindex.rules.content_loss import ContentLoss, content_loss
from kb_reindex.rules.instruction_hold import Hold, InstructionHold, instruction_hold
from kb_reindex.rules.fence import Fence
from kb_reindex.rules.retirement import ensure_not_retired
from kb_reindex.rules.freeze import FreezeView, frozen_view
from kb_reindex.rules.locking import reindex_lock_name
from kb_reindex.domain.model import RunKind, RunOutcome
from kb_reindex.steps.plan import prepare_logged
from kb_reindex.domain.planning import BuildResult, CreatedVersion, DocCounts, Plan
from kb_reindex.steps.promote import PromoteResult, check_shadow, promote, promote_checked_shadow
from kb_reindex.steps.review import supersede_held
from kb_reindex.steps.retention import CleanupResult, cleanup
from kb_reindex.run.runs import Recorder, ensure_lock_held, exclusive
from kb_reindex.services.runtime import Deps, new_run_id
from kb_reindex.steps.snapshot import snapshot_plan
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.steps.validate import validate
from kb_reindex.domain.validation_model import ContentWarning, ReplayReport, ValidationResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunChunks:
    """What this run did (`embedded`, `copied`, `skipped` as already written by an earlier attempt),
    beside what the plan expected (`planned_embed`, `planned_reuse`): a resumed or failed run differs."""

    total: int = 0
    embedded: int = 0
    copied: int = 0
    skipped: int = 0
    planned_embed: int = 0
    planned_reuse: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"total": self.total, "embedded": self.embedded, "copied": self.copied, "skipped": self.skipped,
                "planned_embed": self.planned_embed, "planned_reuse": self.planned_reuse}


def chunk_counts(plan: Plan | None, done: BuildCounts) -> RunChunks:
    """The run's chunk figures: the plan's expectation beside what the build wrote (`done`)."""
    total, embedded, reused = (plan.chunks.total, plan.chunks.embedded, plan.chunks.reused) if plan else (0, 0, 0)
    return RunChunks(total=total, embedded=done.embedded, copied=done.copied, skipped=done.skipped,
                     planned_embed=embedded, planned_reuse=reused)


@dataclass(frozen=True)
class ValidationSummary:
    """What a run's JSON and the CLI carry of a validation (`to_dict()`): the scores and failures; the per-category,
    paired and replay figures as the stored record has them (the replay without its per-query rows)."""

    passed: bool
    hit_rate: float | None  # None: no golden set, nothing probed
    mrr: float | None
    regressions: int
    failures: tuple[str, ...] = ()
    live_hit_rate: float | None = None
    live_mrr: float | None = None
    report: str | None = None
    by_category: list[dict[str, Any]] | None = None
    paired: dict[str, Any] | None = None
    replay: ReplayReport | None = None  # its totals only are carried
    #: tenant changes and duplicates the validation found (the run's `warnings` list them after the plan's)
    warnings: tuple[ContentWarning, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "hit_rate": self.hit_rate, "mrr": self.mrr, "regressions": self.regressions,
                "live_hit_rate": self.live_hit_rate, "live_mrr": self.live_mrr, "failures": list(self.failures),
                "report": self.report, "by_category": self.by_category, "paired": self.paired,
                "replay": self.replay.to_dict(per_query=False) if self.replay is not None else None,
                "warnings": [w.to_dict() for w in self.warnings]}


@dataclass(frozen=True)
class RunResult:
    """What a whole run did; `to_dict()` is the JSON `kb-reindex run --json` prints (keys as they always were:
    the optional ones only when the run got that far)."""

    outcome: str = RunOutcome.FAILED  # a RunOutcome; the CLI's watch adds `auto_rolled_back` and `regressed`
    version: int | None = None
    collection: str | None = None
    docs: DocCounts = field(default_factory=DocCounts)
    chunks: RunChunks = field(default_factory=RunChunks)
    validation: ValidationSummary | None = None
    error: str | None = None
    error_kind: str | None = None
    plan: Plan | None = None  # set once planned (with `notes`); kept out of the CLI's output
    build: BuildResult | None = None
    lowered_thresholds: str | None = None
    frozen: FreezeView | None = None
    held: Hold | None = None
    #: versions waiting before this one (held, or kept while frozen) that it superseded (declined: only the newest waits)
    superseded: tuple[int, ...] = ()
    cleanup: CleanupResult | None = None

    @property
    def warnings(self) -> tuple[ContentWarning, ...]:
        """What the plan's files hold that no check judges, then what the validation found (the JSON's `warnings`)."""
        return (*(self.plan.warnings if self.plan else ()), *(self.validation.warnings if self.validation else ()))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"outcome": self.outcome, "version": self.version, "collection": self.collection,
                               "docs": self.docs.to_dict(), "chunks": self.chunks.to_dict(),
                               "validation": self.validation.to_dict() if self.validation else None,
                               "error": self.error, "error_kind": self.error_kind}
        if self.plan is not None:
            out.update(plan=self.plan.to_dict(), notes=list(self.plan.notes), doc_keys=self.plan.doc_keys.to_dict(),
                       warnings=[w.to_dict() for w in self.warnings])
        optional = {"audit": self.plan.audit.to_dict() if self.plan and self.plan.audit else None,
                    "build": self.build.to_dict() if self.build else None,
                    "lowered_thresholds": self.lowered_thresholds,
                    "frozen": self.frozen.to_dict() if self.frozen else None,
                    "held": self.held.to_dict() if self.held else None,
                    "superseded": list(self.superseded),
                    "cleanup": self.cleanup.to_dict() if self.cleanup else None}
        out.update({k: v for k, v in optional.items() if v})
        return out


def empty_result(outcome: str = RunOutcome.FAILED) -> RunResult:
    """A run before any step: what `kb-reindex plan` fills in for its human summary."""
    return RunResult(outcome=outcome)


def validation_summary(result: dict[str, Any] | ValidationResult) -> ValidationSummary:
    """The summary of a fresh validation, or of a version's stored record (its JSON)."""
    record = result.to_dict() if isinstance(result, ValidationResult) else result
    return ValidationSummary(
        passed=record["passed"], hit_rate=record["hit_rate"], mrr=record["mrr"], regressions=record["regressions"],
        failures=tuple(record["failures"]), live_hit_rate=record.get("live_hit_rate"),
        live_mrr=record.get("live_mrr"), report=record.get("report"), by_category=record.get("by_category"),
        paired=record.get("paired"),
        replay=ReplayReport.from_dict(replayed) if (replayed := record.get("replay")) is not None else None,
        warnings=tuple(ContentWarning.from_dict(w) for w in record.get("warnings") or ()))


@dataclass(frozen=True)
class RunRequest:
    """What a run is asked to do: the CLI's flags, or a DAG run's kind and Params."""

    kind: RunKind = RunKind.REINDEX
    force_full: bool = False
    dry_run: bool = False
    embedder: str | None = None
    model: str | None = None
    dim: int | None = None
    layout: str | None = None
    layout_from: str = "--layout"  # where `layout` was given, as an error about it names it
    promote: bool = True  # False: build and validate a shadow only
    min_hit_rate: float | None = None
    min_mrr: float | None = None
    #: a change feed: the names that changed since the last plan read the source (`plan.prepare`'s `changed`)
    changed: tuple[str, ...] | None = None


# --- the steps: each one DAG task, and one stage of the CLI's run ---------------------------------------


def plan_step(deps: Deps, recorder: Recorder, request: RunRequest) -> Plan:
    """The only step that reads the knowledge folder. Under the run's lock: runs that died are recorded as
    failed, then the plan; one that builds is snapshotted in the state DB (version, manifest, texts to embed),
    and the plan names its version (`version`). The scan itself (tens of MB at 100k chunks) is not kept. A retired
    knowledge base is refused here, under the lock `retire` takes from a run in progress."""
    ensure_not_retired(deps)
    deps.state.fail_orphaned_runs(deps.settings.alias, current=recorder.run_id)
    prepared = prepare_logged(deps, force_full=request.force_full or request.kind == RunKind.MIGRATION,
                              kind=request.kind, embedder=request.embedder, model=request.model, dim=request.dim,
                              layout=request.layout, layout_from=request.layout_from, audit_run_id=recorder.run_id,
                              record=True, changed=request.changed)
    if builds(prepared.plan, dry_run=request.dry_run):
        return snapshot_plan(deps, prepared, run_id=recorder.run_id)
    return prepared.plan


def plan_and_snapshot(deps: Deps, *, run_id: str | None = None, **options: Any) -> Plan:
    """A plan (`plan.prepare`'s `options`) and, when it builds, its snapshot: the plan `create_version` takes,
    outside a recorded run (scripts, tests; a run's plan is `plan_step`)."""
    prepared = prepare_logged(deps, **options)
    return prepared.plan if prepared.plan.no_change else snapshot_plan(deps, prepared, run_id=run_id)


def builds(plan: Plan, *, dry_run: bool) -> bool:
    """Whether the run goes on past its plan: something changed, and more than a dry run was asked for."""
    return not plan.no_change and not dry_run


def finish_unbuilt(recorder: Recorder, plan: Plan) -> RunOutcome:
    """The end of a run that builds nothing: `no_change`, or `dry_run` (what would change, reported)."""
    outcome = RunOutcome.NO_CHANGE if plan.no_change else RunOutcome.DRY_RUN
    recorder.finish(outcome, version=plan.base_version, plan=plan)
    return outcome


def create_version_step(deps: Deps, recorder: Recorder, plan: Plan) -> CreatedVersion:
    created = create_version(deps, plan, run_id=recorder.run_id)
    recorder.version(created.version)
    return created


def recorded_version(deps: Deps, number: int) -> VersionRecord:
    """The state DB's row of this alias's version `number`; a version that is not there is a clear error."""
    record = deps.state.get_version(deps.settings.alias, number)
    if record is None:
        raise ConfigError(f"version {number} does not exist (alias {deps.settings.alias!r} in the state DB)")
    return record


def build_windows(deps: Deps, version_number: int, slice_size: int) -> list[tuple[int, int]]:
    """(offset, limit) windows over the version's manifest: one mapped build task each."""
    total = recorded_version(deps, version_number).points_expected
    return [(start, slice_size) for start in range(0, max(total, 1), slice_size)]


def build_step(deps: Deps, recorder: Recorder, version_number: int, fence: Fence, *,
               window: tuple[int, int] | None = None, counts: BuildCounts | None = None) -> BuildResult:
    """Fill the version (or one window of it); what is written is added to the run's record as it goes."""
    return build(deps, version_number, run_id=recorder.run_id, window=window, counts=counts, fence=fence)


def validate_step(deps: Deps, version_number: int, request: RunRequest) -> ValidationSummary:
    return validation_summary(validate(deps, version_number, min_hit_rate=request.min_hit_rate,
                                       min_mrr=request.min_mrr))


@dataclass(frozen=True)
class Promotion:
    """How the promote step ended: `PROMOTED` (the alias moved, by this run), `NO_CHANGE` (the version was
    already live, moved by an earlier run), `FROZEN` (kept ready until unfreeze) or `SHADOW` (not asked)."""

    outcome: RunOutcome
    version: int
    previous_version: int | None = None
    lowered_thresholds: str | None = None
    frozen: FreezeView | None = None
    held: Hold | None = None
    #: versions waiting before this one (held, or kept while frozen) that it superseded (declined: only the newest waits)
    superseded: tuple[int, ...] = ()

    @property
    def moved(self) -> bool:
        return self.outcome == RunOutcome.PROMOTED

    def superseded_note(self) -> str:
        """"; it supersedes v2, held before it (declined: ...)", or nothing when it superseded none."""
        if not self.superseded:
            return ""
        waiting = self.held is not None or self.outcome == RunOutcome.FROZEN
        why = "only the newest waits" if waiting else "promoting one now would put older text back"
        before = {RunOutcome.FROZEN: "kept while frozen before it", RunOutcome.PROMOTED: "waiting before it"}.get(
            self.outcome, "held before it")
        return f"; it supersedes {', '.join(f'v{n}' for n in self.superseded)}, {before} (declined: {why})"

    def held_message(self) -> str:
        """Why the version waits for a person and how to answer, with the versions it superseded."""
        assert self.held is not None
        return self.held.message(self.version) + self.superseded_note()

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": str(self.outcome), "version": self.version, "previous_version": self.previous_version,
                "lowered_thresholds": self.lowered_thresholds,
                "frozen": self.frozen.to_dict() if self.frozen else None,
                "held": self.held.to_dict() if self.held else None, "superseded": list(self.superseded)}


@dataclass(frozen=True)
class AliasMove:
    """The last recorded move of the alias to a version: which run moved it, from which version."""

    run_id: str | None
    from_version: int | None


def _last_move(deps: Deps, version_number: int) -> AliasMove | None:
    moves = [e for e in deps.state.alias_events(deps.settings.alias) if e.to_version == version_number]
    return AliasMove(run_id=moves[-1].run_id, from_version=moves[-1].from_version) if moves else None


def promote_step(deps: Deps, recorder: Recorder, plan: Plan, version_number: int, fence: Fence, *,
                 request: RunRequest) -> Promotion:
    """Move the alias (compare-and-swap) and record how the run ended. A version already live moved nothing,
    unless this very run moved it in an attempt that died before reporting; a frozen alias moves nothing and
    the version is kept ready; `request.promote` off keeps a shadow."""
    if not request.promote:
        recorder.finish(RunOutcome.SHADOW, version=version_number, plan=plan)
        return Promotion(RunOutcome.SHADOW, version_number)
    if (held := held_for_a_person(deps, plan, version_number)) is not None:  # a person decides, not the pipeline
        promotion = Promotion(RunOutcome.HELD, version_number, held=held,
                              superseded=_supersede(deps, version_number, held))
        recorder.finish(RunOutcome.HELD, version=version_number, plan=plan, reason=promotion.held_message())
        log.warning("kb_reindex: %s", promotion.held_message())
        return promotion
    ensure_lock_held(deps, fence.owner)
    try:
        result: PromoteResult = promote(deps, version_number, run_id=recorder.run_id, fence=fence)
    except AliasFrozen as frozen:  # built and validated; kept ready until unfreeze
        recorder.finish(RunOutcome.FROZEN, version=version_number, plan=plan)
        kept = Promotion(RunOutcome.FROZEN, version_number, frozen=frozen_view(deps, frozen),
                         superseded=_supersede(deps, version_number, None, frozen=True))
        if kept.superseded:
            log.warning("kb_reindex: v%d is kept while frozen%s", version_number, kept.superseded_note())
        return kept
    previous = result.previous_version
    moved = not result.already_live
    if not moved and (last := _last_move(deps, version_number)) is not None and last.run_id == recorder.run_id:
        moved, previous = True, last.from_version
    outcome = RunOutcome.PROMOTED if moved else RunOutcome.NO_CHANGE
    recorder.finish(outcome, version=version_number, plan=plan)
    promotion = Promotion(outcome, version_number, previous_version=previous,
                          lowered_thresholds=result.lowered_thresholds,
                          superseded=_supersede(deps, version_number, None) if moved else ())
    if promotion.superseded:
        log.warning("kb_reindex: v%d is promoted%s", version_number, promotion.superseded_note())
    return promotion


def _supersede(deps: Deps, version_number: int, held: Hold | None, *, frozen: bool = False) -> tuple[int, ...]:
    """`steps.review.supersede_held`, as housekeeping: should it fail, the older versions keep waiting (as before
    this version was held or promoted), the failure is logged, and the run ends as it would have."""
    try:
        return supersede_held(deps.state, recorded_version(deps, version_number), held, frozen=frozen)
    except Exception as exc:  # noqa: BLE001 - the hold stands either way; what waited before keeps waiting
        log.warning("kb_reindex: v%d: the versions held before it were not superseded (%s: %s): they keep "
                    "waiting for a person", version_number, type(exc).__name__, exc)
        return ()


def held_for_a_person(deps: Deps, plan: Plan, version_number: int) -> Hold | None:
    """Why the version must wait for a person before it serves (content loss, new instruction-like lines under
    KB_INSTRUCTION_POLICY=hold), or None: it may go live by itself."""
    hold = Hold(loss=content_held(deps, plan, version_number), instructions=instructions_held(deps, version_number))
    return hold if hold.held else None


def instructions_held(deps: Deps, version_number: int) -> InstructionHold | None:
    """Under KB_INSTRUCTION_POLICY=hold, the version's flagged lines (as its validation recorded them) that
    live does not serve (kb_reindex.rules.instruction_hold); None when none, or under another policy. With
    nothing live (a first build) every flagged line is new: nobody has accepted it, so it is held too."""
    if deps.settings.instruction_policy != "hold":
        return None
    record = recorded_version(deps, version_number)
    live = deps.state.live_version(deps.settings.alias)
    flagged = (record.validation or {}).get("flagged_instructions") or []
    # asked again of the version that serves, what it serves was let through
    served = ([] if live is None else flagged if live.id == record.id
              else (live.validation or {}).get("flagged_instructions") or [])
    hold = instruction_hold(flagged, served)
    if hold.held:
        return hold
    return None


def content_held(deps: Deps, plan: Plan, version_number: int) -> ContentLoss | None:
    """The content loss of the plan against live, when it must be held for a person (kb_reindex.rules.content_loss),
    by the thresholds of the golden set the plan recorded."""
    if plan.base_version is None:  # a first build loses nothing
        return None
    live = deps.state.get_version(deps.settings.alias, plan.base_version)
    if live is None:
        return None
    record = recorded_version(deps, version_number)
    snapshot = deps.state.snapshot(record.id)
    golden = load_golden_set(deps.settings.golden_set, text=snapshot.golden if snapshot else None)
    live_chunks, lost = deps.state.chunks_lost(record.id, live.id)
    loss = content_loss(plan, live_chunks=live_chunks, lost=lost, max_docs_removed=golden.max_docs_removed,
                        max_shrink=golden.max_shrink)
    return loss if loss.held else None


def promote_shadow(deps: Deps, version_number: int, *, expected_live: int | None, run_id: str | None = None,
                   reason: str = "explicit promotion of a shadow version", by: str | None = None) -> PromoteResult:
    """On-call puts a shadow (built and validated, never served) behind the alias on purpose: checked
    (`promote.check_shadow`), validated again against what serves now by the thresholds it was built with (a
    failure leaves it a shadow), then moved by the same compare-and-swap, from `expected_live`, the version
    on-call confirmed serving (None: nothing serves); if another serves by the move, nothing moves. `by`: who
    asked (the Airflow user who triggered it, the CLI's login user), recorded with the alias move."""
    shadow = check_shadow(deps, version_number, expected_live=expected_live)
    built_with = (shadow.version.validation or {}).get("thresholds") or {}
    checked = validate(deps, version_number, min_hit_rate=built_with.get("min_hit_rate"),
                       min_mrr=built_with.get("min_mrr"), record=False)
    return promote_checked_shadow(deps, shadow, checked, run_id=run_id, reason=reason, by=by)


def cleanup_step(deps: Deps) -> CleanupResult:
    """Retention after any run that did not fail, never touching live or the rollback target."""
    return cleanup(deps)


# --- the CLI's whole run ---------------------------------------------------------------------------------


def run_reindex(
    deps: Deps,
    *,
    force_full: bool = False,
    dry_run: bool = False,
    run_id: str | None = None,
    trigger: str = "cli",
    kind: str = RunKind.REINDEX,
    embedder: str | None = None,
    model: str | None = None,
    dim: int | None = None,
    promote_version: bool = True,
    min_hit_rate: float | None = None,
    min_mrr: float | None = None,
    layout: str | None = None,
    changed: tuple[str, ...] | None = None,
) -> RunResult:
    """plan -> create version -> build -> validate -> promote -> cleanup, under the reindex lock, in one process.
    `changed`: a change feed (`RunRequest.changed`)."""
    request = RunRequest(kind=RunKind(kind), force_full=force_full, dry_run=dry_run, embedder=embedder, model=model,
                         dim=dim, layout=layout, promote=promote_version, min_hit_rate=min_hit_rate, min_mrr=min_mrr,
                         changed=changed)
    recorder = Recorder.of(deps, run_id or new_run_id(request.kind))
    recorder.start(request.kind, trigger)
    done = BuildCounts()
    progress = _Progress(RunResult())
    try:
        with exclusive(deps, run_id=recorder.run_id) as owner:
            plan = plan_step(deps, recorder, request)
            progress.result = replace(progress.result, docs=plan.docs, chunks=chunk_counts(plan, done),
                                      plan=plan)
            if not builds(plan, dry_run=dry_run):
                outcome = finish_unbuilt(recorder, plan)
                if outcome == RunOutcome.NO_CHANGE:
                    return replace(progress.result, outcome=outcome, version=plan.base_version,
                                   collection=plan.base_collection)
                return replace(progress.result, outcome=outcome)
            fence = Fence(reindex_lock_name(deps.settings.alias), owner)
            _build_and_release(deps, recorder, request, plan, fence, done, progress)
            return progress.result
    except Exception as exc:
        return _failed(deps, recorder, exc, progress.result, done)


@dataclass
class _Progress:
    """What the run has done so far: returned as it stands when a step fails."""

    result: RunResult


def _build_and_release(deps: Deps, recorder: Recorder, request: RunRequest, plan: Plan, fence: Fence,
                       done: BuildCounts, progress: _Progress) -> None:
    created = create_version_step(deps, recorder, plan)
    number = created.version
    progress.result = replace(progress.result, version=number, collection=created.collection)
    with deps.state.sharing_differences():  # the version against its slot's base: asked once for both
        built = build_step(deps, recorder, number, fence, counts=done)
        progress.result = replace(progress.result, build=built, chunks=chunk_counts(plan, done))
        progress.result = replace(progress.result, validation=validate_step(deps, number, request))
    promotion = promote_step(deps, recorder, plan, number, fence, request=request)
    progress.result = replace(progress.result, outcome=promotion.outcome,
                              lowered_thresholds=promotion.lowered_thresholds, frozen=promotion.frozen,
                              held=promotion.held, superseded=promotion.superseded)
    progress.result = replace(progress.result, cleanup=cleanup_step(deps))


def _failed(deps: Deps, recorder: Recorder, exc: Exception, result: RunResult, done: BuildCounts) -> RunResult:
    """The failure path: recorded through the one error policy; the version's validation, if it got that far."""
    failure = recorder.fail(exc, version=result.version)
    result = replace(result, outcome=RunOutcome.FAILED, error=failure.message, error_kind=failure.kind,
                     chunks=chunk_counts(result.plan, done) if result.plan is not None else result.chunks)
    if result.version is not None and failure.kind != "state_unreachable":
        try:
            record = deps.state.get_version(deps.settings.alias, result.version)
        except Exception as lost:  # the state DB went with the run: said in one line, the run's failure stands
            recorder.fail(lost, retry_left=True)
            return result
        if record is not None and record.validation:
            result = replace(result, validation=validation_summary(record.validation))
    return result
