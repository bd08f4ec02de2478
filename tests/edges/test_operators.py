"""What operators hit (issue #21): each as the operator meets it, mostly in separate processes with the real
environment variables set, the way the CLI, a DAG task or the assistant runs."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import PATTERNS_SCREEN, settings_for

from kb_reindex.services.embedding import HashingEmbedder
from kb_reindex.testing.ollama_server import FakeModel, FakeOllamaServer

CLI = Path(sys.executable).with_name("kb-reindex")
ALIAS = "mall_knowledge"


def kb_env(project: Path, **extra: str) -> dict[str, str]:
    """The child's real environment: what a shell exporting these variables gives the command."""
    return {**os.environ, "KB_PROJECT_ROOT": str(project), "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **extra}


def kb(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def two_ollamas() -> Iterator[tuple[FakeOllamaServer, FakeOllamaServer]]:
    embedder = HashingEmbedder(model="bge-m3", dim=1024)
    models = [FakeModel(name="bge-m3", dim=1024, embed=lambda _m, text: embedder.embed_one(text)),
              FakeModel(name="nomic-embed-text", dim=768)]
    with FakeOllamaServer(models) as a, FakeOllamaServer(models) as b:
        yield a, b


# --- 1. a multi-server OLLAMA_HOST in the real environment ----------------------------------------

#: the reader module as the assistant uses it, in a process of its own
READER = """
import json
from kb_reindex.services.config import Settings
from kb_reindex.reader import search_knowledge
from kb_reindex.services.runtime import open_reader
with open_reader(Settings.from_env()) as reader:
    print(json.dumps({"n": len(search_knowledge(reader, "运费怎么算", k=2).results)}))
"""

#: a DAG run's tasks, called as Airflow's worker calls them (no Connections defined: the environment)
DAG_TASKS = """
import json
from kb_reindex.airflow import tasks as t
run = "airflow__knowledge_reindex__multi-host"
plan = t.plan_task(run_id=run, force_full=True)
version = t.create_version_task(plan=plan, run_id=run)
built = t.build_task(version=version, run_id=run)
print(json.dumps({"version": version["version"], "built": built}, default=str))
"""


def test_a_multi_server_ollama_host_in_the_environment_works_for_every_entry_point(
        project: Path, two_ollamas: tuple[FakeOllamaServer, FakeOllamaServer]) -> None:
    """`import ollama` builds a default client from OLLAMA_HOST and could not parse a list: every command
    that embeds failed with `Port could not be cast to integer value`."""
    a, b = two_ollamas
    env = kb_env(project, KB_EMBEDDER="ollama", OLLAMA_HOST=f"{a.url},{b.url}", KB_EMBED_BATCH_SIZE="8",
                 **PATTERNS_SCREEN)
    done = kb(env, "run", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["outcome"] == "promoted"
    dry = kb(env, "migrate", "--embedder", "ollama", "--model", "nomic-embed-text", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert a.embedded_texts > 0 and b.embedded_texts > 0, "both servers of the list served the build"
    found = kb(env, "query", "运费怎么算", "--json")
    assert found.returncode == 0, found.stderr[-3000:]
    assert json.loads(found.stdout)["results"]
    reader = subprocess.run([sys.executable, "-c", READER], env=env, capture_output=True, text=True, timeout=120)
    assert reader.returncode == 0, reader.stderr[-3000:]
    assert json.loads(reader.stdout)["n"] == 2
    tasks = subprocess.run([sys.executable, "-c", DAG_TASKS], env=env, capture_output=True, text=True, timeout=180)
    assert tasks.returncode == 0, tasks.stderr[-3000:]
    assert json.loads(tasks.stdout.strip().splitlines()[-1])["version"] == 2
    for output in (dry, done, found, reader, tasks):
        assert "could not be cast" not in output.stderr


# --- 4. Qdrant or the state DB gone mid-build: one line, recorded, resumed -----------------------


class HeldOllama:
    """An Ollama test server whose embed requests stop at the `after`-th text until released: the build is
    provably mid-way when the test cuts something, without a sleep."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.texts = 0
        self.reached = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()
        embedder = HashingEmbedder(model="bge-m3", dim=1024)

        def embed(_model: str, text: str) -> list[float]:
            with self._lock:
                self.texts += 1
                hold = self.texts == self.after
            if hold:
                self.reached.set()
                assert self.release.wait(60), "the test never released the held embed request"
            return embedder.embed_one(text)

        self.server = FakeOllamaServer([FakeModel(name="bge-m3", dim=1024, embed=embed)])


@pytest.fixture
def held_ollama() -> Iterator[HeldOllama]:
    held = HeldOllama(after=20)
    with held.server:
        yield held
    held.release.set()


class CuttableProxy:
    """A TCP proxy in front of a server (MariaDB): `cut()` drops every connection and stops listening, as
    a cut network does; `restore()` listens on the same port again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.restore()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        assert self._listener is not None
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        self._listener.close()
        self._listener = None
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def test_qdrant_gone_mid_build_is_one_line_and_the_rerun_resumes(project: Path, held_ollama: HeldOllama,
                                                                  tmp_path: Path) -> None:
    from kb_reindex.testing.qdrant_server import FakeQdrantServer

    qdrant = FakeQdrantServer(tmp_path / "qdrant").start()
    env = kb_env(project, KB_EMBEDDER="ollama", OLLAMA_HOST=held_ollama.server.url, KB_EMBED_BATCH_SIZE="4",
                 KB_QDRANT_URL=qdrant.url, **PATTERNS_SCREEN)
    try:
        proc = subprocess.Popen([str(CLI), "run"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert held_ollama.reached.wait(60), proc.communicate(timeout=5)
        qdrant.stop()
        held_ollama.release.set()
        _out, err = proc.communicate(timeout=120)
        assert proc.returncode == 3, err  # Qdrant gone: unavailable
        errors = [line for line in err.splitlines() if " ERROR " in line or line.startswith("kb-reindex: error")]
        assert "Traceback" not in err and "unexpected error" not in err, err
        assert any(f"Qdrant at {qdrant.url}" in line and "unreachable" in line for line in errors), err
        qdrant.start()
        again = kb(env, "run", "--json")
        assert again.returncode == 0, again.stderr[-3000:]
        result = json.loads(again.stdout)
        assert result["outcome"] == "promoted" and result["chunks"]["skipped"] > 0, result
    finally:
        qdrant.stop()


@pytest.fixture
def mysql_behind_proxy(mysql_url: str) -> Iterator[tuple[str, CuttableProxy]]:
    """The test's MariaDB database through a cuttable proxy, as a user with a password (to see it masked)."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    url = make_url(mysql_url)
    user = f"kb_{url.database[-10:]}"
    admin = sa.create_engine(mysql_url)
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE USER '{user}'@'%' IDENTIFIED BY 's3cret-pw'"))
        conn.execute(sa.text(f"GRANT ALL ON {url.database}.* TO '{user}'@'%'"))
    proxy = CuttableProxy((url.host or "127.0.0.1", url.port or 3306))
    try:
        yield url.set(username=user, password="s3cret-pw", host="127.0.0.1", port=proxy.port).render_as_string(
            hide_password=False), proxy
    finally:
        with contextlib.suppress(Exception):
            proxy.cut()
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP USER IF EXISTS '{user}'@'%'"))
        admin.dispose()


def test_state_db_gone_mid_build_is_one_line_then_recorded_failed_and_resumed(
        project: Path, held_ollama: HeldOllama, mysql_behind_proxy: tuple[str, CuttableProxy]) -> None:
    """Seen: ~900 lines of chained tracebacks ending in a bare OperationalError; the run stayed `running`."""
    from kb_reindex.services.state.store import StateStore

    state_url, proxy = mysql_behind_proxy
    env = kb_env(project, KB_EMBEDDER="ollama", OLLAMA_HOST=held_ollama.server.url, KB_EMBED_BATCH_SIZE="4",
                 KB_STATE_URL=state_url, **PATTERNS_SCREEN)
    proc = subprocess.Popen([str(CLI), "run"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert held_ollama.reached.wait(60), proc.communicate(timeout=5)
    proxy.cut()
    held_ollama.release.set()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err  # the state DB gone: unavailable
    assert "Traceback" not in err and "unexpected error" not in err, err
    assert "s3cret-pw" not in out + err
    errors = [line for line in err.splitlines() if " ERROR " in line or line.startswith("kb-reindex: error")]
    assert errors and all("state DB at mysql+pymysql://" in line and ":***@127.0.0.1:" in line
                          and "KB_STATE_URL" in line for line in errors), err
    assert not [line for line in err.splitlines() if not line.startswith("20")], "every log record is one line"

    proxy.restore()
    state = StateStore(state_url)
    try:
        interrupted = state.list_runs(ALIAS)[0]
        assert interrupted.outcome == "running"  # nothing could record it while the state DB was gone
        again = kb(env, "run", "--json")
        assert again.returncode == 0, again.stderr[-3000:]
        result = json.loads(again.stdout)
        assert result["outcome"] == "promoted" and result["version"] == 1 and result["chunks"]["skipped"] > 0, result
        recorded = state.get_run(interrupted.run_id)
        assert recorded.outcome == "failed" and recorded.error, recorded
    finally:
        state.dispose()


# --- 5. local mode: no stale alias map read, none written back ---------------------------------------


def test_local_mode_never_opens_a_stale_copy_of_the_store(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Local mode reads the folder, then takes its lock: a run that moved the alias and closed in between
    left status a stale alias map (reported as a drift "moved back"), and a writer would save it back."""
    import portalocker
    from kb_reindex.services.store import KnowledgeStore, make_client
    from qdrant_client import QdrantClient

    settings = settings_for(project)
    path = str(settings.qdrant_path)
    first = KnowledgeStore(QdrantClient(path=path))
    for name in ("kb__v1", "kb__v2"):
        first.create_collection(name, dim=8)
    first.swap_alias(ALIAS, to="kb__v1", expected_from=None)

    at_lock, go = threading.Event(), threading.Event()
    real_lock = portalocker.lock

    def lock_after_the_read(file: Any, flags: Any) -> Any:
        if threading.current_thread().name == "status" and not at_lock.is_set():
            at_lock.set()  # the folder is read; the lock is next
            assert go.wait(30)
        return real_lock(file, flags)

    monkeypatch.setattr(portalocker, "lock", lock_after_the_read)
    opened: dict[str, KnowledgeStore] = {}
    reader = threading.Thread(target=lambda: opened.update(store=KnowledgeStore(make_client(settings))), name="status")
    reader.start()
    assert at_lock.wait(30)
    first.swap_alias(ALIAS, to="kb__v2", expected_from="kb__v1")  # the run promotes v2 ...
    first.close()  # ... and ends
    go.set()
    reader.join(30)
    store = opened["store"]
    try:
        assert store.alias_target(ALIAS) == "kb__v2"
        store.create_collection("kb__v3", dim=8)  # a write saves the map it holds: the current one
    finally:
        store.close()
    again = KnowledgeStore(QdrantClient(path=path))
    try:
        assert again.alias_target(ALIAS) == "kb__v2"
    finally:
        again.close()


# --- 8. a connection failure says what happened ---------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(("where", "said"), [("no-such-host.invalid", "name not resolved"),
                                             ("127.0.0.1:{port}", "connection refused")])
def test_connection_failures_say_what_happened(project: Path, where: str, said: str) -> None:
    """Seen: OLLAMA_HOST=http://no-such-host.invalid was reported as "connection refused"."""
    from kb_reindex.services.embedding import OllamaEmbedder
    from kb_reindex.domain.errors import ConfigError, EmbeddingError, StateUnreachable
    from kb_reindex.services.runtime import open_reader
    from kb_reindex.services.state.store import StateStore

    host = where.format(port=free_port())
    with pytest.raises(EmbeddingError) as ollama:
        OllamaEmbedder(host=f"http://{host}", model="bge-m3", dim=16, retries=0).embed(["a"])
    assert str(ollama.value).endswith(f": {said}"), ollama.value
    with pytest.raises(ConfigError) as qdrant, open_reader(settings_for(project, KB_QDRANT_URL=f"http://{host}")):
        pass
    assert f"is unreachable ({said})" in str(qdrant.value), qdrant.value
    with pytest.raises(StateUnreachable) as state:
        StateStore(f"mysql+pymysql://kb:pw@{host}/kb")
    assert f"is unreachable ({said})" in str(state.value) and "pw" not in str(state.value), state.value


def test_tls_to_a_plain_server_says_tls_failed(project: Path, tmp_path: Path) -> None:
    from kb_reindex.domain.errors import ConfigError
    from kb_reindex.services.runtime import open_reader
    from kb_reindex.testing.qdrant_server import FakeQdrantServer

    with FakeQdrantServer(tmp_path / "q") as server, pytest.raises(ConfigError) as qdrant, \
            open_reader(settings_for(project, KB_QDRANT_URL=server.url.replace("http://", "https://"))):
        pass
    assert "is unreachable (TLS failed" in str(qdrant.value), qdrant.value


# --- 6. status's header says what the alias serves -------------------------------------------------


def engine_deps(project: Path, **env: str) -> Any:
    from kb_reindex.services.runtime import Deps
    from kb_reindex.services.state.store import StateStore
    from kb_reindex.services.store import KnowledgeStore
    from qdrant_client import QdrantClient

    settings = settings_for(project, **env)
    return Deps(settings=settings, state=StateStore(settings.state_url), store=KnowledgeStore(QdrantClient(":memory:")))


def test_status_header_names_what_the_alias_serves_during_a_drift(project: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Seen: alias moved by hand to v2 while the state DB says v1: the header read `-> v1`."""
    import argparse

    from kb_reindex import cli

    from kb_reindex.run.pipeline import run_reindex
    from kb_reindex.steps.build import build, create_version
    from kb_reindex.run.pipeline import plan_and_snapshot

    deps = engine_deps(project)
    assert run_reindex(deps).outcome == "promoted"
    (project / "knowledge" / "docs" / "shipping-fee.md").write_text("# 运费\n\n满99元包邮。\n", encoding="utf-8")
    planned = plan_and_snapshot(deps, run_id="by-hand")
    created = create_version(deps, planned, run_id="by-hand")
    build(deps, created.version, run_id="by-hand")
    deps.store.swap_alias(ALIAS, to=created.collection, expected_from=deps.state.live_version(ALIAS).collection)
    capsys.readouterr()
    assert cli._cmd_status(argparse.Namespace(json=False), deps) == 1
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith(f"alias {ALIAS} -> v2 ({created.collection}, "), head
    assert "the state DB says live is v1" in head


# --- 7. symlink loops are listed with the other bad documents --------------------------------------


def test_symlink_loops_are_listed_by_name_with_the_other_bad_documents(project: Path) -> None:
    """Seen: `RuntimeError: Symlink loop` with a traceback, and the other bad files never reported."""
    from kb_reindex.domain.errors import SourceError
    from kb_reindex.services.sources import load_corpus

    docs = project / "knowledge" / "docs"
    (docs / "loop-a.md").symlink_to("loop-b.md")
    (docs / "loop-b.md").symlink_to("loop-a.md")
    (docs / "self.md").symlink_to("self.md")
    (docs / "empty.md").write_text("  \n", encoding="utf-8")
    with pytest.raises(SourceError) as error:
        load_corpus(docs)
    message = str(error.value)
    assert message.startswith("4 knowledge document(s) cannot be indexed"), message
    assert "loop-a.md: is a link that never reaches a file (loop-a.md -> loop-b.md -> loop-a.md)" in message
    assert "loop-b.md: is a link that never reaches a file (loop-b.md -> loop-a.md -> loop-b.md)" in message
    assert "self.md: is a link that never reaches a file (self.md -> self.md)" in message
    assert "empty.md: file is empty" in message
    done = kb(kb_env(project), "run")
    assert done.returncode == 1 and "Traceback" not in done.stderr and "loop-a.md" in done.stdout + done.stderr


# --- smaller ones ------------------------------------------------------------------------------------


def test_status_names_a_version_whose_collection_is_gone_instead_of_none_points(project: Path) -> None:
    """Seen after collections were dropped under another state DB: `v14 … holds None points`."""
    from kb_reindex.run.pipeline import run_reindex
    from kb_reindex.run.status import status_view

    deps = engine_deps(project)
    first = run_reindex(deps)
    (project / "knowledge" / "docs" / "gift-wrap.md").write_text("# 礼品包装\n\n礼品包装免费。\n", encoding="utf-8")
    assert run_reindex(deps).outcome == "promoted"
    deps.store.client.delete_collection(first.collection)
    problems = status_view(deps).to_dict()["problems"]
    assert not any("None" in p for p in problems), problems
    assert any(p.startswith(f"v1 ({first.collection}) is retired in the state DB, but Qdrant has no such collection")
               and "kb-reindex drop --version 1" in p for p in problems), problems


def test_nfc_and_nfd_twins_are_shown_apart(project: Path) -> None:
    """Seen: `café-wifi.md and café-wifi.md: map to the same knowledge_key`."""
    from kb_reindex.domain.errors import SourceError
    from kb_reindex.services.sources import load_corpus

    docs = project / "knowledge" / "docs"
    for name in ("caf\u00e9-wifi.md", "cafe\u0301-wifi.md"):
        (docs / name).write_text("# Wi-Fi\n\n密码在前台。\n", encoding="utf-8")
    with pytest.raises(SourceError) as error:
        load_corpus(docs)
    assert ("cafe\u0301-wifi.md (NFD, decomposed: cafe\\u0301-wifi.md) and caf\u00e9-wifi.md (NFC, composed: "
            "caf\\xe9-wifi.md): map to the same knowledge_key") in str(error.value), error.value


def test_a_missing_golden_set_is_a_configuration_error_like_a_missing_knowledge_folder(project: Path) -> None:
    """Seen: a missing KB_GOLDEN_SET exited 1, a missing KB_KNOWLEDGE_DIR 2."""
    missing_golden = kb(kb_env(project, KB_GOLDEN_SET=str(project / "nope.yaml")), "run")
    assert missing_golden.returncode == 2, missing_golden.stdout + missing_golden.stderr
    assert "nope.yaml does not exist (KB_GOLDEN_SET)" in missing_golden.stdout + missing_golden.stderr
    missing_docs = kb(kb_env(project, KB_KNOWLEDGE_DIR=str(project / "nothing")), "run")
    assert missing_docs.returncode == 2, missing_docs.stdout + missing_docs.stderr


def test_an_empty_mariadb_state_db_says_run_creates_it_and_plan_previews_the_first_run(project: Path,
                                                                                       mysql_url: str) -> None:
    """Seen: on an empty MariaDB state DB, plan and status only suggested `reconcile --rebuild-state`."""
    import sqlalchemy as sa

    env = kb_env(project, KB_STATE_URL=mysql_url, KB_QDRANT_PATH=str(project / "qdrant"))
    status = kb(env, "status")
    assert status.returncode == 2
    assert "holds no kb-reindex state yet (KB_STATE_URL): `kb-reindex run` creates it" in status.stderr, status.stderr
    init = kb(env, "gc")  # creates the local Qdrant folder (and the state), as the first writing command does
    engine = sa.create_engine(mysql_url)
    with engine.begin() as conn:  # back to an empty database: only Qdrant's folder remains
        for table in sa.inspect(conn).get_table_names():
            conn.execute(sa.text(f"DROP TABLE {table}"))
    engine.dispose()
    assert init.returncode == 0, init.stderr[-2000:]
    plan = kb(env, "plan", "--json")
    assert plan.returncode == 0, plan.stderr[-3000:]
    preview = json.loads(plan.stdout)
    assert preview["no_change"] is False and preview["base_version"] is None and preview["docs"]["added"] == 6
    assert "Previewing a first run" in plan.stderr
    engine = sa.create_engine(mysql_url)
    with engine.connect() as conn:
        assert sa.inspect(conn).get_table_names() == [], "the preview created nothing"
    engine.dispose()


def test_a_long_table_is_chunked_under_its_header_row_and_other_chunks_do_not_change() -> None:
    """Seen: a 2 MB Markdown table cut into chunks that start mid-row without the header row."""
    import hashlib

    from kb_reindex.services.chunking import chunk_document
    from kb_reindex.services.sources import load_corpus, parse_document

    header = "| 商品编号 | 名称 | 退货期限 | 备注 |\n|---|---|:---:|---|"
    rows = [f"| SKU-{i:05d} | 商品{i} | {7 + i % 3} 天 | 第{i}行备注，说明退货条件。 |" for i in range(400)]
    body = f"# 退货期限表\n\n下表列出每件商品的退货期限。\n\n{header}\n" + "\n".join(rows) + "\n\n表后的说明。\n"
    doc = parse_document(Path("table.md"), "table.md", body.encode("utf-8"))
    chunks = chunk_document(doc, chunk_size=500, overlap=50)
    table_chunks = [c for c in chunks if "SKU-" in c.text]
    assert len(table_chunks) > 10
    for chunk in table_chunks:
        assert chunk.text.split("\n", 1)[1].startswith(header), chunk.text[:200]
        assert len(chunk.text) <= 500
    found = [line for c in table_chunks for line in c.text.split("\n") if line.startswith("| SKU-")]
    assert found == rows, "every row whole, once, in order"
    assert chunks[0].text.endswith("下表列出每件商品的退货期限。") and chunks[-1].text.endswith("表后的说明。")

    # the shipped documents (whose tables fit a chunk) are cut exactly as before: no vector to re-embed
    digest = hashlib.sha256()
    hashes = {f"{d.knowledge_key}/{size}": "".join(c.chunk_hash for c in chunk_document(d, chunk_size=size, overlap=overlap))
              for d in load_corpus(Path(__file__).resolve().parents[2] / "knowledge" / "docs")
              for size, overlap in ((200, 30), (500, 50))}
    for key in sorted(hashes):
        digest.update(hashes[key].encode())
    assert digest.hexdigest() == "107fd7ccfebac3ddd731d9f4fcb101fd2664bac381dce44db6caed77b12c09ca"


def test_rebuild_state_keeps_each_versions_creation_time_hit_rate_and_mrr(project: Path) -> None:
    """Seen: `reconcile --rebuild-state` dated every version to the rebuild and lost hit rate and MRR."""
    from kb_reindex.run.pipeline import run_reindex
    from kb_reindex.steps.reconcile import rebuild_state
    from kb_reindex.services.state.clock import ManualClock, utcnow
    from kb_reindex.run.status import status_view

    deps = engine_deps(project)
    run_reindex(deps)
    (project / "knowledge" / "docs" / "gift-wrap.md").write_text("# 礼品包装\n\n礼品包装免费。\n", encoding="utf-8")
    assert run_reindex(deps).outcome == "promoted"

    def seen() -> list[tuple[Any, ...]]:
        return [(v["version"], v["status"], v["created_at"], v["hit_rate"], v["mrr"])
                for v in status_view(deps).to_dict()["versions"]]

    before = seen()
    assert all(row[3] is not None for row in before)
    deps.state.clock = ManualClock(utcnow() + timedelta(days=1))  # the rebuild happens a day later
    rebuild_state(deps, replace=True)
    assert seen() == before


# --- P8: the audit of live, in full only when something changed ---------------------------------------


def test_audit_is_full_when_something_changed_and_sampled_otherwise() -> None:
    from dataclasses import replace
    from types import SimpleNamespace

    from kb_reindex.rules.audit import AuditMode, audit_decision
    from kb_reindex.services.state.history import AuditRecord

    now = datetime(2026, 11, 30, 12, 0, 0)
    live: Any = SimpleNamespace(version=3, collection="kb__v3", points_expected=100)
    last = AuditRecord(id=1, alias=ALIAS, version=3, collection="kb__v3", run_id="r1", expected=100, points=100,
                       missing=0, orphans=0, at=now - timedelta(hours=1))

    def mode(last: AuditRecord | None, points: int = 100, **changes: Any) -> AuditMode:
        return audit_decision(last, SimpleNamespace(**{**vars(live), **changes}), points=points, now=now).mode

    assert mode(last) is AuditMode.SAMPLE
    assert mode(None) is AuditMode.FULL
    assert mode(last, collection="kb__v4", version=4) is AuditMode.FULL
    assert mode(last, points=99) is AuditMode.FULL
    assert mode(last, points_expected=101) is AuditMode.FULL
    assert mode(replace(last, missing=1)) is AuditMode.FULL
    assert mode(replace(last, orphans=2)) is AuditMode.FULL
    assert mode(replace(last, at=now - timedelta(hours=24))) is AuditMode.FULL


def test_a_deletion_hidden_by_an_extra_point_is_caught_by_the_samples_within_a_few_runs(project: Path) -> None:
    import random


    from kb_reindex.run.pipeline import run_reindex
    from kb_reindex.rules.audit import audit_live
    from qdrant_client import models

    deps = engine_deps(project)
    assert run_reindex(deps).outcome == "promoted"  # its plan had nothing to audit yet
    live = deps.state.live_version(ALIAS)
    first = audit_live(deps, live, run_id="audit-1")
    # validation's exact check of the build is on record as its full audit: live is sampled from then on
    assert first.mode == "sample" and first.missing == 0 and first.expected == 50
    assert deps.state.last_audit(ALIAS).version == live.version
    assert audit_live(deps, live, run_id="audit-2", sample=8).mode == "sample"

    # one point deleted, one foreign point written: the count is unchanged
    victim = next(deps.store.iter_ids(live.collection))
    deps.store.client.delete(live.collection, points_selector=models.PointIdsList(points=[victim]))
    deps.store.client.upsert(live.collection, points=[models.PointStruct(
        id="00000000-0000-0000-0000-000000000001", vector=[1.0] + [0.0] * 1023, payload={})])
    rng = random.Random(7)
    for runs in range(1, 30):
        found = audit_live(deps, live, run_id=f"audit-sample-{runs}", sample=8, rng=rng)
        if found.missing:
            break
    assert found.mode == "full" and (found.missing, found.orphans) == (1, 1), found
    assert runs <= 15, f"caught only after {runs} runs"  # 8 of 50 IDs a run: p=0.16 each
    assert deps.state.last_audit(ALIAS).run_id == f"audit-sample-{runs}"
    # the problem is now on record: every following run audits in full until it is gone
    assert audit_live(deps, live, run_id="audit-after", sample=8).mode == "full"


def test_a_run_left_running_without_its_lock_is_recorded_failed_by_the_next_run(project: Path) -> None:
    """A run that lost the state DB mid-build could not record its end; if its lock was gone too (expired, or
    released once the state DB came back), no lock takeover records it: the next run does."""
    from kb_reindex.run.pipeline import run_reindex

    deps = engine_deps(project)
    deps.state.start_run(run_id="cli__reindex__lost", alias=ALIAS, kind="reindex", trigger="cli")
    deps.state.update_run("cli__reindex__lost", version=1)
    deps.state.start_run(run_id="cli__reindex__waiting", alias=ALIAS, kind="reindex", trigger="cli")  # no version
    result = run_reindex(deps, run_id="cli__reindex__next")
    assert result.outcome == "promoted"
    lost = deps.state.get_run("cli__reindex__lost")
    assert lost.outcome == "failed" and "found by run cli__reindex__next" in lost.error
    assert deps.state.get_run("cli__reindex__waiting").outcome == "running", "a run waiting for the lock is left"
