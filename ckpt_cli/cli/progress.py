"""Progress on stderr, the CLI's adapters of the ops' one progress contract
(:class:`ckpt_cli.progress.Progress`, ``progress(phase, done, total)``): a byte bar per phase
for long reads and writes (only on a terminal), and a step counter for ``ckpt sample`` (a bar
on a terminal, plain lines elsewhere)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ckpt_cli.progress import Progress
from ckpt_cli.render.human import is_tty, stderr
from ckpt_cli.units import format_duration


class ProgressSink:
    """A :class:`~ckpt_cli.progress.Progress` that feeds rich bars: one per phase, labelled
    with the phase (``writing``, ``crc32``...); until the first phase is reported, one bar
    with the command's description. Does nothing when there is no bar."""

    def __init__(self, bar: Any = None, task: Any = None):
        self._bar, self._task = bar, task
        self._phases: dict[str, Any] = {}

    def __call__(self, phase: str, done: int, total: int, /) -> None:
        """Bytes ``done`` of ``total`` (0: unknown) in ``phase``; ``done`` 0 restarts it."""
        if self._bar is None:
            return
        task = self._phases.get(phase)
        if task is None:
            if self._task is not None:
                self._bar.remove_task(self._task)  # the phases replace the first bar
                self._task = None
            self._phases[phase] = self._bar.add_task(phase, total=total or None,
                                                     completed=done)
        elif done == 0:
            self._bar.reset(task, total=total or None)
        else:
            self._bar.update(task, completed=done, total=total or None)


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
    from rich.progress import (  # heavy: rich  # heavy: rich
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


@contextmanager
def step_progress(prefix: str, *, enabled: bool = True, every: int = 50
                  ) -> Iterator[Progress]:
    """A step counter on stderr for a long job counted in steps (``ckpt sample``'s training).

    On a terminal, a transient rich bar with ``step N/M`` and the time taken; elsewhere (a CI
    log, ``2> file``) a plain line at each new stage and every ``every`` steps, so that a log
    shows the job moving: ``sample: step 150/400: training (12.1s)``.

    Args:
        prefix: What the lines start with (the command's name).
        enabled: False for ``--quiet``/``--json``: nothing is shown.
        every: Steps between two plain lines of one stage.

    Yields:
        The callback to report to.
    """
    if not enabled:
        yield lambda _stage, _step, _total: None
        return
    if not is_tty():
        err, started = stderr(), time.monotonic()
        last: list[tuple[str, int]] = []

        def line(stage: str, step: int, total: int) -> None:
            key = (stage, -1 if step == total else step // every)
            if last == [key]:
                return
            last[:] = [key]
            took = format_duration(time.monotonic() - started)
            err.print(f"{prefix}: step {step}/{total}: {stage} ({took})", soft_wrap=True,
                      markup=False, highlight=False)

        yield line
        return
    from rich.progress import (  # heavy: rich  # heavy: rich
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("step"),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=stderr(),
                  transient=True) as bar:
        task = bar.add_task(prefix, total=None)

        def update(stage: str, step: int, total: int) -> None:
            bar.update(task, description=f"{prefix}: {stage}", completed=step, total=total)

        yield update
