"""Airflow's REST API as the page calls it: *as the signed-in user* (their token), with answers on-call can act on.

Runs and the paused flags are read, and the on-call DAGs triggered, through it: Airflow's authorization
decides every call. Only our DAGs are followed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, TypedDict, TypeVar, cast
from urllib.parse import quote

import httpx
from fastapi import HTTPException, Request

from kb_reindex.domain.errors import classify
from kb_reindex.services.registry import KnowledgeBase

RECENT_RUNS_PER_DAG = 5


@dataclass(frozen=True)
class DagIds:
    """The DAGs of one knowledge base (`knowledge_reindex`, or `knowledge_reindex__<alias>` for a registry
    entry): the only ones its page lists, follows and triggers (the watch's runs are listed: a failed one is an
    automatic rollback)."""

    reindex: str = "knowledge_reindex"
    rollback: str = "knowledge_rollback"
    migration: str = "knowledge_model_migration"
    promote_shadow: str = "knowledge_promote_shadow"
    watch: str = "knowledge_watch"

    @classmethod
    def of(cls, kb: KnowledgeBase) -> DagIds:
        return cls(*(kb.dag_id(base) for base in (cls.reindex, cls.rollback, cls.migration, cls.promote_shadow,
                                                   cls.watch)))

    @property
    def all(self) -> tuple[str, ...]:
        return (self.reindex, self.rollback, self.migration, self.promote_shadow, self.watch)


# --- what the page reads of Airflow's REST API answers (fields Airflow may leave out are optional) ------------

class DagJson(TypedDict, total=False):
    is_paused: bool
    timetable_summary: str | None  # the schedule as written: "0 0 * * *", "@daily", None (manual only)
    timetable_description: str | None  # in words: "At 00:00"
    next_dagrun_run_after: str | None  # when the scheduler starts the next run


class AssetJson(TypedDict, total=False):
    id: int
    name: str


class AssetPageJson(TypedDict, total=False):
    assets: list[AssetJson]


class AssetEventJson(TypedDict, total=False):
    timestamp: str


class AssetEventPageJson(TypedDict, total=False):
    asset_events: list[AssetEventJson]


class DagRunJson(TypedDict, total=False):
    dag_run_id: str
    state: str | None
    run_type: str | None
    run_after: str | None
    start_date: str | None
    end_date: str | None


class DagRunPageJson(TypedDict, total=False):
    dag_runs: list[DagRunJson]


class TaskInstanceJson(TypedDict, total=False):
    task_id: str
    state: str | None
    try_number: int | None
    max_tries: int | None
    map_index: int


class TaskInstancePageJson(TypedDict, total=False):
    task_instances: list[TaskInstanceJson]


class TaskLogJson(TypedDict, total=False):
    content: list[Any]  # structured log messages, read by last_error_line


Answer = TypeVar("Answer")


def run_ui_path(dag_id: str, run_id: str) -> str:
    """Where Airflow's UI shows a run (the page is served by the same api-server)."""
    return f"/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"


@dataclass(frozen=True)
class Retrying:
    """A task of a running dag run that failed and waits for its next try (Airflow's `up_for_retry`): it is
    not failed yet. `attempt` is the try to come, of `attempts` in all (Airflow's try_number counts the tries
    made, max_tries the retries allowed)."""

    task_id: str
    attempt: int
    attempts: int

    @classmethod
    def of(cls, task: TaskInstanceJson) -> Retrying:
        tried = task.get("try_number") or 1
        return cls(task_id=task.get("task_id", ""), attempt=tried + 1, attempts=max(tried, task.get("max_tries") or 0) + 1)

    @property
    def message(self) -> str:
        return f"retrying (attempt {self.attempt} of {self.attempts})"


@dataclass(frozen=True)
class Schedule:
    """The reindex DAG's schedule as Airflow has it: as written, in words, and when its next run starts (None:
    no schedule, or paused)."""

    summary: str | None
    description: str | None
    next_run: str | None

    @classmethod
    def of(cls, dag: DagJson) -> Schedule:
        return cls(summary=dag.get("timetable_summary"), description=dag.get("timetable_description"),
                   next_run=dag.get("next_dagrun_run_after"))


@dataclass(frozen=True)
class DagRun:
    """The fields of an Airflow dag run the page shows, with the link to it; `retrying`: a task of it waits
    for another try (the run is running, its version may show failed meanwhile)."""

    dag_id: str
    dag_run_id: str
    state: str | None
    run_type: str | None
    run_after: str | None
    start_date: str | None
    end_date: str | None
    url: str
    retrying: Retrying | None = None

    @classmethod
    def of(cls, dag_id: str, run: DagRunJson) -> DagRun:
        """From Airflow's JSON for a dag run."""
        run_id = run.get("dag_run_id") or ""
        return cls(dag_id=dag_id, dag_run_id=run_id, state=run.get("state"), run_type=run.get("run_type"),
                   run_after=run.get("run_after"), start_date=run.get("start_date"), end_date=run.get("end_date"),
                   url=run_ui_path(dag_id, run_id))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Triggered:
    """A run the page triggered, and whether its DAG was unpaused first (on-call agreed to it)."""

    run: DagRun
    unpaused: bool

    def to_dict(self) -> dict[str, Any]:
        return {**self.run.to_dict(), "unpaused": self.unpaused}


def last_error_line(content: list[Any]) -> str | None:
    """The last error of a task log as Airflow's API returns it (structured messages): the exception raised
    (its value; the type too unless it is the AirflowFailException our tasks wrap an error in, whose value
    names the error) when the message carries one, else the message."""
    for entry in reversed(content):
        if not isinstance(entry, dict) or str(entry.get("level", "")).lower() not in ("error", "critical"):
            continue
        for detail in entry.get("error_detail") or []:
            if isinstance(detail, dict) and detail.get("exc_value"):
                kind = detail.get("exc_type") or "Error"
                text = str(detail["exc_value"]) if kind == "AirflowFailException" else f"{kind}: {detail['exc_value']}"
                return text.splitlines()[0]
        return str(entry.get("event", "")).splitlines()[0] or None
    return None


def caller_token(request: Request) -> str | None:
    """The signed-in user's JWT: the `Authorization: Bearer` header, or Airflow's `_token` cookie."""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip() or None
    return request.cookies.get("_token")


class AirflowApi:
    """Airflow's REST API called *as the signed-in user* (their token), with answers on-call can act on."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    async def call(self, request: Request, method: str, path: str, answer: type[Answer], *,
                   body: dict[str, Any] | None = None, params: dict[str, Any] | None = None,
                   action: dict[str, str] | None = None) -> Answer:
        """Airflow's JSON answer, as the shape `answer` the caller reads of it (Airflow's API is trusted for
        its own shapes; nothing else is checked). `action` names what a write would have done, for the
        message when its fate is unknown."""
        token = caller_token(request)
        if not token:
            raise HTTPException(401, "sign in to Airflow first: the page acts as you, through the Airflow API")
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                reply = await client.request(method, f"{self.base_url}/api/v2/{path}", params=params, json=body,
                                              headers={"Authorization": f"Bearer {token}",
                                                       "Accept": "application/json"})
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise self._unanswered(exc, action) from None
        if reply.status_code in (401, 403):
            raise HTTPException(reply.status_code, f"Airflow refused: you may not {method} {path}")
        if reply.status_code == 404:
            raise HTTPException(404, f"Airflow has no {path}")
        if reply.status_code >= 400:
            raise HTTPException(502, f"Airflow API answered {reply.status_code}: {reply.text[:300]}")
        return cast(Answer, reply.json())

    def _unanswered(self, exc: Exception, action: dict[str, str] | None) -> HTTPException:
        """A call that got no answer (errors.classify): one never sent changed nothing; one that may have
        arrived must not be followed blindly by a second click."""
        failure = classify(exc)
        where = f"Airflow API at {self.base_url} (KB_AIRFLOW_API_URL)"
        if not failure.reached:
            return HTTPException(502, f"{where} could not be reached: {failure.message}"
                                      + (f"; nothing was triggered, the alias is unchanged. {action['fallback']}"
                                         if action else ""))
        return HTTPException(502, f"{where} gave no answer: {failure.message}"
                                  + (f"; {action['unknown']}" if action else ""))

    async def trigger(self, request: Request, dag_id: str, conf: dict[str, Any], *, fallback: str,
                      unpause: bool) -> Triggered:
        """A manual run of an on-call DAG. A paused DAG would leave the run queued for ever: unpaused first
        when on-call agreed to it in the page's dialog (`unpause`), else refused with what to do. On-call
        DAGs have no schedule, so unpausing one starts nothing but the runs on-call triggers."""
        unpaused = False
        before = {"fallback": fallback, "unknown": f"nothing was triggered. {fallback}"}
        if (await self.call(request, "GET", f"dags/{dag_id}", DagJson, action=before)).get("is_paused"):
            if not unpause:
                raise HTTPException(409, f"{dag_id} is paused in Airflow: a run triggered now would stay queued "
                                         "until it is unpaused. Let the page unpause it (it asks first), or "
                                         f"`airflow dags unpause {dag_id}`; nothing was triggered")
            await self.set_paused(request, dag_id, False,
                                  action={"fallback": fallback, "unknown": f"{dag_id} may have been unpaused; nothing "
                                                                           f"was triggered. {fallback}"})
            unpaused = True
        run = await self.call(request, "POST", f"dags/{dag_id}/dagRuns", DagRunJson, body={"logical_date": None, "conf": conf},
                              action={"fallback": fallback,
                                      "unknown": f"a {dag_id} run may have been created. Check its runs (or "
                                                 "`kb-reindex status`) before trying again"})
        return Triggered(DagRun.of(dag_id, run), unpaused)

    async def run(self, request: Request, dag_id: str, run_id: str) -> DagRun:
        return DagRun.of(dag_id, await self.call(request, "GET", f"dags/{dag_id}/dagRuns/{quote(run_id, safe='')}",
                                                DagRunJson))

    async def recent_runs(self, request: Request, dag_id: str) -> list[DagRun]:
        """The newest runs of `dag_id`; a running one says which task waits for a retry, if one does."""
        page = await self.call(request, "GET", f"dags/{dag_id}/dagRuns", DagRunPageJson,
                               params={"order_by": "-run_after", "limit": RECENT_RUNS_PER_DAG})
        runs = [DagRun.of(dag_id, run) for run in page.get("dag_runs", [])]
        return [replace(run, retrying=await self.retrying(request, dag_id, run.dag_run_id))
                if run.state == "running" else run for run in runs]

    async def retrying(self, request: Request, dag_id: str, run_id: str) -> Retrying | None:
        """The task of a running run that failed and waits for its next try (`up_for_retry`), if any."""
        tasks = (await self.call(request, "GET", f"dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances",
                                 TaskInstancePageJson, params={"state": "up_for_retry"})).get("task_instances", [])
        waiting = [t for t in tasks if t.get("state") == "up_for_retry"]
        return Retrying.of(waiting[0]) if waiting else None

    async def last_asset_event(self, request: Request, asset_name: str) -> str | None:
        """When the Asset `asset_name` last had an event (a source watcher's: a change seen), or None."""
        assets = (await self.call(request, "GET", "assets", AssetPageJson,
                                  params={"name_pattern": asset_name})).get("assets", [])
        ids = [a["id"] for a in assets if a.get("name") == asset_name and "id" in a]
        if not ids:
            return None
        events = (await self.call(request, "GET", "assets/events", AssetEventPageJson,
                                  params={"asset_id": ids[0], "order_by": "-timestamp", "limit": 1}))
        return next((e.get("timestamp") for e in events.get("asset_events", [])), None)

    async def dag(self, request: Request, dag_id: str) -> DagJson:
        return await self.call(request, "GET", f"dags/{dag_id}", DagJson)

    async def is_paused(self, request: Request, dag_id: str) -> bool:
        return bool((await self.dag(request, dag_id)).get("is_paused"))

    async def set_paused(self, request: Request, dag_id: str, paused: bool, *,
                         action: dict[str, str] | None = None) -> bool | None:
        """Pause or unpause `dag_id`; whether Airflow says it is paused now (None: its answer does not say)."""
        dag = await self.call(request, "PATCH", f"dags/{dag_id}", DagJson, body={"is_paused": paused}, action=action)
        return dag.get("is_paused")

    async def failure(self, request: Request, dag_id: str, run_id: str) -> str | None:
        """The failing task's last error line, from its log in Airflow (None when no log says one)."""
        base = f"dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances"
        tasks = (await self.call(request, "GET", base, TaskInstancePageJson)).get("task_instances", [])
        for task in (t for t in tasks if t.get("state") == "failed"):
            log = await self.call(request, "GET", f"{base}/{quote(task['task_id'], safe='')}/logs/"
                                                  f"{task.get('try_number') or 1}", TaskLogJson,
                                  params={"map_index": task.get("map_index", -1)})
            line = last_error_line(log.get("content") or [])
            if line:
                return f"{task['task_id']}: {line}"
        return None
