"""The CLI's log on a terminal: a build's or a restore's progress drawn as a bar (rich, already installed), the
other log lines printed above it. Off a terminal, with `--json` or `-q`, the plain log lines stay as they are.

Progress comes as log records carrying `kb_progress` (label, done, total), the same records the plain log
prints as "build v3 1200/4000 points (30%), ..."; so the steps know nothing of terminals."""

from __future__ import annotations

import logging
from typing import IO, Any

#: the attribute of a log record that carries a progress report (see steps.build.Progress)
PROGRESS = "kb_progress"


class TerminalLog(logging.Handler):
    """Log records on a terminal: one bar per progress label, every other record printed above the bars."""

    def __init__(self, stream: IO[str], fmt: str) -> None:
        super().__init__()
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.setFormatter(logging.Formatter(fmt))
        self.console = Console(file=stream, highlight=False)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("points"), TimeRemainingColumn(), console=self.console)
        self.tasks: dict[str, Any] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            report = getattr(record, PROGRESS, None)
            if report is None:
                self.console.print(self.format(record), markup=False, soft_wrap=True)
                return
            label, done, total = report
            if label not in self.tasks:
                if not self.tasks:
                    self.progress.start()
                self.tasks[label] = self.progress.add_task(label, total=total)
            self.progress.update(self.tasks[label], completed=done, total=total)
        except Exception:  # a log handler never breaks the command it reports on
            self.handleError(record)

    def close(self) -> None:
        if self.tasks:
            self.progress.stop()
        super().close()


def use_terminal_log(stream: IO[str], *, level: int, fmt: str) -> bool:
    """Log to `stream` through a `TerminalLog` when it is a terminal; False (nothing changed) when it is not."""
    if not stream.isatty():
        return False
    handler = TerminalLog(stream, fmt)
    root = logging.getLogger()
    root.setLevel(level)
    root.addHandler(handler)
    import atexit

    atexit.register(handler.close)
    return True
