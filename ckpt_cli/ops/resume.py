"""Resume only from a verified checkpoint.

:func:`latest_verified` reads the run ledger (:mod:`ckpt_cli.trust.ledger`) and returns the newest
checkpoint whose newest line says ``good`` and which is still what was verified: its manifest is
the one recorded (same SHA-256), every file the manifest lists is there with its recorded size
and nothing was added, every file whose size, modification time, inode or inode-change
time (on object storage: version or ETag) is not what the verdict recorded hashes as the
manifest says (with ``verify="full"``, every file is hashed),
and its index reads cleanly. A checkpoint that fails is skipped (the next older one is tried),
so a shard truncated or rewritten after its save is never resumed from; nor is one of a
timeline that a resume from an earlier step abandoned.

Pass the result as ``resume_from_checkpoint=`` (HF Trainer) or ``ckpt_path=`` (Lightning);
``ckpt resume-path RUN_DIR`` prints it for shell scripts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ckpt_cli import storage
from ckpt_cli.formats.containers import holds_optimizer_state
from ckpt_cli.trust import ledger
from ckpt_cli.trust.ledger import links_in, recheck_trusted
from ckpt_cli.trust.thinning import pending, thinned_line

Verify = Literal["sizes", "full"]


@dataclass(frozen=True, slots=True)
class ResumeChoice:
    """The checkpoint to resume from, and what was passed over.

    Attributes:
        path: The checkpoint.
        entry: Its ledger line.
        rejected: ``(path, why)`` of newer checkpoints the ledger trusted that failed the
            re-check (or belong to a timeline a resume abandoned).
        ignored: Paths of ledger lines that name no direct child of the run (nested, ``.``,
            ``..``): never resumed from, worth a warning.
    """

    path: Path
    entry: ledger.LedgerEntry
    rejected: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    ignored: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class ResumeSurvey:
    """Everything :func:`survey` looked at: the choice, or why there is none.

    Attributes:
        choice: The checkpoint to resume from, or None.
        rejected: ``(path, why)`` of the checkpoints the ledger trusted that were passed over,
            newest first.
        ignored: Paths of ledger lines that name no direct child of the run.
        unreadable: Ledger lines that could not be read (torn by a crash, edited by hand).
    """

    choice: ResumeChoice | None
    rejected: tuple[tuple[str, str], ...] = ()
    ignored: tuple[str, ...] = ()
    unreadable: int = 0


def _order(e: ledger.LedgerEntry) -> tuple[int, float]:
    return (e.step if e.step is not None else -1, e.time)


def survey(run_dir: str | os.PathLike[str], *, verify: Verify = "sizes") -> ResumeSurvey:
    """The newest verified checkpoint of ``run_dir`` that is still what was verified, and
    every ledger line passed over on the way, with why.

    The ledger's good checkpoints are tried newest step first. One is passed over when it
    belongs to an abandoned timeline (:func:`ckpt_cli.trust.ledger.abandoned`: a checkpoint of
    a lower step was committed after it, so training was resumed from before it), holds a
    symbolic link, or fails :func:`ckpt_cli.trust.ledger.recheck_trusted`: its manifest is
    not the one recorded, a file the manifest lists is missing or resized or one was added, a
    file whose stamp (size, modification time, inode, inode-change time) differs from the
    verdict's record hashes otherwise than the manifest says (``full``: any file does; so does
    any file when the line's record is not the one its manifest was written with), or its
    index does not read cleanly through the allowlist.

    Args:
        run_dir: The run directory (local or object-store URL).
        verify: ``sizes`` (stat every file; hash only those changed since the verdict) or
            ``full`` (every file hashed against the manifest).

    Raises:
        ValueError: An unknown ``verify``.
        CkptError: The ledger cannot be read.
    """

    if verify not in ("sizes", "full"):
        raise ValueError(f"verify must be 'sizes' or 'full', not {verify!r}")
    root = storage.locate(run_dir)
    book = ledger.read_ledger(root)
    if book is None:
        return ResumeSurvey(None)
    # A thinned checkpoint (prune --thin-after) is good for its weights but lost its optimizer
    # state: resuming from it would restart the optimizer (and HF Trainer its scheduler).
    # A thinning that was interrupted (its intent line never confirmed) may have rewritten the
    # checkpoint before watch verified it again: not resumable either.
    interrupted: set[str] = set()
    thinned: set[str] = set()  # whose newest thinning line confirms a thinning
    for e in book.entries:
        if e.event == ledger.THINNED:
            (interrupted.add if pending(e) else interrupted.discard)(e.path)
            (thinned.add if thinned_line(e) else thinned.discard)(e.path)
    latest = book.latest()
    left_behind = ledger.abandoned(book)
    good = sorted((e for e in latest.values() if e.good and e.event != ledger.THINNED
                   and e.path not in interrupted), key=_order, reverse=True)
    rejected: list[tuple[str, str]] = []
    for e in good:
        path = root / e.path
        later = left_behind.get(e.path)
        if later is not None:
            rejected.append((e.path, f"an abandoned timeline: {later.path} (step {later.step}, "
                                     "an earlier step) was saved after it"))
            continue
        # Never resume through a symbolic link: one swapped in after the save can point at any
        # file of the same size, outside the run (a size check would not tell).
        links = links_in(path)
        if links:
            rejected.append((e.path, f"{links[0]} is a symbolic link"))
            continue
        now = ledger.stamp(path)
        check = recheck_trusted(path, e, full=verify == "full", now=now)
        problems = check.problems
        if problems and now and ledger.saved_again(path, e, now):
            problems = ["written again after it was verified (a newer save not verified yet)"]
        elif (not problems and e.path in thinned and check.index is not None
              and not holds_optimizer_state(check.index)):
            # Verified again after its thinning (a watcher that found no manifest): good for
            # its weights, but resuming would restart the optimizer.
            problems = ["thinned by prune --thin-after: its optimizer state was dropped"]
        if not problems:
            choice = ResumeChoice(path, e, tuple(rejected), book.ignored)
            return ResumeSurvey(choice, tuple(rejected), book.ignored, book.skipped)
        rejected.append((e.path, problems[0]))
    return ResumeSurvey(None, tuple(rejected), book.ignored, book.skipped)


def choose(run_dir: str | os.PathLike[str], *, verify: Verify = "sizes") -> ResumeChoice | None:
    """The newest verified checkpoint of ``run_dir`` that is still what was verified
    (:func:`survey`'s choice).

    Args:
        run_dir: The run directory (local or object-store URL).
        verify: ``sizes`` (stat every file; hash only those changed since the verdict) or
            ``full`` (every file hashed against the manifest).

    Returns:
        The :class:`ResumeChoice`, or None when no checkpoint qualifies (no ledger, none good,
        all failed the re-check).

    Raises:
        ValueError: An unknown ``verify``.
        CkptError: The ledger cannot be read.
    """
    return survey(run_dir, verify=verify).choice


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
