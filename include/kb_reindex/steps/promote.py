"""Step 5: move the alias (compare-and-swap, one atomic request: `alias.switch_alias`).

The alias moves only if it still points where the run planned; the state DB records every move. The
previous collection is kept: it is the rollback target (`rollback.py`), and retention (`retention.py`)
never deletes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from kb_reindex.rules.alias import ROLLBACK_ACTIONS, confirmed_live, switch_alias
from kb_reindex.domain.errors import AliasMovedError, ConfigError, KbError, StoreError
from kb_reindex.rules.fence import Fence
from kb_reindex.steps.golden import load_golden_set, lowered_threshold_advice
from kb_reindex.domain.lifecycle import LIVE, READY, RETIRED
from kb_reindex.domain.model import RunKind
from kb_reindex.domain.names import shortened
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.domain.validation_model import ValidationResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromoteResult:
    """What a promotion did: `to_dict()` is the JSON (CLI, XCom) it always was. A run's promotion says
    `already_live` (and, when it moved, `lowered_thresholds`); a shadow's (`shadow`) names its model and
    dimension instead."""

    version: int
    collection: str
    previous_version: int | None = None
    already_live: bool = False
    lowered_thresholds: str | None = None
    shadow: bool = False
    embed_model: str | None = None
    dim: int | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.shadow:
            return {"version": self.version, "collection": self.collection, "embed_model": self.embed_model,
                    "dim": self.dim, "previous_version": self.previous_version,
                    "lowered_thresholds": self.lowered_thresholds}
        out: dict[str, Any] = {"version": self.version, "collection": self.collection,
                               "previous_version": self.previous_version, "already_live": self.already_live}
        if not self.already_live:
            out["lowered_thresholds"] = self.lowered_thresholds
        return out


def moved_meanwhile(deps: Deps, version: VersionRecord) -> str:
    """Why a run's compare-and-swap failed, from the alias history: who moved the alias to what while it built."""
    alias = deps.settings.alias
    live = deps.state.live_version(alias)
    serving = deps.store.alias_target(alias)
    last = next(iter(reversed(deps.state.alias_events(alias))), None)
    if live is None or serving != live.collection:
        by, now = "someone outside kb-reindex", serving or "nothing"
    else:
        by = "a rollback" if last is not None and last.action in ROLLBACK_ACTIONS else "another run"
        now = f"v{live.version}"
    return (f"alias moved by {by} to {now} while this run built (it planned against "
            f"v{version.base_version if version.base_version is not None else '-'}); v{version.version} kept "
            f"unpromoted (`kb-reindex promote --version {version.version}` to serve it)")


def promote(deps: Deps, version_number: int, *, run_id: str | None = None,
            fence: Fence | None = None) -> PromoteResult:
    """Move the alias from the version this one was planned against (its base) to it. If the alias moved
    meanwhile (a rollback, say), nothing moves and the version stays `ready`: a shadow on-call may promote."""
    alias = deps.settings.alias
    version = deps.state.get_version(alias, version_number)
    if version is None:
        raise KbError(f"version {version_number} of {alias} does not exist")
    if version.status == LIVE and deps.store.alias_target(alias) == version.collection:
        return PromoteResult(version.version, version.collection, already_live=True)
    if version.status != READY:
        raise KbError(f"v{version.version} is {version.status}, not ready; only a validated version can be promoted")
    try:
        previous = switch_alias(
            deps, version, expected_from=version.base_collection,
            action="migrate" if version.kind == RunKind.MIGRATION else "promote", run_id=run_id, fence=fence,
        )
    except AliasMovedError:
        raise AliasMovedError(moved_meanwhile(deps, version)) from None
    except StoreError as exc:
        deps.state.mark_failed(version.id, step="promote", error=str(exc), from_=[READY])
        raise
    if previous is not None:
        log.info("kb_reindex: promoted v%d (%s); previous v%d kept for rollback", version.version, version.collection,
                 previous.version)
    else:
        log.info("kb_reindex: promoted v%d (%s), the first version behind %s", version.version, version.collection, alias)
    return PromoteResult(version.version, version.collection, previous_version=previous.version if previous else None,
                         lowered_thresholds=warn_lowered_thresholds(deps, version))


def warn_lowered_thresholds(deps: Deps, version: VersionRecord) -> str | None:
    """Said at promotion: a version validated with lowered thresholds and scoring under the golden set's
    own leaves every later reindex failing them (kb_reindex.steps.golden.lowered_threshold_advice)."""
    path = deps.settings.golden_set
    try:
        advice = lowered_threshold_advice(version.version, version.validation, load_golden_set(path), path)
    except KbError as exc:
        log.warning("kb_reindex: could not compare v%d's thresholds with the golden set's: %s", version.version, exc)
        return None
    if advice:
        log.warning("kb_reindex: %s", advice)
    return advice


@dataclass(frozen=True)
class ShadowPromotion:
    """A shadow checked for promotion: `version` is ready (built and validated, never served) and moves from
    `expected_from`, the collection of `expected_live`, the version on-call confirmed serving (None: nothing)."""

    version: VersionRecord
    expected_live: int | None
    expected_from: str | None


def check_shadow(deps: Deps, version_number: int, *, expected_live: int | None) -> ShadowPromotion:
    """The shadow to promote, checked before it is validated again: only a ready one (a retired version goes
    back through a rollback), and only from the version on-call confirmed serving (`confirmed_live`)."""
    alias = deps.settings.alias
    version = deps.state.get_version(alias, version_number)
    if version is None:
        raise ConfigError(f"version {version_number} of {alias} does not exist")
    if version.status != READY:
        hint = (" (a rollback returns to a version that served)" if version.status == RETIRED
                else f" ({shortened(version.error.splitlines()[0], 300)})" if version.error else "")  # why it left
        raise ConfigError(f"v{version.version} is {version.status}; only a ready shadow version can be promoted{hint}")
    return ShadowPromotion(version, expected_live, confirmed_live(deps, expected_live, undone="promoted"))


def promote_checked_shadow(deps: Deps, shadow: ShadowPromotion, checked: ValidationResult, *,
                           run_id: str | None = None, reason: str = "explicit promotion of a shadow version",
                           by: str | None = None) -> PromoteResult:
    """Put the checked shadow behind the alias on purpose, once validated again against what serves now
    (`checked`, recorded on it): the same compare-and-swap, from the version on-call confirmed serving; if
    another serves by the move, nothing moves."""
    version = shadow.version
    deps.state.update_version(version.id, validation=checked.to_dict())
    try:
        previous = switch_alias(deps, version, expected_from=shadow.expected_from,
                                action="migrate" if version.kind == RunKind.MIGRATION else "promote", run_id=run_id,
                                reason=reason, by=by)
    except AliasMovedError:
        confirmed_live(deps, shadow.expected_live, undone="promoted")  # says what serves now
        raise
    log.info("kb_reindex: promoted shadow v%d (%s, %s %d-d)", version.version, version.collection,
             version.embed_model, version.embed_dim)
    return PromoteResult(version.version, version.collection, previous_version=previous.version if previous else None,
                         lowered_thresholds=warn_lowered_thresholds(deps, replace(version, validation=checked.to_dict())),
                         shadow=True, embed_model=version.embed_model, dim=version.embed_dim)
