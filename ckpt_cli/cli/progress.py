"""A byte-progress bar on stderr for long reads and writes (only on a terminal)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ckpt_cli.render.human import is_tty, stderr


class ProgressSink:
    """Callbacks that feed a progress bar; every method is a no-op when there is no bar."""

    def __init__(self, bar: Any = None, task: Any = None):
        self._bar, self._task = bar, task
        self._labelled: dict[str, Any] = {}

    def start(self, total: int) -> None:
        """Set the total number of bytes."""
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def advance(self, n: int) -> None:
        """Count ``n`` more bytes done."""
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def update(self, done: int, total: int) -> None:
        """Set bytes done and the total."""
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total)

    def labelled(self, label: str, done: int, total: int) -> None:
        """Bytes done of one of several phases, each with a bar of its own (``crc32``...)."""
        if self._bar is None:
            return
        task = self._labelled.get(label)
        if task is None:
            if self._task is not None and not self._labelled:
                self._bar.remove_task(self._task)  # labelled phases replace the single bar
                self._task = None
            self._labelled[label] = self._bar.add_task(label, total=total, completed=done)
        elif done == 0:
            self._bar.reset(task, total=total)
        else:
            self._bar.update(task, completed=done, total=total)


@contextmanager
def byte_progress(description: str, *, enabled: bool = True) -> Iterator[ProgressSink]:
    """A transient rich progress bar (bytes, rate, ETA) on stderr, or a sink that does nothing.

    Args:
        description: Label of the bar.
        enabled: False for ``--quiet``/``--json``; the bar also stays off when stderr is not
            a terminal (cron, CI logs).

    Yields:
        The :class:`ProgressSink` to report progress to.
    """
    if not (enabled and is_tty()):
        yield ProgressSink()
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=stderr(),
                  transient=True) as bar:
        yield ProgressSink(bar, bar.add_task(description, total=None))
