"""The options of ``ckpt watch`` (:class:`~ckpt_cli.ops.watch.Watcher`): :class:`WatchOptions`,
each field the one declaration of a ``ckpt watch`` flag and a ``ckpt_cli.watch_once()``
keyword (light: the command line builds its flags from it without importing the watcher)."""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_cli.choices import ThinDtype
from ckpt_cli.ops.options import common
from ckpt_cli.optionspec import Caller, option


@dataclass(frozen=True, slots=True)
class WatchOptions:
    """How to watch (``ckpt watch``'s options, declared once: see :mod:`ckpt_cli.optionspec`).
    Durations are seconds here; the command line and the API also take them as text
    (``10m``). Retention runs after a pass that verified something when `keep`,
    `keep_every` or `thin_after` is given (:func:`ckpt_cli.ops.watch.retention`).

    Attributes:
        report_pending: Emit a ``pending`` event for each checkpoint not judged yet in this
            pass (still settling, locked by a writer, not committed yet): ``--once`` and
            ``watch_once()`` say what they left for the next run (no option of its own).
        caller: Whom messages name options for (``--settle 1s`` or ``settle=1s``).
    """

    crc: bool = option(False, help=(
        "Read every byte (CRC-32, DCP items), not just the structure."))
    values: bool = option(False, help="Also scan tensors for NaN, Inf and all-zero.")
    settle: float = option(1.0, metavar="AGE", kind="duration", allow_zero=True, help=(
        "A committed checkpoint must be unchanged this long before it is validated."))
    abandon_after: float = option(600.0, metavar="AGE", kind="duration", help=(
        "A checkpoint still incomplete this long after its last change is reported as "
        "abandoned (a save killed midway)."))
    keep: int | None = option(None, metavar="N", help=(
        "Retention after each verified checkpoint: keep the newest N (as ckpt prune "
        "--keep)."))
    keep_every: int | None = option(None, metavar="STEPS", kind="count", help=(
        "Retention: also keep checkpoints whose step is a multiple of STEPS (e.g. 10K, as "
        "ckpt prune)."))
    grace: float = option(600.0, metavar="AGE", kind="duration", allow_zero=True, help=(
        "Retention never deletes anything changed within AGE (0: off)."))
    thin_after: int | None = common.thin_after()
    thin_to: ThinDtype | None = common.thin_to()
    keep_full_every: int | None = common.keep_full_every()
    keep_abandoned: bool = common.keep_abandoned()
    pattern: str | None = option(None, metavar="REGEX", help=(
        "Which entries are checkpoints, for unusual layouts (a 'step' group gives the "
        "step)."))
    on_bad: str | None = option(None, metavar="CMD", help=(
        "Run CMD for each bad checkpoint (split like a shell would, never run by one) with "
        "its path in $CKPT_BAD_PATH; its output goes to stderr. One that cannot start, fails "
        "or times out is reported as an error."))
    on_bad_timeout: float = option(300.0, metavar="AGE", kind="duration", help=(
        "Kill an `on_bad` command (and what it started) still running after AGE, and report "
        "it."))
    report_pending: bool = False
    caller: Caller = "python"
