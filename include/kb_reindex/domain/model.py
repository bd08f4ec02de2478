"""The names every layer shares: version statuses, run outcomes and run kinds.

They are `StrEnum`s, so a member *is* its string: it compares equal to the value stored in the state DB and
serialises to JSON as that value, and code moves to the enum without a migration. Typed results (the plan,
build, validation, run and rollback results) live beside them in `kb_reindex.results`.
"""

from __future__ import annotations

from enum import StrEnum


class VersionStatus(StrEnum):
    """Where a collection version is in its life (`kb_versions.status`); `kb_reindex.domain.lifecycle` moves it."""

    BUILDING = "building"
    READY = "ready"
    LIVE = "live"
    RETIRED = "retired"
    FAILED = "failed"
    DELETED = "deleted"


class RunKind(StrEnum):
    """What a run does (`kb_runs.kind`, `kb_versions.kind`)."""

    REINDEX = "reindex"
    MIGRATION = "migration"
    ROLLBACK = "rollback"
    PROMOTE = "promote"


class RunOutcome(StrEnum):
    """How a run ended (`kb_runs.outcome`); RUNNING while it has not."""

    RUNNING = "running"
    PROMOTED = "promoted"
    NO_CHANGE = "no_change"
    DRY_RUN = "dry_run"
    SHADOW = "shadow"
    FROZEN = "frozen"
    HELD = "held"  # built and validated, kept unpromoted for a person (kb_reindex.rules.content_loss)
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"
    CANCELLED = "cancelled"


#: Outcomes of a run that ended as it should (nothing to alert on).
SUCCEEDED = frozenset({RunOutcome.PROMOTED, RunOutcome.NO_CHANGE, RunOutcome.DRY_RUN, RunOutcome.SHADOW,
                       RunOutcome.FROZEN, RunOutcome.ROLLED_BACK})


class WatchOutcome(StrEnum):
    """What a post-promotion watch concluded."""

    HEALTHY = "healthy"
    REGRESSED = "regressed"  # a regression seen, but the rollback was refused (the error says why)
    ROLLED_BACK = "rolled_back"
    ALIAS_MOVED = "alias_moved"
    SKIPPED = "skipped"
