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


class FakeAirflowApi:
    """Airflow's trigger endpoint as the page uses it: it authorises by token, then runs the rollback the
    way the knowledge_rollback DAG would (same engine function)."""

    def __init__(self, settings: Settings, tokens: dict[str, str]) -> None:
        self.settings, self.triggers = settings, []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server API
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status = 200 if token == tokens["user"] else 403 if token in tokens.values() else 401
                if self.path != "/api/v2/dags/knowledge_rollback/dagRuns":
                    status = 404
                if status == 200:
                    api.triggers.append(body["conf"])
                    threading.Thread(target=api.run, args=(body["conf"],)).start()
                payload = json.dumps({"dag_run_id": f"manual__{len(api.triggers)}", "state": "queued"} if status == 200
                                     else {"detail": "nope"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def run(self, conf: dict) -> None:
        assert conf["confirm"] is True
        with open_deps(self.settings) as deps:
            engine.run_rollback(deps, reason=conf["reason"], to_version=conf["to_version"], trigger="airflow")


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
    assert client.post("/api/rollback", json={"to_version": 2}, headers=user).status_code == 422
    ok = TestClient(app, cookies={"_token": tokens["user"]}).post("/api/rollback", json={"to_version": 2, "reason": "bad text"})
    assert ok.status_code == 200 and airflow.triggers == [{"to_version": 2, "reason": "bad text", "confirm": True}]
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
    answer = client.post("/api/rollback", json={"to_version": 2, "reason": "x"})
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
        answer = client.post("/api/rollback", json={"to_version": 2, "reason": "x"})
    finally:
        listener.close()
    assert answer.status_code == 502 and "may have been created" in answer.json()["detail"]


def test_plugin_registers_the_page() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("knowledge_index", REPO / "plugins" / "knowledge_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plugin = module.KnowledgeIndexPlugin
    assert plugin.fastapi_apps[0]["url_prefix"] == "/knowledge-index"
    assert plugin.external_views[0]["href"] == "knowledge-index/ui"


@pytest.mark.skipif(not shutil.which("chromium") or not shutil.which("chromedriver"),
                    reason="Debian's chromium and chromium-driver are not installed (scripts/test.sh installs them)")
def test_page_in_headless_chromium_rolls_back(site: tuple[Settings, FakeAirflowApi], tokens: dict[str, str]) -> None:
    import uvicorn
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    settings, airflow = site
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
    try:
        # anonymous: sent to Airflow's login (absent from this bare app) with the way back, shown nothing
        browser.get(f"http://127.0.0.1:{port}/ui")
        assert "/auth/login?next=" in browser.current_url and "serving" not in browser.page_source
        browser.add_cookie({"name": "_token", "value": tokens["user"]})  # what Airflow's login sets
        browser.get(f"http://127.0.0.1:{port}/ui")
        wait = WebDriverWait(browser, 20)
        wait.until(expected_conditions.presence_of_element_located((By.ID, "version-3")))
        assert "serving v3" in browser.find_element(By.ID, "serving").text
        assert "(rollback target)" in browser.find_element(By.ID, "version-2").text
        browser.find_element(By.CSS_SELECTOR, "#version-2 button.rollback").click()
        prompt = wait.until(expected_conditions.alert_is_present())
        prompt.send_keys("wrong coupon rule")
        prompt.accept()
        wait.until(lambda b: "serving v2" in b.find_element(By.ID, "serving").text)
        assert "triggered knowledge_rollback" in browser.find_element(By.ID, "message").text
        wait.until(lambda b: "rollback" in b.find_element(By.ID, "history").text)
        browser.save_screenshot(str(output / "knowledge-index.png"))
    finally:
        browser.quit()
        server.should_exit = True
        thread.join(timeout=10)
    assert airflow.triggers[0]["reason"] == "wrong coupon rule"
