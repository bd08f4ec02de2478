"""The state store on SQLite, on the real MariaDB/MySQL server and on the real PostgreSQL server."""

from __future__ import annotations

import threading
from contextlib import closing
from pathlib import Path

import pytest
import sqlalchemy as sa

from kb_reindex.domain.errors import ConfigError, LockHeldError
from kb_reindex.services.state.manifests import ManifestChunk, ManifestDocument
from kb_reindex.services.state.versions import QdrantSnapshotRef
from kb_reindex.services.state.store import StateStore


@pytest.fixture(params=["sqlite", pytest.param("mysql", marks=pytest.mark.mysql),
                        pytest.param("postgres", marks=pytest.mark.postgres)])
def state(request: pytest.FixtureRequest, tmp_path: Path) -> StateStore:
    url = f"sqlite:///{tmp_path}/state.db" if request.param == "sqlite" else request.getfixturevalue(f"{request.param}_url")
    store = StateStore(url)
    yield store
    store.dispose()


def new_version(state: StateStore, alias: str = "kb") -> object:
    return state.allocate_version(
        alias=alias, collection_for=lambda n: f"{alias}__m__v{n}", kind="reindex", embedder="hashing",
        embed_model="m", embed_dim=8, distance="Cosine", chunking_version="c", corpus_fingerprint="f",
    )


def test_schema_is_created_on_first_use_and_versions_count_up(state: StateStore) -> None:
    assert [new_version(state).version for _ in range(3)] == [1, 2, 3]
    assert new_version(state, alias="other").version == 1
    assert [v.version for v in state.list_versions("kb")] == [3, 2, 1]


def test_concurrent_allocation_never_takes_a_number_twice(state: StateStore) -> None:
    numbers: list[int] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(5):
                numbers.append(new_version(state).version)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(numbers) == list(range(1, 21))


def test_manifest_write_is_idempotent(state: StateStore) -> None:
    version = new_version(state)
    docs = [ManifestDocument(knowledge_key="退货/政策", source="退货/政策.md", title="退货", category="售后",
                             tenant="default", content_hash="a" * 64, chunk_count=2)]
    chunks = [ManifestChunk(point_id=f"00000000-0000-0000-0000-00000000000{i}", knowledge_key="退货/政策",
                            chunk_index=i, chunk_hash=str(i) * 64, source_point_id=None) for i in range(2)]
    state.write_manifest(version.id, docs, chunks)
    state.write_manifest(version.id, docs, chunks)
    assert state.manifest_documents(version.id) == docs
    assert state.manifest_chunks(version.id) == chunks


def test_manifest_write_that_fails_keeps_the_old_manifest(state: StateStore) -> None:
    """Rows that disagree with their document (more rows than it counts, a document not listed, a document's
    rows apart) stop the write by name, and the manifest written before stays whole."""
    from kb_reindex.domain.errors import KbError

    version = new_version(state)
    doc = ManifestDocument(knowledge_key="k", source="k.md", title="K", category="c", tenant="default",
                           content_hash="a" * 64, chunk_count=1)
    row = ManifestChunk(point_id="p1", knowledge_key="k", chunk_index=0, chunk_hash="0" * 64, source_point_id=None)
    state.write_manifest(version.id, [doc], [row])
    with pytest.raises(KbError, match="2 chunk rows of 'k', whose document counts 1"):
        state.write_manifest(version.id, [doc], [row._replace(point_id="p2"), row._replace(point_id="p3", chunk_index=1)])
    with pytest.raises(KbError, match="chunk rows of 'j', a document it does not list"):
        state.write_manifest(version.id, [doc], [row._replace(knowledge_key="j"), row])
    with pytest.raises(KbError, match="chunk rows of 'k'"):  # k's rows apart: the first part is short
        state.write_manifest(version.id, [doc._replace(chunk_count=2), doc._replace(knowledge_key="j")],
                             [row, row._replace(knowledge_key="j"), row._replace(point_id="p2", chunk_index=1)])
    assert [c.point_id for c in state.manifest_chunks(version.id)] == ["p1"]
    assert state.manifest_documents(version.id) == [doc]


def test_keys_compare_and_order_by_code_point_whatever_the_databases_collation(state: StateStore) -> None:
    """A slice's documents are those whose keys lie between its first and last row's keys, in Python's order
    (code points): on a PostgreSQL database with a linguistic collation 'Zeta' sorts after 'alpha', and the
    slice [Zeta, alpha] would find no document."""
    version = new_version(state)
    keys = ["émile", "alpha", "Zeta", "Éclair"]
    docs = [ManifestDocument(knowledge_key=key, source=f"{key}.md", title=key, category="c", tenant="default",
                             content_hash="a" * 64, chunk_count=1) for key in keys]
    rows = [ManifestChunk(point_id=f"p{i}", knowledge_key=key, chunk_index=0, chunk_hash=f"{i:064d}",
                          source_point_id=None) for i, key in enumerate(sorted(keys))]
    state.write_manifest(version.id, docs, rows)
    assert [d.knowledge_key for d in state.manifest_documents(version.id)] == sorted(keys)
    assert [r.knowledge_key for r in state.manifest_refs(version.id)] == sorted(keys)
    assert [d.knowledge_key for d in state.manifest_documents(version.id, ["alpha", "Zeta", "Zeta"])] == ["Zeta", "alpha"]


def test_manifest_refs_stream_in_manifest_order_and_give_the_connection_back(state: StateStore) -> None:
    version = new_version(state)
    rows = sorted((ManifestChunk(point_id=f"p{i:02d}", knowledge_key=f"k{i % 3}", chunk_index=i // 3,
                                 chunk_hash=f"{i:064d}", source_point_id=f"s{i:02d}" if i % 2 else None)
                   for i in range(12)), key=lambda r: (r.knowledge_key, r.chunk_index))
    docs = [ManifestDocument(knowledge_key=f"k{n}", source=f"k{n}.md", title="K", category="c", tenant="default",
                             content_hash="a" * 64, chunk_count=4) for n in range(3)]
    state.write_manifest(version.id, docs, rows)
    expected = [(r.point_id, r.knowledge_key, r.source_point_id)
                for r in sorted(rows, key=lambda r: (r.knowledge_key, r.chunk_index))]
    assert [tuple(r) for r in state.iter_manifest_refs(version.id)] == expected
    assert [tuple(r) for r in state.manifest_refs(version.id)] == expected
    with closing(state.iter_manifest_refs(version.id)) as refs:  # a caller that stops at the first row
        assert tuple(next(refs)) == expected[0]
    assert state.engine.pool.checkedout() == 0


def test_switch_records_event_and_retires_previous(state: StateStore) -> None:
    first, second = new_version(state), new_version(state)
    for built in (first, second):
        state.transition_version(built.id, from_=["building"], to="ready")
    state.record_switch(alias="kb", action="promote", to=first, previous=None, run_id="r1")
    state.record_switch(alias="kb", action="promote", to=second, previous=state.live_version("kb"), run_id="r2")
    assert state.live_version("kb").version == 2
    assert state.get_version("kb", 1).status == "retired"
    events = state.alias_events("kb")
    assert [(e.from_version, e.to_version) for e in events] == [(None, 1), (1, 2)]


def test_runs_are_recorded_with_duration(state: StateStore) -> None:
    state.start_run(run_id="r1", alias="kb", kind="reindex", trigger="cli")
    state.finish_run("r1", outcome="promoted", chunks_embedded=3)
    run = state.get_run("r1")
    assert run.outcome == "promoted" and run.chunks_embedded == 3 and run.duration_s >= 0


def test_lock_excludes_a_second_owner_until_released_or_expired(state: StateStore) -> None:
    state.acquire_lock("reindex:kb", owner="a", ttl_s=60)
    with pytest.raises(LockHeldError, match="working on kb: a, since"):
        state.acquire_lock("reindex:kb", owner="b", ttl_s=60)
    state.release_lock("reindex:kb", owner="a")
    state.acquire_lock("reindex:kb", owner="b", ttl_s=-1)  # already expired
    state.acquire_lock("reindex:kb", owner="c", ttl_s=60)
    with pytest.raises(LockHeldError):
        state.acquire_lock("reindex:kb", owner="b", ttl_s=60)


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lock_of_a_dead_process_on_this_host_is_taken_over_at_once_and_recorded(state: StateStore) -> None:
    from kb_reindex.services.state.locks import default_lock_owner

    dead = default_lock_owner("cli__reindex__crashed", pid=_dead_pid())
    state.acquire_lock("reindex:kb", owner=dead, ttl_s=3600)
    state.acquire_lock("reindex:kb", owner="next-run", ttl_s=60)  # no wait for the TTL
    assert state.lock_held_by("reindex:kb") == "next-run"
    [event] = state.lock_events(names=["reindex:kb"])
    assert event.action == "takeover" and event.owner == dead and event.by == "next-run"


def test_lock_of_a_live_process_or_another_host_is_not_taken_over(state: StateStore) -> None:
    import socket

    from kb_reindex.services.state.locks import default_lock_owner

    mine = default_lock_owner("run-a")  # this process: alive
    state.acquire_lock("reindex:kb", owner=mine, ttl_s=3600)
    with pytest.raises(LockHeldError, match="its process is alive on this host"):
        state.acquire_lock("reindex:kb", owner="next-run", ttl_s=60)
    state.release_lock("reindex:kb", owner=mine)
    elsewhere = default_lock_owner("run-b", pid=_dead_pid()).replace(socket.gethostname(), "another-host", 1)
    state.acquire_lock("reindex:kb", owner=elsewhere, ttl_s=3600)
    with pytest.raises(LockHeldError, match="held from host another-host"):
        state.acquire_lock("reindex:kb", owner="next-run", ttl_s=60)
    state.break_lock("reindex:kb", by="test", reason="next case")
    # same hostname, another PID namespace (a container with the host's name): its PIDs mean other processes
    other_space = default_lock_owner("run-c", pid=_dead_pid()).rsplit(":", 1)[0] + ":0123456789"
    state.acquire_lock("reindex:kb", owner=other_space, ttl_s=3600)
    with pytest.raises(LockHeldError):
        state.acquire_lock("reindex:kb", owner="next-run", ttl_s=60)
    assert [e.action for e in state.lock_events(names=["reindex:kb"])] == ["unlock"]


def test_lock_whose_pid_was_reused_by_a_newer_process_is_taken_over(state: StateStore) -> None:
    """This process's PID, but the lock is older than the process: the PID belongs to someone else now."""
    from datetime import timedelta

    from kb_reindex.services.state.clock import ManualClock, utcnow

    from kb_reindex.services.state.locks import default_lock_owner

    state.clock = ManualClock(utcnow() - timedelta(days=3))
    state.acquire_lock("reindex:kb", owner=default_lock_owner("old"), ttl_s=4 * 86400)  # 3 days ago
    state.clock.advance(3 * 86400)  # now: its TTL has a day to run, its PID is this process's
    state.acquire_lock("reindex:kb", owner="next-run", ttl_s=60)
    assert state.lock_held_by("reindex:kb") == "next-run"
    [event] = state.lock_events(names=["reindex:kb"])
    assert event.action == "takeover" and event.at == state.clock.now()


def test_lock_expiry_and_every_timestamp_follow_the_stores_clock(state: StateStore) -> None:
    """Lock TTLs are judged by the store's clock: a test moves time instead of sleeping or editing rows."""
    from datetime import datetime

    from kb_reindex.services.state.clock import ManualClock

    start = datetime(2030, 1, 1, 12, 0, 0)
    state.clock = ManualClock(start)
    state.acquire_lock("reindex:kb", owner="stuck-elsewhere", ttl_s=60)
    state.clock.advance(59)
    assert state.lock_held_by("reindex:kb") == "stuck-elsewhere"
    with pytest.raises(LockHeldError, match="expires 2030-01-01 12:01:00 UTC"):
        state.acquire_lock("reindex:kb", owner="next-run", ttl_s=60)
    assert state.renew_lock("reindex:kb", owner="stuck-elsewhere", ttl_s=60)  # now until 12:01:59
    state.clock.advance(60)
    assert state.lock_held_by("reindex:kb") == "stuck-elsewhere"
    state.clock.advance(1.5)
    assert state.lock_held_by("reindex:kb") is None
    [row] = state.list_locks(subject="kb")
    assert row.expired and row.owner == "stuck-elsewhere"
    state.acquire_lock("reindex:kb", owner="next-run", ttl_s=60)  # the expired lock is taken, no wait
    [row] = state.list_locks(subject="kb")
    assert (row.owner, row.acquired_at) == ("next-run", datetime(2030, 1, 1, 12, 2, 0, 500000))
    # what the store writes is stamped by the same clock: a run's duration is the time moved
    state.start_run(run_id="r1", alias="kb", kind="reindex", trigger="cli")
    state.clock.advance(42)
    state.finish_run("r1", outcome="success")
    run = state.get_run("r1")
    assert run.finished_at == datetime(2030, 1, 1, 12, 2, 42, 500000) and run.duration_s == 42.0


def test_lock_is_waited_for_a_bounded_time(state: StateStore) -> None:
    import time

    from kb_reindex.services.state.locks import default_lock_owner

    holder = default_lock_owner("run-a")
    state.acquire_lock("reindex:kb", owner=holder, ttl_s=60)
    threading.Timer(0.8, lambda: state.release_lock("reindex:kb", owner=holder)).start()
    started = time.monotonic()
    state.acquire_lock("reindex:kb", owner="patient", ttl_s=60, wait_s=10)
    assert 0.5 < time.monotonic() - started < 5
    started = time.monotonic()
    with pytest.raises(LockHeldError, match="another run is working on kb: patient"):
        state.acquire_lock("reindex:kb", owner="impatient", ttl_s=60, wait_s=0.5)
    assert time.monotonic() - started >= 0.5


def test_break_lock_is_recorded(state: StateStore) -> None:
    state.acquire_lock("reindex:kb", owner="stuck", ttl_s=60)
    assert state.break_lock("reindex:kb", by="on-call", reason="hung build").owner == "stuck"
    assert state.lock_held_by("reindex:kb") is None
    [event] = state.lock_events(names=["reindex:kb"])
    assert (event.action, event.owner, event.by, event.reason) == ("unlock", "stuck", "on-call", "hung build")
    assert state.break_lock("reindex:kb", by="on-call", reason="again") is None


def test_lock_held_past_its_ttl_is_renewed_while_the_holder_works(state: StateStore) -> None:
    import time

    with state.lock("reindex:kb", owner="long-build", ttl_s=1.2):
        time.sleep(3.0)  # well past the TTL: without the heartbeat the row would have expired
        with pytest.raises(LockHeldError, match="working on kb: long-build"):
            state.acquire_lock("reindex:kb", owner="next-run", ttl_s=60)
    state.acquire_lock("reindex:kb", owner="next-run", ttl_s=60)  # released on exit


def test_unreachable_state_db_is_unavailable_without_password() -> None:
    from kb_reindex.domain.errors import StateUnreachable

    with pytest.raises(StateUnreachable) as error:
        StateStore("mysql+pymysql://kb:hunter2@127.0.0.1:1/kb")
    assert "unreachable" in str(error.value) and "hunter2" not in str(error.value)


def test_keys_differing_only_by_accent_are_distinct(state: StateStore) -> None:
    version = new_version(state)
    docs = [ManifestDocument(knowledge_key=key, source=f"{key}.md", title=key, category="c", tenant="t",
                             content_hash="a" * 64, chunk_count=0) for key in ("café", "cafe")]
    state.write_manifest(version.id, docs, [])
    assert sorted(d.knowledge_key for d in state.manifest_documents(version.id)) == ["cafe", "café"]


def test_schema_lock_that_cannot_be_opened_does_not_stop_the_state_db(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "state.db.schema-lock").mkdir()  # in the way: cannot be opened as a file
    store = StateStore(f"sqlite:///{tmp_path}/state.db")
    assert store.list_versions("kb") == []
    assert "no schema lock beside" in caplog.text
    store.dispose()
    StateStore(f"sqlite:///{tmp_path}/state.db").dispose()  # schema complete: no lock needed at all


def test_a_reader_meeting_a_schema_being_created_waits_for_it_and_a_half_schema_that_stays_is_named(
        state: StateStore) -> None:
    """Seen in the P9 bench: two first runs on one new SQLite file; one process's read-only open met
    kb_versions made and kb_alias_events not yet, and its run failed 'tables kb_alias_events missing'."""
    from kb_reindex.services.state.schema import alias_events

    alias_events.drop(state.engine)  # what a reader sees between the writer's two CREATE TABLEs
    again = threading.Timer(1.0, lambda: alias_events.create(state.engine))
    again.start()
    try:
        StateStore(state.url, create=False).dispose()  # waits for the table instead of failing
    finally:
        again.join()
    alias_events.drop(state.engine)  # and now nobody creates it
    with pytest.raises(ConfigError, match="tables kb_alias_events missing"):
        StateStore(state.url, create=False)
    alias_events.create(state.engine)


def test_processes_creating_one_sqlite_state_db_at_once_all_succeed(tmp_path: Path) -> None:
    """A race: without the schema lock about one round in five ends in 'database is locked'."""
    import subprocess
    import sys

    code = "import sys; from kb_reindex.services.state.store import StateStore; StateStore(sys.argv[1]).dispose()"
    for attempt in range(4):
        url = f"sqlite:///{tmp_path}/fresh-{attempt}/state.db"
        procs = [subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(8)]
        outputs = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [0] * 8, [err[-500:] for _out, err in outputs if err]


def _manifest(state: StateStore, version_id: int, chunks: list[tuple[str, str | None]]) -> None:
    """One document whose chunks are (chunk_hash, source_point_id): None = embedded by this version."""
    docs = [ManifestDocument(knowledge_key="k", source="k.md", title="K", category="c", tenant="default",
                             content_hash="a" * 64, chunk_count=len(chunks))]
    rows = [ManifestChunk(point_id=f"00000000-0000-0000-0000-{version_id:04d}{i:08d}", knowledge_key="k",
                          chunk_index=i, chunk_hash=h, source_point_id=source) for i, (h, source) in enumerate(chunks)]
    state.write_manifest(version_id, docs, rows)


def test_chunk_texts_are_kept_while_a_version_embeds_them_and_dropped_with_the_last(state: StateStore) -> None:
    """Shared by hash across versions; 4-byte UTF-8 and texts over 64 KB (LONGTEXT on MySQL) come back as
    stored; retention/drop (status deleted) and forget drop only what no kept version embeds."""
    h1, h2, h3 = "1" * 64, "2" * 64, "3" * 64
    v1, v2 = new_version(state), new_version(state)
    _manifest(state, v1.id, [(h1, None), (h2, None)])
    _manifest(state, v2.id, [(h2, None), (h3, "00000000-0000-0000-0000-000000000001")])  # h3 copied, not embedded
    long_text = "退货规则😀 " * 20_000
    assert state.missing_texts([h1, h2, h3]) == {h1, h2, h3}
    state.add_texts([{"chunk_hash": h1, "section": "退货 > 😀", "text": long_text},
                     {"chunk_hash": h2, "section": "", "text": "two"}, {"chunk_hash": h3, "section": "", "text": "x"}])
    state.add_texts([{"chunk_hash": h2, "section": "", "text": "two"}])  # stored meanwhile by another plan: kept
    assert state.texts([h1, h2]) == {h1: ("退货 > 😀", long_text), h2: ("", "two")}

    assert state.drop_unneeded_texts() == 1  # h3: no version embeds it
    assert set(state.texts([h1, h2, h3])) == {h1, h2}
    state.transition_version(v1.id, from_=["building"], to="failed")
    state.transition_version(v1.id, from_=["failed"], to="deleted")
    state.drop_unneeded_texts()
    assert set(state.texts([h1, h2, h3])) == {h2}, "h2 is still embedded by v2"
    state.forget_versions("kb")
    assert state.texts([h1, h2, h3]) == {}


def test_a_routine_cleanup_drops_only_the_texts_the_versions_it_deleted_embedded(state: StateStore) -> None:
    """Retention names the versions it deleted: their embedded texts no kept version embeds go, one still
    embedded by a kept version stays, and a text neither of them embeds is not even looked at (a full sweep,
    as a drop or forget does, finds it)."""
    h1, h2, h3, h4 = "1" * 64, "2" * 64, "3" * 64, "4" * 64
    v1, v2 = new_version(state), new_version(state)
    _manifest(state, v1.id, [(h1, None), (h2, None)])
    _manifest(state, v2.id, [(h2, None), (h3, None)])
    state.add_texts([{"chunk_hash": h, "section": "", "text": h[:1]} for h in (h1, h2, h3, h4)])
    state.transition_version(v1.id, from_=["building"], to="failed")
    state.transition_version(v1.id, from_=["failed"], to="deleted")
    assert state.drop_unneeded_texts(versions_gone=[v1.id]) == 1
    assert set(state.texts([h1, h2, h3, h4])) == {h2, h3, h4}
    assert state.drop_unneeded_texts(versions_gone=[]) == 0
    assert state.drop_unneeded_texts() == 1  # h4: no version embeds it
    assert set(state.texts([h1, h2, h3, h4])) == {h2, h3}


def test_a_build_slice_reads_its_manifest_rows_by_position(state: StateStore) -> None:
    version = new_version(state)
    _manifest(state, version.id, [(f"{i:064d}", None) for i in range(10)])
    rows = state.slice_rows(version.id, (3, 4))
    assert [r.chunk_index for r in rows] == [3, 4, 5, 6]
    assert [r.chunk_index for r in state.slice_rows(version.id)] == list(range(10))
    assert state.slice_rows(version.id, (8, 5))[-1].chunk_index == 9
    assert [d.knowledge_key for d in state.manifest_documents(version.id, ["k", "absent"])] == ["k"]


def test_a_slice_against_its_base_reads_the_rows_that_differ_and_the_ids_kept(state: StateStore) -> None:
    """A: unchanged; B: edited (a new point); C: the same point, its title changed (its payload rewritten);
    D: new; E: gone. The difference names the added rows, counts the kept ones and names, of those, the rows to
    rewrite; a window limits all three to its positions. A sample of the kept IDs is looked up by position."""
    base, version = new_version(state), new_version(state)

    def doc(key: str, title: str = "t", chunks: int = 1) -> ManifestDocument:
        return ManifestDocument(knowledge_key=key, source=f"{key}.md", title=title, category="c", tenant="default",
                                content_hash="a" * 64, chunk_count=chunks)

    def row(key: str, index: int, point: str) -> ManifestChunk:
        return ManifestChunk(point_id=point, knowledge_key=key, source_point_id=None, chunk_index=index,
                             chunk_hash=f"{point:0>64}")

    state.write_manifest(base.id, [doc("A", chunks=2), doc("B"), doc("C"), doc("E")],
                         [row("A", 0, "a0"), row("A", 1, "a1"), row("B", 0, "b0"), row("C", 0, "c0"), row("E", 0, "e0")])
    state.write_manifest(version.id, [doc("A", chunks=2), doc("B"), doc("C", title="new"), doc("D")],
                         [row("A", 0, "a0"), row("A", 1, "a1"), row("B", 0, "b1"), row("C", 0, "c0"), row("D", 0, "d0")])
    diff = state.slice_difference(version.id, base.id)
    assert [r.point_id for r in diff.added] == ["b1", "d0"]
    assert diff.kept == 3
    assert [r.point_id for r in diff.rewrite] == ["c0"]
    assert diff.total == 5
    window = state.slice_difference(version.id, base.id, (2, 2))  # positions 2, 3: B's and C's rows
    assert ([r.point_id for r in window.added], window.kept, [r.point_id for r in window.rewrite]) == (["b1"], 1, ["c0"])
    assert state.kept_sample(version.id, base.id, range(5)) == ["a0", "a1", "c0"]  # positions 2 (b1), 4 (d0) added
    assert state.kept_sample(version.id, base.id, [4, 1, 2]) == ["a1"]
    assert [r.point_id for r in state.dropped_chunks(version.id, base.id)] == ["b0", "e0"]
    assert [r.point_id for r in state.added_chunks(version.id, base.id)] == ["b1", "d0"]  # no rewrites weighed
    # the documents whose payload fields differ (C's title), with the base's of their key, and those it lacks (D);
    # A and B (same fields: B's rows differ, its document's fields do not) are not read
    changes = state.documents_changed(version.id, base.id)
    assert [(d.knowledge_key, d.title, was.title if was else None) for d, was in changes] == [
        ("C", "new", "t"), ("D", "t", None)]
    assert state.changed_documents(version.id, base.id) == {"C", "D"}
    assert state.documents_changed(base.id, base.id) == []


def test_identical_chunks_are_looked_for_among_the_hashes_of_the_documents_named(state: StateStore) -> None:
    """A and B share h1, B and C share h2, D is alone: every shared row without keys; with keys, only the
    groups of those documents' hashes (an edit's changed documents), the other documents' rows of them included."""
    version = new_version(state)
    layout = {"A": ["1", "x"], "B": ["1", "2"], "C": ["2"], "D": ["d"]}
    docs = [ManifestDocument(knowledge_key=k, source=f"{k}.md", title=k, category="c", tenant="default",
                             content_hash=k * 64, chunk_count=len(hs)) for k, hs in layout.items()]
    rows = [ManifestChunk(point_id=f"{k}{i}", knowledge_key=k, chunk_index=i, chunk_hash=h * 64, source_point_id=None)
            for k, hs in layout.items() for i, h in enumerate(hs)]
    state.write_manifest(version.id, docs, rows)
    assert [(r.knowledge_key, r.chunk_index) for r in state.shared_chunks(version.id)] == [
        ("A", 0), ("B", 0), ("B", 1), ("C", 0)]
    assert [(r.knowledge_key, r.chunk_index) for r in state.shared_chunks(version.id, {"A"})] == [("A", 0), ("B", 0)]
    assert [r.knowledge_key for r in state.shared_chunks(version.id, {"C", "D"})] == ["B", "C"]
    assert state.shared_chunks(version.id, set()) == []


def test_an_edits_manifest_copies_its_unchanged_documents_rows_from_its_base_inside_the_database(
        state: StateStore) -> None:
    """`write_manifest_from`: the base's rows of A and B (one run) and of D are copied in SQL, with their
    document rows; C's new rows and E's are given; the result is the manifest a whole write gives (positions in
    manifest order, a copied row's point its vector's source). A run whose rows are not where its documents
    said (a base without positions), or a copied document the base lacks, writes nothing and answers False."""
    from kb_reindex.services.state.manifests import CopiedRows

    base, version, whole = new_version(state), new_version(state), new_version(state)

    def doc(key: str, chunks: int = 1) -> ManifestDocument:
        return ManifestDocument(knowledge_key=key, source=f"{key}.md", title="t", category="c", tenant="default",
                                content_hash="a" * 64, chunk_count=chunks)

    def row(key: str, index: int, point: str, source: str | None = None) -> ManifestChunk:
        return ManifestChunk(point_id=point, knowledge_key=key, source_point_id=source, chunk_index=index,
                             chunk_hash=f"{point:0>64}")

    state.write_manifest(base.id, [doc("A", 2), doc("B"), doc("C"), doc("D", 2)],
                         [row("A", 0, "a0"), row("A", 1, "a1"), row("B", 0, "b0"), row("C", 0, "c0"),
                          row("D", 0, "d0"), row("D", 1, "d1")])
    documents = [doc("A", 2), doc("B"), doc("C"), doc("D", 2), doc("E")]
    edited = [row("C", 0, "c1"), row("E", 0, "e0", "a0")]
    parts: list = [CopiedRows(start=0, size=3, first_key="A", last_key="B"), edited[:1],
                   CopiedRows(start=4, size=2, first_key="D", last_key="D"), edited[1:]]
    assert not state.write_manifest_from(version.id, base.id, [doc("C"), doc("E")], parts,
                                         copied_documents={"A", "B", "D", "F"})  # no F in the base
    assert state.manifest_documents(version.id) == [] and state.manifest_chunks(version.id) == []
    assert state.write_manifest_from(version.id, base.id, [doc("C"), doc("E")], parts,
                                     copied_documents={"A", "B", "D"})
    state.write_manifest(whole.id, documents, [row("A", 0, "a0", "a0"), row("A", 1, "a1", "a1"), row("B", 0, "b0", "b0"),
                                               *edited[:1], row("D", 0, "d0", "d0"), row("D", 1, "d1", "d1"), *edited[1:]])
    assert state.manifest_chunks(version.id) == state.manifest_chunks(whole.id)
    assert state.slice_rows(version.id) == state.slice_rows(whole.id)  # by position
    assert [r.point_id for r in state.slice_rows(version.id, (3, 2))] == ["c1", "d0"]
    assert state.manifest_documents(version.id) == documents

    # runs not where the base's documents are: a start one off, a size one short
    assert not state.write_manifest_from(version.id, base.id, [doc("C"), doc("E")], [
        CopiedRows(start=1, size=3, first_key="A", last_key="B"), *parts[1:]], copied_documents={"A", "B", "D"})
    assert not state.write_manifest_from(version.id, base.id, [doc("C"), doc("E")], [
        CopiedRows(start=0, size=2, first_key="A", last_key="B"), *parts[1:]], copied_documents={"A", "B", "D"})
    assert state.manifest_chunks(version.id) == state.manifest_chunks(whole.id), "nothing written"
    assert state.manifest_documents(version.id) == documents


def test_the_chunks_a_version_loses_against_its_base_are_counted_by_document_in_sql(state: StateStore) -> None:
    """`chunks_lost`: the base's chunks, and the chunks its documents that stay lost (A 3 -> 1); a document that
    grew (B), one added (D) or one removed (C) loses nothing by this count (removal is counted apart)."""
    base, version = new_version(state), new_version(state)

    def doc(key: str, chunks: int) -> ManifestDocument:
        return ManifestDocument(knowledge_key=key, source=f"{key}.md", title="t", category="c", tenant="default",
                                content_hash="a" * 64, chunk_count=chunks)

    def rows(docs: list[ManifestDocument]) -> list[ManifestChunk]:
        return [ManifestChunk(point_id=f"{d.knowledge_key}{i}", knowledge_key=d.knowledge_key, source_point_id=None,
                              chunk_index=i, chunk_hash=f"{d.knowledge_key}{i}".rjust(64, "0"))
                for d in docs for i in range(d.chunk_count)]

    for version_id, docs in ((base.id, [doc("A", 3), doc("B", 2), doc("C", 4)]),
                             (version.id, [doc("A", 1), doc("B", 5), doc("D", 7)])):
        state.write_manifest(version_id, docs, rows(docs))
    assert state.chunks_lost(version.id, base.id) == (9, 2)
    assert state.chunks_lost(base.id, base.id) == (9, 0)


def test_a_sample_of_a_manifest_is_read_by_position(state: StateStore) -> None:
    """`manifest_at` reads the rows at these positions, across documents (an empty one between them holds
    none); `manifest_size` counts them."""
    version = new_version(state)
    layout = {"A": 3, "B": 0, "C": 2, "D": 5}
    docs = [ManifestDocument(knowledge_key=k, source=f"{k}.md", title=k, category="c", tenant="default",
                             content_hash="a" * 64, chunk_count=n) for k, n in layout.items()]
    rows = [ManifestChunk(point_id=f"{k}{i}", knowledge_key=k, chunk_index=i, chunk_hash=f"{k}{i}".rjust(64, "0"),
                          source_point_id=None) for k, n in layout.items() for i in range(n)]
    state.write_manifest(version.id, docs, rows)
    assert state.manifest_size(version.id) == 10
    assert [r.point_id for r in state.manifest_at(version.id, [7, 2, 2, 3, 0, 9, 10])] == ["A0", "A2", "C0", "D2", "D4"]
    assert [r.point_id for r in state.slice_rows(version.id, (2, 4))] == ["A2", "C0", "C1", "D0"]
    assert state.manifest_at(version.id, []) == []


def test_within_a_run_the_difference_of_two_manifests_is_asked_once_and_forgotten_on_a_write(
        state: StateStore) -> None:
    """`sharing_differences` (a run's build and validation): the rows one manifest lacks and the documents whose
    fields differ are asked of the database once; a manifest written meanwhile is seen (what was kept is
    forgotten); outside the block every call asks."""
    base, version = new_version(state), new_version(state)

    def doc(key: str, title: str = "t") -> ManifestDocument:
        return ManifestDocument(knowledge_key=key, source=f"{key}.md", title=title, category="c", tenant="default",
                                content_hash="a" * 64, chunk_count=1)

    def row(key: str, point: str) -> ManifestChunk:
        return ManifestChunk(point_id=point, knowledge_key=key, source_point_id=None, chunk_index=0,
                             chunk_hash=f"{point:0>64}")

    state.write_manifest(base.id, [doc("A"), doc("B")], [row("A", "a0"), row("B", "b0")])
    state.write_manifest(version.id, [doc("A", "new"), doc("C")], [row("A", "a0"), row("C", "c0")])
    statements: list[str] = []
    sa.event.listen(state.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    with state.sharing_differences():
        assert [r.point_id for r in state.dropped_chunks(version.id, base.id)] == ["b0"]
        assert sorted(state.changed_documents(version.id, base.id)) == ["A", "C"]
        asked = len(statements)
        assert [r.point_id for r in state.dropped_chunks(version.id, base.id)] == ["b0"]
        assert sorted(state.changed_documents(version.id, base.id)) == ["A", "C"]
        assert len(statements) == asked  # remembered: not one statement
        state.write_manifest(version.id, [doc("A"), doc("B")], [row("A", "a0"), row("B", "b0")])
        assert state.dropped_chunks(version.id, base.id) == [] and state.changed_documents(version.id, base.id) == set()
    asked = len(statements)
    state.dropped_chunks(version.id, base.id)
    assert len(statements) > asked  # outside the block: asked again


def test_a_small_sample_of_a_large_manifest_reads_the_documents_near_it(state: StateStore) -> None:
    """A sample spanning little of the manifest finds its rows from the documents that start near each position
    (by the position index), not from every document's start, and finds the same rows a full read would."""
    from kb_reindex.services.state.manifests import _starts_near

    version = new_version(state)
    counts = [(i * 7) % 5 for i in range(400)]  # 0-4 chunks, empty documents among them: 800 rows
    docs = [ManifestDocument(knowledge_key=f"k{i:03d}", source=f"k{i:03d}.md", title="t", category="c",
                             tenant="default", content_hash="a" * 64, chunk_count=n) for i, n in enumerate(counts)]
    rows = [ManifestChunk(point_id=f"k{i:03d}-{c}", knowledge_key=f"k{i:03d}", chunk_index=c,
                          chunk_hash=f"{i}-{c}".rjust(64, "0"), source_point_id=None)
            for i, n in enumerate(counts) for c in range(n)]
    state.write_manifest(version.id, docs, rows)
    in_order = [r.point_id for r in rows]  # keys sort as written: manifest order
    wanted = [0, 1, 97, 98, 401, 555, 799, 800]
    assert [r.point_id for r in state.manifest_at(version.id, wanted)] == [in_order[p] for p in wanted if p < 800]
    with state.engine.connect() as conn:
        near = _starts_near(conn, version.id, sorted(wanted))
    assert 0 < len(near) <= len(wanted) * 4 < len([n for n in counts if n])  # 320 documents with chunks


def test_cleanup_prunes_the_manifests_of_deleted_versions_no_slot_needs(state: StateStore) -> None:
    """v1 deleted and nowhere: its manifest goes (the version row stays). v2 deleted but its slot still holds
    its points, v3 deleted but the base v4's slot difference is taken from, v4 building: all kept. Another
    alias's deleted version is not touched."""
    v1, v2, v3, v4 = (new_version(state) for _ in range(4))
    other = new_version(state, alias="other")
    for v in (v1, v2, v3, v4, other):
        _manifest(state, v.id, [(f"{v.id:064d}", None)])
    state.add_slot(alias="kb", collection="kb__s1", profile="p")
    state.take_slot(version_id=v2.id, collection="kb__s1", base_version=None, evicted_name=None)
    state.add_slot(alias="kb", collection="kb__s2", profile="p")
    state.take_slot(version_id=v4.id, collection="kb__s2", base_version=v3.version, evicted_name=None)
    for v in (v1, v2, v3, other):
        state.transition_version(v.id, from_=["building"], to="failed")
        state.transition_version(v.id, from_=["failed"], to="deleted")
    assert state.prune_manifests("kb") == 1
    assert [state.manifest_size(v.id) for v in (v1, v2, v3, v4, other)] == [0, 1, 1, 1, 1]
    assert state.manifest_documents(v1.id) == [] and state.version_by_id(v1.id).status == "deleted"
    assert state.prune_manifests("kb") == 0


def test_a_state_db_from_before_revisions_is_split_into_revisions_at_open(state: StateStore) -> None:
    """A state DB made before revisions (a row per chunk in kb_manifest_chunks, document rows without a
    revision, no kb_file_hashes): opening it, read-only too, adds what it lacks, moves each version's rows into
    its documents' revisions and sources and empties the old table; every manifest reads back as it was; a
    second open changes nothing."""
    from kb_reindex.services.state.schema import legacy_manifest_chunks

    url = state.url
    v1, v2 = new_version(state), new_version(state)

    def doc(key: str, chunks: int) -> ManifestDocument:
        return ManifestDocument(knowledge_key=key, source=f"{key}.md", title="t", category="c", tenant="default",
                                content_hash=key * 64, chunk_count=chunks)

    def row(key: str, index: int, version: int, source: str | None) -> ManifestChunk:
        return ManifestChunk(point_id=f"{key}{index}-{version}", knowledge_key=key, source_point_id=source,
                             chunk_index=index, chunk_hash=f"{key}{index}{version}".rjust(64, "0"))

    manifests = {
        v1.id: ([doc("A", 2), doc("B", 1), doc("E", 0)], [row("A", 0, 1, None), row("A", 1, 1, None), row("B", 0, 1, None)]),
        v2.id: ([doc("A", 2), doc("B", 1), doc("C", 1)], [row("A", 0, 1, "A0-1"), row("A", 1, 1, "A1-1"),
                                                         row("B", 0, 2, "B0-1"), row("C", 0, 2, None)]),
    }
    with state.engine.begin() as conn:  # the old layout, as the release before revisions wrote it
        legacy_manifest_chunks.create(conn)
        for version_id, (docs, rows) in manifests.items():
            conn.execute(sa.text("INSERT INTO kb_manifest_documents (version_id, knowledge_key, source, title, category, "
                                 "tenant, content_hash, chunk_count) VALUES (:v, :k, :s, :t, :c, :te, :h, :n)"),
                         [{"v": version_id, "k": d.knowledge_key, "s": d.source, "t": d.title, "c": d.category,
                           "te": d.tenant, "h": d.content_hash, "n": d.chunk_count} for d in docs])
            conn.execute(legacy_manifest_chunks.insert(), [{"version_id": version_id, **r._asdict()} for r in rows])
        for index in ("ix_kb_manifest_documents_position", "ix_kb_manifest_documents_rev"):
            on = " ON kb_manifest_documents" if state.engine.dialect.name == "mysql" else ""
            conn.execute(sa.text(f"DROP INDEX {index}{on}"))
        for column in ("rev_id", "first_position"):
            conn.execute(sa.text(f"ALTER TABLE kb_manifest_documents DROP COLUMN {column}"))
        for table in ("kb_doc_chunks", "kb_manifest_sources", "kb_file_hashes"):
            conn.execute(sa.text(f"DROP TABLE {table}"))
    state.dispose()

    def legacy_rows(store: StateStore) -> int:
        with store.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(legacy_manifest_chunks)).scalar_one()

    reader = StateStore(url, create=False)
    assert reader.file_hashes("root") == {}, "read-only on an old DB: no cache, no error"
    for version_id, (docs, rows) in manifests.items():
        assert reader.manifest_documents(version_id) == docs
        assert reader.manifest_chunks(version_id) == rows
    assert legacy_rows(reader) == 0
    reader.dispose()
    for _ in range(2):
        upgraded = StateStore(url)
        assert [upgraded.manifest_chunks(v) for v in manifests] == [rows for _docs, rows in manifests.values()]
        assert [r.point_id for r in upgraded.slice_rows(v2.id, (1, 2))] == ["A1-1", "B0-2"]
        assert [r.point_id for r in upgraded.slice_difference(v2.id, v1.id).added] == ["B0-2", "C0-2"]
        assert [r.point_id for r in upgraded.embedded_chunks(v2.id)] == ["C0-2"]
        upgraded.dispose()


def test_an_old_state_db_gets_the_snapshot_columns_and_its_old_snapshot_records_still_show(state: StateStore) -> None:
    """A state DB from before the snapshot had its own column kept the snapshot in the validation record:
    opening it adds the columns, and status reads the old record until a new snapshot is taken."""
    from datetime import datetime

    url = state.url
    version = new_version(state)
    old = {"name": "kb__m__v1-1.snapshot", "collection": version.collection, "at": "2026-01-02T03:04:05Z"}
    state.update_version(version.id, validation={"hit_rate": 1.0, "snapshot": old})
    with state.engine.begin() as conn:
        for column in ("qdrant_snapshot", "qdrant_snapshot_at"):
            conn.execute(sa.text(f"ALTER TABLE kb_versions DROP COLUMN {column}"))
    state.dispose()
    upgraded = StateStore(url)
    try:
        columns = {c["name"] for c in sa.inspect(upgraded.engine).get_columns("kb_versions")}
        assert {"qdrant_snapshot", "qdrant_snapshot_at"} <= columns
        record = upgraded.version_by_id(version.id)
        assert record.qdrant_snapshot is None and record.snapshot_view() == QdrantSnapshotRef.from_dict(old)
        assert record.snapshot_view().to_dict() == old
        upgraded.update_version(version.id, qdrant_snapshot="kb__m__v1-2.snapshot",
                                qdrant_snapshot_at=datetime(2026, 2, 3, 4, 5, 6, 789))
        assert upgraded.version_by_id(version.id).snapshot_view() == QdrantSnapshotRef(
            name="kb__m__v1-2.snapshot", collection=version.collection, at="2026-02-03T04:05:06Z")
        assert "qdrant_snapshot" not in upgraded.version_by_id(version.id).to_dict()
    finally:
        upgraded.dispose()


def test_file_hashes_are_recorded_whole_or_in_part(state: StateStore) -> None:
    from kb_reindex.services.state.manifests import FileHash

    state.record_file_hashes("r", {"a.md": FileHash(1, 10, "a" * 64, 100), "b.md": FileHash(2, 20, "b" * 64, 100)},
                             replace_all=True)
    state.record_file_hashes("r", {"b.md": FileHash(3, 30, "c" * 64, 200)}, replace_all=False)
    assert state.file_hashes("r") == {"a.md": FileHash(1, 10, "a" * 64, 100), "b.md": FileHash(3, 30, "c" * 64, 200)}
    state.record_file_hashes("r", {"文档/😀.md": FileHash(4, 40, "d" * 64, 300)}, replace_all=True)
    assert list(state.file_hashes("r")) == ["文档/😀.md"] and state.file_hashes("other") == {}


@pytest.mark.postgres
def test_the_kb_state_connection_may_be_a_postgres_one(postgres_url: str) -> None:
    """An Airflow Connection of type postgres (as `airflow connections add` or AIRFLOW_CONN_KB_STATE makes it)
    names a state DB the store opens through psycopg."""
    from urllib.parse import urlsplit

    from airflow.models.connection import Connection

    from kb_reindex.airflow.connections import state_url_from_connection

    db = urlsplit(postgres_url)
    conn = Connection(conn_id="kb_state", uri=f"postgres://{db.username}@{db.hostname}:{db.port}{db.path}")
    url = state_url_from_connection(conn)
    assert url == f"postgresql+psycopg://{db.username}@{db.hostname}:{db.port}{db.path}"
    store = StateStore(url)
    try:
        assert new_version(store).version == 1
    finally:
        store.dispose()



def test_the_last_registry_entry_that_loaded_is_kept_once_per_alias(state: StateStore) -> None:
    """What on-call acts from when an entry stops loading: written when it changed, read back as it was."""
    from kb_reindex.services.state.entries import RecordedEntry

    entry = RecordedEntry(alias="wiki", registry="/srv/registry.yaml", schedule=None, qdrant_conn_id="qdrant_wiki",
                          ollama_conn_id="ollama_default", aws_conn_id="aws_default",
                          env={"KB_ALIAS": "wiki", "KB_EMBED_MODEL": "bge-m3"})
    assert state.recorded_entry("wiki") is None
    assert state.record_entry(entry) is True
    assert state.record_entry(entry) is False, "unchanged: not written again"
    kept = state.recorded_entry("wiki")
    assert kept is not None and kept.recorded_at is not None
    assert (kept.qdrant_conn_id, kept.schedule, dict(kept.env)) == ("qdrant_wiki", None, dict(entry.env))
    assert state.record_entry(RecordedEntry(**{**entry.__dict__, "schedule": "@hourly"})) is True
    assert [(e.alias, e.schedule) for e in state.recorded_entries()] == [("wiki", "@hourly")]


def test_a_parse_reads_the_unretired_entries_over_a_bounded_connection_and_never_makes_a_db(
        state: StateStore, tmp_path: Path) -> None:
    """What the rollback DAG's file reads at parse (`unretired_entries`): every recorded entry but a retired
    one's, the retirement undone bringing it back; a SQLite state DB not made yet is none, and is not made."""
    from kb_reindex.services.state.entries import RecordedEntry, unretired_entries

    for alias in ("wiki", "seller_rules"):
        state.record_entry(RecordedEntry(alias=alias, registry="/srv/registry.yaml", schedule=None,
                                         qdrant_conn_id="qdrant_default", ollama_conn_id="ollama_default",
                                         aws_conn_id="aws_default", env={"KB_ALIAS": alias}))
    assert [e.alias for e in unretired_entries(state.url)] == ["seller_rules", "wiki"]
    state.retire("seller_rules", reason="moved", by="oncall")
    assert [e.alias for e in unretired_entries(state.url)] == ["wiki"]
    state.undo_retirement("seller_rules", by="oncall")
    assert [e.alias for e in unretired_entries(state.url)] == ["seller_rules", "wiki"]
    missing = tmp_path / "nowhere" / "state.db"
    assert unretired_entries(f"sqlite:///{missing}") == [] and not missing.parent.exists()


def test_bases_shows_a_candidate_whose_run_is_in_progress_as_no_shadow(state: StateStore, tmp_path: Path) -> None:
    """A ready version that never served is a shadow in `kb-reindex bases` only once its run has ended (a migration
    kept it): while its run validates or promotes, it is that run's candidate; and a first run in progress says so."""
    from kb_reindex.run.bases import summary
    from kb_reindex.services.registry import KnowledgeBase

    kb = KnowledgeBase(alias="kb", registry=tmp_path / "registry.yaml", schedule=None,
                       env={"KB_ALIAS": "kb", "KB_QDRANT_PATH": str(tmp_path / "q"), "KB_PROJECT_ROOT": str(tmp_path)})
    columns = dict(kind="reindex", embedder="hashing", embed_model="m", embed_dim=8, distance="Cosine",
                   chunking_version="c", corpus_fingerprint="f", status="ready")
    state.start_run(run_id="building", alias="kb", kind="reindex", trigger="airflow")
    state.insert_version(alias="kb", version=1, collection="kb__m__v1", run_id="building", **columns)
    candidate = summary(state, kb)
    assert candidate.shadows == () and candidate.problems == ("no version serves yet: its first run (building) is "
                                                              "in progress",)
    state.finish_run("building", outcome="shadow")
    assert summary(state, kb).shadows == (1,)


def test_kept_query_vectors_and_screen_scores_round_trip_exactly_and_a_race_keeps_the_first(state: StateStore) -> None:
    """On SQLite, MariaDB and PostgreSQL: a 1024-d float64 vector comes back bit for bit (validation's ranks with
    it are the first validation's), scores come back, and a second writer of the same rows changes nothing."""
    import random

    vector = [random.Random(7).uniform(-1, 1) for _ in range(1024)]
    state.remember_query_vectors("hashing/m/8", {"a" * 64: vector})
    state.remember_query_vectors("hashing/m/8", {"a" * 64: [0.0] * 1024, "b" * 64: [1.0] * 1024})  # a's kept
    kept = state.recall_query_vectors("hashing/m/8", ["a" * 64, "b" * 64, "c" * 64])
    assert kept == {"a" * 64: vector, "b" * 64: [1.0] * 1024}
    assert state.recall_query_vectors("other/profile/8", ["a" * 64]) == {}
    state.remember_scores("clf", {"d" * 64: 0.25})
    state.remember_scores("clf", {"d" * 64: 0.9, "e" * 64: 0.5})
    assert state.recall_scores("clf", ["d" * 64, "e" * 64]) == {"d" * 64: 0.25, "e" * 64: 0.5}


def test_a_retirement_is_recorded_once_dropped_undone_and_kept_as_history(state: StateStore) -> None:
    """`kb-reindex retire`'s record: one in force per alias (a second keeps the first), its drop stamped once,
    its undo kept; a state DB made before the table gains it when a state-only command retires."""
    from kb_reindex.services.state.schema import retirements

    with state.engine.begin() as conn:  # as a state DB made before retirements
        retirements.drop(conn, checkfirst=True)
    old = StateStore(state.url, create=False)
    try:
        assert old.retirement("wiki") is None and old.retired_aliases() == {} and old.undo_retirement("wiki", by="x") is None
        first, recorded = old.retire("wiki", reason=" merged ", by="alice@host")
    finally:
        old.dispose()
    assert recorded and (first.reason, first.retired_by, first.dropped_at) == ("merged", "alice@host", None)
    again, recorded = state.retire("wiki", reason="other", by="bob@host")
    assert not recorded and again == first
    assert list(state.retired_aliases()) == ["wiki"] and state.retirement("shop") is None
    dropped = state.mark_retirement_dropped("wiki", by="bob@host")
    assert dropped is not None and dropped.dropped_by == "bob@host" and dropped.dropped_at is not None
    assert state.mark_retirement_dropped("wiki", by="carol@host") == dropped, "the first drop is kept"
    assert state.undo_retirement("wiki", by="alice@host") == dropped and state.retirement("wiki") is None
    assert [e.action for e in state.retirement_events("wiki")] == ["retire", "drop-collections", "unretire"]
    with pytest.raises(ConfigError, match="a retirement needs a reason"):
        state.retire("wiki", reason=" ", by="alice@host")


def test_a_snapshot_written_by_the_release_before_reuse_kept_reads_read_only_and_as_not_reusing(state: StateStore) -> None:
    """A state DB of the release before `kb_snapshots.reuse_kept`: a read-only command (`status`, `plan`, the
    page) reads its snapshots without a write having added the column first, and such a snapshot builds as that
    release did: taking nothing from the vectors the profile keeps."""
    v = new_version(state)
    state.finish_snapshot(v.id, run_id=None, chunks_to_embed=3, flagged=[])
    url = state.url
    with state.engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE kb_snapshots DROP COLUMN reuse_kept"))
    state.dispose()
    reader = StateStore(url, create=False)
    snapshot = reader.snapshot(v.id)
    assert snapshot is not None and snapshot.reuse_kept is False and snapshot.chunks_to_embed == 3
    reader.dispose()
