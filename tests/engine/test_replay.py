"""Real queries beyond the golden set: the opt-in query log, the replay gate before promotion, the alias
read back after every move, and the watch after a promotion that rolls back on a regression."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml
from conftest import write_doc
from kb_reindex.steps import querylog
from kb_reindex.run.pipeline import run_reindex
from kb_reindex.run.runs import run_rollback
from kb_reindex.domain.errors import AliasReadBackError, ConfigError, GoldenSetError
from kb_reindex.reader import search_knowledge
from kb_reindex.steps.replay import load_replay_gate
from kb_reindex.services.runtime import Deps
from kb_reindex.services.state.store import StateStore
from kb_reindex.run.watch import watch
from kb_reindex.run.status import status_view
from qdrant_client import models

# customer questions about member points that are not in the golden set; live answers them with member-rules
REAL_QUERIES = ["积分兑换的商品可以退吗", "银卡会员每年有几张运费券", "会员成长值怎么算", "积分抵扣现金的比例是多少"]


@pytest.fixture
def logged(deps: Deps) -> Deps:
    """The same deps with the query log on."""
    querylog.reset_cache()
    yield replace(deps, settings=replace(deps.settings, query_log=True))
    querylog.reset_cache()


def ask(deps: Deps, queries: list[str], *, k: int = 1, tenant: str | None = None) -> list[list[str]]:
    return [[r.knowledge_key for r in search_knowledge(deps, q, k=k, tenant=tenant).results] for q in queries]


def set_replay(deps: Deps, **thresholds: object) -> None:
    path = deps.settings.golden_set
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    data["replay"] = {**(data.get("replay") or {}), **thresholds}
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")


def crowding_page(root: Path, queries: list[str]) -> None:
    """A new FAQ page that repeats customers' questions word for word: it outranks the page that answers them,
    while the golden probes (other questions) still find their documents."""
    sections = "\n\n".join(f"## 问题{i}\n\n" + (q + "。") * 3 for i, q in enumerate(queries))
    write_doc(root, "faq-extra", f"---\ntitle: 常见问题\ncategory: 其他\ntenant: default\n---\n\n# 常见问题\n\n{sections}")


# --- the query log ---------------------------------------------------------------------------------------


def test_query_log_is_off_by_default_and_records_text_tenant_version_and_keys_when_on(deps: Deps, logged: Deps) -> None:
    assert run_reindex(deps).outcome == "promoted"
    assert status_view(deps).to_dict()["query_log"] == {"enabled": False, "queries": 0, "keep": 5000}
    ask(deps, REAL_QUERIES[:1])  # off: nothing recorded
    assert querylog.recent(deps.state, deps.settings.alias, limit=10) == []

    answers = ask(logged, REAL_QUERIES[:2], k=3, tenant="default")
    rows = querylog.recent(deps.state, deps.settings.alias, limit=10)
    assert [r.query for r in rows] == REAL_QUERIES[1::-1]  # newest first
    assert [list(r.keys) for r in rows] == answers[::-1] and all(len(r.keys) == 3 for r in rows)
    assert {(r.tenant, r.k, r.version) for r in rows} == {("default", 3, 1)}
    # one COUNT of this alias's rows: on, 2 held; rows of another alias are not counted
    querylog.record(deps.state, alias="other", query="q", tenant=None, k=1, version=None, keys=[], keep=10)
    assert status_view(logged).to_dict()["query_log"] == {"enabled": True, "queries": 2, "keep": 5000}
    assert status_view(deps).to_dict()["query_log"]["queries"] == 2  # switched off, the rows it holds are still said


def test_status_of_a_state_db_made_before_the_query_log_counts_none_and_creates_nothing(deps: Deps) -> None:
    querylog.query_log.drop(deps.state.engine)
    querylog.reset_cache()
    assert querylog.count(deps.state, deps.settings.alias) == 0
    assert not sa.inspect(deps.state.engine).has_table(querylog.query_log.name)


def test_query_log_keeps_only_the_newest_rows_on_sqlite_and_mysql(tmp_path: Path, mysql_url: str) -> None:
    for url in (f"sqlite:///{tmp_path / 'state.db'}", mysql_url):
        state = StateStore(url)
        try:
            for i in range(7):
                querylog.record(state, alias="a", query=f"q{i}", tenant=None, k=4, version=1, keys=[] if i % 2 else ["x"],
                                keep=3)
            querylog.record(state, alias="other", query="kept", tenant=None, k=4, version=1, keys=["x"], keep=3)
            rows = querylog.recent(state, "a", limit=10)
            assert [r.query for r in rows] == ["q6", "q5", "q4"], url
            assert querylog.empty_rate(rows) == pytest.approx(1 / 3)
            assert [r.query for r in querylog.recent(state, "other", limit=10)] == ["kept"]
        finally:
            state.dispose()


def test_a_query_log_failure_never_fails_the_query(deps: Deps, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from kb_reindex.services.runtime import ReaderDeps

    assert run_reindex(deps).outcome == "promoted"
    querylog.reset_cache()
    # the reader has no state DB of its own; this URL names none, so the log cannot be written
    reader = ReaderDeps(settings=replace(deps.settings, query_log=True,
                                         state_url=f"sqlite:///{tmp_path / 'missing' / 'state.db'}"),
                        store=deps.store)
    with caplog.at_level(logging.WARNING, logger="kb_reindex.steps.querylog"):
        found = search_knowledge(reader, REAL_QUERIES[0], k=2)
    assert len(found.results) == 2
    assert any("query log (KB_QUERY_LOG) not written" in r.getMessage() for r in caplog.records)


# --- replay before promotion -------------------------------------------------------------------------


def test_a_corpus_edit_that_breaks_real_queries_but_not_the_golden_set_is_blocked_by_replay(logged: Deps) -> None:
    deps = logged
    assert run_reindex(deps).outcome == "promoted"
    assert ask(deps, REAL_QUERIES) == [["member-rules"]] * 4
    crowding_page(deps.settings.root, REAL_QUERIES)
    # the new page also nudges 5 golden probes down a rank (none lost): the paired sign test's p=0.031 would
    # flag that at 0.05; at 0.01 only the replay is left to see what the customers' own questions lose
    path = deps.settings.golden_set
    golden = yaml.safe_load(path.read_text(encoding="utf-8"))
    path.write_text(yaml.safe_dump({**golden, "paired_alpha": 0.01}, allow_unicode=True), encoding="utf-8")

    result = run_reindex(deps)
    assert result.outcome == "failed" and result.version == 2
    validation = result.validation
    # the golden set alone would have passed: no regression, hit rate above the threshold
    assert validation.regressions == 0 and validation.hit_rate >= 0.9
    assert [f for f in validation.failures if not f.startswith("replay:")] == []
    replayed = validation.replay
    assert (replayed.queries, replayed.mean_overlap, replayed.empty_live, replayed.empty_candidate,
            replayed.lost_top_hits) == (4, 0.0, 0.0, 0.0, 4)
    # the run's JSON carries the totals; the rows are in the report and the version's record
    assert "per_query" not in validation.to_dict()["replay"]
    assert "member-rules" in result.error and "replay.max_lost_top_hits" in result.error
    assert deps.store.alias_target(deps.settings.alias).endswith("__s1")
    record = deps.state.get_version(deps.settings.alias, 2)
    rows = record.validation["replay"]["per_query"]
    assert {(r["live_top"], r["rank_change"], r["lost_top_hit"], r["top_changed"]) for r in rows} == \
        {("member-rules", None, True, False)}
    page = (Path(result.validation.report).parent / "validation.html").read_text(encoding="utf-8")
    assert "Replay of logged queries: FAILED" in page and REAL_QUERIES[0] in page
    markdown = Path(result.validation.report).read_text(encoding="utf-8")  # the Markdown report says the same
    replay_section = markdown[markdown.index("## Replay of logged queries: FAILED"):]
    assert "lost from the top k: 4 of 4 queries" in replay_section
    assert all(f"| {q} |" in replay_section for q in REAL_QUERIES)

    # the share the team allows decides: 4 of 4 within a share of 1.0 passes
    set_replay(deps, max_lost_top_hits=1.0)
    assert run_reindex(deps).outcome == "promoted"


def test_replay_blocks_a_candidate_whose_empty_result_rate_rises(logged: Deps) -> None:
    deps = logged
    write_doc(deps.settings.root, "vip-perks", "---\ntitle: VIP专享\ncategory: 会员\ntenant: vip\n---\n\n# VIP专享\n\n"
              "VIP客户享受专属客服和极速退款。")
    assert run_reindex(deps).outcome == "promoted"
    ask(deps, ["VIP有专属客服吗"], tenant="vip")
    ask(deps, REAL_QUERIES[:3])
    (deps.settings.knowledge_dir / "vip-perks.md").unlink()

    result = run_reindex(deps)
    assert result.outcome == "failed"
    replayed = result.validation.replay
    assert (replayed.empty_live, replayed.empty_candidate) == (0.0, 0.25)
    assert "replay: empty-result rate 0.250 on the candidate > 0.000 on live v1" in result.error


def test_replay_is_skipped_and_says_why_without_a_log_or_without_live(deps: Deps) -> None:
    first = run_reindex(deps)
    assert first.validation.replay.skipped.startswith("no live version to replay against")
    write_doc(deps.settings.root, "faq-extra", "# 常见问题\n\n发票可以在订单详情页申请。")
    second = run_reindex(deps)
    assert second.outcome == "promoted"
    assert second.validation.replay.skipped.startswith("no logged queries")


@pytest.mark.parametrize(("section", "field"), [
    ({"max_lost_top_hits": 1.5}, "replay.max_lost_top_hits"),
    ({"max_empty_increase": "a bit"}, "replay.max_empty_increase"),
    ({"watch_min_queries": 0}, "replay.watch_min_queries"),
    ({"max_lost": 0.1}, "unknown field(s) max_lost"),
    ("strict", "'replay' must be a mapping"),
])
def test_replay_thresholds_are_checked_with_the_field_named(tmp_path: Path, section: object, field: str) -> None:
    path = tmp_path / "golden.yaml"
    path.write_text(yaml.safe_dump({"k": 4, "probes": [], "replay": section}), encoding="utf-8")
    with pytest.raises(GoldenSetError, match="golden.yaml") as caught:
        load_replay_gate(path)
    assert field in str(caught.value)


def test_a_bad_replay_threshold_stops_the_plan_before_anything_is_built(deps: Deps) -> None:
    set_replay(deps, max_lost_top_hits=2)
    result = run_reindex(deps)
    assert result.outcome == "failed" and result.version is None
    assert "'replay.max_lost_top_hits' must be a number from 0 to 1, got 2" in result.error
    assert deps.state.list_versions(deps.settings.alias) == []


# --- the alias is read back after every move -------------------------------------------------------------


def swallow_alias_moves(deps: Deps, store_kind: str, monkeypatch: pytest.MonkeyPatch, request) -> None:
    """An alias move answered with success that does not take: a fault of the Qdrant test server, or the
    same on local mode's client."""
    if store_kind == "server":
        server = request.getfixturevalue("qdrant_server_of")(deps)
        server.faults.add("update_aliases", ignore=True, count=None)
    else:
        monkeypatch.setattr(deps.store.client, "update_collection_aliases", lambda **_kwargs: True)


@pytest.fixture
def qdrant_server_of():
    """The FakeQdrantServer behind a `deps` of the server kind (found by its URL among live threads)."""
    import gc

    from kb_reindex.testing.qdrant_server import FakeQdrantServer

    def find(deps: Deps) -> FakeQdrantServer:
        return next(o for o in gc.get_objects() if isinstance(o, FakeQdrantServer) and o.url == deps.settings.qdrant_url)

    return find


def test_a_move_that_does_not_take_fails_loudly_and_records_nothing(deps: Deps, store_kind: str,
                                                                     monkeypatch: pytest.MonkeyPatch, request) -> None:
    two_versions(deps)
    write_doc(deps.settings.root, "faq-more", "# 更多问题\n\n开具发票后可以修改抬头吗？可以在七天内修改。")
    swallow_alias_moves(deps, store_kind, monkeypatch, request)
    monkeypatch.setattr("kb_reindex.services.store.time.sleep", lambda _s: None)

    # a promotion
    result = run_reindex(deps)
    assert result.outcome == "failed" and result.error_kind == "AliasReadBackError"
    assert "moved to mall_knowledge__hashing-ngram-v1__s3 (Qdrant answered success) but reads back as " \
           "mall_knowledge__hashing-ngram-v1__s2" in result.error and "the move did not take" in result.error
    assert deps.state.live_version(deps.settings.alias).version == 2
    assert deps.state.get_version(deps.settings.alias, 3).status == "failed"
    # a rollback
    with pytest.raises(AliasReadBackError, match="reads back as mall_knowledge__hashing-ngram-v1__s2"):
        run_rollback(deps, reason="test", to_version=1)
    assert deps.state.live_version(deps.settings.alias).version == 2
    assert [e.action for e in deps.state.alias_events(deps.settings.alias)] == ["promote", "promote"]


# --- the watch after the swap -------------------------------------------------------------------------


class FakeClock:
    """Time that passes only when the watch sleeps: a 30-minute window in milliseconds."""

    def __init__(self, on_sleep=None) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []
        self.on_sleep = on_sleep

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(len(self.sleeps))


def two_versions(deps: Deps) -> None:
    assert run_reindex(deps).outcome == "promoted"
    write_doc(deps.settings.root, "faq-extra", "# 常见问题\n\n发票可以在订单详情页申请。")
    assert run_reindex(deps).outcome == "promoted"


def damage(deps: Deps, version: int, keys: list[str]) -> None:
    """A regression injected after the promotion: the live collection loses these documents' points."""
    collection = deps.state.get_version(deps.settings.alias, version).collection
    deps.store.client.delete(collection, points_selector=models.Filter(must=[
        models.FieldCondition(key="knowledge_key", match=models.MatchAny(any=keys))]))


def test_watch_of_a_healthy_version_checks_each_interval_and_moves_nothing(deps: Deps) -> None:
    two_versions(deps)
    clock = FakeClock()
    result = watch(deps, 2, minutes=30, interval_s=600, clock=clock, sleep=clock.sleep)
    assert result.outcome == "healthy" and len(result.checks) == 4 and clock.sleeps == [600, 600, 600]
    assert all(not c.regressed and c.hit_rate >= 0.9 for c in result.checks)
    assert [e.action for e in deps.state.alias_events(deps.settings.alias)] == ["promote", "promote"]
    assert watch(deps, 2, minutes=0, interval_s=60).outcome == "skipped"


def test_watch_rolls_back_a_regression_injected_after_promotion(deps: Deps) -> None:
    two_versions(deps)
    clock = FakeClock(on_sleep=lambda n: damage(deps, 2, ["return-policy", "member-rules"]) if n == 1 else None)
    result = watch(deps, 2, minutes=30, interval_s=600, clock=clock, sleep=clock.sleep)
    assert result.outcome == "rolled_back" and result.to_version == 1
    assert len(result.checks) == 2 and not result.checks[0].regressed
    assert deps.store.alias_target(deps.settings.alias).endswith("__s1")
    assert deps.state.live_version(deps.settings.alias).version == 1
    event = deps.state.alias_events(deps.settings.alias)[-1]
    assert (event.action, event.from_version, event.to_version) == ("auto-rollback", 2, 1)
    assert event.reason is not None and event.reason.startswith("watch of v2: golden probes through the alias: hit rate")
    assert deps.state.list_runs(deps.settings.alias, limit=1)[0].trigger == "watch"


def test_watch_rolls_back_when_the_query_log_empty_rate_rises(logged: Deps) -> None:
    deps = logged
    set_replay(deps, watch_min_queries=3)
    two_versions(deps)
    # served by v2: a tenant's customers now get nothing back (v1 answered them all before)
    querylog.record(deps.state, alias=deps.settings.alias, query="q", tenant=None, k=4, version=1, keys=["a"], keep=100)
    ask(deps, REAL_QUERIES[:1])
    ask(deps, ["VIP有专属客服吗", "VIP退款多快"], tenant="vip")
    clock = FakeClock()
    result = watch(deps, 2, minutes=5, interval_s=60, clock=clock, sleep=clock.sleep)
    assert result.outcome == "rolled_back"
    assert result.to_dict()["signals"] == ["query log: empty-result rate 0.667 over 3 queries since the promotion > 0.000 "
                                 "(v1's 1 logged queries; +0.0 allowed)"]
    assert deps.state.alias_events(deps.settings.alias)[-1].action == "auto-rollback"


def test_watch_does_nothing_when_the_alias_moved_meanwhile(deps: Deps) -> None:
    two_versions(deps)

    def on_call_rolls_back_then_v1_breaks(n: int) -> None:
        if n == 1:
            run_rollback(deps, reason="on-call rolled back by hand", to_version=1)
            damage(deps, 1, ["return-policy", "member-rules"])

    clock = FakeClock(on_sleep=on_call_rolls_back_then_v1_breaks)
    result = watch(deps, 2, minutes=30, interval_s=600, clock=clock, sleep=clock.sleep)
    assert result.outcome == "alias_moved" and "not v2" in (result.reason or "")
    assert [e.action for e in deps.state.alias_events(deps.settings.alias)] == ["promote", "promote", "rollback"]
    assert deps.store.alias_target(deps.settings.alias).endswith("__s1")


def test_an_auto_rollback_is_passed_over_by_the_next_rollback_target(deps: Deps) -> None:
    from kb_reindex.rules.alias import rollback_target

    two_versions(deps)
    write_doc(deps.settings.root, "faq-more", "# 更多问题\n\n开具发票后可以修改抬头吗？可以在七天内修改。")
    assert run_reindex(deps).outcome == "promoted"
    damage(deps, 3, ["return-policy", "member-rules"])
    clock = FakeClock()
    assert watch(deps, 3, minutes=1, interval_s=60, clock=clock, sleep=clock.sleep).outcome == "rolled_back"
    # like on-call's rollback: rolling back again goes further back, not to the damaged v3
    assert rollback_target(deps).version == 1


def test_cli_run_with_watch(project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from kb_reindex.cli import main

    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    monkeypatch.setenv("KB_WATCH_INTERVAL_S", "1")
    assert main(["run", "--json", "-q"]) == 0
    capsys.readouterr()
    write_doc(project, "faq-extra", "# 常见问题\n\n发票可以在订单详情页申请。")
    assert main(["run", "--json", "-q", "--watch", "0.001"]) == 0  # 60 ms: a window, not minutes
    answer = json.loads(capsys.readouterr().out)
    assert answer["outcome"] == "promoted" and answer["watch"]["outcome"] == "healthy"
    assert answer["validation"]["replay"]["skipped"].startswith("no logged queries")
    assert main(["run", "--json", "-q", "--watch", "-1"]) == 2
    with pytest.raises(ConfigError, match="KB_WATCH_MINUTES"):
        from kb_reindex.services.config import Settings

        Settings.from_env({"KB_PROJECT_ROOT": str(project), "KB_WATCH_MINUTES": "soon"})


def test_the_dag_watch_task_is_skipped_at_window_0_and_fails_after_an_auto_rollback(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
    from kb_reindex.airflow import connections, tasks
    from kb_reindex.services.config import Settings
    from kb_reindex.services.runtime import open_deps

    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    monkeypatch.setattr(connections, "_connection", lambda conn_id: None)  # no Airflow Connections defined
    with open_deps(Settings.from_env()) as deps:
        two_versions(deps)
    with pytest.raises(AirflowSkipException, match=r"KB_WATCH_MINUTES \(or the watch_minutes Param\) is 0"):
        tasks.watch_task(promoted={"version": 2}, run_id="airflow__reindex__w")
    # a look within the window: healthy, not done (the sensor is rescheduled, holding no slot, until its next look)
    assert tasks.watch_task(promoted={"version": 2}, run_id="airflow__reindex__w", minutes=30).is_done is False
    # a look taken hours after its window ended (knowledge_watch was paused, or queued) is not taken
    from datetime import timedelta

    from kb_reindex.services.state import clock as state_clock

    real_now = state_clock.utcnow
    monkeypatch.setattr(state_clock, "utcnow", lambda: real_now() + timedelta(hours=3))
    with pytest.raises(AirflowSkipException, match=r"the 30-minute window of v2 \(promoted .*\) ended \d+ s before "
                                                   r"this look could be taken \(knowledge_watch paused or queued\)"):
        tasks.watch_task(promoted={"version": 2}, run_id="airflow__reindex__w", minutes=30)
    monkeypatch.setattr(state_clock, "utcnow", real_now)

    with open_deps(Settings.from_env()) as deps:
        damage(deps, 2, ["return-policy", "member-rules"])
    monkeypatch.setenv("KB_WATCH_MINUTES", "0.001")
    with pytest.raises(AirflowFailException, match="v2 was rolled back to v1 automatically: watch of v2: golden"):
        tasks.watch_task(promoted={"version": 2}, run_id="airflow__reindex__w")
    with open_deps(Settings.from_env()) as deps:
        assert deps.state.live_version(deps.settings.alias).version == 1
        event = deps.state.alias_events(deps.settings.alias)[-1]
        assert (event.action, event.run_id) == ("auto-rollback", "airflow__reindex__w")
    # a retry of the same watch (Airflow may run a rescheduled sensor again) says the rollback again: never success
    with pytest.raises(AirflowFailException, match="v2 was rolled back to v1 automatically: watch of v2: golden"):
        tasks.watch_task(promoted={"version": 2}, run_id="airflow__reindex__w")


def test_knowledge_watch_watches_the_newest_run_promotion_among_its_events_and_skips_other_moves() -> None:
    """Promotions queued while a watch ran start one knowledge_watch run with all their events: the newest run's
    promotion is watched, for the window its run asked for; a rollback's event alone is skipped, saying so."""
    from datetime import UTC, datetime
    from types import SimpleNamespace

    from airflow.sdk.exceptions import AirflowSkipException
    from kb_reindex.airflow.tasks import promotion_to_watch

    def event(minute: int, action: str, version: int, watch: dict | None = None) -> SimpleNamespace:
        extra = {"alias": "mall_knowledge", "action": action, "version": version} | ({"watch": watch} if watch else {})
        return SimpleNamespace(extra=extra, timestamp=datetime(2026, 12, 1, 10, minute, tzinfo=UTC))

    newest = event(9, "promote", 4, {"minutes": 30, "run_id": "airflow:knowledge_reindex:r4"})
    events = {"kb_alias_mall_knowledge": [newest, event(1, "promote", 3, {"minutes": None, "run_id": "r3"}),
                                          event(5, "rollback", 2), event(12, "migrate", 5)]}
    assert promotion_to_watch(events) == newest.extra, "the newest with a run's watch: the shadow's (v5) has none"
    with pytest.raises(AirflowSkipException, match="the alias moved by rollback of v2: only a reindex's or a "
                                                   "migration's promotion is watched"):
        promotion_to_watch({"kb_alias_mall_knowledge": [event(5, "rollback", 2)]})
    with pytest.raises(AirflowSkipException, match="no event"):
        promotion_to_watch(None)


def test_a_watch_look_is_late_only_past_its_window_and_the_slack_of_a_last_look() -> None:
    from datetime import datetime, timedelta

    from kb_reindex.run.watch import late_by

    promoted = datetime(2026, 12, 1, 10, 0)
    at = lambda minutes: promoted + timedelta(minutes=minutes)  # noqa: E731
    assert late_by(at(30), promoted, minutes=30, interval_s=60) == 0.0, "the last look, at the window's end"
    assert late_by(at(33), promoted, minutes=30, interval_s=60) == 0.0, "a last look a few intervals late"
    assert late_by(at(34), promoted, minutes=30, interval_s=60) == 60.0
    assert late_by(at(32), promoted, minutes=30, interval_s=10) == 0.0, "at least two minutes of slack"
    assert late_by(at(600), None, minutes=30, interval_s=60) == 0.0, "never promoted: not late"
