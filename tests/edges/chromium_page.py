"""What the page's browser tests share: the page's app served by uvicorn in a thread, inside a copy of Airflow's
frame, and a headless Chromium of 1280x800 signed in to it.

Airflow 3.3's UI shows the plugin's page (`external_views`, destination `nav`) at `/plugin/<url_route>` in an
iframe filling its content area: beside the 64 px navigation bar, inside 12 px of padding less 8 px of margin,
sandboxed `allow-scripts allow-same-origin allow-forms allow-downloads` (no `allow-modals`: `prompt()` and
`confirm()` return at once, so the page asks in its own dialog). Measured in Chromium at a 1280x800 window on
a real `airflow api-server` with the plugin (the iframe at x 68, y 4, 72 px narrower and 8 px lower than the
viewport); `airflow_frame` rebuilds that frame around the page, same origin, as Airflow serves both.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from starlette.types import ASGIApp

#: the window of the browser tests (a laptop's screen; the viewport is what the window leaves)
WINDOW = (1280, 800)
#: where Airflow mounts the plugin's app, and where its UI shows it in the frame
PREFIX, FRAME_ROUTE = "/knowledge-index", "/plugin/knowledge-index"
#: Airflow's sandbox of the frame (no allow-modals)
SANDBOX = "allow-scripts allow-same-origin allow-forms allow-downloads"

needs_chromium = pytest.mark.skipif(
    not shutil.which("chromium") or not shutil.which("chromedriver"),
    reason="Debian's chromium and chromium-driver are not installed (scripts/test.sh installs them)")

_FRAME = f"""<!doctype html><html><head><meta charset="utf-8"><title>Airflow</title><style>
html,body{{margin:0;height:100%;overflow:hidden;font-family:sans-serif}}
nav{{position:fixed;left:0;top:0;bottom:0;width:64px;background:#e4ebf5}}
main{{margin-left:64px;padding:12px;height:100%;box-sizing:border-box}}
#holder{{margin:-8px;height:calc(100% + 16px)}}
iframe{{border:none;display:block;width:100%;height:100%}}
</style></head><body><nav aria-label="Airflow's navigation"></nav><main><div id="holder">
<iframe id="plugin" title="Knowledge index" sandbox="{SANDBOX}" src="{PREFIX}/ui"></iframe></div></main></body></html>"""


def airflow_frame(app: ASGIApp) -> FastAPI:
    """The page's app mounted where Airflow mounts it, and Airflow's frame around it at FRAME_ROUTE."""
    host = FastAPI()

    @host.get(FRAME_ROUTE, response_class=HTMLResponse)
    async def frame() -> str:
        return _FRAME

    host.mount(PREFIX, app)
    return host


@contextmanager
def served(app: ASGIApp) -> Iterator[str]:
    """`app` on a free local port in a uvicorn thread; its base URL."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):
        if server.started or not thread.is_alive():
            break
        time.sleep(0.05)
    assert server.started, "the page's uvicorn server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium of WINDOW's size."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(shutil.which("chromium"))
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--window-size={WINDOW[0]},{WINDOW[1]}"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(str(shutil.which("chromedriver"))), options=options)
    try:
        yield browser
    finally:
        browser.quit()


def sign_in(browser: Any, base: str, token: str, path: str) -> None:
    """What Airflow's login leaves: its `_token` cookie; then `path` opened."""
    browser.get(f"{base}{path}")
    browser.add_cookie({"name": "_token", "value": token})
    browser.get(f"{base}{path}")


def rect(browser: Any, element: Any) -> dict[str, float]:
    """An element's bounding rectangle in its own document's viewport, with that viewport's size."""
    return browser.execute_script(
        "const r=arguments[0].getBoundingClientRect();return {left:r.left,top:r.top,right:r.right,bottom:r.bottom,"
        "width:innerWidth,height:innerHeight,scroll_width:document.documentElement.scrollWidth};", element)


def fully_visible(box: dict[str, float]) -> bool:
    """Inside its viewport, nothing cut off, no scrolling needed."""
    return 0 <= box["left"] < box["right"] <= box["width"] and 0 <= box["top"] < box["bottom"] <= box["height"]


def page_wait(browser: Any, timeout_s: float = 60) -> Any:
    """Selenium's wait, re-reading elements a poll redrew (stale), whose timeout names the test's lines that
    waited, with their source: CI keeps the failure's summary line when it cuts the traceback."""
    import inspect

    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    class NamedWait(WebDriverWait):  # type: ignore[type-arg]
        def until(self, method: Any, message: str = "") -> Any:
            try:
                return super().until(method, message)
            except TimeoutException:
                # the test's own lines, innermost first (a helper such as `text()` waits for the line calling it)
                lines = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}: {(f.code_context or [''])[0].strip()}"
                         for f in inspect.stack()[1:] if f.filename.rsplit("/", 1)[-1].startswith("test_")]
                raise TimeoutException(f"waited {timeout_s:g} s at " + (" <- ".join(lines[:3]) or "?")) from None

    return NamedWait(browser, timeout_s, ignored_exceptions=(StaleElementReferenceException,))
