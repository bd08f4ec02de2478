"""The watch after a promotion: for a window, look at what readers get, and undo the promotion if it regressed.

Why: validation judged the candidate before it served; some failures show only once it serves (a
collection damaged after validation, real traffic the log had not seen). Every `interval` for `minutes`:
- the golden probes are searched **through the alias**, as readers search: hit rate and MRR below the
  version's thresholds, or more probes lost than `max_regressions` (against its own validation), regress;
- the query log's empty-result rate of the queries this version answered since its promotion (once at
  least `replay.watch_min_queries` were asked) may not exceed the previous version's logged rate (or, with
  none logged, the replay's live rate) by more than `replay.max_empty_increase`.
On a regression the alias goes back with the same compare-and-swap as a rollback (alias event
`auto-rollback`, the reason naming the signal), only while the alias still points at the version this
watch was started for: a watch whose alias moved meanwhile (a rollback, another promotion) stops, moving
nothing. The CLI (`kb-reindex run --watch MINUTES`) calls `watch`; knowledge_watch's rescheduled `watch` sensor
takes one `look_once` a poke.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kb_reindex.domain.errors import AliasMovedError, KbError
from kb_reindex.steps.golden import first_hit_rank, load_golden_set, score
from kb_reindex.domain.model import WatchOutcome
from kb_reindex.run.runs import run_rollback
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.versions import VersionRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WatchCheck:
    """One look of the watch: the golden probes through the alias, the query log since the promotion."""

    hit_rate: float | None  # None: no golden set, no probe to look with
    mrr: float | None
    lost_probes: tuple[str, ...]
    logged_queries: int
    empty_rate: float | None
    signals: tuple[str, ...]

    @property
    def regressed(self) -> bool:
        return bool(self.signals)

    def to_dict(self) -> dict[str, Any]:
        return {"hit_rate": self.hit_rate, "mrr": self.mrr, "lost_probes": list(self.lost_probes),
                "logged_queries": self.logged_queries, "empty_rate": self.empty_rate, "regressed": self.regressed,
                "signals": list(self.signals)}


@dataclass(frozen=True)
class WatchResult:
    """What a watch concluded; `to_dict()` is its JSON (the CLI's `watch`, the DAG task's XCom), with only the
    keys that outcome carries, as always."""

    outcome: WatchOutcome
    checks: tuple[WatchCheck, ...] = ()
    version: int | None = None  # None: skipped before looking at a version
    to_version: int | None = None  # rolled_back: the version the alias went back to
    reason: str | None = None
    signals: tuple[str, ...] | None = None  # the regression's signals, once one was seen
    error: str | None = None  # regressed: why no rollback was possible

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"outcome": str(self.outcome)}
        optional = {"version": self.version, "to_version": self.to_version, "reason": self.reason,
                    "signals": None if self.signals is None else list(self.signals), "error": self.error}
        out.update({k: v for k, v in optional.items() if v is not None})
        out["checks"] = [c.to_dict() for c in self.checks]
        return out


def _serves(deps: Deps, version: VersionRecord) -> str | None:
    """None while the alias and the state DB both still say `version` serves; else what changed."""
    alias = deps.settings.alias
    target = deps.store.alias_target(alias)
    live = deps.state.live_version(alias)
    if target != version.collection:
        return f"alias {alias} points at {target or 'nothing'} now, not v{version.version}"
    if live is None or live.id != version.id:
        return f"the state DB records v{live.version if live else '-'} as live now, not v{version.version}"
    return None


def _previous_version(deps: Deps, version: VersionRecord) -> int | None:
    """What the alias pointed at before this version's latest promotion."""
    moves = [e for e in deps.state.alias_events(deps.settings.alias) if e.to_version == version.version]
    return moves[-1].from_version if moves else None


def _empty_baseline(deps: Deps, version: VersionRecord) -> tuple[float | None, str]:
    from kb_reindex.steps import querylog

    previous = _previous_version(deps, version)
    if previous is not None:
        rows = querylog.recent(deps.state, deps.settings.alias, limit=deps.settings.replay_queries or 200,
                               version=previous)
        if rows:
            return querylog.empty_rate(rows), f"v{previous}'s {len(rows)} logged queries"
    replayed = (version.validation or {}).get("replay") or {}
    if replayed.get("empty_live") is not None:
        return float(replayed["empty_live"]), "live's rate in the replay before promotion"
    return None, "no baseline"


def check_once(deps: Deps, version: VersionRecord, *, probe_vectors: list[list[float]], golden: Any,
               gate: Any, baseline_empty: float | None, baseline_from: str) -> WatchCheck:
    """One look: the golden probes through the alias, and the query log since the promotion."""
    from kb_reindex.steps import querylog

    alias = deps.settings.alias
    thresholds = (version.validation or {}).get("thresholds") or {}
    need_hit = thresholds.get("min_hit_rate", golden.min_hit_rate)
    need_mrr = thresholds.get("min_mrr", golden.min_mrr)
    hit_before = {p["probe"] for p in (version.validation or {}).get("probes") or [] if p.get("rank_candidate")}
    ranks, lost = [], []
    for probe, vector in zip(golden.probes, probe_vectors, strict=True):
        hits = deps.store.search(alias, vector, k=golden.k, tenant=probe.tenant)
        rank = first_hit_rank([str((h.payload or {}).get("knowledge_key")) for h in hits], probe.expected)
        ranks.append(rank)
        if rank is None and probe.id in hit_before:
            lost.append(probe.id)
    hit_rate, mrr = score(ranks)
    signals: list[str] = []
    if golden.probes and hit_rate < need_hit:  # no golden set: only the query log is looked at
        signals.append(f"golden probes through the alias: hit rate {hit_rate:.3f} < {need_hit}")
    if golden.probes and mrr < need_mrr:
        signals.append(f"golden probes through the alias: MRR {mrr:.3f} < {need_mrr}")
    if len(lost) > golden.max_regressions:
        signals.append(f"golden probes through the alias: {len(lost)} probe(s) that hit at validation miss now "
                       f"(max {golden.max_regressions}): {', '.join(lost)}")

    since = version.serving_since
    rows = [r for r in querylog.recent(deps.state, alias, limit=deps.settings.query_log_keep, version=version.version)
            if since is None or r.at >= since]
    empty = querylog.empty_rate(rows)
    if (empty is not None and baseline_empty is not None and len(rows) >= gate.watch_min_queries
            and empty > baseline_empty + gate.max_empty_increase + 1e-9):
        signals.append(f"query log: empty-result rate {empty:.3f} over {len(rows)} queries since the promotion > "
                       f"{baseline_empty:.3f} ({baseline_from}; +{gate.max_empty_increase} allowed)")
    return WatchCheck(hit_rate=round(hit_rate, 4) if golden.probes else None,
                      mrr=round(mrr, 4) if golden.probes else None, lost_probes=tuple(lost),
                      logged_queries=len(rows), empty_rate=None if empty is None else round(empty, 4),
                      signals=tuple(signals))


@dataclass(frozen=True)
class WatchSetup:
    """What every look of a watch compares with: the version, its golden set and replay gate, the probes'
    vectors, and the query log's baseline."""

    version: VersionRecord
    golden: Any
    gate: Any
    probe_vectors: list[list[float]]
    baseline_empty: float | None
    baseline_from: str


def prepare_watch(deps: Deps, version_number: int) -> WatchSetup:
    from kb_reindex.steps.replay import load_replay_gate
    from kb_reindex.steps.validate import embed_probes

    alias = deps.settings.alias
    version = deps.state.get_version(alias, version_number)
    if version is None:
        raise KbError(f"version {version_number} of {alias} does not exist; nothing to watch")
    golden = load_golden_set(deps.settings.golden_set)
    baseline_empty, baseline_from = _empty_baseline(deps, version)
    return WatchSetup(version=version, golden=golden, gate=load_replay_gate(deps.settings.golden_set),
                      probe_vectors=embed_probes(deps, version, golden), baseline_empty=baseline_empty,
                      baseline_from=baseline_from)


def late_by(now: datetime, promoted_at: datetime | None, *, minutes: float, interval_s: float) -> float:
    """Seconds past a watch window's end beyond the slack of a last look (three intervals, at least 2 min): more
    than 0, and the look would judge a version that has served long unwatched (knowledge_watch paused or queued
    behind another watch), so it is not taken."""
    if promoted_at is None:
        return 0.0
    end = promoted_at + timedelta(minutes=minutes, seconds=max(3 * interval_s, 120.0))
    return max(0.0, (now - end).total_seconds())


def look_once(deps: Deps, setup: WatchSetup, *, last: bool, checks: tuple[WatchCheck, ...] = (),
              run_id: str | None = None, trigger: str = "watch") -> tuple[WatchCheck | None, WatchResult | None]:
    """One look of the watch: (the check, None) to go on watching; (check, result) when the watch ends here:
    the alias moved (nothing is moved), a regression (undone), or `last` look passed (healthy). The CLI's
    loop (`watch`) and knowledge_watch's rescheduled `watch` sensor both take their looks with it."""
    version = setup.version
    moved = _serves(deps, version)
    if moved is not None:
        log.warning("kb_reindex: watch of v%d stopped: %s; it moves nothing", version.version, moved)
        return None, WatchResult(WatchOutcome.ALIAS_MOVED, checks, version=version.version, reason=moved)
    version = deps.state.get_version(deps.settings.alias, version.version) or version  # promoted_at as recorded
    check = check_once(deps, version, probe_vectors=setup.probe_vectors, golden=setup.golden, gate=setup.gate,
                       baseline_empty=setup.baseline_empty, baseline_from=setup.baseline_from)
    checks = (*checks, check)
    if check.regressed:
        return check, _undo(deps, version, check, checks, run_id=run_id, trigger=trigger)
    if last:
        log.info("kb_reindex: watch of v%d passed (%d checks)", version.version, len(checks))
        return check, WatchResult(WatchOutcome.HEALTHY, checks, version=version.version)
    return check, None


def watch(
    deps: Deps,
    version_number: int,
    *,
    minutes: float,
    interval_s: float,
    run_id: str | None = None,
    trigger: str = "watch",
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> WatchResult:
    """Watch `version_number` for `minutes` (0: skipped). Outcomes: `skipped`, `healthy` (the window passed),
    `alias_moved` (stopped, nothing moved), `rolled_back` (auto-rollback done), `regressed` (no version to
    go back to: said loudly, nothing moved). `clock`/`sleep` are injectable: tests do not wait minutes."""
    if minutes <= 0:
        return WatchResult(WatchOutcome.SKIPPED, reason="watch window is 0 (KB_WATCH_MINUTES / --watch)")
    setup = prepare_watch(deps, version_number)
    deadline = clock() + minutes * 60
    checks: tuple[WatchCheck, ...] = ()
    log.info("kb_reindex: watching v%d behind %s for %s min, every %ss", version_number, deps.settings.alias,
             minutes, interval_s)
    while True:
        check, result = look_once(deps, setup, last=clock() >= deadline, checks=checks, run_id=run_id,
                                  trigger=trigger)
        if result is not None:
            return result
        checks = (*checks, check) if check else checks
        sleep(max(0.0, min(interval_s, deadline - clock())))


def _undo(deps: Deps, version: VersionRecord, check: WatchCheck, checks: tuple[WatchCheck, ...], *,
          run_id: str | None, trigger: str) -> WatchResult:
    from kb_reindex.domain.errors import RollbackRefused

    reason = f"watch of v{version.version}: " + "; ".join(check.signals)
    log.error("kb_reindex: %s; rolling back", reason)
    try:
        done = run_rollback(deps, reason=reason, run_id=run_id, trigger=trigger, action="auto-rollback",
                            expected_live=version.version)
    except AliasMovedError as exc:  # moved between the look and the compare-and-swap: not ours to undo
        log.warning("kb_reindex: watch of v%d found a regression but the alias moved meanwhile: %s",
                    version.version, exc)
        return WatchResult(WatchOutcome.ALIAS_MOVED, checks, version=version.version, reason=str(exc),
                           signals=check.signals)
    except RollbackRefused as exc:
        log.error("kb_reindex: watch of v%d: regression, and no rollback possible: %s", version.version, exc)
        return WatchResult(WatchOutcome.REGRESSED, checks, version=version.version, signals=check.signals,
                           error=str(exc))
    return WatchResult(WatchOutcome.ROLLED_BACK, checks, version=version.version, to_version=done.to_version,
                       reason=reason, signals=check.signals)
