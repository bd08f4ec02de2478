"""The version lifecycle: which status a version may move to from which, and the rules the steps share.

One table (`TRANSITIONS`) says every allowed move of `kb_versions.status`; `StateStore.transition_version`
is the one place a status is written, as a conditional UPDATE (`... WHERE id = ? AND status IN (from)`)
checked against this table. A row that moved underneath (another run, command or retention changed it
between the read and the write) updates nothing, and `StatusMoved` says which version, what the writer
expected and what it found. New rows are born `CREATED` (a plan's allocation) or, rebuilt from Qdrant,
in one of `REBUILT`.

    building -> ready (validated) | failed | building (taken over by a new run)
    ready    -> live (promoted) | failed (validation or the alias move) | building (its plan resumed) | deleted
    failed   -> building (resumed) | ready (validated again) | failed | deleted (retention)
    live     -> retired (another version went live)
    retired  -> live (rollback) | deleted (retention)
    deleted  -> nothing

`reconcile` records what the alias serves as live whatever the state DB said of it (Qdrant's alias is what
readers see), so building and failed versions may go live through it alone (`RECONCILABLE`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import TypedDict

from kb_reindex.domain.errors import KbError
from kb_reindex.domain.model import VersionStatus

BUILDING, READY, LIVE = VersionStatus.BUILDING, VersionStatus.READY, VersionStatus.LIVE
RETIRED, FAILED, DELETED = VersionStatus.RETIRED, VersionStatus.FAILED, VersionStatus.DELETED

#: every allowed move: from -> the statuses it may go to
TRANSITIONS: Mapping[VersionStatus, frozenset[VersionStatus]] = {
    BUILDING: frozenset({BUILDING, READY, FAILED, LIVE}),
    READY: frozenset({BUILDING, READY, FAILED, LIVE, DELETED}),
    FAILED: frozenset({BUILDING, READY, FAILED, LIVE, DELETED}),
    LIVE: frozenset({RETIRED}),
    RETIRED: frozenset({LIVE, DELETED}),
    DELETED: frozenset(),
}

#: the status a new version is allocated in
CREATED = BUILDING
#: the statuses `reconcile --rebuild-state` gives a version read back from its collection
REBUILT = frozenset({LIVE, RETIRED, READY, FAILED})

#: a version failed at one of these steps is continued by the next run of its plan (create, build) and
#: validated again (validate); "promote": validated, but the alias move was refused (a Qdrant error, a move
#: that did not take): nothing to build again. Failed elsewhere ("rebuild": read back from Qdrant unfinished)
#: it stays failed until retention drops it.
RESUMABLE_STEPS = ("create", "build", "validate", "promote")

#: a version the alias may be moved to by a promotion or a rollback (`switch_alias` refuses the rest)
SWITCHABLE = frozenset({READY, RETIRED})
#: what `reconcile` may record as live: whatever the alias serves, unless it was deleted
RECONCILABLE = frozenset({BUILDING, READY, FAILED, RETIRED})
#: a version a build (create, fill) may (re)start: unfinished, or failed at a resumable step
BUILDABLE = frozenset({BUILDING, FAILED})
#: a version a validation may record as ready or failed (a failed one only at a resumable step)
VALIDATABLE = frozenset({BUILDING, READY, FAILED})
#: a kept version whose collection may be dropped (retention, `kb-reindex drop`)
DROPPABLE = frozenset({READY, RETIRED, FAILED})


class StatusMoved(KbError):
    """A conditional status write found the version elsewhere than the writer expected (or gone)."""


def allowed(from_: VersionStatus | str, to: VersionStatus | str) -> bool:
    return VersionStatus(to) in TRANSITIONS[VersionStatus(from_)]


def sources(to: VersionStatus | str) -> frozenset[VersionStatus]:
    """Every status a version may move to `to` from."""
    return frozenset(s for s, targets in TRANSITIONS.items() if VersionStatus(to) in targets)


def check(from_: Iterable[VersionStatus | str], to: VersionStatus | str) -> tuple[VersionStatus, ...]:
    """The from-statuses of a move, each checked against the table; a disallowed one is a `KbError` naming it
    (a writer asking for a move the lifecycle does not have: a bug, refused before anything is written)."""
    target = VersionStatus(to)
    statuses = tuple(sorted({VersionStatus(s) for s in from_}))
    if not statuses:
        raise KbError(f"a move to {target} needs the statuses it may come from")
    wrong = [s for s in statuses if not allowed(s, target)]
    if wrong:
        raise KbError(f"a version cannot move from {', '.join(wrong)} to {target} (kb_reindex.domain.lifecycle.TRANSITIONS)")
    return statuses


def may_resume(status: str, failed_step: str | None) -> bool:
    """A version a rerun of its plan continues (and a validation may record): unfinished, or failed at a
    step that the next run takes over (`RESUMABLE_STEPS`)."""
    return status == BUILDING or (status == FAILED and failed_step in RESUMABLE_STEPS)


def may_validate(status: str, failed_step: str | None) -> bool:
    """A version whose validation is recorded as its status (ready or failed): a ready one, or one a rerun
    resumes; any other keeps its status and gets only the validation record."""
    return status == READY or may_resume(status, failed_step)


class StatusStamps(TypedDict, total=False):
    """The kb_versions columns a status move stamps (`stamps`); the state's column keywords extend these."""

    error: str | None
    failed_step: str | None
    ready_at: datetime | None
    promoted_at: datetime | None
    live_since: datetime | None
    retired_at: datetime | None
    deleted_at: datetime | None


def stamps(to: VersionStatus | str, now: datetime) -> StatusStamps:
    """The columns a move to `to` always writes beside the status (the caller's own override them)."""
    target = VersionStatus(to)
    if target == BUILDING:
        return {"error": None, "failed_step": None}
    if target == READY:
        return {"error": None, "failed_step": None, "ready_at": now}
    if target == LIVE:  # promoted_at: the first time only (the state store keeps one already set)
        return {"promoted_at": now, "live_since": now, "error": None, "failed_step": None}
    if target == RETIRED:
        return {"retired_at": now}
    if target == DELETED:
        return {"deleted_at": now}
    return {}


def moved_message(*, version: int | None, alias: str | None, expected: Iterable[str], to: str,
                  found: str | None) -> str:
    name = f"v{version} of {alias}" if version is not None else "the version"
    expect = " or ".join(sorted(str(s) for s in expected))
    now = f"is {found} now" if found is not None else "is gone"
    return (f"{name} {now}, not {expect} as expected: it was changed underneath this move to {to} (another run or "
            "command); nothing was recorded. Check `kb-reindex status`")
