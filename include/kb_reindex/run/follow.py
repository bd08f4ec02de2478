"""Following a knowledge source: the looks a freshness watcher takes, and `follow`, the foreground loop of
`kb-reindex run --follow`. Airflow's trigger (`kb_reindex.airflow.triggers`) takes the same looks and applies
the same coalescing (`kb_reindex.domain.freshness.SourceWatch`); only how it waits differs.

A look reads the listing (names, sizes, modification times) and no file; whether the source differs from what
the last plan read comes from the file hashes plans record; whether a run is in progress from the reindex lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kb_reindex.domain.errors import ConfigError, KbError
from kb_reindex.domain.freshness import (ListedFile, Listing, SourceWatch, changed_sources, differs_from_recorded,
                                         stat_key)
from kb_reindex.rules.locking import reindex_lock_name
from kb_reindex.services.config import Settings
from kb_reindex.services.corpus import cache_root
from kb_reindex.services.runtime import open_source
from kb_reindex.services.sources import KnowledgeSource, listing
from kb_reindex.services.state.store import StateStore

log = logging.getLogger(__name__)


def look(source: KnowledgeSource) -> Listing:
    """The source's listing (a folder's or a bucket's; no document read). A source that cannot be listed (a
    missing folder, a bucket that refuses or does not answer) is a listing of its error, so the change reaches
    a run, which fails naming it, once, rather than a watcher that goes quiet."""
    try:
        return listing(source)
    except (KbError, OSError) as exc:
        log.error("kb_reindex: %s: the source cannot be listed: %s", source.uri, exc)
        return Listing((ListedFile(f"error: {exc}", -1, 0),))


def differs_from_last_plan(state: StateStore, settings: Settings, source: KnowledgeSource, now: Listing) -> bool:
    """True when listing `now` is not what the last plan of this source read (or no plan read it yet)."""
    recorded = state.file_hashes(cache_root(source, settings.default_tenant))
    return differs_from_recorded(now, {name: stat_key(h.size, h.mtime_ns, h.etag) for name, h in recorded.items()})


def change_feed(state: StateStore, settings: Settings, source: KnowledgeSource, now: Listing) -> tuple[str, ...] | None:
    """The names listing `now` shows changed since the last plan read the source (`freshness.changed_sources`):
    what a run is told, so its plan looks at them and lists nothing; None: the run lists the source."""
    recorded = state.file_hashes(cache_root(source, settings.default_tenant))
    return changed_sources(now, {name: stat_key(h.size, h.mtime_ns, h.etag) for name, h in recorded.items()})


def run_in_progress(state: StateStore, settings: Settings) -> bool:
    """A run of this knowledge base holds its reindex lock (a CLI run, or a DAG run between plan and promote)."""
    return state.lock_held_by(reindex_lock_name(settings.alias)) is not None


def follow(settings: Settings, state: StateStore, run_once: Callable[[tuple[str, ...] | None], Any], *,
           clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
           max_runs: int | None = None) -> int:
    """Run `run_once` at the start if the source differs from what the last plan read, then once per change
    (quiet for KB_SOURCE_QUIET_S), until interrupted (Ctrl-C: KeyboardInterrupt leaves through the run's own
    lock release) or `max_runs` runs are done. Returns the number of runs. `run_once` is given the change
    feed of the last look (`change_feed`)."""
    poll_s, quiet_s = settings.source_poll_s, settings.source_quiet_s
    if poll_s <= 0:
        raise ConfigError("run --follow lists the source every KB_SOURCE_POLL_S seconds; it is 0 (watching off): "
                          "set it, e.g. KB_SOURCE_POLL_S=5")
    watch = SourceWatch(quiet_s=quiet_s)
    source = open_source(settings)  # a bucket through s3fs with the AWS environment, as every CLI command reads it
    last = look(source)
    watch.start(last, differs_from_plan=differs_from_last_plan(state, settings, source, last), now=clock() - quiet_s)
    log.info("kb_reindex: following %s every %gs (quiet %gs)%s", source.uri, poll_s, quiet_s,
             "; it changed since the last plan" if watch.pending else "")
    while max_runs is None or watch.fired_count < max_runs:
        if watch.due(now=clock(), run_active=run_in_progress(state, settings)):
            watch.fired(now=clock())
            try:
                changed = change_feed(state, settings, source, last)
            except KbError as exc:  # the run lists the source, and meets the state DB's trouble itself
                log.error("kb_reindex: %s: cannot tell what changed since the last plan (%s); the run lists the "
                          "source", source.uri, exc)
                changed = None
            run_once(changed)
            # what the run read is the listing to compare with next (edits during it are a change)
            continue
        sleep(watch.next_look_s(poll_s))
        last = look(source)
        if watch.observe(last, now=clock()):
            log.info("kb_reindex: %s changed; waiting until it is quiet for %gs", source.uri, quiet_s)
    return watch.fired_count
