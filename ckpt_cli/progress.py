"""The one progress contract of every op: ``progress(phase, done, total)``.

Every op that takes long (``validate``, ``diff``, ``stats``, ``convert``, ``consolidate``,
``prune``, ``plan``, ``sample``) accepts ``progress: Progress | None = None`` and calls it
as work is done. The rules, the same for every op:

- ``phase`` names what is being done (``writing``, ``comparing``, ``deleting``,
  ``measuring``, ``values``, ``crc32``, ``training``...); an op may have several phases,
  one after another or interleaved (``validate`` checks CRC-32 and values of each checkpoint
  of a run in turn, each phase named after the checkpoint: ``step_400: crc32``).
- ``done`` of ``total`` units of that phase: bytes for reads and writes, checkpoints for
  ``prune``, steps for ``sample``. ``total`` is 0 while unknown; ``done`` never goes
  down within one phase except back to 0, when the phase starts again.
- Called from the thread that called the op, never from worker threads, so a callback
  needs no lock (it may update a progress bar or a GUI directly).
- Progress only: what a callback raises propagates out of the op (stopping it); a
  callback must not print to the stdout of a ``--json`` run.

The CLI's one adapter is ``ckpt_cli.cli.progress.ProgressSink`` (a rich bar per phase on
stderr); the Python API passes the caller's ``on_progress`` callback through as it is.
:class:`Tally` adapts the writers' ``on_start(total)``/``on_progress(n)`` byte counts.
This module is at the bottom layer: it imports nothing of ckpt_cli.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Progress", "Tally"]


class Progress(Protocol):
    """``progress(phase, done, total)``: ``done`` of ``total`` units in ``phase`` (see the
    module's rules). Any function of three positional arguments fits."""

    def __call__(self, phase: str, done: int, total: int, /) -> None:
        """Report progress.

        Args:
            phase: What is being done.
            done: Units done so far in this phase.
            total: Units in this phase (0 while unknown).
        """


class Tally:
    """Counts units reported one increment at a time (a writer's ``on_progress(n)``, after
    one ``on_start(total)``) into ``progress(phase, done, total)``.

    Args:
        progress: Where to report.
        phase: The phase reported.
    """

    def __init__(self, progress: Progress, phase: str) -> None:
        self.progress, self.phase = progress, phase
        self.done = self.total = 0

    def start(self, total: int) -> None:
        """The total units, once known."""
        self.total = total
        self.progress(self.phase, self.done, total)

    def advance(self, n: int) -> None:
        """``n`` more units done."""
        self.done += n
        self.progress(self.phase, self.done, self.total)

    @classmethod
    def of(cls, progress: Progress | None, phase: str) -> Tally | None:
        """A :class:`Tally` reporting to ``progress``, or None when there is none."""
        return cls(progress, phase) if progress is not None else None
