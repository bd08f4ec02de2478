"""The "Knowledge index" page: API, Airflow-authorised rollback, and a real headless Chromium."""

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

GOOD, VIEWER = "op-token", "viewer-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeAirflowApi:
    """Airflow's trigger endpoint as the page uses it: it authorises by token, then runs the rollback the
    way the knowledge_rollback DAG would (same engine function)."""

    def __init__(self, settings: Settings) -> None:
        self.settings, self.triggers = settings, []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server API
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status = 200 if token == GOOD else 403 if token == VIEWER else 401
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
def site(project: Path) -> Iterator[tuple[Settings, FakeAirflowApi]]:
    settings = settings_for(project)
    for n in range(3):
        if n:
            path = settings.knowledge_dir / "coupon-rules.md"
            path.write_text(path.read_text(encoding="utf-8") + f"\n\n补充{n}：限时活动。\n", encoding="utf-8")
        with open_deps(settings) as deps:
            assert engine.run_reindex(deps)["outcome"] == "promoted"
    airflow = FakeAirflowApi(settings)
    yield settings, airflow
    airflow.server.shutdown()


def test_status_reports_and_rollback_authorisation(site: tuple[Settings, FakeAirflowApi]) -> None:
    settings, airflow = site
    client = TestClient(create_app(settings_factory=lambda: settings, airflow_api_url=airflow.url))
    status = client.get("/api/status").json()
    assert status["live"]["version"] == 3 and status["rollback_target"] == 2
    assert [e["action"] for e in status["history"]] == ["promote"] * 3
    assert "Knowledge index" in client.get("/ui").text
    assert client.get("/reports/v3/validation.html").status_code == 200
    assert client.get("/reports/v3/../../secret").status_code == 404

    assert client.post("/api/rollback", json={"to_version": 2, "reason": "x"}).status_code == 401
    refused = client.post("/api/rollback", json={"to_version": 2, "reason": "x"}, headers={"Authorization": f"Bearer {VIEWER}"})
    assert refused.status_code == 403 and airflow.triggers == []
    assert client.post("/api/rollback", json={"to_version": 2}, headers={"Authorization": f"Bearer {GOOD}"}).status_code == 422
    ok = client.post("/api/rollback", json={"to_version": 2, "reason": "bad text"}, cookies={"_token": GOOD})
    assert ok.status_code == 200 and airflow.triggers == [{"to_version": 2, "reason": "bad text", "confirm": True}]
    for _ in range(100):
        if client.get("/api/status").json()["live"]["version"] == 2:
            break
        time.sleep(0.1)
    assert client.get("/api/status").json()["live"]["version"] == 2


def test_rollback_when_the_airflow_api_does_not_answer_says_so_and_changes_nothing(
        site: tuple[Settings, FakeAirflowApi]) -> None:
    settings, _airflow = site
    nowhere = f"http://127.0.0.1:{free_port()}"
    client = TestClient(create_app(settings_factory=lambda: settings, airflow_api_url=nowhere))
    answer = client.post("/api/rollback", json={"to_version": 2, "reason": "x"}, cookies={"_token": GOOD})
    assert answer.status_code == 502
    assert nowhere in answer.json()["detail"] and "nothing was triggered" in answer.json()["detail"]
    assert client.get("/api/status").json()["live"]["version"] == 3


def test_rollback_whose_request_got_no_answer_says_a_run_may_exist(site: tuple[Settings, FakeAirflowApi]) -> None:
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
        client = TestClient(create_app(settings_factory=lambda: settings, airflow_api_url=url))
        answer = client.post("/api/rollback", json={"to_version": 2, "reason": "x"}, cookies={"_token": GOOD})
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
def test_page_in_headless_chromium_rolls_back(site: tuple[Settings, FakeAirflowApi]) -> None:
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
        browser.get(f"http://127.0.0.1:{port}/ui")
        wait = WebDriverWait(browser, 20)
        wait.until(expected_conditions.presence_of_element_located((By.ID, "version-3")))
        assert "serving v3" in browser.find_element(By.ID, "serving").text
        assert "(rollback target)" in browser.find_element(By.ID, "version-2").text
        browser.add_cookie({"name": "_token", "value": GOOD})
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
