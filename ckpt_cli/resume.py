"""Resume only from a verified checkpoint.

:func:`latest_verified` reads the run ledger (:mod:`ckpt_cli.trust.ledger`) and returns the newest
checkpoint whose newest line says ``good`` and which is still what was verified: its manifest is
the one recorded (same SHA-256), every file the manifest lists is there with its recorded size
and nothing was added, and with ``verify="full"`` every file's checksum matches too. A
checkpoint that fails is skipped (the next older one is tried), so a shard truncated or
rewritten after its save is never resumed from.

Pass the result as ``resume_from_checkpoint=`` (HF Trainer) or ``ckpt_path=`` (Lightning);
``ckpt resume-path RUN_DIR`` prints it for shell scripts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ckpt_cli import storage
from ckpt_cli.trust import ledger

Verify = Literal["sizes", "full"]


@dataclass(frozen=True, slots=True)
class ResumeChoice:
    """The checkpoint to resume from, and what was passed over.

    Attributes:
        path: The checkpoint.
        entry: Its ledger line.
        rejected: ``(path, why)`` of newer checkpoints the ledger trusted that failed the
            re-check.
    """

    path: Path
    entry: ledger.LedgerEntry
    rejected: tuple[tuple[str, str], ...] = field(default_factory=tuple)


def _order(e: ledger.LedgerEntry) -> tuple[int, float]:
    return (e.step if e.step is not None else -1, e.time)


def choose(run_dir: str | os.PathLike[str], *, verify: Verify = "sizes") -> ResumeChoice | None:
    """The newest verified checkpoint of ``run_dir`` that still matches its manifest.

    Args:
        run_dir: The run directory (local or object-store URL).
        verify: ``sizes`` (files present with their recorded sizes; cheap) or ``full``
            (every file hashed against the manifest).

    Returns:
        The :class:`ResumeChoice`, or None when no checkpoint qualifies (no ledger, none good,
        all failed the re-check).

    Raises:
        ValueError: An unknown ``verify``.
        CkptError: The ledger cannot be read.
    """
    from ckpt_cli.trust.ledger import links_in, recheck_good
    from ckpt_cli.trust.thinning import pending

    if verify not in ("sizes", "full"):
        raise ValueError(f"verify must be 'sizes' or 'full', not {verify!r}")
    root = storage.locate(run_dir)
    book = ledger.read_ledger(root)
    if book is None:
        return None
    # A thinned checkpoint (prune --thin-after) is good for its weights but lost its optimizer
    # state: resuming from it would restart the optimizer (and HF Trainer its scheduler).
    # A thinning that was interrupted (its intent line never confirmed) may have rewritten the
    # checkpoint before watch verified it again: not resumable either.
    interrupted: set[str] = set()
    for e in book.entries:
        if e.event == ledger.THINNED:
            (interrupted.add if pending(e) else interrupted.discard)(e.path)
    good = sorted((e for e in book.latest().values() if e.good and e.event != ledger.THINNED
                   and e.path not in interrupted), key=_order, reverse=True)
    rejected: list[tuple[str, str]] = []
    for e in good:
        # Never resume through a symbolic link: one swapped in after the save can point at any
        # file of the same size, outside the run (a size check would not tell).
        links = links_in(root / e.path)
        if links:
            rejected.append((e.path, f"{links[0]} is a symbolic link"))
            continue
        if _rewritten_since(root / e.path, e):
            rejected.append((e.path, "written again after it was verified (a newer save "
                                     "not verified yet)"))
            continue
        problems = recheck_good(root / e.path, e, full=verify == "full")
        if not problems:
            return ResumeChoice(root / e.path, e, tuple(rejected))
        rejected.append((e.path, problems[0]))
    return None


def _rewritten_since(path: Path, line: ledger.LedgerEntry) -> bool:
    """Whether a ``last.ckpt``-style copy was written again after its verdict.

    Lightning overwrites ``last.ckpt`` in place at every save (``save_last=True``): a newer
    save of the same size passes a size check against the old manifest, so its modification
    time is compared with the verdict's. (Other checkpoints are never written again under
    their name; local files only.)
    """
    from ckpt_cli.formats.names import is_last_copy

    if not is_last_copy(path.name) or not storage.has_file_system(path):
        return False
    try:
        return os.stat(path).st_mtime > line.time
    except OSError:
        return False  # gone: the re-check says so


def latest_verified(run_dir: str | os.PathLike[str], *, verify: Verify = "sizes") -> Path | None:
    """The newest checkpoint whose ledger verdict is good and whose manifest still matches.

    Args:
        run_dir: The run directory.
        verify: ``sizes`` (default) or ``full`` (hash every file).

    Returns:
        Its path, or None when there is none.
    """
    choice = choose(run_dir, verify=verify)
    return choice.path if choice is not None else None
