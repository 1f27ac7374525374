"""A byte-progress bar on stderr for long reads and writes (only on a terminal)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ckpt_cli.render.human import is_tty, stderr


@contextmanager
def byte_progress(description: str, *, enabled: bool = True,
                  ) -> Iterator[tuple[Callable[[int], None], Callable[[int], None]]]:
    """A rich progress bar (bytes, rate, ETA) on stderr, or no-ops when not wanted.

    Args:
        description: Label of the bar.
        enabled: False for ``--quiet``/``--json``; the bar also stays off when stderr is not
            a terminal (cron, CI logs).

    Yields:
        ``(on_start(total_bytes), on_progress(bytes_done))`` callbacks.
    """
    if not (enabled and is_tty()):
        yield (lambda _total: None), (lambda _n: None)
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
        task = bar.add_task(description, total=None)

        def start(total: int) -> None:
            bar.update(task, total=total)

        def advance(n: int) -> None:
            bar.advance(task, n)

        yield start, advance
