"""A change feed (the names a watcher saw change since the last plan read the source, or `run --changed`): the
plan looks at those files and takes every other one as the last plan recorded it, listing nothing
(`corpus.feed_listing`); it plans exactly what a listing plans. A change it does not name waits for the next
feed or listing, and a feed that cannot be taken alone (nothing recorded, a folder, a link, a name out of the
folder) is set aside for a listing. The bucket's case is in test_s3_source.py, the trigger's in
test_freshness_watch.py, Airflow's in test_freshness_airflow.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import settings_for, write_doc
from kb_reindex.run.follow import change_feed, look
from kb_reindex.run.pipeline import run_reindex
from kb_reindex.services import corpus, sources
from kb_reindex.services.config import Settings
from kb_reindex.services.runtime import open_deps, open_source
from kb_reindex.services.state.store import StateStore
from kb_reindex.steps import plan as plan_module
from kb_reindex.steps.plan import prepare
from test_known_files import built_with_aged_files


class Listings:
    """Counts the listings of the source (`sources.list_source`, wherever it is called from)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = sources.list_source

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        for module in (plan_module, corpus, sources):
            monkeypatch.setattr(module, "list_source", counted)


def feed(settings: Settings) -> tuple[str, ...] | None:
    """What the watcher's event would carry now."""
    state = StateStore(settings.state_url)
    try:
        source = open_source(settings)
        return change_feed(state, settings, source, look(source))
    finally:
        state.dispose()


def test_a_fed_edit_lists_nothing_and_plans_what_a_listing_plans(project: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    settings, files = built_with_aged_files(project)
    edited = files[2]
    edited.write_text(edited.read_text(encoding="utf-8") + "\n\n补充：本条今日更新。\n", encoding="utf-8")
    name = edited.relative_to(settings.knowledge_dir).as_posix()
    assert feed(settings) == (name,)
    with open_deps(settings) as deps:
        listed = prepare(deps).plan
    listings = Listings(monkeypatch)
    with open_deps(settings) as deps:
        fed = prepare(deps, changed=(name,)).plan
    assert listings.count == 0
    assert (fed.fingerprint, fed.docs, fed.chunks) == (listed.fingerprint, listed.docs, listed.chunks)
    assert fed.docs.changed == 1 and fed.chunks.embedded >= 1

    with open_deps(settings) as deps:
        result = run_reindex(deps, changed=(name,))
    assert result.outcome == "promoted" and result.docs.changed == 1, result
    assert listings.count == 0
    assert feed(settings) == ()  # (the watcher's listing)
    listings.count = 0

    # a page added, then removed, each named alone
    added = write_doc(project, "holiday-notice", "# 节假日公告\n\n春节期间客服在线时间为每天九点到十八点。\n")
    added_name = added.relative_to(settings.knowledge_dir).as_posix()
    with open_deps(settings) as deps:
        result = run_reindex(deps, changed=(added_name,))
    assert result.outcome == "promoted" and result.docs.added == 1, result
    added.unlink()
    with open_deps(settings) as deps:
        result = run_reindex(deps, changed=(added_name,))
    assert result.outcome == "promoted" and result.docs.removed == 1, result
    assert listings.count == 0
    with open_deps(settings) as deps:  # and a listing finds the version as the feed left it: nothing to do
        assert prepare(deps).plan.no_change


def test_a_change_the_feed_does_not_name_waits_for_the_next_feed(project: Path) -> None:
    settings, files = built_with_aged_files(project)
    named, unnamed = files[0], files[3]
    unnamed.write_text(unnamed.read_text(encoding="utf-8") + "\n\n补充：运费险以保单为准。\n", encoding="utf-8")
    with open_deps(settings) as deps:  # told that only `named` changed, which it did not
        result = run_reindex(deps, changed=(named.relative_to(settings.knowledge_dir).as_posix(),))
    assert result.outcome == "no_change", result
    # the watcher compares its listing with what plans recorded: the unnamed change is its next event's feed
    name = unnamed.relative_to(settings.knowledge_dir).as_posix()
    assert feed(settings) == (name,)
    with open_deps(settings) as deps:
        result = run_reindex(deps, changed=(name,))
    assert result.outcome == "promoted" and result.docs.changed == 1, result
    assert feed(settings) == ()


def test_a_feed_that_cannot_be_taken_alone_is_set_aside_for_a_listing(project: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_for(project)
    listings = Listings(monkeypatch)
    with open_deps(settings) as deps:  # nothing recorded yet: a first plan lists
        assert run_reindex(deps, changed=("coupon-rules.md",)).outcome == "promoted"
    assert listings.count == 1
    docs = settings.knowledge_dir
    (docs / "faq").mkdir()
    (docs / "faq" / "points.md").write_text("# 积分\n\n积分有效期两年。\n", encoding="utf-8")
    os.symlink(docs / "payment-guide.md", docs / "pay-link.md")
    for changed, why in ((("faq",), "a folder"), (("pay-link.md",), "a link"),
                         (("../golden.yaml",), "out of the folder"), (("/etc/passwd",), "absolute"),
                         (("knowledge/docs/coupon-rules.md",), "a name neither there nor recorded")):
        with open_deps(settings) as deps:
            planned = prepare(deps, changed=changed).plan
        assert listings.count == 2, why
        listings.count = 1
        # the listing finds both new documents, whatever the feed named
        assert planned.docs.added == 2, (why, planned.docs)
    # names that are no documents (hidden, not Markdown) are nothing to look at (and the two documents added
    # above, not named, wait for a feed that names them or a listing)
    with open_deps(settings) as deps:
        planned = prepare(deps, changed=(".draft.md", "notes.txt", "sub/.hidden/x.md")).plan
    assert listings.count == 1 and planned.no_change


def test_a_document_taken_from_the_record_and_read_after_all_is_recorded_with_its_stat_now(project: Path) -> None:
    """A file the feed did not name but the plan must read (modified within the trust margin of its recording)
    is looked at again first: the record pairs what was read with the stat before the reading, never with the
    record's older stat (which a later plan would trust if the file came back to it)."""
    settings, files = built_with_aged_files(project)
    named, unnamed = files[0], files[4]
    name = unnamed.relative_to(settings.knowledge_dir).as_posix()
    unnamed.write_text(unnamed.read_text(encoding="utf-8") + "\n\n补充：第一次修改。\n", encoding="utf-8")
    with open_deps(settings) as deps:  # recorded just after it was written: within the margin, read again next time
        assert run_reindex(deps, changed=(name,)).outcome == "promoted"
    unnamed.write_text(unnamed.read_text(encoding="utf-8") + "补充：第二次修改，长一些。\n", encoding="utf-8")
    with open_deps(settings) as deps:
        result = run_reindex(deps, changed=(named.relative_to(settings.knowledge_dir).as_posix(),))
    assert result.outcome == "promoted" and result.docs.changed == 1, result  # read after all: the change is in
    state = StateStore(settings.state_url)
    try:
        from kb_reindex.services.corpus import cache_root

        entry = state.file_hashes(cache_root(settings.knowledge_dir))[name]
    finally:
        state.dispose()
    now = unnamed.stat()
    assert (entry.size, entry.mtime_ns) == (now.st_size, now.st_mtime_ns)


def test_a_removed_folder_or_a_renamed_spelling_named_by_hand_lists_the_source(project: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_for(project)
    docs = settings.knowledge_dir
    (docs / "faq").mkdir()
    (docs / "faq" / "points.md").write_text("# 积分\n\n积分有效期两年。\n", encoding="utf-8")
    with open_deps(settings) as deps:
        assert run_reindex(deps).outcome == "promoted"
    listings = Listings(monkeypatch)
    (docs / "faq" / "points.md").unlink()
    (docs / "faq").rmdir()
    with open_deps(settings) as deps:  # `run --changed faq` after `rm -r faq`: its documents must go
        result = run_reindex(deps, changed=("faq",))
    assert listings.count == 1 and result.outcome == "promoted" and result.docs.removed == 1, result
    # a new spelling of a recorded name (a case-insensitive filesystem finds both): a listing settles it, here
    # by naming the two files whose keys collide
    (docs / "Coupon-Rules.md").write_text("# 优惠券\n\n优惠券不可叠加。\n", encoding="utf-8")
    with open_deps(settings) as deps:
        with pytest.raises(Exception, match="map to the same knowledge_key"):
            prepare(deps, changed=("Coupon-Rules.md",))
    assert listings.count == 2
