"""Rollback: put a version that served before back behind the alias, through the same compare-and-swap.

The target is read from the alias history; a version that never served (a shadow) is refused, since a
shadow goes live only through a promotion that validates it again. Checked (`check_rollback`), then moved
(`rollback`); the recorded rollback (`runs.run_rollback`) scores the target in between, for the record.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kb_reindex.rules.alias import confirmed_live, has_served, rollback_target, switch_alias
from kb_reindex.rules.checks import structural_problems
from kb_reindex.rules.slots import own_name
from kb_reindex.domain.errors import AliasMovedError, RollbackRefused
from kb_reindex.domain.lifecycle import BUILDABLE, DELETED
from kb_reindex.domain.model import RunOutcome
from kb_reindex.domain.validation_model import ContentWarning
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.domain.validation_model import ValidationResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rescore:
    """The rollback target's golden-set scores, for the record (a failure to score does not stop it)."""
    passed: bool | None
    hit_rate: float | None = None
    mrr: float | None = None
    report: Any = None
    error: str | None = None

    @classmethod
    def of(cls, result: ValidationResult) -> Rescore:
        return cls(passed=result.passed, hit_rate=result.hit_rate, mrr=result.mrr, report=result.report)

    def to_dict(self) -> dict[str, Any]:
        if self.error is not None:
            return {"passed": None, "error": self.error}
        return {"passed": self.passed, "hit_rate": self.hit_rate, "mrr": self.mrr, "report": self.report}


@dataclass(frozen=True)
class RollbackResult:
    """What a rollback did: the alias moved from `from_version` back to `to_version` (its `collection`)."""
    from_version: int
    to_version: int
    collection: str
    validation: Rescore | None = None
    outcome: RunOutcome = RunOutcome.ROLLED_BACK
    #: what it brought back that live did not serve (`runs.rollback_warnings`): flagged lines, model, layout
    warnings: tuple[ContentWarning, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": str(self.outcome), "from_version": self.from_version, "to_version": self.to_version,
                "collection": self.collection, "validation": self.validation.to_dict() if self.validation else None,
                "warnings": [w.to_dict() for w in self.warnings], "error": None}


@dataclass(frozen=True)
class RollbackMove:
    """A rollback checked and ready to move: from `live` (what serves, as on-call confirmed it) back to `target`
    (a kept version that served before and is structurally whole)."""
    live: VersionRecord
    target: VersionRecord
    reason: str


def check_rollback(deps: Deps, *, reason: str, to_version: int | None = None,
                   expected_live: int | None = None) -> RollbackMove:
    """What a rollback would move, checked before anything is scored or moved.

    `expected_live`: the version on-call confirmed serving (the CLI's prompt, the DAG's `live_version`, the
    watch's own promotion); a stale one is refused here, and `rollback` moves the alias only from it.
    None (scripts, tests): whatever serves when this reads. `to_version` default: the version that preceded
    live. A version that never served (a shadow), is not kept or not whole is refused."""
    alias = deps.settings.alias
    if not reason or not reason.strip():
        raise RollbackRefused("a rollback needs a reason (it is recorded in the alias history)")
    live = deps.state.live_version(alias)
    if live is None:
        raise RollbackRefused(f"{alias} has no live version; there is nothing to roll back from")
    if expected_live is not None:
        confirmed_live(deps, expected_live, undone="rolled back")
    target = deps.state.get_version(alias, to_version) if to_version is not None else rollback_target(deps, live)
    if target is None:
        raise RollbackRefused(
            f"no version {to_version} of {alias}" if to_version is not None
            else f"no previous version of {alias} in the alias history; name one with --to-version"
        )
    if target.id == live.id:
        raise RollbackRefused(f"v{target.version} is already live")
    if target.status in (*BUILDABLE, DELETED):
        raise RollbackRefused(f"v{target.version} is {target.status}; only a complete, kept version can serve")
    if not has_served(target):
        raise RollbackRefused(
            f"v{target.version} ({target.embed_model}, {target.embed_dim}-d) never served behind {alias}: a rollback "
            "returns only to a version that served before. A shadow goes live through a promotion that validates "
            f"it again: `kb-reindex promote --version {target.version}`"
        )
    if target.collection == own_name(target) and not deps.store.exists(target.collection):
        # kept, but its slot went to a newer build
        raise RollbackRefused(
            f"v{target.version} is kept but resides in no slot (a newer build took it): restore it first, "
            f"`kb-reindex restore --version {target.version}` (writes up to {target.points_expected} points from the "
            "other slots and the vault, embeds none), then roll back; the previous version is always one move away")
    problems = structural_problems(deps, target)
    if problems:
        raise RollbackRefused(f"v{target.version} ({target.collection}) is not whole: " + "; ".join(problems))
    return RollbackMove(live=live, target=target, reason=reason.strip())


def rollback(deps: Deps, move: RollbackMove, *, run_id: str | None = None, action: str = "rollback",
             scores: Rescore | None = None, by: str | None = None) -> RollbackResult:
    """Put the checked target back behind the alias, by the compare-and-swap under the alias lock from the
    live version the check read: if another version serves by then, nothing moves and `AliasMovedError` says
    which. Takes no reindex lock: a build in flight does not delay it, and fails its own compare-and-swap
    after. `scores`: the target's golden-set scores, for the record. `action="auto-rollback"` is the watch's.
    `by`: who asked for it (recorded with the alias move)."""
    alias = deps.settings.alias
    live, target = move.live, move.target
    try:
        switch_alias(deps, target, expected_from=live.collection, action=action, run_id=run_id, reason=move.reason,
                     by=by)
    except AliasMovedError:
        confirmed_live(deps, live.version, undone="rolled back")  # names what serves now
        raise
    log.info("kb_reindex: rolled %s back from v%d to v%d (%s)", alias, live.version, target.version, move.reason)
    return RollbackResult(from_version=live.version, to_version=target.version, collection=target.collection,
                          validation=scores)
