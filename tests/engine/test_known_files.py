"""A routine edit's plan reads the files it touched, not the folder: live's unchanged documents are taken as its
manifest holds them (`corpus.KnownFiles`), and the plan is the one a scan reading every file makes."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from conftest import settings_for
from kb_reindex.run.pipeline import run_reindex
from kb_reindex.services.config import Settings
from kb_reindex.services.corpus import CorpusScan, KnownDocument
from kb_reindex.services.runtime import open_deps
from kb_reindex.services.state.schema import doc_chunks, manifest_documents
from kb_reindex.services.state.store import StateStore
from kb_reindex.steps import plan as plan_step
from kb_reindex.steps.plan import prepare


def age_files(settings: Settings, seconds: float = 3600) -> None:
    """Every knowledge file written an hour ago: older than the trust margin of the recorded file hashes."""
    then = time.time() - seconds
    for path in settings.knowledge_dir.rglob("*.md"):
        os.utime(path, (then, then))


def plan_both_ways(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> tuple[plan_step.Prepared, plan_step.Prepared]:
    with open_deps(settings) as deps:
        known = prepare(deps)
    with monkeypatch.context() as patched, open_deps(settings) as deps:
        patched.setattr(plan_step, "known_files", lambda *_args, **_kwargs: None)
        every = prepare(deps)
    return known, every


def counted(scan: CorpusScan) -> list[tuple[object, ...]]:
    return [(d.info, d.chunk_count, d.flagged) for d in scan.documents]


def built_with_aged_files(project: Path) -> tuple[Settings, list[Path]]:
    """The project's first version built from files written an hour ago; its settings and files."""
    settings = settings_for(project)
    age_files(settings)
    with open_deps(settings) as deps:
        assert run_reindex(deps).outcome == "promoted"
    return settings, sorted(settings.knowledge_dir.rglob("*.md"))


def test_an_edit_plan_reads_only_the_edited_file_and_plans_as_a_full_read(project: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    settings, files = built_with_aged_files(project)
    edited = files[len(files) // 2]
    edited.write_text(edited.read_text(encoding="utf-8") + "\n\n补充：本条今日更新。\n", encoding="utf-8")
    known, every = plan_both_ways(settings, monkeypatch)
    assert known.scan is not None and every.scan is not None
    assert (known.scan.read, every.scan.read) == (1, len(files))
    # the unread documents carry live's facts, chunk counts and flagged lines, not their chunk rows
    assert counted(known.scan) == counted(every.scan) and known.scan.fingerprint == every.scan.fingerprint
    assert [type(d) for d in known.scan.documents].count(KnownDocument) == len(files) - 1
    assert known.plan == every.plan and known.plan.docs.changed == 1
    copied: list[bool] = []
    write_from = StateStore.write_manifest_from
    monkeypatch.setattr(StateStore, "write_manifest_from",
                        lambda self, *a, **k: copied.append(write_from(self, *a, **k)) or copied[-1])
    with open_deps(settings) as deps:
        live = deps.state.live_version(settings.alias)
        result = run_reindex(deps)
        assert result.outcome == "promoted"
        # the version built from the known documents holds what a full read gives: every chunk of every file
        assert result.chunks.total == every.plan.chunks.total
        # its manifest: the unchanged documents' rows copied from live's inside the database, the edited one's
        # written; in manifest order at positions 0..N-1, each reused chunk's vector source a point of live's
        assert copied == [True]
        version = deps.state.get_version(settings.alias, result.version)
        rows = deps.state.manifest_chunks(version.id)
        assert deps.state.slice_rows(version.id) == rows
        assert [r.point_id for r in rows] == [c.point_id for c in every.scan.read_chunks()]
        live_points = {r.point_id: r for r in deps.state.manifest_chunks(live.id)}
        edited_key = next(d.info.knowledge_key for d in every.scan.documents if d.info.source.endswith(edited.name))
        for r in rows:
            if r.knowledge_key != edited_key:
                assert r.source_point_id == r.point_id and r.point_id in live_points, r
            elif r.source_point_id is not None:
                assert live_points[r.source_point_id].chunk_hash == r.chunk_hash, r


def test_a_file_rewritten_to_other_bytes_or_a_changed_screen_is_read_again(project: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    settings, files = built_with_aged_files(project)
    # the same size and an old mtime, but written after the hashes were recorded: not trusted (its mtime moved)
    first = files[0]
    text = first.read_text(encoding="utf-8")
    first.write_text(text.replace("。", "，", 1) if "。" in text else text + " ", encoding="utf-8")
    age_files(settings, seconds=1800)  # every file's mtime differs from the recorded one now
    known, every = plan_both_ways(settings, monkeypatch)
    assert known.scan is not None and known.scan.read == len(files)
    assert known.plan == every.plan
    # another screen than the one that judged live: its flags are not carried, so every file is read and judged
    with open_deps(settings_for(project, KB_INSTRUCTION_SCREEN="patterns")) as deps:
        if deps.settings.instruction_screen == settings.instruction_screen:
            pytest.skip("the default screen is already the patterns")
        other = prepare(deps)
    assert other.scan is not None and other.scan.read == len(files)


def test_an_edit_plan_records_the_hash_of_the_file_it_read_and_forgets_a_file_gone(project: Path) -> None:
    """The file hash cache is written by difference: an edit's plan adds the edited file's row and drops a
    deleted file's, and every other recorded row is left as it was (a full read writes them all)."""
    from kb_reindex.services.corpus import cache_root

    extra = settings_for(project).knowledge_dir / "extra-note.md"
    extra.write_text("# 附注\n\n本页只为本测试而设。\n", encoding="utf-8")
    settings, files = built_with_aged_files(project)
    edited, removed = files[1], extra
    edited.write_text(edited.read_text(encoding="utf-8") + "\n\n补充：本条今日更新。\n", encoding="utf-8")
    removed.unlink()
    with open_deps(settings) as deps:
        root = cache_root(deps.knowledge, settings.default_tenant)
        before = deps.state.file_hashes(root)
        calls: list[tuple[set[str], bool, set[str]]] = []
        real = deps.state.record_file_hashes

        def record(root: str, entries: dict, *, replace_all: bool, forget: object = ()) -> None:
            calls.append((set(entries), replace_all, set(forget)))  # type: ignore[call-overload]
            real(root, entries, replace_all=replace_all, forget=forget)  # type: ignore[arg-type]

        deps.state.record_file_hashes = record  # type: ignore[method-assign]
        prepare(deps, record=True)
        after = deps.state.file_hashes(root)
    edited_source = edited.relative_to(settings.knowledge_dir).as_posix()
    removed_source = removed.relative_to(settings.knowledge_dir).as_posix()
    assert calls == [({edited_source}, False, {removed_source})]
    assert set(after) == set(before) - {removed_source}
    assert after[edited_source] != before[edited_source]
    assert all(after[s] == before[s] for s in after if s != edited_source)


def test_a_base_whose_rows_are_not_where_its_counts_say_is_read_for_the_known_documents(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy inside the database refused (a base written before positions): the known documents' rows are
    read from live's manifest by key and the manifest written whole, the same rows the copy would give."""
    settings, files = built_with_aged_files(project)
    edited = files[0]
    edited.write_text(edited.read_text(encoding="utf-8") + "\n\n补充：本条今日更新。\n", encoding="utf-8")
    _known, every = plan_both_ways(settings, monkeypatch)
    assert every.scan is not None
    monkeypatch.setattr(StateStore, "write_manifest_from", lambda *_a, **_k: False)
    with open_deps(settings) as deps:
        live = deps.state.live_version(settings.alias)
        assert live is not None
        live_rows = {r.point_id for r in deps.state.manifest_chunks(live.id)}
        result = run_reindex(deps)
        assert result.outcome == "promoted"
        rows = deps.state.manifest_chunks(deps.state.get_version(settings.alias, result.version).id)
    assert [r.point_id for r in rows] == [c.point_id for c in every.scan.read_chunks()]
    edited_key = next(d.info.knowledge_key for d in every.scan.documents if d.info.source.endswith(edited.name))
    kept = [r for r in rows if r.knowledge_key != edited_key]
    assert kept and all(r.source_point_id == r.point_id and r.point_id in live_rows for r in kept)


def test_a_known_document_missing_rows_in_live_stops_the_plan_by_name_and_live_serves(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Live's manifest lacks a row its document counts: the copy finds it short, the whole write finds it short,
    and the run stops naming the file (no manifest is written on a guess); live still serves."""
    settings, files = built_with_aged_files(project)
    edited, damaged = files[0], files[-1]
    edited.write_text(edited.read_text(encoding="utf-8") + "\n\n补充：本条今日更新。\n", encoding="utf-8")
    damaged_source = damaged.relative_to(settings.knowledge_dir).as_posix()
    with open_deps(settings) as deps:
        live = deps.state.live_version(settings.alias)
        assert live is not None
        doc = next(d for d in deps.state.manifest_documents(live.id) if d.source == damaged_source)
        with deps.state.engine.begin() as conn:  # a chunk row of the revision live's document names, lost
            rev_id = conn.execute(sa.select(manifest_documents.c.rev_id).where(
                manifest_documents.c.version_id == live.id,
                manifest_documents.c.knowledge_key == doc.knowledge_key)).scalar_one()
            conn.execute(doc_chunks.delete().where(doc_chunks.c.rev_id == rev_id, doc_chunks.c.ordinal == 0))
        result = run_reindex(deps)
        assert result.outcome == "failed" and result.error is not None
        assert re.search(rf"{doc.chunk_count - 1} chunk rows of {damaged_source}.*--force-full", result.error)
        assert deps.store.alias_target(settings.alias) == live.collection
        assert deps.state.live_version(settings.alias).version == live.version  # type: ignore[union-attr]


def test_an_edit_plan_reads_live_documents_not_its_chunk_rows(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan of a one-file edit asks the state DB for none of live's chunk rows wholesale: the unchanged
    documents come as live's documents hold them (counts), and only the edited file's chunk hashes are looked up."""
    settings, files = built_with_aged_files(project)
    edited = files[len(files) // 2]
    edited.write_text(edited.read_text(encoding="utf-8") + "\n\n补充：本条今日更新。\n", encoding="utf-8")
    wholesale: list[str] = []
    looked_up: list[int] = []
    for name in ("manifest_chunks", "iter_manifest_refs", "slice_rows", "manifest_refs"):
        real = getattr(StateStore, name)
        monkeypatch.setattr(StateStore, name, lambda self, *a, _n=name, _r=real, **k: wholesale.append(_n) or _r(self, *a, **k))
    by_hash = StateStore.chunks_by_hash
    monkeypatch.setattr(StateStore, "chunks_by_hash",
                        lambda self, versions, hashes: looked_up.append(len(set(hashes))) or by_hash(self, versions, hashes))
    with open_deps(settings) as deps:
        prepared = prepare(deps)
    assert prepared.scan is not None and prepared.scan.read == 1 and prepared.plan.docs.changed == 1
    assert wholesale == []
    assert looked_up == [len({c.chunk_hash for c in prepared.scan.read_chunks()})]
    assert [d.info.source for d in prepared.scan.read_documents()] == [
        edited.relative_to(settings.knowledge_dir).as_posix()]
