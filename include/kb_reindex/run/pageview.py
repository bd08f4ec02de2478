"""What the Knowledge index page shows, read-only: the state DB always, Qdrant when it can be opened.

The page never creates anything: the state DB is opened with `create=False` (a missing one is an error
naming KB_STATE_URL, as for `kb-reindex status`). Qdrant's local mode admits one process per folder: while
a build holds it, the page answers at once from the state DB (versions, runs, progress, locks, history) with
the parts only Qdrant knows (point counts, the alias, the audit, the structural checks) marked busy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from kb_reindex.services.config import Settings
from kb_reindex.domain.errors import KbError, StateEmpty, StateMissing, classify
from kb_reindex.domain.validation_model import ContentWarning
from kb_reindex.run.runs import rollback_warnings
from kb_reindex.steps.golden import load_golden_set, lowered_threshold_advice
from kb_reindex.services.runtime import StateDeps, open_deps
from kb_reindex.services.state.dag_runs import dag_run_of
from kb_reindex.services.state.store import StateStore
from kb_reindex.services.state.clock import utc_stamp
from kb_reindex.run.status import HistoryEvent, StatusView, VersionRow, history, state_only_view, status_view
from kb_reindex.services.store import describe_qdrant_failure, make_client

#: how many runs of the state DB the page lists
RECENT_RUNS = 8


class QdrantAccess(StrEnum):
    READ = "read"  # everything is current
    BUSY = "busy"  # the local store is held by another process (a build): Qdrant's parts are unknown
    UNAVAILABLE = "unavailable"  # Qdrant could not be opened (detail says why)


@dataclass(frozen=True)
class RunRow:
    """A run as the state DB records it; `dag_id`/`dag_run_id` when an Airflow DAG run made it."""

    run_id: str
    kind: str
    trigger: str
    outcome: str
    version: int | None
    started_at: str
    finished_at: str | None
    error: str | None
    dag_id: str | None
    dag_run_id: str | None


@dataclass(frozen=True)
class PageStatus:
    qdrant: QdrantAccess
    qdrant_detail: str | None
    #: status.status_view (Qdrant read) or status.state_only_view (Qdrant busy or unavailable)
    status: StatusView
    history: tuple[HistoryEvent, ...]
    runs: tuple[RunRow, ...]
    #: version -> what makes it unfit for a rollback, as far as the page can tell without the full check
    rollback_problems: dict[int, tuple[str, ...]]
    #: version -> what a rollback to it brings back that live does not serve (runs.rollback_warnings)
    rollback_warnings: dict[int, tuple[ContentWarning, ...]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The page's /api/status JSON: the status (each version with its `rollback_problems` and
        `rollback_warnings`), the history, the state DB's recent runs and whether Qdrant could be read."""
        status = self.status.to_dict()
        for row in status["versions"]:
            row["rollback_problems"] = list(self.rollback_problems.get(row["version"], ()))
            row["rollback_warnings"] = [w.to_dict() for w in self.rollback_warnings.get(row["version"], ())]
        return {**status, "history": [e.to_dict() for e in self.history], "runs": [asdict(r) for r in self.runs],
                "qdrant": {"access": self.qdrant.value, "detail": self.qdrant_detail}}


@dataclass(frozen=True)
class FreshInstall:
    """No version yet: the state DB does not exist, or holds no kb-reindex state (nothing was built with this
    configuration). The page says what to do instead of an error; `detail` names where it looked."""

    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"fresh": True, "detail": self.detail}


def airflow_run(run_id: str | None) -> tuple[str | None, str | None]:
    """(dag_id, dag_run_id) of a state-DB run id written by a DAG task (dag_runs.kb_run_id)."""
    ref = dag_run_of(run_id) if run_id else None
    return (ref.dag_id, ref.run_id) if ref is not None else (None, None)


def _stamp(value: Any) -> str | None:
    return utc_stamp(value) if value is not None else None


def recent_runs(state: StateStore, alias: str) -> tuple[RunRow, ...]:
    return tuple(
        RunRow(run_id=r.run_id, kind=r.kind, trigger=r.trigger, outcome=r.outcome, version=r.version,
               started_at=_stamp(r.started_at) or "", finished_at=_stamp(r.finished_at), error=r.error,
               dag_id=airflow_run(r.run_id)[0], dag_run_id=airflow_run(r.run_id)[1])
        for r in state.list_runs(alias, limit=RECENT_RUNS))


def rollback_problems(row: VersionRow) -> tuple[str, ...]:
    """What the status already shows that makes a kept version unfit to serve (the full structural check,
    IDs included, runs when on-call asks for the rollback)."""
    if not row.rollback_allowed:
        return ()
    if row.evicted:
        return (f"resides in no slot (a newer build took it): restore it first, `kb-reindex restore --version "
                f"{row.version}` ({row.points_expected} points to write, nothing embedded)",)
    if row.points is None:
        return (f"collection {row.collection} is missing from Qdrant",)
    if row.points != row.points_expected:
        return (f"{row.collection} holds {row.points} points, its manifest lists {row.points_expected}",)
    return ()


def _threshold_problem(settings: Settings, status: StatusView, state: StateStore) -> str | None:
    if status.live is None:
        return None
    version = state.get_version(settings.alias, status.live.version)
    try:
        golden = load_golden_set(settings.golden_set)
    except KbError as exc:
        return f"the golden set cannot be read, so later reindexes will fail: {exc}"
    return lowered_threshold_advice(status.live.version, version.validation if version else None, golden,
                                    settings.golden_set)


def _qdrant_status(settings: Settings, state: StateStore) -> tuple[StatusView | None, QdrantAccess, str | None]:
    """status_view when Qdrant opens at once (local mode: busy now is busy, no waiting), else why not: a
    failure errors.classify expects (a setting, Qdrant down or busy) leaves the page the state DB's half."""
    client = None
    try:
        client = make_client(settings, wait_s=0, create=False)
        with open_deps(settings, client=client, state=state, create=False) as deps:
            return status_view(deps), QdrantAccess.READ, None
    except Exception as exc:
        failure = classify(exc, state_url=settings.state_url,
                           qdrant=lambda e: describe_qdrant_failure(e, settings, client))
        if not failure.expected:
            raise
        local_held = settings.qdrant_path is not None and "in use by another process" in failure.message
        return None, (QdrantAccess.BUSY if local_held else QdrantAccess.UNAVAILABLE), failure.message
    finally:
        if client is not None:
            client.close()


def read_status(settings: Settings) -> PageStatus:
    """The page's status, read-only. Raises ConfigError when there is no state DB (nothing is created)."""
    state = StateStore(settings.state_url, create=False)
    try:
        status, access, detail = _qdrant_status(settings, state)
        deps_state = StateDeps(settings=settings, state=state)
        if status is None:
            status = state_only_view(deps_state)
        busy = ("Qdrant is busy or unavailable: the structural check cannot run now",)
        problems = {row.version: rollback_problems(row) if access is QdrantAccess.READ else
                    busy if row.rollback_allowed else () for row in status.versions}
        advice = _threshold_problem(settings, status, state)
        if advice:
            status = replace(status, problems=(*status.problems, advice))
        return PageStatus(qdrant=access, qdrant_detail=detail, status=status, history=tuple(history(deps_state)),
                          runs=recent_runs(state, settings.alias), rollback_problems=problems,
                          rollback_warnings=_rollback_warnings(state, settings.alias, status))
    finally:
        state.dispose()


def read_page(settings: Settings) -> PageStatus | FreshInstall:
    """read_status, or FreshInstall when nothing was ever built here (no state DB, or none of our tables);
    any other failure is raised as read_status raises it."""
    try:
        return read_status(settings)
    except (StateMissing, StateEmpty) as exc:
        return FreshInstall(detail=str(exc))


def _rollback_warnings(state: StateStore, alias: str, status: StatusView) -> dict[int, tuple[ContentWarning, ...]]:
    """For each version a rollback may go to: what it would bring back that live does not serve."""
    live = state.live_version(alias)
    if live is None:
        return {}
    records = {r.version: r for r in state.list_versions(alias)}
    return {row.version: rollback_warnings(live, records[row.version]) for row in status.versions
            if row.rollback_allowed and row.version in records}
