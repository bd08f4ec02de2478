"""The freshness watcher of a knowledge base's source: an Airflow event trigger (`BaseEventTrigger`) behind
the source's Asset (`source_asset`), which the knowledge base's `knowledge_reindex` is scheduled on besides its
time schedule. It runs in the triggerer, lists the source every KB_SOURCE_POLL_S seconds (names, sizes,
modification times; no file is read), and fires one asset event per change once the source was quiet for
KB_SOURCE_QUIET_S and no run of the knowledge base is in progress (`kb_reindex.domain.freshness`). At its
start (a triggerer start, a DAG unpaused, a fresh install) it fires once if the source differs from what the
last plan read, and an event no plan followed (fired while the DAG was paused) fires again
(`domain.freshness.SourceWatch.recheck_due`). A local folder's file events (`kb_reindex.services.file_events`) make the next look come at once,
so an edit is seen within milliseconds and fires after the quiet time; the poll stays as the fallback.

Blocking looks (the listing, the state DB) run in a worker thread, never on the triggerer's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

log = logging.getLogger(__name__)


class SourceChangeTrigger(BaseEventTrigger):
    """Fires `{"alias", "files", "listing", "changed"}` for each quiet change of knowledge base `kb`'s source
    (None: the environment's one knowledge base); `changed`: the names that differ from what the last plan read
    (`follow.change_feed`), which the run's plan looks at instead of listing the source (None: it lists)."""

    def __init__(self, *, kb: str | None, alias: str, poll_s: float, quiet_s: float) -> None:
        super().__init__()
        self.kb, self.alias, self.poll_s, self.quiet_s = kb, alias, float(poll_s), float(quiet_s)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        # the same kwargs at every parse: Airflow identifies an asset's trigger by classpath and kwargs
        return (f"{__name__}.SourceChangeTrigger",
                {"kb": self.kb, "alias": self.alias, "poll_s": self.poll_s, "quiet_s": self.quiet_s})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from kb_reindex.domain.errors import KbError
        from kb_reindex.domain.freshness import SourceWatch
        from kb_reindex.run.follow import change_feed, differs_from_last_plan, look, run_in_progress
        from kb_reindex.airflow.connections import object_storage
        from kb_reindex.services.registry import select_knowledge_base
        from kb_reindex.services.file_events import FileEvents
        from kb_reindex.services.runtime import open_source
        from kb_reindex.services.state.store import StateStore

        kb = await asyncio.to_thread(select_knowledge_base, self.kb)
        settings = await asyncio.to_thread(kb.settings)
        # a bucket through the knowledge base's aws Connection, as its tasks read it (Airflow's ObjectStoragePath)
        access = object_storage(kb) if settings.knowledge_remote else None
        source = await asyncio.to_thread(open_source, settings, access)
        state = await asyncio.to_thread(StateStore, await self._state_url(settings.state_url))
        watch = SourceWatch(quiet_s=self.quiet_s)
        # a local folder's file events wake the next look at once (the poll stays the fallback); a bucket is polled
        events = FileEvents(Path(source.root)) if source.local else None
        woken = events is not None and events.start()
        try:
            listing = await asyncio.to_thread(look, source)
            try:
                differs = await asyncio.to_thread(differs_from_last_plan, state, settings, source, listing)
            except KbError as exc:  # no answer from the state DB: a run finds out and says so
                self.log.error("kb_reindex: %s: cannot tell what the last plan read (%s): firing once", self.alias, exc)
                differs = True
            watch.start(listing, differs_from_plan=differs, now=time.monotonic() - self.quiet_s)
            self.log.info("kb_reindex: watching %s for %s %s every %gs (quiet %gs); %s", source.uri,
                          self.alias, "by file events, and a listing" if woken else "by a listing", self.poll_s,
                          self.quiet_s,
                          "it differs from what the last plan read" if differs else "unchanged since the last plan")
            if events is not None and not woken:
                self.log.warning("kb_reindex: %s: no file events (%s); listing every %gs", self.alias,
                                 events.failure, self.poll_s)
            while True:
                if watch.quiet(now=time.monotonic()):
                    try:
                        active = await asyncio.to_thread(run_in_progress, state, settings)
                    except KbError as exc:
                        self.log.error("kb_reindex: %s: state DB: %s; looking again", self.alias, exc)
                        active = True
                    if not active:
                        try:
                            changed = await asyncio.to_thread(change_feed, state, settings, source, listing)
                        except KbError as exc:  # the run lists the source itself
                            self.log.error("kb_reindex: %s: state DB: %s; the run lists the source", self.alias, exc)
                            changed = None
                        watch.fired(now=time.monotonic())
                        files = len(listing.files)
                        self.log.info("kb_reindex: %s changed (%d files%s): asset event", self.alias, files,
                                      f", {len(changed)} of them since the last plan" if changed is not None else "")
                        yield TriggerEvent({"alias": self.alias, "files": files, "listing": watch.seen,
                                            "changed": list(changed) if changed is not None else None})
                elif watch.recheck_due(now=time.monotonic()):
                    try:  # a run in progress will record what its plan read: asked again once it ended
                        active = await asyncio.to_thread(run_in_progress, state, settings)
                        differs = not active and await asyncio.to_thread(differs_from_last_plan, state, settings,
                                                                          source, listing)
                    except KbError as exc:  # asked again at the next look
                        self.log.error("kb_reindex: %s: state DB: %s; looking again", self.alias, exc)
                    else:
                        if differs:
                            self.log.warning(
                                "kb_reindex: %s: no plan read the change fired %.0fs ago (its event came while the "
                                "DAG was paused, or was lost): firing again", self.alias,
                                time.monotonic() - (watch.unplanned_since or 0.0))
                        if not active:
                            watch.rechecked(differs_from_plan=differs, now=time.monotonic())
                wait_s = watch.next_look_s(self.poll_s)
                await (events.wait(wait_s) if events is not None else asyncio.sleep(wait_s))
                listing = await asyncio.to_thread(look, source)
                if watch.observe(listing, now=time.monotonic()):
                    self.log.info("kb_reindex: %s: the source changed; waiting %gs of quiet", self.alias,
                                  self.quiet_s)
        finally:
            if events is not None:
                await events.close()
            state.dispose()

    @staticmethod
    async def _state_url(from_env: str) -> str:
        """The state DB as the tasks find it: the `kb_state` Connection when defined (asked the triggerer's async
        way), else KB_STATE_URL."""
        from airflow.sdk import BaseHook
        from airflow.sdk.exceptions import AirflowNotFoundException

        from kb_reindex.airflow.connections import STATE_CONN_ID, state_url_from_connection

        try:
            connection = await BaseHook.aget_connection(STATE_CONN_ID)
        except AirflowNotFoundException:
            return from_env
        return state_url_from_connection(connection)
