"""What the Knowledge index page shows, read-only: the state DB always, Qdrant when it can be opened.

The page never creates anything: the state DB is opened with `create=False` (a missing one is an error
naming KB_STATE_URL, as for `kb-reindex status`). Qdrant's local mode admits one process per folder: while
a build holds it, the page answers at once from the state DB (versions, runs, progress, locks, history) with
the parts only Qdrant knows (point counts, the alias, the audit, the structural checks) marked busy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from kb_reindex import engine, querylog
from kb_reindex.alias import rollback_target
from kb_reindex.config import Settings
from kb_reindex.errors import KbError, StoreError
from kb_reindex.freeze import freeze_view
from kb_reindex.golden import load_golden_set, lowered_threshold_advice
from kb_reindex.runtime import StateDeps, open_deps
from kb_reindex.state import StateStore
from kb_reindex.store import make_client

#: how many runs of the state DB the page lists
RECENT_RUNS = 8
AIRFLOW_RUN_PREFIX = "airflow__"


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
    #: engine.status (Qdrant read) or its state-DB half (Qdrant busy): the JSON edge
    status: dict[str, Any]
    history: list[dict[str, Any]]
    runs: tuple[RunRow, ...]

    def to_json(self) -> dict[str, Any]:
        return {**self.status, "history": self.history, "runs": [asdict(r) for r in self.runs],
                "qdrant": {"access": self.qdrant.value, "detail": self.qdrant_detail}}


def airflow_run(run_id: str | None) -> tuple[str | None, str | None]:
    """(dag_id, dag_run_id) of a state-DB run id written by a DAG task (kb_reindex.airflow.constants.kb_run_id)."""
    if not run_id or not run_id.startswith(AIRFLOW_RUN_PREFIX):
        return None, None
    dag_id, _, dag_run_id = run_id.removeprefix(AIRFLOW_RUN_PREFIX).partition("__")
    return (dag_id, dag_run_id) if dag_id and dag_run_id else (None, None)


def _stamp(value: Any) -> str | None:
    return value.isoformat(timespec="seconds") + "Z" if value is not None else None


def recent_runs(state: StateStore, alias: str) -> tuple[RunRow, ...]:
    return tuple(
        RunRow(run_id=r["run_id"], kind=r["kind"], trigger=r["trigger"], outcome=r["outcome"], version=r["version"],
               started_at=_stamp(r["started_at"]) or "", finished_at=_stamp(r["finished_at"]), error=r["error"],
               dag_id=airflow_run(r["run_id"])[0], dag_run_id=airflow_run(r["run_id"])[1])
        for r in state.list_runs(alias, limit=RECENT_RUNS))


def rollback_problems(row: dict[str, Any]) -> list[str]:
    """What the status already shows that makes a kept version unfit to serve (the full structural check,
    IDs included, runs when on-call asks for the rollback)."""
    if not row["rollback_allowed"]:
        return []
    if row["points"] is None:
        return [f"collection {row['collection']} is missing from Qdrant"]
    if row["points"] != row["points_expected"]:
        return [f"{row['collection']} holds {row['points']} points, its manifest lists {row['points_expected']}"]
    return []


def _state_only(deps: StateDeps) -> dict[str, Any]:
    """engine.status without Qdrant: what the state DB records, Qdrant's numbers left None."""
    alias = deps.settings.alias
    live = deps.state.live_version(alias)
    target = rollback_target(deps) if live else None  # type: ignore[arg-type]  # reads only the state DB
    pins = deps.state.active_pins(alias)
    versions = [engine.version_row(v, target=target, pins=pins, serving=None, points=None, collection_config=None)
                for v in deps.state.list_versions(alias)]
    live_info = None
    if live is not None:
        row = next(v for v in versions if v["version"] == live.version)
        live_info = {k: row[k] for k in ("version", "collection", "points", "embed_model", "dim", "embedder",
                                         "payload_layout", "embed_profile")}
    return {"alias": alias, "serving_collection": None, "live": live_info,
            "rollback_target": target.version if target else None, "pinned": sorted(pins), "audit": None,
            "versions": versions, "locks": engine.lock_view(deps), "problems": [], "notes": [],  # type: ignore[arg-type]
            "metrics": engine.metrics(deps), "query_log": querylog.summary(deps),  # type: ignore[arg-type]
            "freeze": freeze_view(deps)}


def _threshold_problem(settings: Settings, status: dict[str, Any], state: StateStore) -> str | None:
    live = status["live"]
    if live is None:
        return None
    version = state.get_version(settings.alias, live["version"])
    try:
        golden = load_golden_set(settings.golden_set)
    except KbError as exc:
        return f"the golden set cannot be read, so later reindexes will fail: {exc}"
    return lowered_threshold_advice(live["version"], version.validation if version else None, golden,
                                    settings.golden_set)


def read_status(settings: Settings) -> PageStatus:
    """The page's status, read-only. Raises ConfigError when there is no state DB (nothing is created)."""
    state = StateStore(settings.state_url, create=False)
    try:
        access, detail = QdrantAccess.READ, None
        client = None
        try:
            client = make_client(settings, wait_s=0, create=False)  # local mode: busy now is busy, no waiting
            with open_deps(settings, client=client, state=state, create=False) as deps:
                status = engine.status(deps)
        except StoreError as exc:
            local_held = settings.qdrant_path is not None and "in use by another process" in str(exc)
            access, detail = (QdrantAccess.BUSY if local_held else QdrantAccess.UNAVAILABLE), str(exc)
        except KbError as exc:
            access, detail = QdrantAccess.UNAVAILABLE, str(exc)
        finally:
            if client is not None:
                client.close()
        deps_state = StateDeps(settings=settings, state=state)
        if access is not QdrantAccess.READ:
            status = _state_only(deps_state)
        for row in status["versions"]:
            row["rollback_problems"] = (rollback_problems(row) if access is QdrantAccess.READ else
                                        ["Qdrant is busy or unavailable: the structural check cannot run now"]
                                        if row["rollback_allowed"] else [])
        advice = _threshold_problem(settings, status, state)
        if advice:
            status["problems"].append(advice)
        return PageStatus(qdrant=access, qdrant_detail=detail, status=status, history=engine.history(deps_state),
                          runs=recent_runs(state, settings.alias))
    finally:
        state.dispose()


def check_rollback_target(settings: Settings, version: int) -> list[str]:
    """The full structural check (count, IDs, dimension, distance) of a rollback target, before triggering."""
    from kb_reindex.checks import structural_problems

    state = StateStore(settings.state_url, create=False)
    client = None
    try:
        client = make_client(settings, wait_s=0, create=False)
        with open_deps(settings, client=client, state=state, create=False) as deps:
            record = deps.state.get_version(settings.alias, version)
            return structural_problems(deps, record) if record else [f"no version {version}"]
    finally:
        if client is not None:
            client.close()
        state.dispose()

