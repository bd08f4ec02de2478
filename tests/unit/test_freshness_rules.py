"""The freshness watcher's coalescing (kb_reindex.domain.freshness): a burst is one change, fired once quiet and
never while a run is in progress; the source compared with what the last plan recorded."""

from __future__ import annotations

from types import SimpleNamespace

from kb_reindex.domain.freshness import (FEED_MAX_NAMES, ListedFile, Listing, SourceWatch, changed_sources,
                                         differs_from_recorded, merged_feed, stat_key)


def listing(*files: tuple[str, int, int]) -> Listing:
    return Listing(tuple(sorted(ListedFile(*f) for f in files)))


A = listing(("a.md", 10, 1))
B = listing(("a.md", 11, 2))
C = listing(("a.md", 11, 2), ("b.md", 5, 3))


def test_a_burst_of_changes_fires_once_after_the_quiet_time() -> None:
    watch = SourceWatch(quiet_s=5)
    watch.start(A, differs_from_plan=False, now=0)
    assert not watch.due(now=100, run_active=False)  # unchanged since the last plan: nothing to do
    assert watch.observe(B, now=10)
    assert not watch.due(now=12, run_active=False)  # not quiet yet
    assert watch.observe(C, now=13)  # another save restarts the quiet time
    assert not watch.observe(C, now=16)
    assert not watch.due(now=17, run_active=False)
    assert watch.due(now=18, run_active=False)
    watch.fired(now=18)
    assert not watch.due(now=60, run_active=False) and watch.fired_count == 1


def test_a_change_during_a_run_waits_for_it_and_fires_once() -> None:
    watch = SourceWatch(quiet_s=5)
    watch.start(A, differs_from_plan=False, now=0)
    watch.observe(B, now=1)
    watch.observe(C, now=2)
    assert not watch.due(now=30, run_active=True)
    assert watch.due(now=31, run_active=False)
    watch.fired(now=31)
    assert not watch.due(now=32, run_active=False)


def test_at_its_start_a_source_that_differs_from_the_last_plan_fires() -> None:
    fresh = SourceWatch(quiet_s=5)
    fresh.start(A, differs_from_plan=True, now=0)
    assert not fresh.due(now=4, run_active=False) and fresh.due(now=5, run_active=False)


def test_an_event_no_plan_followed_fires_again_later_and_less_often_until_a_plan_reads_it() -> None:
    """The DAG was paused while its watcher still ran: the event fired and no run came. The watcher looks again
    REFIRE_AFTER_S later, fires again while no plan read the source as it is (twice as late each time, up to
    REFIRE_MAX_S), and stops looking once one did."""
    from kb_reindex.domain.freshness import REFIRE_AFTER_S, REFIRE_MAX_S

    watch = SourceWatch(quiet_s=5)
    watch.start(A, differs_from_plan=False, now=0)
    watch.observe(B, now=1)
    assert watch.due(now=6, run_active=False)
    watch.fired(now=6)
    assert not watch.recheck_due(now=6 + REFIRE_AFTER_S - 1)
    assert watch.recheck_due(now=6 + REFIRE_AFTER_S)
    watch.rechecked(differs_from_plan=True, now=6 + REFIRE_AFTER_S)  # nobody planned it: it waits again
    assert watch.due(now=6 + REFIRE_AFTER_S, run_active=False) and not watch.recheck_due(now=10_000)
    assert not watch.due(now=6 + REFIRE_AFTER_S, run_active=True)  # never while a run is in progress
    watch.fired(now=400)
    assert not watch.recheck_due(now=400 + REFIRE_AFTER_S) and watch.recheck_due(now=400 + 2 * REFIRE_AFTER_S)
    for _ in range(10):
        watch.rechecked(differs_from_plan=True, now=0)
    assert watch.refire_after_s == REFIRE_MAX_S
    watch.fired(now=9_000)
    watch.rechecked(differs_from_plan=False, now=9_000 + REFIRE_MAX_S)  # a plan read it: nothing waits
    assert not watch.recheck_due(now=1e9) and not watch.due(now=1e9, run_active=False)
    watch.observe(C, now=20_000)
    watch.fired(now=20_010)
    assert watch.refire_after_s == REFIRE_AFTER_S  # a new change starts from the first interval again


def test_looks_come_faster_while_a_change_waits() -> None:
    watch = SourceWatch(quiet_s=5)
    watch.start(A, differs_from_plan=False, now=0)
    assert watch.next_look_s(15) == 15
    watch.observe(B, now=1)
    assert watch.next_look_s(15) == 5


def test_differs_from_recorded_names_added_removed_and_touched_files() -> None:
    recorded = {"a.md": (11, 2, None), "b.md": (5, 3, None)}
    assert not differs_from_recorded(C, recorded)
    assert differs_from_recorded(B, recorded)  # b.md removed
    assert differs_from_recorded(listing(("a.md", 11, 2), ("b.md", 5, 4)), recorded)  # b.md touched
    assert differs_from_recorded(listing(("a.md", 11, 2), ("c.md", 5, 3)), recorded)  # renamed
    assert differs_from_recorded(A, {})  # nothing recorded: a fresh install
    assert differs_from_recorded(listing(("a.md", 11, 2, "e2"), ("b.md", 5, 3)), recorded)  # another ETag


def test_the_digest_changes_with_any_field() -> None:
    assert len({A.digest, B.digest, C.digest, listing(("a.md", 10, 2)).digest}) == 4
    assert A.digest == listing(("a.md", 10, 1)).digest


def test_the_change_feed_names_what_was_added_changed_or_removed_since_the_last_plan() -> None:
    recorded = {"a.md": (10, 1, None), "b.md": (5, 3, None), "gone.md": (1, 1, None)}
    now = listing(("a.md", 10, 1), ("b.md", 6, 4), ("new.md", 2, 5))
    assert changed_sources(now, recorded) == ("b.md", "gone.md", "new.md")
    assert changed_sources(listing(("a.md", 10, 1), ("b.md", 5, 3), ("gone.md", 1, 1)), recorded) == ()
    # an object's ETag alone tells an edit of the same size in the same second
    assert changed_sources(Listing((ListedFile("a.md", 10, 1, "e2"),)), {"a.md": (10, 1, "e1")}) == ("a.md",)


def test_no_feed_when_the_run_must_list_the_source_itself() -> None:
    recorded = {"a.md": (10, 1, None)}
    assert changed_sources(listing(("a.md", 10, 1)), {}) is None  # nothing recorded: a first plan
    problem = Listing((ListedFile("a.md", 10, 1), ListedFile("x.md: is a link to /etc; refused", -1, 0)))
    assert changed_sources(problem, recorded) is None  # only a listing names a refused link
    many = listing(*((f"{i}.md", 1, 1) for i in range(FEED_MAX_NAMES + 1)))
    assert changed_sources(many, recorded) is None
    assert len(changed_sources(listing(*((f"{i}.md", 1, 1) for i in range(FEED_MAX_NAMES - 1))), recorded)) == FEED_MAX_NAMES


def test_a_run_started_by_several_events_is_fed_their_names_together_or_lists() -> None:
    from kb_reindex.airflow.tasks import change_feed_of

    def event(payload: object) -> SimpleNamespace:
        return SimpleNamespace(extra={"from_trigger": True, "payload": payload})

    assert merged_feed([["b.md"], ["a.md", "b.md"]]) == ("a.md", "b.md")
    assert merged_feed([]) is None  # a run on its time schedule or by hand
    assert merged_feed([["a.md"], None]) is None  # one event without a feed
    assert merged_feed([["a.md"], "a.md"]) is None  # not a list of names: not guessed at
    assert merged_feed([[str(i)] for i in range(FEED_MAX_NAMES + 1)]) is None
    source = object()
    assert change_feed_of({source: [event({"changed": ["b.md"]}), event({"changed": ["a.md"]})]}) == ("a.md", "b.md")
    assert change_feed_of({source: [event({"changed": ["a.md"]}), SimpleNamespace(extra={})]}) is None
    assert change_feed_of({source: [event({"changed": ["a.md"]}), event("a.md")]}) is None  # posted by hand
    assert change_feed_of(None) is None


def test_an_objects_record_in_milliseconds_is_the_same_as_its_listing_in_seconds() -> None:
    """A record made before object times were kept in whole seconds (MinIO's listing) does not fire the watcher,
    nor make a plan read the object again, after the upgrade; a file's time counts to the nanosecond."""
    recorded = {"a.md": stat_key(10, 1_250_000_000, "e1"), "b.md": stat_key(5, 1_250_000_000, None)}
    now = Listing((ListedFile("a.md", 10, 1_000_000_000, "e1"), ListedFile("b.md", 5, 1_000_000_000)))
    assert changed_sources(now, recorded) == ("b.md",)
