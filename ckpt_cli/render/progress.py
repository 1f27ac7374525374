"""A progress bar on stderr for commands that read data, driven by ``on_progress`` callbacks.

Library functions report ``(label, done, total)`` in bytes; this turns that into a rich
progress bar when stderr is a terminal, and into nothing otherwise (pipes, CI logs, --json).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ckpt_cli.render import human
from ckpt_cli.streaming import ProgressFn


@contextlib.contextmanager
def progress_bar(enabled: bool = True) -> Iterator[ProgressFn | None]:
    """A progress callback showing one bar per label, or None when not on a terminal.

    Args:
        enabled: False (``--quiet``) yields None whatever stderr is.

    Yields:
        The callback, or None.
    """
    if not enabled or not human.is_tty():
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TaskID,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns: list[Any] = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                          TransferSpeedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=human.stderr(), transient=True) as prog:
        tasks: dict[str, TaskID] = {}

        def update(label: str, done: int, total: int) -> None:
            tid = tasks.get(label)
            if tid is None:
                tasks[label] = prog.add_task(label, total=total, completed=done)
            elif done == 0:
                prog.reset(tid, total=total)
            else:
                prog.update(tid, completed=done, total=total)

        yield update
