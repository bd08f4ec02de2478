"""Fresh within a minute, under `make airflow` (scripts/airflow.sh: LocalExecutor, the triggerer running): the
source watcher of knowledge_reindex (an AssetWatcher whose trigger lists the knowledge folder) starts every run
here; no test triggers one, clicks or calls the API to start a build. One Airflow for the module, in order: a
fresh install builds its first version; a burst of edits becomes searchable in at most two runs; edits saved
while a small run builds give one follow-up; edits made while the triggerer is down are caught when it starts again; a paused DAG starts nothing and catches up when
unpaused; a triggered run's plan and validate wait for a lock and for Qdrant's index rescheduled; and the watch
after a promotion (knowledge_watch) waits rescheduled, holding no slot and no later run back, then rolls back the
version it watches when that regresses."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from conftest import REPO
from test_local_airflow import BIN, LocalAirflow, free_port, kb

pytestmark = pytest.mark.airflow
DAG, WATCH = "knowledge_reindex", "knowledge_watch"


class Stack:
    def __init__(self, airflow: LocalAirflow, project: Path, qdrant: Any, script_env: dict[str, str]) -> None:
        self.airflow, self.project, self.qdrant, self.script_env = airflow, project, qdrant, script_env

    def runs(self) -> list[dict]:
        return self.airflow.http.get(f"/dags/{DAG}/dagRuns", params={"order_by": "run_after"}).json()["dag_runs"]

    def edit(self, name: str, sentence: str) -> None:
        doc = self.project / "knowledge" / "docs" / f"{name}.md"
        doc.write_text(doc.read_text(encoding="utf-8") + f"\n\n{sentence}\n", encoding="utf-8")

    def searchable(self, question: str, sentence: str) -> bool:
        """As a user asks: `kb-reindex query` in a process of its own."""
        found = kb(self.airflow.env, "query", question, "-k", "3")
        return any(sentence in (hit.get("text") or "") for hit in found.get("results") or [])

    def answered(self, question: str, sentence: str) -> bool:
        """As the assistant reads, in this process (`kb_reindex.reader` through the alias): a poll that costs a
        request, not a process start and its imports (which, every half second, took the CPU the run it waits
        for needs)."""
        from kb_reindex.domain.errors import KbError
        from kb_reindex.reader import search_knowledge
        from kb_reindex.services.config import Settings
        from kb_reindex.services.runtime import open_reader

        try:
            with open_reader(Settings.from_env(self.airflow.env)) as deps:
                hits = search_knowledge(deps, question, k=3).results
        except KbError:  # nothing served yet
            return False
        return any(sentence in (hit.text or "") for hit in hits)

    def wait_searchable(self, question: str, sentence: str, timeout_s: float = 150) -> float:
        """Seconds until the assistant finds `sentence`; then the user's `kb-reindex query` finds it too."""
        started = time.monotonic()
        self.airflow.wait(f"{sentence!r} searchable", lambda: self.answered(question, sentence), timeout_s)
        took = time.monotonic() - started
        assert self.searchable(question, sentence), f"the reader found {sentence!r}, `kb-reindex query` did not"
        return took


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from kb_reindex.testing.qdrant_server import FakeQdrantServer

    project = tmp_path_factory.mktemp("fresh-project")
    shutil.copytree(REPO / "knowledge", project / "knowledge")
    home = tmp_path_factory.mktemp("fresh-airflow") / "airflow-home"
    with FakeQdrantServer(tmp_path_factory.mktemp("fresh-qdrant")) as qdrant:
        env = {name: value for name, value in os.environ.items() if not name.startswith("AIRFLOW")}
        # the single-knowledge-base form, no time schedule: every run here is the watcher's. The DAG file is
        # parsed again every 10 s, so a pause or an unpause reaches the watcher soon
        env.update(AIRFLOW_HOME=str(home), KB_PROJECT_ROOT=str(project), KB_AIRFLOW_PORT=str(free_port()),
                   PATH=f"{BIN}:{env.get('PATH', '')}", KB_QDRANT_URL=qdrant.url, KB_REGISTRY="",
                   KB_REINDEX_SCHEDULE="", KB_SOURCE_POLL_S="1", KB_SOURCE_QUIET_S="2", KB_WATCH_INTERVAL_S="8",
                   KB_RETRY_DELAY_S="2", AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL="10",
                   # the product's default: an edit's run is one task (small_run), as a user's is
                   KB_SMALL_RUN_POINTS="1000")
        try:
            started = subprocess.run(["bash", str(REPO / "scripts" / "airflow.sh")], env=env, capture_output=True,
                                     text=True, timeout=240)
            assert started.returncode == 0, started.stdout + started.stderr
            base = next(word for word in started.stdout.split() if word.startswith("http://127.0.0.1:"))
            yield Stack(LocalAirflow(base, home, env), project, qdrant, env)
        finally:
            subprocess.run(["bash", str(REPO / "scripts" / "airflow-stop.sh")], env=env, capture_output=True,
                           text=True, timeout=120)


def test_a_fresh_install_builds_its_first_version_with_no_click(stack: Stack) -> None:
    airflow = stack.airflow
    # the alias, asked at the Qdrant server every half second (a `kb-reindex status` process per look took the CPU
    # the first build needs); then status, once, as a user asks
    def aliased() -> bool:
        return bool(httpx.get(f"{stack.qdrant.url}/aliases", timeout=10).json()["result"]["aliases"])

    airflow.wait("the first version live", aliased, 240)
    assert (kb(airflow.env, "status").get("live") or {}).get("version") == 1
    runs = stack.runs()
    assert [r["run_type"] for r in runs] == ["asset_triggered"], runs
    airflow.wait("the first run finished", lambda: airflow.idle(DAG), 60)


def test_a_burst_of_edits_becomes_searchable_in_at_most_two_runs(stack: Stack) -> None:
    before = len(stack.runs())
    sentences = {"shipping-policy": ("偏远海岛的包裹怎么送", "偏远海岛地区的包裹由渡轮转运，另加两天。"),
                 "coupon-rules": ("生日券可以转赠吗", "生日优惠券仅限本人使用，不可转赠。"),
                 "payment-guide": ("能用外币付款吗", "暂不支持外币支付，请使用人民币结算。")}
    for name, (_question, sentence) in sentences.items():  # three saves half a second apart: one change
        stack.edit(name, sentence)
        time.sleep(0.5)
    took = [stack.wait_searchable(question, sentence) for question, sentence in sentences.values()]
    stack.airflow.wait("the runs finished", lambda: stack.airflow.idle(DAG), 60)
    runs = stack.runs()[before:]
    assert 1 <= len(runs) <= 2 and {r["run_type"] for r in runs} == {"asset_triggered"}, runs
    # each run was told by its event what changed since the last plan: its plan listed no folder
    for run in runs:
        said = plan_log(stack.airflow, run["dag_run_id"])
        assert "the change feed named" in said and "no listing of the source" in said, said[-3000:]
    print(f"burst of 3 edits -> searchable in {took[0]:.1f} s, {len(runs)} run(s)")


def plan_log(airflow: LocalAirflow, run_id: str) -> str:
    """The plan task's log of a run, as Airflow wrote it under its home."""
    runs = airflow.home / "logs" / f"dag_id={DAG}"
    folders = [p for p in runs.iterdir() if p.name == f"run_id={run_id}"] if runs.is_dir() else []
    return "\n".join(log.read_text(errors="replace") for folder in folders
                     for log in sorted((folder / "task_id=plan").glob("attempt=*.log")))


def test_edits_saved_while_a_small_run_builds_give_exactly_one_follow_up_run(stack: Stack) -> None:
    """Issue #41's acceptance: an edit's run takes the one-task path (small_run); two more edits saved while it
    is held at Qdrant's first write give exactly one follow-up run, which serves both."""
    from test_local_airflow import UpsertHold

    airflow = stack.airflow
    before = len(stack.runs())
    with UpsertHold(stack.qdrant) as hold:
        stack.edit("member-rules", "银卡会员每月可领取两张免运费券。")
        assert hold.held.wait(120), f"no run wrote\n{airflow.logs()}"
        stack.edit("return-policy", "定制商品不支持七天无理由退货。")
        time.sleep(0.5)
        stack.edit("shipping-policy", "大件家具送货上门并免费安装。")
        time.sleep(4)  # the watcher sees both and is quiet again, while the run still holds the lock
    stack.wait_searchable("定制商品能退吗", "定制商品不支持七天无理由退货。")
    stack.wait_searchable("家具送货安装吗", "大件家具送货上门并免费安装。")
    airflow.wait("the runs finished", lambda: airflow.idle(DAG), 90)
    runs = stack.runs()[before:]
    assert len(runs) == 2 and {r["state"] for r in runs} == {"success"}, runs
    # the follow-up was told the two files saved during the first run: the feed misses nothing the watcher saw
    said = plan_log(airflow, runs[1]["dag_run_id"])
    assert "the change feed named 2 file(s)" in said, said[-3000:]
    for run in runs:
        url = f"/dags/{DAG}/dagRuns/{quote(run['dag_run_id'], safe='')}/taskInstances"
        states = {t["task_id"]: t["state"] for t in airflow.http.get(url).json()["task_instances"]}
        assert (states["small_run"], states["build_slices"]) == ("success", "skipped"), states
    assert stack.searchable("银卡会员有什么福利", "银卡会员每月可领取两张免运费券。")


def test_edits_made_while_the_triggerer_is_down_are_caught_when_it_starts(stack: Stack) -> None:
    run_dir = stack.airflow.home / "run"
    pid = int((run_dir / "triggerer.pid").read_text())
    os.killpg(pid, signal.SIGTERM)  # its own session (setsid): the triggerer and its children
    stack.airflow.wait("the triggerer stopped", lambda: subprocess.run(["ps", "-p", str(pid)],
                                                                      capture_output=True).returncode != 0, 60)
    before = len(stack.runs())
    stack.edit("member-rules", "会员积分可在每年十二月兑换年度礼包。")
    time.sleep(5)
    assert len(stack.runs()) == before  # nobody watches: no run
    started = subprocess.run(["bash", str(REPO / "scripts" / "airflow.sh")], env=stack.script_env,
                             capture_output=True, text=True, timeout=240)
    assert started.returncode == 0 and "started airflow triggerer" in started.stdout, started.stdout
    stack.wait_searchable("积分能兑换年度礼包吗", "会员积分可在每年十二月兑换年度礼包。")
    stack.airflow.wait("the run finished", lambda: stack.airflow.idle(DAG), 60)


def test_a_paused_dag_starts_no_run_and_catches_up_when_unpaused(stack: Stack) -> None:
    stack.airflow.set_paused(DAG, True)
    before = len(stack.runs())
    sentence = "售后工单将在四小时内首次响应。"
    stack.edit("after-sales-guide", sentence)
    time.sleep(10)  # poll, quiet time and scheduler loops: a paused DAG queues no run from an asset event
    assert len(stack.runs()) == before and not stack.searchable("售后多久响应", sentence)
    stack.airflow.set_paused(DAG, False)
    stack.wait_searchable("售后多久响应", sentence)  # the watcher, back with the next parse, finds the edit
    assert len(stack.runs()) == before + 1
    stack.airflow.wait("the run finished", lambda: stack.airflow.idle(DAG), 60)


def test_plan_and_validate_wait_off_their_slots_under_the_scheduler(stack: Stack) -> None:
    """A triggered run meets another holder of the reindex lock, then a new collection Qdrant is still indexing:
    `plan`, then `validate`, are up_for_reschedule (no worker slot held) until what they wait for is there, and
    the run promotes. The scheduler, not dag.test(), starts them again at their next look."""
    from kb_reindex.rules.locking import reindex_lock_name
    from kb_reindex.services.config import Settings
    from kb_reindex.services.state.locks import default_lock_owner
    from kb_reindex.services.state.store import StateStore

    airflow = stack.airflow
    live_before = kb(airflow.env, "status")["live"]["version"]
    lock = reindex_lock_name("mall_knowledge")
    state = StateStore(Settings.from_env(airflow.env).state_url)
    try:
        owner = default_lock_owner()
        state.acquire_lock(lock, owner=owner, ttl_s=600)
        # the mapped path, whose validate gives its slot back (a small plan's one task waits in it)
        run_id = airflow.trigger(DAG, {"force_full_rebuild": True, "small_run_points": 0})
        url = f"/dags/{DAG}/dagRuns/{quote(run_id, safe='')}"

        def task_state(task_id: str) -> str | None:
            tis = airflow.http.get(f"{url}/taskInstances").json()["task_instances"]
            return next((t["state"] for t in tis if t["task_id"] == task_id), None)

        airflow.wait("plan waiting off its slot", lambda: task_state("plan") == "up_for_reschedule", 120)
        stack.qdrant.hold_indexing(1_000_000)
        state.release_lock(lock, owner=owner)
    finally:
        state.dispose()
    try:
        airflow.wait("validate waiting off its slot", lambda: task_state("validate") == "up_for_reschedule", 180)
    finally:
        stack.qdrant.hold_indexing(0)
    airflow.wait("the run succeeded", lambda: airflow.http.get(url).json()["state"] == "success", 120)
    assert kb(airflow.env, "status")["live"]["version"] == live_before + 1


def watch_runs(stack: Stack) -> list[dict]:
    return stack.airflow.http.get(f"/dags/{WATCH}/dagRuns", params={"order_by": "run_after"}).json()["dag_runs"]


def watch_waiting(stack: Stack) -> str:
    """The knowledge_watch run whose watch is up_for_reschedule (between its looks: no worker slot held)."""
    http, found = stack.airflow.http, []

    def waiting() -> bool:
        for run in watch_runs(stack)[-3:]:
            url = f"/dags/{WATCH}/dagRuns/{quote(run['dag_run_id'], safe='')}"
            if [t["state"] for t in http.get(f"{url}/taskInstances").json()["task_instances"]] == ["up_for_reschedule"]:
                found.append(url)
                return True
        return False

    stack.airflow.wait("a watch waiting off its slot", waiting, 240)
    return found[-1]


def test_a_watch_holds_no_run_back_and_rolls_back_only_the_version_it_promoted(stack: Stack) -> None:
    """The runs a test triggers: with a 5-minute watch (the watch_minutes Param). The run ends at its promotion;
    knowledge_watch, started by the promotion's event on the alias Asset, waits rescheduled (holding no slot)
    between its looks. An edit made meanwhile is built and served at once, not after the window, and that watch
    ends at its next look (the alias moved on). Then a watched version damaged behind everyone's back is rolled
    back from that version to the one before, and its watch fails so on-call hears of it."""
    from qdrant_client import QdrantClient, models

    airflow = stack.airflow
    live_before = kb(airflow.env, "status")["live"]["version"]
    run_id = airflow.trigger(DAG, {"force_full_rebuild": True, "watch_minutes": 5})
    airflow.wait_for_success(DAG, run_id, 180)
    first_watch = watch_waiting(stack)
    assert kb(airflow.env, "status")["live"]["version"] == live_before + 1

    sentence = "跨境商品的关税由平台代缴，无需另付。"
    stack.edit("payment-guide", sentence)
    stack.wait_searchable("跨境商品要另付关税吗", sentence)  # the watcher's run did not wait out the window
    assert kb(airflow.env, "status")["live"]["version"] == live_before + 2
    airflow.wait("the first watch ended: the alias moved on", lambda: http_state(airflow, first_watch) == "success", 60)

    run_id = airflow.trigger(DAG, {"force_full_rebuild": True, "watch_minutes": 5})
    airflow.wait_for_success(DAG, run_id, 180)
    second_watch = watch_waiting(stack)
    promoted = kb(airflow.env, "status")["live"]
    assert promoted["version"] == live_before + 3
    client = QdrantClient(url=stack.qdrant.url, timeout=30)
    try:  # the promoted version damaged behind everyone's back: its probes find nothing
        client.delete(promoted["collection"], points_selector=models.FilterSelector(filter=models.Filter()))
    finally:
        client.close()
    airflow.wait("the watch failed", lambda: http_state(airflow, second_watch) == "failed", 120)
    events = kb(airflow.env, "history")["events"]
    assert (events[-1]["action"], events[-1]["from_version"], events[-1]["to_version"]) == (
        "auto-rollback", live_before + 3, live_before + 2), events[-1]
    assert events[-1]["run_id"].startswith("airflow:knowledge_watch:asset_triggered__")
    assert kb(airflow.env, "status")["live"]["version"] == live_before + 2


def http_state(airflow: LocalAirflow, url: str) -> str:
    return airflow.http.get(url).json()["state"]
