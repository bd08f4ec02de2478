"""The Knowledge index page over several knowledge bases (KB_REGISTRY): it opens on the list (what each serves,
frozen, its last run, a problem marker), one click reaches one knowledge base's page, and that page's buttons
act on its own DAGs only; behind Airflow's login as ever. An entry added to the registry shows up without a
restart. Then the list and one knowledge base's page in a real headless Chromium, signed in, at 1280x800."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from chromium_page import FRAME_ROUTE, PREFIX, airflow_frame, chromium, needs_chromium, page_wait, served, sign_in
from conftest import REPO, as_page, settings_for
from kb_reindex.run.pipeline import run_reindex
from kb_reindex.services.registry import select_knowledge_base
from kb_reindex.services.runtime import open_deps
from kb_reindex.web.app import deployment_app

SHOP, SELLER = "mall_knowledge", "seller_rules"


class RecordingAirflow:
    """Airflow's REST API as far as the page's rollback asks it: every DAG unpaused, every trigger recorded."""

    def __init__(self) -> None:
        self.triggers: list[tuple[str, dict]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                pass

            def answer(self, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's names
                self.answer({"is_paused": False, "dag_runs": [], "total_entries": 0})

            def do_POST(self) -> None:  # noqa: N802
                dag_id = self.path.split("/dags/", 1)[1].split("/", 1)[0]
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.triggers.append((dag_id, body["conf"]))
                self.answer({"dag_run_id": f"manual__{len(api.triggers)}", "state": "queued"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def tokens(airflow_db: None) -> dict[str, str]:
    from airflow.api_fastapi.app import init_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    manager = init_auth_manager()
    return {role: manager.generate_jwt(SimpleAuthManagerUser(username=f"kb-{role}", role=role))
            for role in ("user", "viewer")}


@pytest.fixture
def registry_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, RecordingAirflow]]:
    """The shipped registry in a project: the shop built twice (a rollback target), the sellers' rules once."""
    project = tmp_path / "project"
    shutil.copytree(REPO / "knowledge", project / "knowledge")
    for name, value in {"KB_PROJECT_ROOT": str(project), "KB_REGISTRY": "knowledge/registry.yaml",
                        "KB_EMBEDDER": "hashing"}.items():
        monkeypatch.setenv(name, value)
    settings_for(project)  # the hashing embedder, as the suite's
    for kb, runs in ((SHOP, 2), (SELLER, 1)):
        settings = select_knowledge_base(kb).settings()
        for n in range(runs):
            if n:
                path = settings.knowledge_dir / "coupon-rules.md"
                path.write_text(path.read_text(encoding="utf-8") + "\n\n补充：限时活动。\n", encoding="utf-8")
            with open_deps(settings) as deps:
                assert run_reindex(deps).outcome == "promoted"
    airflow = RecordingAirflow()
    yield project, airflow
    airflow.server.shutdown()


def test_the_page_lists_every_knowledge_base_and_each_acts_on_its_own_dags(
        registry_site: tuple[Path, RecordingAirflow], tokens: dict[str, str]) -> None:
    project, airflow = registry_site
    app = deployment_app(airflow_api_url=airflow.url)
    anonymous = TestClient(app, follow_redirects=False)
    for opened in ("/ui", f"/kb/{SELLER}/ui"):
        assert anonymous.get(opened).status_code == 307, opened  # to Airflow's login, as before
    assert anonymous.get("/api/bases").status_code == 401
    assert anonymous.get(f"/kb/{SHOP}/api/status").status_code == 401

    client = TestClient(app, **as_page(tokens["user"]))
    listed = client.get("/ui").text
    assert f'href="kb/{SHOP}/ui"' in listed and f'href="kb/{SELLER}/ui"' in listed
    bases = {b["alias"]: b for b in client.get("/api/bases").json()["knowledge_bases"]}
    assert (bases[SHOP]["live_version"], bases[SELLER]["live_version"]) == (2, 1)
    assert bases[SHOP]["last_run"]["outcome"] == "promoted" and bases[SELLER]["frozen"] is False

    page = client.get(f"/kb/{SELLER}/ui").text
    assert f"<code>{SELLER}</code>" in page and '"knowledge_rollback__seller_rules"' in page and "all knowledge bases" in page
    assert client.get(f"/kb/{SELLER}/api/status").json()["alias"] == SELLER
    assert client.get(f"/kb/{SHOP}/reports/v2/validation.html").status_code == 200
    assert client.get(f"/kb/{SELLER}/reports/v2/validation.html").status_code == 404  # the seller has one version
    assert client.get("/kb/nope/ui").status_code == 404

    rolled = client.post(f"/kb/{SHOP}/api/rollback", json={"to_version": 1, "reason": "bad coupon", "live_version": 2})
    assert rolled.status_code == 200, rolled.text
    assert airflow.triggers == [(f"knowledge_rollback__{SHOP}",
                                 {"to_version": 1, "reason": "bad coupon", "confirm": True, "live_version": 2})]
    # the seller's page cannot roll the shop back: its versions are its own
    assert client.post(f"/kb/{SELLER}/api/rollback", json={"to_version": 1, "reason": "x", "live_version": 2}
                       ).status_code == 409
    frozen = client.post(f"/kb/{SELLER}/api/freeze", json={"reason": "checking"})
    assert frozen.status_code == 200, frozen.text
    bases = {b["alias"]: b for b in client.get("/api/bases").json()["knowledge_bases"]}
    assert (bases[SHOP]["frozen"], bases[SELLER]["frozen"]) == (False, True)

    # an entry added to the registry shows up at the next request, no restart
    (project / "knowledge" / "wiki").mkdir()
    (project / "knowledge" / "wiki" / "a.md").write_text("# 说明\n\n内部说明。\n", encoding="utf-8")
    registry = project / "knowledge" / "registry.yaml"
    registry.write_text(registry.read_text(encoding="utf-8") + "  wiki:\n    source: wiki\n    golden_set: golden.yaml\n",
                        encoding="utf-8")
    bases = {b["alias"]: b for b in client.get("/api/bases").json()["knowledge_bases"]}
    assert list(bases) == [SHOP, SELLER, "wiki"] and bases["wiki"]["problems"] == [
        "no version serves yet: trigger knowledge_reindex__wiki"]
    wiki = client.get("/kb/wiki/api/status")
    assert wiki.status_code == 200 and wiki.json()["alias"] == "wiki" and wiki.json()["live"] is None


def test_a_typo_in_an_entry_keeps_its_page_and_its_rollback_and_refusals_are_pages(
        registry_site: tuple[Path, RecordingAirflow], tokens: dict[str, str]) -> None:
    """The shop's entry mistyped (`golden_sett`): its row stays in the list with the error, its page opens with the
    error at the top, shows what serves, and its rollback button triggers its rollback DAG (which the registry's
    DAG file keeps). A knowledge base the page cannot open is a page saying why, naming the registry from the
    project, never the server's absolute path (an API call gets JSON)."""
    project, airflow = registry_site
    registry = project / "knowledge" / "registry.yaml"
    registry.write_text(registry.read_text(encoding="utf-8").replace("    golden_set: golden.yaml",
                                                                     "    golden_sett: golden.yaml"), encoding="utf-8")
    client = TestClient(deployment_app(airflow_api_url=airflow.url), **as_page(tokens["user"]))
    bases = {b["alias"]: b for b in client.get("/api/bases").json()["knowledge_bases"]}
    assert list(bases) == [SHOP, SELLER] and bases[SHOP]["live_version"] == 2
    assert "golden_sett: unknown key" in bases[SHOP]["registry_error"] and bases[SELLER]["registry_error"] is None
    assert f'href="kb/{SHOP}/ui"' in client.get("/ui").text
    page = client.get(f"/kb/{SHOP}/ui")
    assert page.status_code == 200 and 'id="registry-error"' in page.text and "golden_sett: unknown key" in page.text
    assert client.get(f"/kb/{SHOP}/api/status").json()["live"]["version"] == 2
    rolled = client.post(f"/kb/{SHOP}/api/rollback", json={"to_version": 1, "reason": "bad coupon", "live_version": 2})
    assert rolled.status_code == 200, rolled.text
    assert airflow.triggers[-1] == (f"knowledge_rollback__{SHOP}",
                                    {"to_version": 1, "reason": "bad coupon", "confirm": True, "live_version": 2})
    refused = client.get("/kb/nope/ui", headers={"Accept": "text/html"})
    assert refused.status_code == 404 and refused.headers["content-type"].startswith("text/html")
    assert "no knowledge base &#39;nope&#39; can be opened here" in refused.text
    api = client.get("/kb/nope/api/status")
    assert api.status_code == 404 and "no knowledge base 'nope' can be opened here" in api.json()["detail"]
    # signed in or not, a 404 names neither the registry's path nor the other knowledge bases
    anonymous = TestClient(deployment_app(airflow_api_url=airflow.url)).get("/kb/nope/api/status")
    for answer in (refused.text, api.text, anonymous.text):
        assert str(project) not in answer and "registry.yaml" not in answer
        assert SHOP not in answer and SELLER not in answer


@needs_chromium
@pytest.mark.browser
def test_the_list_and_one_knowledge_base_in_headless_chromium(registry_site: tuple[Path, RecordingAirflow],
                                                              tokens: dict[str, str]) -> None:
    """Signed in, in Airflow's frame at 1280x800: the list shows both knowledge bases with what they serve; its
    link opens the sellers' page, which names its own alias and DAGs and leads back. Screenshots in
    test-output/."""
    from selenium.webdriver.common.by import By

    _project, airflow = registry_site
    output = REPO / "test-output"
    output.mkdir(exist_ok=True)
    with served(airflow_frame(deployment_app(airflow_api_url=airflow.url))) as base, chromium() as browser:
        wait = page_wait(browser)

        def here() -> str:
            return browser.execute_script("return location.pathname")

        browser.get(f"{base}{PREFIX}/ui")
        assert "/auth/login?next=" in browser.current_url  # anonymous: to Airflow's login
        sign_in(browser, base, tokens["user"], FRAME_ROUTE)
        browser.switch_to.frame(browser.find_element(By.ID, "plugin"))
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#bases tbody tr"))
        rows = {r.get_attribute("id"): r.text for r in browser.find_elements(By.CSS_SELECTOR, "#bases tbody tr")}
        assert list(rows) == [f"kb-{SHOP}", f"kb-{SELLER}"]
        assert "v2" in rows[f"kb-{SHOP}"] and "reindex promoted" in rows[f"kb-{SHOP}"]
        assert "v1" in rows[f"kb-{SELLER}"] and "triggered only" in rows[f"kb-{SELLER}"]
        browser.switch_to.default_content()
        browser.save_screenshot(str(output / "knowledge-bases.png"))
        browser.switch_to.frame(browser.find_element(By.ID, "plugin"))
        browser.find_element(By.LINK_TEXT, SELLER).click()
        wait.until(lambda b: here() == f"{PREFIX}/kb/{SELLER}/ui")
        wait.until(lambda b: "serving v1" in b.find_element(By.ID, "serving").text)
        assert browser.find_element(By.TAG_NAME, "h1").text == f"Knowledge index: {SELLER}"
        wait.until(lambda b: f"knowledge_reindex__{SELLER}" in b.find_element(By.ID, "reindex-paused").text)
        browser.switch_to.default_content()
        browser.save_screenshot(str(output / "knowledge-base-seller.png"))
        browser.switch_to.frame(browser.find_element(By.ID, "plugin"))
        browser.find_element(By.ID, "all-bases").click()
        wait.until(lambda b: here() == f"{PREFIX}/ui")
