"""A routine edit's plan reads the files it touched, not the folder: live's unchanged documents are taken as its
manifest holds them (`corpus.KnownFiles`), and the plan is the one a scan reading every file makes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from conftest import settings_for
from kb_reindex.run.pipeline import run_reindex
from kb_reindex.services.config import Settings
from kb_reindex.services.runtime import open_deps
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
        patched.setattr(plan_step, "known_files", lambda *_args: None)
        every = prepare(deps)
    return known, every


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
    assert known.scan.documents == every.scan.documents and known.scan.fingerprint == every.scan.fingerprint
    assert known.plan == every.plan and known.plan.docs.changed == 1
    with open_deps(settings) as deps:
        result = run_reindex(deps)
        assert result.outcome == "promoted"
        # the version built from the known documents holds what a full read gives: every chunk of every file
        assert result.chunks.total == every.plan.chunks.total


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
