"""The "Knowledge index" page: behind Airflow's login, Airflow-authorised rollback, a real headless Chromium."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest
from fastapi.testclient import TestClient

from kb_reindex import engine
from kb_reindex.config import Settings
from kb_reindex.runtime import open_deps
from kb_reindex.web import create_app

from conftest import REPO, settings_for



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
    the reindex's paused flag, and runs a triggered rollback or shadow promotion the way its DAG would (the
    same engine functions), queued, then running, then success or failed."""

    def __init__(self, settings: Settings, tokens: dict[str, str]) -> None:
        self.settings, self.triggers, self.paused, self.sabotage = settings, [], False, False
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

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                self.handle_any("GET")

            def do_POST(self) -> None:  # noqa: N802
                self.handle_any("POST")

            def do_PATCH(self) -> None:  # noqa: N802
                self.handle_any("PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def seed(self, dag_id: str, run_id: str, state: str, run_type: str = "manual", conf: dict | None = None) -> dict:
        run = {"dag_id": dag_id, "dag_run_id": run_id, "state": state, "run_type": run_type, "conf": conf or {},
               "run_after": f"2026-01-{len(self.runs) + 1:02d}T00:00:00Z", "start_date": None, "end_date": None}
        self.runs[dag_id, run_id] = run
        return run

    def route(self, method: str, parts: list[str], body: dict | None, query: dict) -> tuple[int, dict]:
        if parts == ["dags", "knowledge_reindex"] and method in ("GET", "PATCH"):
            if method == "PATCH":
                self.paused = body["is_paused"]
            return 200, {"dag_id": "knowledge_reindex", "is_paused": self.paused}
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
            threading.Thread(target=self.run, args=(run,)).start()
            return 200, dict(run)
        if len(parts) == 4 and parts[0] == "dags" and parts[2] == "dagRuns" and (parts[1], parts[3]) in self.runs:
            return 200, dict(self.runs[parts[1], parts[3]])
        return 404, {"detail": "not found"}

    def run(self, run: dict) -> None:
        from kb_reindex.promote import promote_shadow

        time.sleep(0.5)
        run["state"] = "running"
        conf = run["conf"]
        assert conf["confirm"] is True
        try:
            if self.sabotage:
                raise RuntimeError("the worker died")
            with open_deps(self.settings) as deps:
                if run["dag_id"] == "knowledge_rollback":
                    engine.run_rollback(deps, reason=conf["reason"], to_version=conf["to_version"], trigger="airflow",
                                        expected_live=conf["live_version"])
                else:
                    with engine.exclusive(deps):
                        promote_shadow(deps, conf["version"], reason=conf["reason"], expected_live=conf["live_version"])
        except Exception:  # noqa: BLE001 - as Airflow records a failed task
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
            assert engine.run_reindex(deps)["outcome"] == "promoted"
    airflow = FakeAirflowApi(settings, tokens)
    yield settings, airflow
    airflow.server.shutdown()


@pytest.fixture
def busy_site(site: tuple[Settings, FakeAirflowApi]) -> tuple[Settings, FakeAirflowApi]:
    """Beside v1-v3 (v3 live): a shadow v4 from a migration that was not promoted, a build v5 half-way (its
    process gone), and a lock left behind by a dead process on this host."""

    from kb_reindex.build import build, create_version, reindex_lock_name
    from kb_reindex.plan import plan

    settings, airflow = site
    with open_deps(settings) as deps:
        shadow = engine.run_reindex(deps, kind="migration", embedder="hashing", model="hashing-ngram-v4", dim=512,
                                    promote_version=False)
        assert shadow["outcome"] == "shadow" and shadow["version"] == 4
        path = settings.knowledge_dir / "coupon-rules.md"
        path.write_text(path.read_text(encoding="utf-8") + "\n\n补充：节假日不适用。\n", encoding="utf-8")
        created = create_version(deps, plan(deps))
        build(deps, created["version"], window=(0, 20))
        from kb_reindex.state import default_lock_owner

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
        assert client.get("/reports/v3/validation.html").status_code == expected, credentials
        assert client.post("/api/rollback", json={"to_version": 2, "reason": "x"}).status_code == expected
        page = client.get("/ui")
        assert page.status_code == 307, credentials
        assert page.headers["location"].startswith("/auth/login?next=") and "knowledge" not in page.text.lower()
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
    refused = client.post("/api/rollback", json={"to_version": 2, "reason": "x"})
    assert refused.status_code == 403 and airflow.triggers == []
    user = {"Authorization": f"Bearer {tokens['user']}"}  # an explicit bearer wins over the viewer's cookie
    assert client.post("/api/rollback", json={"to_version": 2, "live_version": 3}, headers=user).status_code == 422
    # the version on-call saw serving goes with the rollback: without it, nothing is triggered
    no_live = client.post("/api/rollback", json={"to_version": 2, "reason": "x"}, headers=user)
    assert no_live.status_code == 422 and "live_version" in no_live.json()["detail"] and airflow.triggers == []
    ok = TestClient(app, cookies={"_token": tokens["user"]}).post(
        "/api/rollback", json={"to_version": 2, "live_version": 3, "reason": "bad text"})
    assert ok.status_code == 200 and airflow.triggers == [
        {"to_version": 2, "live_version": 3, "reason": "bad text", "confirm": True}]
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
    answer = client.post("/api/rollback", json={"to_version": 2, "live_version": 3, "reason": "x"})
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
        connection, _ = listener.accept()
        connection.recv(65536)
        connection.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        client = TestClient(create_app(settings_factory=lambda: settings, airflow_api_url=url),
                            cookies={"_token": tokens["user"]})
        answer = client.post("/api/rollback", json={"to_version": 2, "live_version": 3, "reason": "x"})
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
    assert user.post("/api/promote-shadow", json={"version": 2, "reason": "x"}).status_code == 409
    assert user.post("/api/rollback", json={"to_version": 4, "live_version": 3, "reason": "x"}).status_code == 409
    assert airflow.triggers == []
    run = user.post("/api/promote-shadow", json={"version": 4, "live_version": 3, "reason": "model trial"}).json()
    assert airflow.triggers == [{"version": 4, "live_version": 3, "reason": "model trial", "confirm": True}]
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
def test_page_in_headless_chromium_on_call(busy_site: tuple[Settings, FakeAirflowApi], tokens: dict[str, str]) -> None:
    """What on-call sees and does: versions with the right action each, the chart, a build's progress,
    metrics, locks and notes, Airflow's runs and the paused flag; rollback and shadow promotion followed to
    their end with a link to the run; the pause toggle."""
    import uvicorn
    from selenium import webdriver
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
    while not server.started:
        time.sleep(0.05)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    output = REPO / "test-output"
    output.mkdir(exist_ok=True)

    def text(css: str) -> str:
        return browser.find_element(By.CSS_SELECTOR, css).text

    def click(css: str) -> None:
        """The page redraws its tables when the status changes: find the button again if it was replaced."""
        from selenium.common.exceptions import StaleElementReferenceException

        for _ in range(20):
            try:
                return browser.find_element(By.CSS_SELECTOR, css).click()
            except StaleElementReferenceException:
                time.sleep(0.1)
        raise AssertionError(f"{css} kept being redrawn")

    def run_message(expected: str) -> str:
        wait.until(lambda b: expected in text("#message"))
        return browser.find_element(By.ID, "run-link").get_attribute("href")

    try:
        # anonymous: sent to Airflow's login (absent from this bare app) with the way back, shown nothing
        browser.get(f"http://127.0.0.1:{port}/ui")
        assert "/auth/login?next=" in browser.current_url and "serving" not in browser.page_source
        browser.add_cookie({"name": "_token", "value": tokens["user"]})  # what Airflow's login sets
        browser.get(f"http://127.0.0.1:{port}/ui")
        wait = WebDriverWait(browser, 30)
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

        # runbook step 3: pause the reindex, as the user, through Airflow
        assert "knowledge_reindex is active" in text("#reindex-paused")
        click("#pause-toggle")
        wait.until(expected_conditions.alert_is_present()).accept()
        wait.until(lambda b: "PAUSED" in text("#reindex-paused"))
        assert airflow.paused and text("#pause-toggle") == "Unpause knowledge_reindex"

        # roll back, followed to the end of the Airflow run
        click("#version-2 button.rollback")
        prompt = wait.until(expected_conditions.alert_is_present())
        prompt.send_keys("wrong coupon rule")
        prompt.accept()
        href = run_message("knowledge_rollback run manual__2026-11-30T09:00:01+00:00 succeeded")
        assert href.endswith("/dags/knowledge_rollback/runs/manual__2026-11-30T09%3A00%3A01%2B00%3A00")
        wait.until(lambda b: "serving v2" in text("#serving"))

        # promote the shadow: the confirmation names its model and dimension
        click("#version-4 button.promote")
        prompt = wait.until(expected_conditions.alert_is_present())
        assert "hashing-ngram-v4" in prompt.text and "512-d" in prompt.text and "never served" in prompt.text
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
        href = run_message("knowledge_rollback run manual__2026-11-30T09:00:03+00:00 FAILED")
        assert href.endswith("/dags/knowledge_rollback/runs/manual__2026-11-30T09%3A00%3A03%2B00%3A00")
        assert "serving v4" in text("#serving")
    finally:
        browser.quit()
        server.should_exit = True
        thread.join(timeout=10)
    assert [t["reason"] for t in airflow.triggers] == ["wrong coupon rule", "model trial", "try v3"]


def engine_status(settings: Settings) -> dict:
    with open_deps(settings) as deps:
        return engine.status(deps)
