"""When a watched knowledge source's changes become a run: the listing it is watched by, and the quiet-time
coalescing that Airflow's trigger (`kb_reindex.airflow.triggers`) and `kb-reindex run --follow` both apply.

A watcher looks at the source's listing (names, sizes, modification times; never a file's content) every poll.
A listing that differs from the last one it looked at is a change; the change fires once the listing has stayed
the same for the quiet time (a burst of saves is one change), and not while a run of the knowledge base is in
progress (edits landing during a build give one follow-up run, which sees them all). At its start a watcher
fires once if the source differs from what the last plan read (the recorded file hashes): edits made while
nothing watched are caught, a fresh install builds its first version, and a held, frozen or failed run is not
retried until the source changes again. An event no plan followed (fired while the DAG was paused, before
Airflow stopped its watcher) fires again `REFIRE_AFTER_S` later, then at doubling intervals until a plan reads
the source as it is.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class ListedFile:
    """A document as the listing shows it, before anything is read."""

    #: the name under the folder or prefix, POSIX separators: `faq/退货.md`
    source: str
    size: int
    mtime_ns: int
    #: the object store's ETag (changes with every write of other content); None for a file
    etag: str | None = None


@dataclass(frozen=True)
class Listing:
    """A source's Markdown files in path order."""

    files: tuple[ListedFile, ...]

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.source}\x00{f.size}\x00{f.mtime_ns}\x00{f.etag or ''}\n".encode())
        return h.hexdigest()

    @property
    def newest_ns(self) -> int:
        return max((f.mtime_ns for f in self.files), default=0)


#: seconds after an event fires before its watcher looks whether a plan read the change (and fires again if not)
REFIRE_AFTER_S = 300.0
#: the longest wait between two such looks while no plan reads the change (a paused DAG)
REFIRE_MAX_S = 3600.0


@dataclass
class SourceWatch:
    """The coalescing of one watcher (monotonic seconds in, decisions out; nothing of I/O).

    `observe` every listing; `due` says when to fire; `fired` after firing."""

    quiet_s: float
    seen: str | None = None  #: digest of the listing looked at last
    pending: bool = False  #: a change seen and not fired yet
    changed_at: float = 0.0  #: when the latest change was seen
    fired_count: int = 0
    #: when the last event fired, while no plan is known to have read what it fired for (None: nothing waits)
    unplanned_since: float | None = None
    #: seconds after a firing to look whether a plan read it; doubles with each firing again, up to REFIRE_MAX_S
    refire_after_s: float = 0.0

    def start(self, listing: Listing, *, differs_from_plan: bool, now: float) -> None:
        """The first look: a source that differs from what the last plan read is a change."""
        self.seen, self.pending, self.changed_at = listing.digest, differs_from_plan, now

    def observe(self, listing: Listing, *, now: float) -> bool:
        """Take a listing; True when it differs from the last one (a change, quiet time restarts)."""
        if listing.digest == self.seen:
            return False
        self.seen, self.pending, self.changed_at = listing.digest, True, now
        return True

    def quiet(self, *, now: float) -> bool:
        return self.pending and now - self.changed_at >= self.quiet_s

    def due(self, *, now: float, run_active: bool) -> bool:
        """Fire now: a change, quiet for `quiet_s`, and no run in progress (it would not see all of it)."""
        return self.quiet(now=now) and not run_active

    def fired(self, *, now: float) -> None:
        self.pending = False
        self.fired_count += 1
        self.unplanned_since = now
        self.refire_after_s = self.refire_after_s or REFIRE_AFTER_S

    def recheck_due(self, *, now: float) -> bool:
        """Time to look whether a plan read what the last event fired for: an event can be lost (it came while
        the knowledge base's DAG was paused, and its watcher not yet stopped), and nothing would fire again
        until the next edit."""
        return (not self.pending and self.unplanned_since is not None
                and now - self.unplanned_since >= self.refire_after_s)

    def rechecked(self, *, differs_from_plan: bool, now: float) -> None:
        """What the recheck found: a plan read the source as it is (done), or none did (the change waits again,
        due at once, and the next recheck comes twice as late: a DAG paused for long is not flooded)."""
        if not differs_from_plan:
            self.unplanned_since, self.refire_after_s = None, 0.0
            return
        self.pending, self.changed_at = True, now - self.quiet_s
        self.refire_after_s = min(self.refire_after_s * 2, REFIRE_MAX_S)

    def next_look_s(self, poll_s: float) -> float:
        """Seconds until the next look: the poll interval, or the quiet time while a change waits."""
        return min(poll_s, max(self.quiet_s, 0.5)) if self.pending else poll_s


def stat_key(size: int, mtime_ns: int, etag: str | None) -> tuple[int, int, str | None]:
    """What tells a listed document from its record: size, modification time and ETag, an object's time (one
    with an ETag) in whole seconds (a HEAD answers in seconds where some servers' listings give milliseconds;
    the ETag tells content apart)."""
    return (size, mtime_ns - mtime_ns % 1_000_000_000 if etag is not None else mtime_ns, etag)


def differs_from_recorded(listing: Listing, recorded: dict[str, tuple[int, int, str | None]]) -> bool:
    """True when the listing is not the one the last plan read: a file added, removed, or with another size,
    modification time or ETag than its recorded hash was taken at (`recorded`: source -> its `stat_key`)."""
    if len(recorded) != len(listing.files):
        return True
    return any(recorded.get(f.source) != stat_key(f.size, f.mtime_ns, f.etag) for f in listing.files)


#: the most names a change feed carries; a larger change is listed in full by the run (a feed is for edits)
FEED_MAX_NAMES = 500


def changed_sources(listing: Listing, recorded: dict[str, tuple[int, int, str | None]]) -> tuple[str, ...] | None:
    """The change feed of a listing: the names that differ from what the last plan read (added, removed, or
    with another size, modification time or ETag), sorted. None when the listing holds a problem (a refused
    link, a source that cannot be listed: only a full listing names it), nothing recorded (a first plan), or more
    than `FEED_MAX_NAMES` names: the run then lists everything itself."""
    if not recorded or any(f.size < 0 for f in listing.files):  # nothing recorded: every file is new
        return None
    names = {f.source for f in listing.files if recorded.get(f.source) != stat_key(f.size, f.mtime_ns, f.etag)}
    if sum(1 for f in listing.files if f.source in recorded) < len(recorded):  # some recorded file is gone
        listed = {f.source for f in listing.files}
        names.update(source for source in recorded if source not in listed)
    if len(names) > FEED_MAX_NAMES:
        return None
    return tuple(sorted(names))


def merged_feed(feeds: list[object]) -> tuple[str, ...] | None:
    """One change feed for a run started by several watcher events (each one's `changed`): their names together,
    or None (the run lists the source) when there is no event (a run on its time schedule, or started by hand),
    when one event carries no feed, or when together they name more than `FEED_MAX_NAMES`."""
    if not feeds:
        return None
    names: set[str] = set()
    for feed in feeds:
        if not isinstance(feed, list) or not all(isinstance(name, str) for name in feed):
            return None
        names.update(feed)
    return tuple(sorted(names)) if len(names) <= FEED_MAX_NAMES else None
