"""The operating system's file events under a local knowledge folder (watchfiles: inotify on Linux, FSEvents,
ReadDirectoryChangesW), as a wake-up for the source's watcher. What changed is still decided by the listing
(`kb_reindex.domain.freshness`): an event only makes the next look come at once, so a missed or a spurious one
costs one look at most, never a wrong run, and the poll goes on as the fallback."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

log = logging.getLogger(__name__)

#: milliseconds watchfiles groups a burst of events for (its default, 1.6 s, would delay every edit)
DEBOUNCE_MS = 50


class FileEvents:
    """`start()` inside the running event loop; `wait(timeout_s)` between looks; `close()` at the end."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._changed = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: why events are not coming (None while they are): the watcher polls alone then
        self.failure: str | None = None

    def start(self) -> bool:
        """Watch the folder; False (with `failure` said) when the platform gives no events for it."""
        try:
            import watchfiles
        except ImportError as exc:
            self.failure = f"watchfiles cannot be imported ({exc})"
            return False
        if not self.folder.is_dir():
            self.failure = f"{self.folder} is not a folder"
            return False
        self._task = asyncio.create_task(self._consume(watchfiles))
        return True

    async def _consume(self, watchfiles: object) -> None:
        try:
            async for _ in watchfiles.awatch(self.folder, stop_event=self._stop,  # type: ignore[attr-defined]
                                             debounce=DEBOUNCE_MS, step=DEBOUNCE_MS, recursive=True):
                self._changed.set()
        except Exception as exc:  # no watch left (fs.inotify.max_user_watches), the folder gone: poll alone
            self.failure = f"{type(exc).__name__}: {exc}"
            log.warning("kb_reindex: file events of %s stopped (%s); the listing poll goes on alone",
                        self.folder, self.failure)

    @property
    def active(self) -> bool:
        return self._task is not None and not self._task.done()

    async def wait(self, timeout_s: float) -> bool:
        """Until a file event or `timeout_s`: True for an event (taken), False at the timeout."""
        if not self.active:
            await asyncio.sleep(timeout_s)
            return False
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            return False
        self._changed.clear()
        return True

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 5)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
