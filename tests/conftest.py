"""Shared fixtures: a throwaway project (knowledge copy, local-mode Qdrant, SQLite state) per test.

Airflow reads its configuration at import, so its home is set here, before any test imports it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# a test module may use another folder's helpers (`from test_dags import run_dag`): every folder of tests/ is
# importable whichever subset runs (their module names are unique)
for _folder in sorted(p for p in Path(__file__).resolve().parent.iterdir() if p.is_dir() and p.name != "__pycache__"):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))
_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="kb-airflow-home-"))
os.environ["AIRFLOW_HOME"] = str(_AIRFLOW_HOME)
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(REPO / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(REPO / "plugins")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__LOGGING__LOGGING_LEVEL"] = "WARNING"
for name in list(os.environ):
    # AWS_*: the S3 tests point s3fs at moto's server themselves, never at a developer's own account
    if (name.startswith(("KB_", "AIRFLOW_CONN_", "AWS_")) and not name.startswith("KB_TEST_")) or name == "OLLAMA_HOST":
        del os.environ[name]
# the suite embeds with the fast hashing embedder (as do the CLI and Airflow processes it starts, which inherit
# this); the tests of retrieval quality ask for e5 by name (tests/engine/test_e5.py)
os.environ["KB_EMBEDDER"] = "hashing"
# no freshness watcher starts runs of its own in a test (the Airflow stacks' triggerers would otherwise run every
# DAG whose source differs from its last plan); the tests of the watcher turn it on (test_freshness_*.py)
os.environ["KB_SOURCE_POLL_S"] = "0"
# a DAG run takes the mapped slices (build_slices, build, validate, promote, cleanup), whose tasks most DAG tests
# name; the tests of the one-task path for small plans turn it on (the `small_run_points` Param or the variable)
os.environ["KB_SMALL_RUN_POINTS"] = "0"

#: the instruction screen by its patterns alone, for a test that embeds through our Ollama server for what the
#: server lets it hold, fault or count, not for the screen: `auto` with Ollama also judges every line of a first
#: build with e5 (about 13 CPU-seconds a process on the shipped pages, and such tests start several). The meaning
#: screen's own tests ask for it: tests/engine/test_screen_cli.py, test_e5.py, tests/unit/test_screen.py
PATTERNS_SCREEN = {"KB_INSTRUCTION_SCREEN": "patterns"}

# the tests that stop a process with Ctrl-C (SIGINT) need it to reach the process: a suite started in the
# background by a shell without job control inherits SIGINT ignored, and so would every process it starts
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from qdrant_client import QdrantClient  # noqa: E402

from kb_reindex.services.config import Settings  # noqa: E402
from kb_reindex.services.runtime import Deps  # noqa: E402
from kb_reindex.services.state.store import StateStore  # noqa: E402
from kb_reindex.services.store import KnowledgeStore  # noqa: E402


def _checkout_state() -> list[tuple[str, int]]:
    root = REPO / ".kb"
    if not root.exists():
        return []
    return sorted((str(p.relative_to(root)), p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="session", autouse=True)
def checkout_state_untouched() -> Iterator[None]:
    """No test writes the checkout's own state (`.kb/`, the default project root's, which `make demo` serves):
    a test's work that outlives its patches lands there (seen: `make test` left the demo's alias frozen)."""
    before = _checkout_state()
    yield
    changed = sorted(set(_checkout_state()) ^ set(before))
    assert not changed, f"a test wrote into the checkout's .kb/: {changed[:5]}"


@pytest.fixture(scope="session")
def airflow_db() -> None:
    """A migrated SQLite metadata DB and the Qdrant write pool, once per session (DAG runs, and the page's
    login checks: Airflow looks up revoked tokens and DAG teams there)."""
    airflow = str(Path(sys.executable).with_name("airflow"))
    for command in (
        [airflow, "db", "migrate"],
        [airflow, "pools", "set", "kb_qdrant_writes", "1", "Qdrant writes of kb-reindex"],
    ):
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=os.environ.copy())
        assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of the shipped knowledge folder and golden set in a fresh project root."""
    root = tmp_path / "project"
    shutil.copytree(REPO / "knowledge", root / "knowledge")
    return root


def settings_for(root: Path, **env: str) -> Settings:
    """Settings of a test project; the hashing embedder unless the test names another."""
    return Settings.from_env({"KB_PROJECT_ROOT": str(root), "KB_EMBEDDER": "hashing", **env})


@pytest.fixture
def settings(project: Path) -> Settings:
    return settings_for(project)


@pytest.fixture(params=["local", "server"])
def store_kind(request: pytest.FixtureRequest) -> str:
    """Where the engine's tests run: qdrant-client's local mode, and the Qdrant-protocol test server
    through the real remote client (`kb_reindex.testing.qdrant_server`), the path production takes."""
    return request.param


@pytest.fixture
def deps(settings: Settings, store_kind: str, tmp_path: Path) -> Iterator[Deps]:
    """Engine dependencies on a fresh Qdrant (in memory, or the test server over HTTP) and a SQLite file."""
    from dataclasses import replace

    server = None
    if store_kind == "server":
        from kb_reindex.testing.qdrant_server import FakeQdrantServer

        server = FakeQdrantServer(tmp_path / "qdrant-server").start()
        settings = replace(settings, qdrant_url=server.url, qdrant_path=None)
        client = QdrantClient(url=server.url, timeout=30)
    else:
        client = QdrantClient(":memory:")
    state = StateStore(settings.state_url)
    yield Deps(settings=settings, state=state, store=KnowledgeStore(client))
    state.dispose()
    client.close()
    if server is not None:
        server.stop()


def init_embedded(root: Path) -> None:
    """An empty state DB and local Qdrant store under `root`, as the first writing command leaves them:
    read-only commands (plan, status, history) refuse to create them."""
    settings = settings_for(root)
    StateStore(settings.state_url).dispose()
    QdrantClient(path=str(settings.qdrant_path)).close()


def write_doc(root: Path, key: str, text: str) -> Path:
    path = root / "knowledge" / "docs" / f"{key}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def force_status(state: StateStore, version_id: int, status: str) -> None:
    """Damage a version's status behind kb-reindex's back (a move `kb_reindex.domain.lifecycle` would refuse), as a
    hand edit or a lost write would leave it."""
    import sqlalchemy as sa

    from kb_reindex.services.state.schema import versions

    with state.engine.begin() as conn:
        conn.execute(sa.update(versions).where(versions.c.id == version_id).values(status=status))


def mysql_base_url() -> str | None:
    return os.environ.get("KB_TEST_MYSQL_URL")


@pytest.fixture
def mysql_url() -> Iterator[str]:
    """A database of its own on the real MariaDB/MySQL server, dropped afterwards.

    In CI (CI=true) a missing server is a failure, not a skip.
    """
    import sqlalchemy as sa

    base = mysql_base_url()
    if not base:
        if os.environ.get("CI"):
            pytest.fail("KB_TEST_MYSQL_URL is not set; the MySQL tests must run in CI")
        pytest.skip("KB_TEST_MYSQL_URL not set")
    name = f"kb_test_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(base)
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci"))
    except sa.exc.OperationalError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"MySQL not reachable: {exc.orig}")
    try:
        yield f"{base.rstrip('/')}/{name}?charset=utf8mb4"
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        admin.dispose()


def postgres_base_url() -> str:
    return os.environ.get("KB_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432")


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A database of its own on the real PostgreSQL server (KB_TEST_POSTGRES_URL, default the local one with
    trust auth), dropped afterwards. Skipped only outside CI when the server does not answer.

    Its default collation is linguistic (ICU en-US, as on many production servers), not the code-point order
    Python sorts by: the state DB must not depend on the database's collation."""
    url = postgres_base_url()
    name = f"kb_test_{uuid.uuid4().hex[:10]}"
    try:
        create_postgres_database(url, name)
    except Exception as exc:  # psycopg's OperationalError: no server there
        if os.environ.get("CI"):
            raise
        pytest.skip(f"PostgreSQL not reachable at {url}: {str(exc).splitlines()[0]}")
    try:
        yield f"{url.rstrip('/')}/{name}"
    finally:
        drop_postgres_database(url, name)


def create_postgres_database(base: str, name: str, *, linguistic: bool = True) -> None:
    import sqlalchemy as sa

    admin = sa.create_engine(f"{base.rstrip('/')}/postgres", isolation_level="AUTOCOMMIT")
    collation = " LOCALE_PROVIDER icu ICU_LOCALE 'en-US'" if linguistic else ""
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name} ENCODING 'UTF8' TEMPLATE template0{collation}"))
    finally:
        admin.dispose()


def drop_postgres_database(base: str, name: str) -> None:
    import sqlalchemy as sa

    admin = sa.create_engine(f"{base.rstrip('/')}/postgres", isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    finally:
        admin.dispose()


#: the longest modules first, longest to shortest (measured: docs/testing.md), then the rest in file order: each
#: worker takes the next file when it is free (--dist loadfile), so the long ones overlap each other and the short
#: ones fill the end, instead of a long module starting last and running alone
SLOW_FIRST = ("test_celery_airflow.py", "test_local_airflow.py", "test_many_bases_airflow.py", "test_freshness_airflow.py",
              "test_bench_smoke.py", "test_races.py",
              "test_operations.py", "test_engine.py", "test_dags.py", "test_operators.py", "test_web.py",
              "test_freeze.py", "test_qdrant_server.py")


#: each folder of tests/ is a marker too, so a group is selected by folder (`pytest tests/engine`) or by marker
#: (`-m "not airflow and not bench"`): docs/testing.md
FOLDER_MARKERS = {"unit": "unit", "state_db": "state", "engine": "engine", "edges": "edges", "airflow_dags": "airflow",
                  "benchmarks": "bench"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Whole modules move, never single tests: a module's tests keep their order (some build on the one before)."""
    for item in items:
        folder = item.path.parent.name
        if folder in FOLDER_MARKERS:
            item.add_marker(FOLDER_MARKERS[folder])
    rank = {name: position for position, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))


def as_page(session: str) -> dict[str, dict[str, str]]:
    """A TestClient's arguments to act as the page a signed-in browser opened: Airflow's session cookie, the
    page's own origin, and the token the page was served with (web.guard)."""
    from kb_reindex.web.guard import SESSION_COOKIE, TOKEN_HEADER, page_token

    return {"cookies": {SESSION_COOKIE: session},
            "headers": {"Origin": "http://testserver", TOKEN_HEADER: page_token(session)}}
