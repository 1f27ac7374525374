"""Timelines for retention: which checkpoints of a run a rollback abandoned, from its ledger.

A run resumed from an earlier step saves the later steps again; the higher steps of the first
timeline that were not saved again stay behind, and resume-path already passes over them
(:func:`ckpt_cli.trust.ledger.abandoned`). Retention gives them no place of its rules either
(:mod:`ckpt_cli.ops.prune.retention`), so after a rollback ``--keep N`` holds N checkpoints of
the timeline training is on.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from ckpt_cli import storage
from ckpt_cli.trust import ledger


def abandoned_checkpoints(book: ledger.Ledger, root: Path,
                          names: Collection[str]) -> dict[str, str]:
    """The checkpoints present that a rollback abandoned, each with the sentence saying so.

    One written again since its verdict (its files are not the ones verified: a save of the new
    timeline under the old name, perhaps still in progress) is not abandoned: it is left to the
    usual rules and protections.

    Args:
        book: The run's ledger.
        root: The run directory.
        names: The checkpoints listed in it.

    Returns:
        Name -> ``abandoned by the rollback to step S: <name> (step T) was saved after it``.
    """
    latest = book.latest()
    out: dict[str, str] = {}
    for name, later in ledger.abandoned(book).items():
        line = latest.get(name)
        if name not in names or line is None:
            continue
        path = root / name
        if storage.has_file_system(path) and ledger.changed_files(line, ledger.stamp(path)):
            continue
        origin = rollback_origin(book, line)
        where = f"the rollback to step {origin:,}" if origin is not None else "a rollback"
        out[name] = (f"abandoned by {where}: {later.path} (step {later.step:,}) was saved "
                     "after it" if later.step is not None else f"abandoned by {where}")
    return out


def rollback_origin(book: ledger.Ledger, left: ledger.LedgerEntry) -> int | None:
    """The step training went back to when it left ``left`` behind: the highest step saved
    before the first save of the new timeline (a lower step committed after ``left``).

    Args:
        book: The run's ledger.
        left: The newest line of an abandoned checkpoint.

    Returns:
        That step; 0 when no earlier save is recorded (a restart from scratch); None when it
        cannot be told.
    """
    lines = [e for e in book.latest().values() if e.event == ledger.VERIFIED
             and e.step is not None and e.committed is not None]
    if left.step is None or left.committed is None:
        return None
    after = [e for e in lines if (e.step or 0) < left.step
             and (e.committed or 0.0) > left.committed]
    if not after:
        return None
    first = min(after, key=lambda e: e.committed or 0.0)
    before = [e.step or 0 for e in lines if (e.step or 0) < (first.step or 0)
              and (e.committed or 0.0) < (first.committed or 0.0)]
    return max(before, default=0)
