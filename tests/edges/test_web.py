"""The "Knowledge index" page: behind Airflow's login, Airflow-authorised rollback, a real headless Chromium."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest
from conftest import REPO, settings_for
from fastapi.testclient import TestClient
from kb_reindex.run.pipeline import run_reindex
from kb_reindex.run.runs import exclusive, run_rollback
from kb_reindex.services.config import Settings
from kb_reindex.services.runtime import open_deps
from kb_reindex.web.app import create_app
from kb_reindex.run.status import status_view


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tokens(airflow_db: None) -> dict[str, str]:
    """Real JWTs signed by the auth manager the API server uses (SimpleAuthManager), as its login issues them:
    `user` may trigger DAG runs, `viewer` may only look."""
    from airflow.api_fastapi.app import init_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    manager = init_auth_manager()
    return {role: manager.generate_jwt(SimpleAuthManagerUser(username=f"kb-{role}", role=role))
            for role in ("user", "viewer")}


RUN_UI = "/dags/{dag}/runs/{run}"


class FakeAirflowApi:
    """Airflow's REST API as the page uses it, in a thread: it authorises by token (`user` may act, `viewer`
    may only read), keeps dag runs (a scheduled reindex run that failed before reaching our code among them),
    each DAG's paused flag, and runs a triggered rollback or shadow promotion the way its DAG would (the
    same engine functions), queued, then running, then success or failed; a run of a paused DAG stays
    queued. A failed run's task keeps its log (structured messages), the error last."""

    def __init__(self, settings: Settings, tokens: dict[str, str]) -> None:
        self.settings, self.triggers, self.sabotage = settings, [], False
        self.dag_paused = dict.fromkeys(("knowledge_reindex", "knowledge_rollback", "knowledge_model_migration",
                                         "knowledge_promote_shadow"), False)
        self.logs: dict[tuple[str, str], list[dict]] = {}
        self.runs: dict[tuple[str, str], dict] = {}
        self.seed("knowledge_reindex", "scheduled__2026-01-01T00:00:00+00:00", "success", "scheduled")
        self.seed("knowledge_reindex", "scheduled__2026-01-02T00:00:00+00:00", "failed", "scheduled")
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                pass

            def answer(self, status: int, payload: dict) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def handle_any(self, method: str) -> None:
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                if token not in tokens.values():
                    return self.answer(401, {"detail": "not authenticated"})
                if method != "GET" and token != tokens["user"]:
                    return self.answer(403, {"detail": "forbidden"})
                url = urlsplit(self.path)
                parts = [unquote(p) for p in url.path.removeprefix("/api/v2/").split("/")]
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                status, payload = api.route(method, parts, body, parse_qs(url.query))
                self.answer(status, payload)

            def do_GET(self) -> None:
                self.handle_any("GET")

            def do_POST(self) -> None:
                self.handle_any("POST")

            def do_PATCH(self) -> None:
                self.handle_any("PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def paused(self) -> bool:
        return self.dag_paused["knowledge_reindex"]

    def seed(self, dag_id: str, run_id: str, state: str, run_type: str = "manual", conf: dict | None = None) -> dict:
        run = {"dag_id": dag_id, "dag_run_id": run_id, "state": state, "run_type": run_type, "conf": conf or {},
               "run_after": f"2026-01-{len(self.runs) + 1:02d}T00:00:00Z", "start_date": None, "end_date": None}
        self.runs[dag_id, run_id] = run
        return run

    def route(self, method: str, parts: list[str], body: dict | None, query: dict) -> tuple[int, dict]:
        if len(parts) == 2 and parts[0] == "dags" and parts[1] in self.dag_paused and method in ("GET", "PATCH"):
            if method == "PATCH":
                self.dag_paused[parts[1]] = body["is_paused"]
            return 200, {"dag_id": parts[1], "is_paused": self.dag_paused[parts[1]]}
        if len(parts) == 5 and parts[4] == "taskInstances" and (parts[1], parts[3]) in self.runs:
            failed = (parts[1], parts[3]) in self.logs
            return 200, {"task_instances": [{"task_id": "work", "state": "failed" if failed else "success",
                                             "try_number": 1, "map_index": -1}]}
        if len(parts) == 8 and parts[6] == "logs" and (parts[1], parts[3]) in self.logs:
            return 200, {"content": self.logs[parts[1], parts[3]], "continuation_token": None}
        if len(parts) == 3 and parts[0] == "dags" and parts[2] == "dagRuns":
            dag_id = parts[1]
            if method == "GET":
                runs = sorted((r for (d, _), r in self.runs.items() if d == dag_id), key=lambda r: r["run_after"],
                              reverse=True)[: int(query.get("limit", ["100"])[0])]
                return 200, {"dag_runs": runs, "total_entries": len(runs)}
            if dag_id not in ("knowledge_rollback", "knowledge_promote_shadow"):
                return 404, {"detail": "no such DAG"}
            self.triggers.append(body["conf"])
            run = self.seed(dag_id, f"manual__2026-11-30T09:00:{len(self.triggers):02d}+00:00", "queued",
                            conf=body["conf"])
            if not self.dag_paused[dag_id]:
                threading.Thread(target=self.run, args=(run,)).start()
            return 200, dict(run)
        if len(parts) == 4 and parts[0] == "dags" and parts[2] == "dagRuns" and (parts[1], parts[3]) in self.runs:
            return 200, dict(self.runs[parts[1], parts[3]])
        return 404, {"detail": "not found"}

    def run(self, run: dict) -> None:
        from kb_reindex.run.pipeline import promote_shadow

        time.sleep(0.5)
        run["state"] = "running"
        conf = run["conf"]
        assert conf["confirm"] is True
        try:
            if self.sabotage:
                raise RuntimeError("the worker died")
            with open_deps(self.settings) as deps:
                if run["dag_id"] == "knowledge_rollback":
                    run_rollback(deps, reason=conf["reason"], to_version=conf["to_version"], trigger="airflow",
                                        expected_live=conf["live_version"])
                else:
                    with exclusive(deps):
                        promote_shadow(deps, conf["version"], reason=conf["reason"], expected_live=conf.get("live_version"))
        except Exception as exc:  # as Airflow records a failed task and logs why
            self.logs[run["dag_id"], run["dag_run_id"]] = [
                {"timestamp": "2026-11-30T09:00:00Z", "event": "starting", "level": "info"},
                {"timestamp": "2026-11-30T09:00:01Z", "event": "Task failed with exception", "level": "error",
                 "error_detail": [{"exc_type": type(exc).__name__, "exc_value": str(exc), "frames": []}]},
                {"timestamp": "2026-11-30T09:00:02Z", "event": "done", "level": "info"}]
            run["state"] = "failed"
        else:
            run["state"] = "success"


@pytest.fixture
def site(project: Path, tokens: dict[str, str]) -> Iterator[tuple[Settings, FakeAirflowApi]]:
    settings = settings_for(project)
    for n in range(3):
        if n:
            path = settings.knowledge_dir / "coupon-rules.md"
            path.write_text(path.read_text(encoding="utf-8") + f"\n\n补充{n}：限时活动。\n", encoding="utf-8")
        with open_deps(settings) as deps:
            assert run_reindex(deps)["outcome"] == "promoted"
    airflow = FakeAirflowApi(settings, tokens)
    yield settings, airflow
    airflow.server.shutdown()


@pytest.fixture
def busy_site(site: tuple[Settings, FakeAirflowApi]) -> tuple[Settings, FakeAirflowApi]:
    """Beside v1-v3 (v3 live): a shadow v4 from a migration that was not promoted, a build v5 half-way (its
    process gone), and a lock left behind by a dead process on this host."""

    from kb_reindex.steps.build import build, create_version
    from kb_reindex.rules.locking import reindex_lock_name
    from kb_reindex.run.pipeline import plan_and_snapshot

    settings, airflow = site
    with open_deps(settings) as deps:
        shadow = run_reindex(deps, kind="migration", embedder="hashing", model="hashing-ngram-v4", dim=512,
                                    promote_version=False)
        assert shadow["outcome"] == "shadow" and shadow["version"] == 4
        path = settings.knowledge_dir / "coupon-rules.md"
        path.write_text(path.read_text(encoding="utf-8") + "\n\n补充：节假日不适用。\n", encoding="utf-8")
        created = create_version(deps, plan_and_snapshot(deps))
        build(deps, created.version, window=(0, 20))
        from kb_reindex.services.state.locks import default_lock_owner

        # a lock left by a process that is gone (pid 999999 does not exist here)
        deps.state.acquire_lock(reindex_lock_name(settings.alias), owner=default_lock_owner(pid=999999), ttl_s=3600)
    return settings, airflow


def test_every_route_refuses_a_caller_without_a_valid_airflow_login(site: tuple[Settings, FakeAirflowApi]) -> None:
    settings, airflow = site
    app = create_app(settings_factory=lambda: settings, airflow_api_url=airflow.url)
    for credentials in ({}, {"cookies": {"_token": "not-a-jwt"}}, {"headers": {"Authorization": "Bearer not-a-jwt"}}):
        client = TestClient(app, follow_redirects=False, **credentials)
        expected = 401 if not credentials else 403  # Airflow's own answers: not authenticated / invalid JWT
        assert client.get("/api/status").status_code == expected, credentials
        assert client.post("/api/rollback", json={"to_version": 2, "reason": "x"}).status_code == expected
        # what a browser opens (the page, a report link): sent to the login and back, never raw JSON
        for opened in ("/ui", "/reports/v3/validation.html"):
            page = client.get(opened)
            assert page.status_code == 307, (opened, credentials)
            assert page.headers["location"].startswith("/auth/login?next=") and opened in unquote(
                page.headers["location"])
            assert "knowledge" not in page.text.lower() and "detail" not in page.text
    assert airflow.triggers == []


def test_status_reports_and_rollback_authorisation(site: tuple[Settings, FakeAirflowApi],
                                                   tokens: dict[str, str]) -> None:
    settings, airflow = site
    app = create_app(settings_factory=lambda: settings, airflow_api_url=airflow.url)
    client = TestClient(app, cookies={"_token": tokens["viewer"]})
    status = client.get("/api/status").json()
    assert status["live"]["version"] == 3 and status["rollback_target"] == 2
    assert [e["action"] for e in status["history"]] == ["promote"] * 3
    assert "Knowledge index" in client.get("/ui").text
    assert client.get("/reports/v3/validation.html").status_code == 200
    assert client.get("/reports/v3/../../secret").status_code == 404

    # a viewer may look but not trigger knowledge_rollback: refused here, Airflow's API is never called
    refused = client.post("/api/rollback", json={"to_version": 2, "reason": "x", "live_version": 3})
    assert refused.status_code == 403 and airflow.triggers == []
    user = {"Authorization": f"Bearer {tokens['user']}"}  # an explicit bearer wins over the viewer's cookie
    assert client.post("/api/rollback", json={"to_version": 2, "live_version": 3}, headers=user).status_code == 422
    ok = TestClient(app, cookies={"_token": tokens["user"]}).post(
        "/api/rollback", json={"to_version": 2, "reason": "bad text", "live_version": 3})
    assert ok.status_code == 200
    assert airflow.triggers == [{"to_version": 2, "reason": "bad text", "confirm": True, "live_version": 3}]
    for _ in range(100):
        if client.get("/api/status").json()["live"]["version"] == 2:
            break
        time.sleep(0.1)
    assert client.get("/api/status").json()["live"]["version"] == 2


def test_rollback_when_the_airflow_api_does_not_answer_says_so_and_changes_nothing(
        site: tuple[Settings, FakeAirflowApi], tokens: dict[str, str]) -> None:
    settings, _airflow = site
    nowhere = f"http://127.0.0.1:{free_port()}"
    client = TestClient(create_app(settings_factory=lambda: settings, airflow_api_url=nowhere),
                        cookies={"_token": tokens["user"]})
    answer = client.post("/api/rollback", json={"to_version": 2, "reason": "x", "live_version": 3})
    assert answer.status_code == 502
    assert nowhere in answer.json()["detail"] and "nothing was triggered" in answer.json()["detail"]
    assert client.get("/api/status").json()["live"]["version"] == 3


def test_rollback_whose_request_got_no_answer_says_a_run_may_exist(site: tuple[Settings, FakeAirflowApi],
                                                                   tokens: dict[str, str]) -> None:
    """Airflow may have created the run before the connection broke: on-call must check, not click again."""
    settings, _airflow = site
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def hang_up() -> None:
        """Answers the page's look at the DAG (not paused), then takes the trigger and hangs up."""
        connection, _ = listener.accept()
        assert connection.recv(65536).startswith(b"GET /api/v2/dags/knowledge_rollback ")
        body = b'{"dag_id": "knowledge_rollback", "is_paused": false}'
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        connection.close()
        connection, _ = listener.accept()
        connection.recv(65536)
        connection.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        client = TestClient(create_app(settings_factory=lambda: settings, airflow_api_url=url),
                            cookies={"_token": tokens["user"]})
        answer = client.post("/api/rollback", json={"to_version": 2, "reason": "x", "live_version": 3})
    finally:
        listener.close()
    assert answer.status_code == 502 and "may have been created" in answer.json()["detail"]


def test_a_script_in_the_alias_comes_out_escaped_in_the_page(project: Path, tokens: dict[str, str]) -> None:
    """The page's template autoescapes: in the heading the alias is text; in the script it is a JavaScript
    string (tojson) that neither a quote nor `</script>` can end. (KB_ALIAS refuses such a name; the template
    must not rely on that.)"""
    from dataclasses import replace

    alias = "kb</script><script>alert('x')</script>"
    settings = replace(settings_for(project), alias=alias)
    app = create_app(settings_factory=lambda: settings, airflow_api_url="http://127.0.0.1:9")
    page = TestClient(app, cookies={"_token": tokens["viewer"]}).get("/ui")
    assert page.status_code == 200
    assert "<script>alert" not in page.text and page.text.count("<script>") == 1
    assert "<code>kb&lt;/script&gt;&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;</code>" in page.text
    assert json.dumps(alias).replace("<", "\\u003c").replace(">", "\\u003e").replace("'", "\\u0027") in page.text


def test_plugin_registers_the_page() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("knowledge_index", REPO / "plugins" / "knowledge_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plugin = module.KnowledgeIndexPlugin
    assert plugin.fastapi_apps[0]["url_prefix"] == "/knowledge-index"
    assert plugin.external_views[0]["href"] == "knowledge-index/ui"


def test_shadow_promotion_pause_and_runs_through_airflow_as_the_caller(busy_site: tuple[Settings, FakeAirflowApi],
                                                                        tokens: dict[str, str]) -> None:
    settings, airflow = busy_site
    app = create_app(settings_factory=lambda: settings, airflow_api_url=airflow.url)
    viewer = TestClient(app, cookies={"_token": tokens["viewer"]})
    user = TestClient(app, cookies={"_token": tokens["user"]})
    rows = {v["version"]: v for v in viewer.get("/api/status").json()["versions"]}
    assert sorted(n for n, v in rows.items() if v["rollback_allowed"]) == [1, 2]
    assert [n for n, v in rows.items() if v["shadow"]] == [4] and rows[5]["status"] == "building"

    # a shadow is promoted, never rolled back to; a version that served is rolled back to, never "promoted"
    assert viewer.post("/api/promote-shadow", json={"version": 4, "reason": "x"}).status_code == 403
    assert user.post("/api/promote-shadow", json={"version": 4}).status_code == 422
    assert user.post("/api/promote-shadow", json={"version": 2, "reason": "x", "live_version": 3}).status_code == 409
    assert user.post("/api/rollback", json={"to_version": 4, "reason": "x", "live_version": 3}).status_code == 409
    assert airflow.triggers == []
    run = user.post("/api/promote-shadow", json={"version": 4, "reason": "model trial", "live_version": 3}).json()
    assert airflow.triggers == [{"version": 4, "reason": "model trial", "confirm": True, "live_version": 3}]
    assert run["dag_id"] == "knowledge_promote_shadow" and run["state"] == "queued"
    assert run["url"] == RUN_UI.format(dag="knowledge_promote_shadow", run=quote(run["dag_run_id"], safe=""))
    follow = f"/api/runs/knowledge_promote_shadow/{quote(run['dag_run_id'], safe='')}"
    for _ in range(100):
        if viewer.get(follow).json()["state"] in ("success", "failed"):
            break
        time.sleep(0.1)
    assert viewer.get(follow).json()["state"] == "success"
    assert viewer.get("/api/status").json()["live"]["version"] == 4
    assert viewer.get("/api/runs/some_other_dag/x").status_code == 404  # only our DAGs are proxied

    view = viewer.get("/api/airflow").json()
    assert view["reindex_paused"] is False and view["errors"] == []
    failed = next(r for r in view["runs"] if r["state"] == "failed")
    assert failed["dag_id"] == "knowledge_reindex" and failed["run_type"] == "scheduled"  # from Airflow, not our DB
    assert failed["url"] == "/dags/knowledge_reindex/runs/scheduled__2026-01-02T00%3A00%3A00%2B00%3A00"
    assert {r["dag_id"] for r in view["runs"]} == {"knowledge_reindex", "knowledge_promote_shadow"}

    assert viewer.post("/api/reindex-paused", json={"paused": True}).status_code == 403 and not airflow.paused
    assert user.post("/api/reindex-paused", json={"paused": "yes"}).status_code == 422
    assert user.post("/api/reindex-paused", json={"paused": True}).json()["reindex_paused"] is True
    assert airflow.paused and viewer.get("/api/airflow").json()["reindex_paused"] is True


def test_airflow_view_says_when_airflow_does_not_answer(site: tuple[Settings, FakeAirflowApi],
                                                        tokens: dict[str, str]) -> None:
    settings, _airflow = site
    nowhere = f"http://127.0.0.1:{free_port()}"
    client = TestClient(create_app(settings_factory=lambda: settings, airflow_api_url=nowhere),
                        cookies={"_token": tokens["viewer"]})
    view = client.get("/api/airflow").json()
    assert view["reindex_paused"] is None and view["runs"] == [] and nowhere in view["errors"][0]
    assert client.get("/api/status").status_code == 200  # the engine's side of the page still answers


@pytest.mark.skipif(not shutil.which("chromium") or not shutil.which("chromedriver"),
                    reason="Debian's chromium and chromium-driver are not installed (scripts/test.sh installs them)")
@pytest.mark.browser
def test_page_in_headless_chromium_on_call(busy_site: tuple[Settings, FakeAirflowApi], tokens: dict[str, str]) -> None:
    """What on-call sees and does: versions with the right action each, the chart, a build's progress,
    metrics, locks and notes, Airflow's runs and the paused flag; rollback and shadow promotion followed to
    their end with a link to the run; the pause toggle."""
    import uvicorn
    from selenium import webdriver
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    settings, airflow = busy_site
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings_factory=lambda: settings, airflow_api_url=airflow.url),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):
        if server.started or not thread.is_alive():
            break
        time.sleep(0.05)
    assert server.started, "the page's uvicorn server did not start"
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    # every wait re-reads the page: an element a poll redrew because its data changed is found again (a loaded
    # machine is slow, not wrong: the limit only bounds a failure)
    wait = WebDriverWait(browser, 60, ignored_exceptions=(StaleElementReferenceException,))
    output = REPO / "test-output"
    output.mkdir(exist_ok=True)

    def text(css: str) -> str:
        return browser.find_element(By.CSS_SELECTOR, css).text

    def click(css: str) -> None:
        """Found and clicked in one step, found again if the data it shows changed meanwhile (the page keeps a
        button whose data did not change: checked below)."""
        wait.until(lambda b: b.find_element(By.CSS_SELECTOR, css).click() or True)

    def still_shown(element: object) -> bool:
        try:
            return browser.execute_script("return arguments[0].isConnected", element)
        except StaleElementReferenceException:
            return False

    def run_message(expected: str) -> str:
        wait.until(lambda b: expected in text("#message"))
        run_link = browser.find_element(By.ID, "run-link")
        assert run_link.get_attribute("target") == "_top"  # Airflow's UI, out of the iframe it shows this page in
        return run_link.get_attribute("href")

    try:
        # anonymous: sent to Airflow's login (absent from this bare app) with the way back, shown nothing
        browser.get(f"http://127.0.0.1:{port}/ui")
        assert "/auth/login?next=" in browser.current_url and "serving" not in browser.page_source
        browser.add_cookie({"name": "_token", "value": tokens["user"]})  # what Airflow's login sets
        browser.get(f"http://127.0.0.1:{port}/ui")
        wait.until(expected_conditions.presence_of_element_located((By.ID, "version-5")))
        wait.until(lambda b: "scheduled__2026-01-02" in text("#runs"))
        assert "serving v3" in text("#serving")

        # each version offers what it may: rollback to served ones, promotion of the shadow, nothing else
        actions = {n: [b.text for b in browser.find_elements(By.CSS_SELECTOR, f"#version-{n} button")]
                   for n in range(1, 6)}
        assert actions == {1: ["Roll back to v1"], 2: ["Roll back to v2"], 3: [],
                           4: ["Promote shadow v4 (hashing-ngram-v4, 512-d)"], 5: []}
        assert "(rollback target)" in text("#version-2") and "shadow, never served" in text("#version-4")
        bar = browser.find_element(By.CSS_SELECTOR, "#version-5 progress.build-progress")
        expected = {v["version"]: v for v in engine_status(settings)["versions"]}[5]
        assert 0 < expected["points_written"] < expected["points_expected"]
        assert (int(float(bar.get_attribute("value"))), int(float(bar.get_attribute("max")))) == \
            (expected["points_written"], expected["points_expected"])
        assert f"{expected['points_written']}/{expected['points_expected']} points" in text("#version-5")

        # chart: one point per validated version and series, labelled by whole versions
        assert len(browser.find_elements(By.CSS_SELECTOR, "#chart circle.point-hit_rate")) == 4
        assert len(browser.find_elements(By.CSS_SELECTOR, "#chart circle.point-mrr")) == 4
        assert [t.text for t in browser.find_elements(By.CSS_SELECTOR, "#chart text.x-label")] == \
            ["v1", "v2", "v3", "v4"]
        # metrics as a table of labelled values; locks and notes shown
        assert "run success rate" in text("#metric-run_success_rate") and "%" in text("#metric-run_success_rate")
        assert "{" not in text("#metrics")
        assert ":999999:" in text("#locks") and "whose process is gone" in text("#notes")
        # the query log: off here, holding nothing
        assert text("#query-log") == "query log (KB_QUERY_LOG): off, 0 logged queries held (keeps the newest 5000)"
        # Airflow's own runs, failed before our code ran included, linked to Airflow's UI
        failed = browser.find_element(By.LINK_TEXT, "scheduled__2026-01-02T00:00:00+00:00")
        assert failed.get_attribute("href").endswith(
            "/dags/knowledge_reindex/runs/scheduled__2026-01-02T00%3A00%3A00%2B00%3A00")
        assert "failed" in failed.find_element(By.XPATH, "../..").text

        # a poll redraws only what changed: while the status changes on every poll (the age of the ready shadow)
        # and Airflow lists one more run, the buttons and links on-call is about to click stay the same elements
        held = {what: browser.find_element(By.CSS_SELECTOR, css) for what, css in (
            ("rollback button", "#version-2 button.rollback"), ("promotion button", "#version-4 button.promote"),
            ("freeze button", "#freeze-toggle"), ("report link", "#version-3 a"),
            ("metric row", "#metric-run_success_rate"), ("chart point", "#chart circle.point-mrr"))}
        held["Airflow run link"] = failed
        age = text("#metric-ready_unpromoted_age_s")
        airflow.seed("knowledge_reindex", "scheduled__2026-01-03T00:00:00+00:00", "success", "scheduled")
        wait.until(lambda b: text("#metric-ready_unpromoted_age_s") != age and "scheduled__2026-01-03" in text("#runs"))
        assert [what for what, element in held.items() if not still_shown(element)] == []

        # runbook step 3: pause the reindex, as the user, through Airflow
        assert "knowledge_reindex is active" in text("#reindex-paused")
        click("#pause-toggle")
        wait.until(expected_conditions.alert_is_present()).accept()
        wait.until(lambda b: "PAUSED" in text("#reindex-paused"))
        assert airflow.paused and text("#pause-toggle") == "Unpause knowledge_reindex"

        # roll back, followed to the end of the Airflow run
        # ... from a knowledge_rollback that is paused in Airflow: said plainly, unpaused after asking
        airflow.dag_paused["knowledge_rollback"] = True
        wait.until(lambda b: "knowledge_rollback is PAUSED in Airflow" in text("#dags-paused"))
        click("#version-2 button.rollback")
        prompt = wait.until(expected_conditions.alert_is_present())
        assert "v3 -> v2" in prompt.text and "knowledge_rollback is PAUSED in Airflow: it will be unpaused" in prompt.text
        assert "is then frozen: no run, migration or shadow promotion moves it forward" in prompt.text
        prompt.send_keys("wrong coupon rule")
        prompt.accept()
        href = run_message("knowledge_rollback run manual__2026-11-30T09:00:01+00:00 succeeded")
        assert "(knowledge_rollback was paused: unpaused it)" in text("#message")
        assert not airflow.dag_paused["knowledge_rollback"]
        assert href.endswith("/dags/knowledge_rollback/runs/manual__2026-11-30T09%3A00%3A01%2B00%3A00")
        wait.until(lambda b: "serving v2" in text("#serving"))

        # promote the shadow: the confirmation names its model and dimension
        click("#version-4 button.promote")
        prompt = wait.until(expected_conditions.alert_is_present())
        assert "hashing-ngram-v4" in prompt.text and "512-d" in prompt.text and "never served" in prompt.text
        assert "v2 (hashing-ngram-v1, " in prompt.text and "-d) -> v4?" in prompt.text
        prompt.send_keys("model trial")
        prompt.accept()
        href = run_message("knowledge_promote_shadow run manual__2026-11-30T09:00:02+00:00 succeeded")
        assert href.endswith("/dags/knowledge_promote_shadow/runs/manual__2026-11-30T09%3A00%3A02%2B00%3A00")
        wait.until(lambda b: "serving v4" in text("#serving"))
        wait.until(lambda b: "knowledge_promote_shadow" in text("#runs"))
        browser.set_window_size(1280, browser.execute_script("return document.body.scrollHeight") + 160)
        browser.save_screenshot(str(output / "knowledge-index.png"))

        # a run that fails says so, with its link
        airflow.sabotage = True
        click("#version-3 button.rollback")
        prompt = wait.until(expected_conditions.alert_is_present())
        prompt.send_keys("try v3")
        prompt.accept()
        href = run_message("knowledge_rollback run manual__2026-11-30T09:00:03+00:00 FAILED: "
                           "work: RuntimeError: the worker died")
        assert href.endswith("/dags/knowledge_rollback/runs/manual__2026-11-30T09%3A00%3A03%2B00%3A00")
        assert "serving v4" in text("#serving")

        # the freeze: who, when, why; then lifted
        click("#freeze-toggle")
        prompt = wait.until(expected_conditions.alert_is_present())
        prompt.send_keys("sale weekend")
        prompt.accept()
        wait.until(lambda b: "FROZEN since" in text("#freeze-text"))
        assert "by kb-user: sale weekend" in text("#freeze-text")
        click("#freeze-toggle")
        wait.until(expected_conditions.alert_is_present()).accept()
        wait.until(lambda b: "not frozen" in text("#freeze-text"))

        # a status poll that fails says so in a banner (the state DB moved away), and clears when it answers
        state_file = Path(settings.state_url.removeprefix("sqlite:///"))
        state_file.rename(state_file.with_suffix(".away"))
        try:
            wait.until(lambda b: "the status poll failed: HTTP 503" in text("#poll-error"))
        finally:
            state_file.with_suffix(".away").rename(state_file)
        wait.until(lambda b: text("#poll-error") == "")

        # a viewer is shown no action Airflow would refuse
        browser.delete_cookie("_token")
        browser.add_cookie({"name": "_token", "value": tokens["viewer"]})
        browser.get(f"http://127.0.0.1:{port}/ui")
        wait.until(expected_conditions.presence_of_element_located((By.ID, "version-5")))
        wait.until(lambda b: "knowledge_reindex is" in text("#reindex-paused"))
        assert browser.find_elements(By.CSS_SELECTOR, "#versions button") == []
        assert not browser.find_element(By.ID, "pause-toggle").is_displayed()
        assert browser.find_elements(By.ID, "freeze-toggle") == []
    finally:
        browser.quit()
        server.should_exit = True
        thread.join(timeout=10)
    assert [t["reason"] for t in airflow.triggers] == ["wrong coupon rule", "model trial", "try v3"]


def engine_status(settings: Settings) -> dict:
    with open_deps(settings) as deps:
        return status_view(deps).to_dict()


# --- issue #20 (on-call) and #22: what the page shows and refuses ----------------------------------------


def _clients(settings: Settings, airflow: FakeAirflowApi, tokens: dict[str, str]) -> tuple[TestClient, TestClient]:
    app = create_app(settings_factory=lambda: settings, airflow_api_url=airflow.url)
    return TestClient(app, cookies={"_token": tokens["viewer"]}), TestClient(app, cookies={"_token": tokens["user"]})


def _wait_for_end(client: TestClient, run: dict) -> dict:
    follow = f"/api/runs/{run['dag_id']}/{quote(run['dag_run_id'], safe='')}"
    for _ in range(200):
        now = client.get(follow).json()
        if now["state"] in ("success", "failed"):
            return now
        time.sleep(0.05)
    raise AssertionError(f"{run['dag_run_id']} did not end")


def test_triggers_carry_the_live_version_on_call_confirmed(site: tuple[Settings, FakeAirflowApi],
                                                           tokens: dict[str, str]) -> None:
    """The conf names the live version the page showed ("v3 -> v2"); once the alias has moved, the click
    is refused and nothing is triggered."""
    settings, airflow = site
    _viewer, user = _clients(settings, airflow, tokens)
    stale = user.post("/api/rollback", json={"to_version": 1, "reason": "x", "live_version": 2})
    assert stale.status_code == 409 and "serves v3 now, not v2 as you confirmed" in stale.json()["detail"]
    assert user.post("/api/rollback", json={"to_version": 1, "reason": "x"}).status_code == 409
    assert user.post("/api/rollback", json={"to_version": 1, "reason": "x", "live_version": "3"}).status_code == 422
    assert airflow.triggers == []
    run = user.post("/api/rollback", json={"to_version": 1, "reason": "x", "live_version": 3}).json()
    assert airflow.triggers == [{"to_version": 1, "reason": "x", "confirm": True, "live_version": 3}]
    assert _wait_for_end(user, run)["state"] == "success"
    assert user.get("/api/status").json()["live"]["version"] == 1


def test_a_paused_on_call_dag_is_said_and_unpaused_only_when_on_call_agreed(
        site: tuple[Settings, FakeAirflowApi], tokens: dict[str, str]) -> None:
    """A run of a paused DAG stays queued for ever: the page says which on-call DAG is paused, refuses to
    trigger it silently, and unpauses it first when the request carries on-call's agreement."""
    settings, airflow = site
    viewer, user = _clients(settings, airflow, tokens)
    airflow.dag_paused["knowledge_rollback"] = True
    assert viewer.get("/api/airflow").json()["paused"] == {
        "knowledge_reindex": False, "knowledge_rollback": True, "knowledge_model_migration": False,
        "knowledge_promote_shadow": False}
    body = {"to_version": 2, "reason": "x", "live_version": 3}
    refused = user.post("/api/rollback", json=body)
    assert refused.status_code == 409 and "knowledge_rollback is paused" in refused.json()["detail"]
    assert "`airflow dags unpause knowledge_rollback`" in refused.json()["detail"]
    assert airflow.triggers == [] and airflow.dag_paused["knowledge_rollback"]
    run = user.post("/api/rollback", json={**body, "unpause": True}).json()
    assert run["unpaused"] is True and not airflow.dag_paused["knowledge_rollback"]
    assert _wait_for_end(user, run)["state"] == "success"
    again = user.post("/api/rollback", json={"to_version": 3, "reason": "y", "live_version": 2, "unpause": True})
    assert again.json()["unpaused"] is False  # nothing to unpause: said so


def _hold_local_qdrant(settings: Settings) -> subprocess.Popen:
    """Another process holding the local store, as a build's slice does; it lets go when its stdin closes."""
    holder = subprocess.Popen(
        [sys.executable, "-c", ("import sys\nfrom qdrant_client import QdrantClient\nc = QdrantClient(path=sys.argv[1])\n"
                                "print('held', flush=True)\nsys.stdin.read()\nc.close()"),
         str(settings.qdrant_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_status_answers_from_the_state_db_while_a_build_holds_local_qdrant(
        site: tuple[Settings, FakeAirflowApi], tokens: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Local mode admits one process per folder: while a build holds it, the status comes at once (no
    10 s wait for the folder) from the state DB (versions, the run and its progress), Qdrant's parts marked
    busy, and no rollback is offered (its structural check cannot run)."""
    from kb_reindex.services import store
    from kb_reindex.steps.build import build, create_version
    from kb_reindex.run.pipeline import plan_and_snapshot

    settings, airflow = site
    run_id = "airflow__knowledge_reindex__manual__2026-11-30T10:00:00+00:00"
    with open_deps(settings) as deps:
        path = settings.knowledge_dir / "coupon-rules.md"
        path.write_text(path.read_text(encoding="utf-8") + "\n\n补充：周末不适用。\n", encoding="utf-8")
        deps.state.start_run(run_id=run_id, alias=settings.alias, kind="reindex", trigger="airflow")
        created = create_version(deps, plan_and_snapshot(deps, run_id=run_id), run_id=run_id)
        build(deps, created.version, run_id=run_id, window=(0, 10))
    viewer, user = _clients(settings, airflow, tokens)

    def no_waiting(_seconds: float) -> None:
        raise AssertionError("the page waited for the local Qdrant folder")

    holder = _hold_local_qdrant(settings)
    try:
        with monkeypatch.context() as patched:
            patched.setattr(store.time, "sleep", no_waiting)
            answer = viewer.get("/api/status")
            refused = user.post("/api/rollback", json={"to_version": 2, "reason": "x", "live_version": 3})
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert answer.status_code == 200, answer.text
    assert refused.status_code == 409 and "the structural check of v2 cannot run now" in refused.json()["detail"]
    assert airflow.triggers == []
    s = answer.json()
    assert s["qdrant"]["access"] == "busy" and "in use by another process" in s["qdrant"]["detail"]
    assert s["live"]["version"] == 3 and s["live"]["points"] is None
    rows = {v["version"]: v for v in s["versions"]}
    assert rows[4]["status"] == "building" and rows[4]["points"] is None
    assert 0 < rows[4]["points_written"] < rows[4]["points_expected"] and rows[4]["run_id"] == run_id
    assert all(v["rollback_problems"] for v in s["versions"] if v["rollback_allowed"]) and rows[2]["rollback_allowed"]
    running = next(r for r in s["runs"] if r["run_id"] == run_id)
    assert running["outcome"] == "running" and running["dag_id"] == "knowledge_reindex"
    assert running["dag_run_id"] == "manual__2026-11-30T10:00:00+00:00"
    assert [e["action"] for e in s["history"]] == ["promote"] * 3
    # with the folder free again, Qdrant's parts are back
    again = viewer.get("/api/status").json()
    assert again["qdrant"]["access"] == "read" and again["live"]["points"] > 0


def test_the_page_never_creates_a_state_db(project: Path, tokens: dict[str, str]) -> None:
    """Issue 22: a GET must not create an empty state DB (nor a Qdrant folder); it says what is missing."""
    settings = settings_for(project)
    state_file = Path(settings.state_url.removeprefix("sqlite:///"))
    client = TestClient(create_app(settings_factory=lambda: settings, airflow_api_url="http://127.0.0.1:9"),
                        cookies={"_token": tokens["viewer"]})
    answer = client.get("/api/status")
    assert answer.status_code == 503 and "KB_STATE_URL" in answer.json()["detail"]
    assert str(state_file) in answer.json()["detail"]
    assert not state_file.exists() and not settings.qdrant_path.exists()
    assert client.get("/ui").status_code == 200  # the page itself loads, and shows the error in its banner
    # nor does an action: each says the state DB is missing, and still creates nothing
    user = TestClient(create_app(settings_factory=lambda: settings, airflow_api_url="http://127.0.0.1:9"),
                      cookies={"_token": tokens["user"]})
    for path, body in (("/api/freeze", {"reason": "x"}), ("/api/unfreeze", {}),
                       ("/api/rollback", {"to_version": 1, "reason": "x"})):
        answer = user.post(path, json=body)
        assert answer.status_code == 503 and "KB_STATE_URL" in answer.json()["detail"], (path, answer.text)
    assert not state_file.exists() and not settings.qdrant_path.exists()


def test_a_failed_version_and_a_failed_run_say_why(site: tuple[Settings, FakeAirflowApi],
                                                   tokens: dict[str, str]) -> None:
    """The version row carries its failure reason; a followed run that failed carries its failing task's
    last error line from the task log, not "its task log says why"."""
    settings, airflow = site
    viewer, user = _clients(settings, airflow, tokens)
    with open_deps(settings) as deps:
        path = settings.knowledge_dir / "coupon-rules.md"
        path.write_text(path.read_text(encoding="utf-8") + "\n\n补充：会员日双倍积分。\n", encoding="utf-8")
        failed = run_reindex(deps, min_hit_rate=1.0, min_mrr=1.0)
    assert failed["outcome"] == "failed"
    row = next(v for v in viewer.get("/api/status").json()["versions"] if v["version"] == failed["version"])
    assert row["status"] == "failed" and "MRR" in row["error"] and "< 1.0" in row["error"]

    airflow.sabotage = True
    run = user.post("/api/rollback", json={"to_version": 2, "reason": "x", "live_version": 3}).json()
    ended = _wait_for_end(viewer, run)
    assert ended["state"] == "failed" and ended["error"] == "work: RuntimeError: the worker died"


def test_last_error_line_of_a_structured_task_log() -> None:
    from kb_reindex.web.airflow_api import last_error_line

    assert last_error_line([{"event": "fine", "level": "info"}]) is None
    assert last_error_line([{"event": "kb_reindex: rollback refused\nmore", "level": "error"},
                            {"event": "later", "level": "info"}]) == "kb_reindex: rollback refused"
    assert last_error_line([{"event": "Task failed with exception", "level": "error", "error_detail": [
        {"exc_type": "RollbackRefused", "exc_value": "v1 is not whole: point count: 3 points, manifest lists 4"}]}]) \
        == "RollbackRefused: v1 is not whole: point count: 3 points, manifest lists 4"
    # our tasks wrap a final error in AirflowFailException("<type>: <message>"): its value is the line
    assert last_error_line([{"event": "Task failed with exception", "level": "error", "error_detail": [
        {"exc_type": "AirflowFailException", "exc_value": "RollbackRefused: v1 is failed"},
        {"exc_type": "KeyError", "exc_value": "'x'"}]}]) == "RollbackRefused: v1 is failed"


def test_rollback_is_offered_only_to_whole_versions(site: tuple[Settings, FakeAirflowApi],
                                                    tokens: dict[str, str]) -> None:
    """A retired version whose collection is gone, or that lost points, is no rollback target: the row says
    what is missing (no "holds None points"), and a request for it is refused before Airflow is asked."""
    from qdrant_client import models

    settings, airflow = site
    viewer, user = _clients(settings, airflow, tokens)
    with open_deps(settings) as deps:
        v1, v2 = (deps.state.get_version(settings.alias, n) for n in (1, 2))
        deps.store.client.delete_collection(v1.collection)
        lost = deps.state.manifest_refs(v2.id)[0].point_id
        deps.store.client.delete(v2.collection, points_selector=models.PointIdsList(points=[lost]), wait=True)
    s = viewer.get("/api/status").json()
    rows = {v["version"]: v for v in s["versions"]}
    assert rows[1]["rollback_problems"] == [f"collection {v1.collection} is missing from Qdrant"]
    assert rows[2]["rollback_problems"] == [
        f"{v2.collection} holds {v2.points_expected - 1} points, its manifest lists {v2.points_expected}"]
    assert not any("None" in p for p in s["problems"])
    assert any(f"({v1.collection}) is retired in the state DB, but Qdrant has no such collection" in p for p in s["problems"])
    for version, missing in ((1, f"{v1.collection} is missing"), (2, "point count")):
        refused = user.post("/api/rollback", json={"to_version": version, "reason": "x", "live_version": 3})
        assert refused.status_code == 409 and missing in refused.json()["detail"], refused.json()
    assert airflow.triggers == []


def test_actions_are_offered_by_role(site: tuple[Settings, FakeAirflowApi], tokens: dict[str, str]) -> None:
    """A viewer is shown no action that Airflow would then refuse with "Forbidden"."""
    settings, airflow = site
    viewer, user = _clients(settings, airflow, tokens)
    assert viewer.get("/api/status").json()["may"] == {"rollback": False, "promote_shadow": False,
                                                      "pause_reindex": False, "freeze": False}
    assert user.get("/api/status").json()["may"] == {"rollback": True, "promote_shadow": True, "pause_reindex": True,
                                                    "freeze": True}


def test_times_follow_airflows_time_zone_beside_utc(project: Path, tokens: dict[str, str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import airflow.settings
    import pendulum

    settings = settings_for(project)
    client = TestClient(create_app(settings_factory=lambda: settings, airflow_api_url="http://127.0.0.1:9"),
                        cookies={"_token": tokens["viewer"]})
    assert 'const TIMEZONE="UTC";' in client.get("/ui").text
    monkeypatch.setattr(airflow.settings, "TIMEZONE", pendulum.timezone("Europe/Amsterdam"))
    assert 'const TIMEZONE="Europe/Amsterdam";' in client.get("/ui").text


def test_state_db_run_ids_of_dag_runs_link_to_airflow() -> None:
    from kb_reindex.run.pageview import airflow_run

    assert airflow_run("airflow__knowledge_rollback__manual__2026-11-30T09:00:01+00:00") == (
        "knowledge_rollback", "manual__2026-11-30T09:00:01+00:00")
    assert airflow_run("cli__rollback__0123456789ab") == (None, None) and airflow_run(None) == (None, None)


def test_a_bad_payload_layout_param_is_named_as_the_param(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The migration DAG's Param, not the environment variable it defaults to, is what on-call fixes."""
    from airflow.sdk.exceptions import AirflowFailException
    from kb_reindex.airflow import connections, tasks

    monkeypatch.setenv("KB_PROJECT_ROOT", str(project))
    monkeypatch.setattr(connections, "_connection", lambda conn_id: None)
    with pytest.raises(AirflowFailException) as failed:
        tasks.plan_task(run_id="airflow__knowledge_model_migration__m1", kind="migration",
                                embedder="hashing", layout="foo")
    assert "Param payload_layout='foo' is unknown" in str(failed.value)
    assert "KB_PAYLOAD_LAYOUT" not in str(failed.value)


def test_a_promotion_with_lowered_thresholds_says_later_reindexes_will_fail(
        project: Path, tokens: dict[str, str], caplog: pytest.LogCaptureFixture) -> None:
    """A version validated with thresholds below the golden set's, and scoring under them, leaves every later
    reindex failing: said at its promotion (log and result) and on the page, with what to do."""
    import yaml

    settings = settings_for(project)
    golden = yaml.safe_load(settings.golden_set.read_text(encoding="utf-8"))
    golden.update(min_hit_rate=1.0, min_mrr=1.0)
    settings.golden_set.write_text(yaml.safe_dump(golden, allow_unicode=True), encoding="utf-8")
    with open_deps(settings) as deps, caplog.at_level("WARNING", logger="kb_reindex.steps.promote"):
        result = run_reindex(deps, min_hit_rate=0.5, min_mrr=0.5)
    assert result["outcome"] == "promoted"
    said = result["lowered_thresholds"]
    assert said.startswith("v1 was promoted with lowered thresholds: hit rate ") and "< the golden set's 1.0" in said
    assert "(validated against a lowered 0.5)" in said
    assert "Every later reindex" in said and str(settings.golden_set) in said and said in caplog.text
    client = TestClient(create_app(settings_factory=lambda: settings, airflow_api_url="http://127.0.0.1:9"),
                        cookies={"_token": tokens["viewer"]})
    assert said in client.get("/api/status").json()["problems"]


def test_freeze_from_the_page_shows_who_when_why_and_holds_promotions(
        site: tuple[Settings, FakeAirflowApi], tokens: dict[str, str]) -> None:
    """The Pause button freezes the alias in the state DB as the signed-in user, with a reason (a viewer may
    not); the page shows who, when and why; a reindex then keeps its version ready; Unfreeze lifts it."""
    settings, airflow = site
    viewer, user = _clients(settings, airflow, tokens)
    assert viewer.get("/api/status").json()["freeze"] is None
    assert viewer.post("/api/freeze", json={"reason": "x"}).status_code == 403
    assert user.post("/api/freeze", json={"reason": " "}).status_code == 422
    frozen = user.post("/api/freeze", json={"reason": "sale weekend"}).json()
    assert (frozen["frozen"], frozen["set_by"], frozen["reason"]) == (True, "kb-user", "sale weekend")
    shown = viewer.get("/api/status").json()
    assert shown["freeze"]["set_by"] == "kb-user" and shown["freeze"]["reason"] == "sale weekend"
    assert shown["freeze"]["set_at"].endswith("Z")
    assert shown["history"][-1]["action"] == "freeze" and "sale weekend" in shown["history"][-1]["reason"]
    with open_deps(settings) as deps:
        path = settings.knowledge_dir / "coupon-rules.md"
        path.write_text(path.read_text(encoding="utf-8") + "\n\n补充：冻结期间。\n", encoding="utf-8")
        assert run_reindex(deps)["outcome"] == "frozen"
    assert viewer.get("/api/status").json()["live"]["version"] == 3
    assert viewer.post("/api/unfreeze", json={}).status_code == 403
    lifted = user.post("/api/unfreeze", json={}).json()
    assert lifted["frozen"] is False and lifted["lifted"]["reason"] == "sale weekend"
    assert viewer.get("/api/status").json()["freeze"] is None
