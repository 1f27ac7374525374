"""One answer to "is this a run, a pointer or a checkpoint?", for every command.

:func:`resolve` looks at what a command was given, before any checkpoint is read:

- ``checkpoint``: a file, a directory a reader recognises as one checkpoint (DCP, HF shards,
  DeepSpeed tag, Megatron iteration, a checkpoint directory of loose files), or anything when
  ``--input-format`` is given.
- ``run``: a directory of checkpoints (``checkpoint-N/``, ``global_stepN/``, step-named files,
  ...), including an HF Trainer ``output_dir`` whose final model lies beside its
  ``checkpoint-N/`` (:attr:`Target.final_model`).
- ``pointer``: a run directory whose resume pointer (DeepSpeed ``latest``, Megatron
  ``latest_checkpointed_iteration.txt``) names one of its checkpoints. Commands that read one
  checkpoint (convert, diff, consolidate) read that one; those that describe or check a run
  (inspect, validate, stats, watch) list the run.

Two kinds of directory are refused, each naming what the user can pass instead: a directory
above runs (a Lightning ``lightning_logs/version_0/checkpoints/`` tree, a project holding
``checkpoints/`` and ``best/``), and a folder of unrelated checkpoint files, which would
otherwise be read as one checkpoint with clashing names renamed ``name#2``. Files that make one
checkpoint together (HF shards, per-rank files, a training checkpoint's weights beside its
optimizer, scheduler and RNG state) are not unrelated.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ckpt_cli import storage
from ckpt_cli.errors import CkptError, CorruptCheckpointError, UnknownFormatError, UsageError
from ckpt_cli.formats import detect
from ckpt_cli.formats.directory import checkpoint_files
from ckpt_cli.formats.names import is_leftover
from ckpt_cli.formats.torchfile import role_of
from ckpt_cli.runs import Followed, follow_pointer, holds_final_model, is_run_dir, list_run

Kind = Literal["checkpoint", "run", "pointer"]

__all__ = ["Kind", "Target", "holds_runs", "resolve", "runs_below", "unrelated_files"]


@dataclass(frozen=True, slots=True)
class Target:
    """What a path given to a command is.

    Attributes:
        kind: ``checkpoint``, ``run`` or ``pointer`` (a run whose resume pointer names one).
        path: The path given.
        reason: Why, in a few words (``"an HF Trainer output_dir: ..."``).
        followed: For ``pointer``: the pointer and the checkpoint it names.
        final_model: For ``run``: an HF Trainer ``output_dir`` with its final model at the top.
        pointer_error: For ``run``: a resume pointer that cannot be followed (it names nothing
            there, or cannot be read); raised by :meth:`checkpoint`, listed by run commands.
    """

    kind: Kind
    path: Path
    reason: str
    followed: Followed | None = None
    final_model: bool = False
    pointer_error: CorruptCheckpointError | None = None

    @property
    def is_run(self) -> bool:
        """Whether the path holds checkpoints (``run`` or ``pointer``)."""
        return self.kind != "checkpoint"

    def checkpoint(self) -> Path:
        """The one checkpoint to read, for commands that read one.

        Returns:
            The path itself, or the checkpoint a pointer names.

        Raises:
            CorruptCheckpointError: A run whose resume pointer cannot be followed.
            UsageError: A run without a resume pointer (the message names its newest entry).
        """
        if self.followed is not None:
            return self.followed.path
        if self.kind == "checkpoint":
            return self.path
        if self.pointer_error is not None:
            raise self.pointer_error
        entries = [e for e in list_run(self.path).entries if e.complete]
        hint = (f"name one of its checkpoints, e.g. {self.path / entries[-1].name} (the newest)"
                if entries else "name one of its checkpoints")
        raise UsageError(f"a run directory ({len(entries)} complete checkpoints), not a "
                         "checkpoint", path=self.path, hint=hint)


def resolve(path: str | os.PathLike[str], *, input_format: str | None = None) -> Target:
    """Decide whether ``path`` is a checkpoint, a run directory or a run with a resume pointer.

    Reads directory listings and small marker files only, never tensor data or pickles.

    Args:
        path: What the command was given (a local path or URL).
        input_format: The ``--input-format`` given, if any: then ``path`` is one checkpoint of
            that format, whatever it looks like.

    Returns:
        The :class:`Target`.

    Raises:
        UsageError: A directory that holds runs rather than checkpoints, or unrelated
            checkpoint files that do not make one checkpoint (the message names them).
    """
    p = storage.locate(path)
    if input_format is not None:
        return Target("checkpoint", p, f"--input-format {input_format} given")
    if not p.is_dir():
        return Target("checkpoint", p, "a file")
    if holds_final_model(p):
        return Target("run", p, "an HF Trainer output_dir: checkpoints saved on the way, the "
                      "final model beside them", final_model=True)
    if is_run_dir(p):
        try:
            followed = follow_pointer(p)
        except CorruptCheckpointError as e:
            return Target("run", p, "a directory of checkpoints whose resume pointer cannot "
                          "be followed", pointer_error=e)
        if followed is not None:
            return Target("pointer", p, f"a directory of checkpoints whose {followed.pointer} "
                          f"names {followed.checkpoint}", followed=followed)
        return Target("run", p, "a directory of checkpoints")
    try:
        reader = detect(p)
    except UnknownFormatError:
        above = holds_runs(p)
        if above is not None:
            raise above from None
        # The command's read says what is wrong, in the words every reader uses.
        return Target("checkpoint", p, "a directory no reader recognises")
    except CkptError:
        return Target("checkpoint", p, "a directory that cannot be read")
    if reader.name == "dir":
        loose = unrelated_files(p)
        if loose:
            shown = ", ".join(loose[:6]) + (f" and {len(loose) - 6} more" if len(loose) > 6
                                             else "")
            raise UsageError(f"holds {len(loose)} unrelated checkpoint files ({shown}), not one "
                             "checkpoint; pass one of them", path=p,
                             hint=f"e.g. {p / loose[0]}; files named by step "
                                  "(model_100.pt, step=200.ckpt) are read as a run")
    return Target("checkpoint", p, f"a {reader.name} checkpoint")


def holds_runs(p: Path) -> UsageError | None:
    """The refusal of a directory above runs (or above checkpoints), naming them.

    Args:
        p: A directory that is neither a run nor a checkpoint.

    Returns:
        The error to raise, or None when nothing run- or checkpoint-like is below ``p``.
    """
    below = runs_below(p)
    if not below:
        return None
    runs = [n for n, k in below if k != "checkpoint"]
    ckpts = [n for n, k in below if k == "checkpoint"]

    def names(xs: list[str]) -> str:
        return ", ".join(f"{x}/" for x in xs[:5]) + (f" and {len(xs) - 5} more"
                                                     if len(xs) > 5 else "")

    message = f"holds runs: {names(runs)}" if runs else f"holds checkpoints: {names(ckpts)}"
    if runs and ckpts:
        message += f" (and checkpoints: {names(ckpts)})"
    first = (runs or ckpts)[0]
    return UsageError(message + "; pass one of them", path=p,
                      hint=f"e.g. ckpt inspect {p / first}")


# Bounds of the search below a directory that is neither a run nor a checkpoint.
_DEPTH = 3
_MAX_DIRS = 256


def runs_below(root: Path) -> list[tuple[str, Kind]]:
    """The run directories under ``root`` (up to three levels down), and the checkpoint
    directories right below it, for a directory that is neither.

    A bounded walk of directory listings: no symlinks, hidden or leftover names, at most
    256 directories looked at.

    Args:
        root: A directory.

    Returns:
        ``(path relative to root, "run" or "checkpoint")``, in name order.
    """
    out: list[tuple[str, Kind]] = []
    level = [root]
    seen = 0
    for depth in range(_DEPTH):
        nxt: list[Path] = []
        for d in level:
            for sub in _subdirs(d):
                seen += 1
                if seen > _MAX_DIRS:
                    return out
                rel = sub.relative_to(root).as_posix()
                if holds_final_model(sub) or is_run_dir(sub):
                    out.append((rel, "run"))
                elif depth == 0 and _is_checkpoint(sub):
                    out.append((rel, "checkpoint"))
                else:
                    nxt.append(sub)
        level = nxt
    return out


def _subdirs(d: Path) -> list[Path]:
    try:
        with storage.scandir(d) as it:
            names = sorted(e.name for e in it if e.is_dir(follow_symlinks=False)
                           and not e.name.startswith(".") and not is_leftover(e.name))
    except OSError:
        return []
    return [d / n for n in names]


def _is_checkpoint(d: Path) -> bool:
    try:
        detect(d)
    except Exception:  # any reason it is not one: unreadable, unknown, ambiguous
        return False
    return True


# Names of files that are parts of one checkpoint: shards of a set, per-rank files, Meta's
# model-parallel ``consolidated.NN.pth``.
_PART = re.compile(r"-of-|rank|shard|_part_?\d|\.distcp\Z|^consolidated\.\d+\.", re.IGNORECASE)
_STATE_FILES = ("trainer_state.json", "config.json", "meta.json", "metadata.json", "params.json")


def unrelated_files(path: Path) -> list[str]:
    """Checkpoint files at the top of ``path`` that are each a model of their own: two or more
    weight files that are no shards or rank files of one set, in a directory without a
    training checkpoint's other files (optimizer, scheduler, RNG state, args) or JSON state.

    Read as one checkpoint they would clash name for name (renamed ``name#2``); an HF
    directory's ``pytorch_model.bin`` beside its ``model.safetensors`` is left to the reader.

    Args:
        path: A directory the ``dir`` reader recognises.

    Returns:
        Their names, sorted; empty when the directory is one checkpoint.
    """
    files = checkpoint_files(path)
    if any((path / n).exists() for n in _STATE_FILES):
        return []
    if any(role_of(f.name) != "weights" for f in files):
        return []
    weights = [f.name for f in files if not _PART.search(f.name)]
    if any(n.endswith(".safetensors") for n in weights):
        weights = [n for n in weights if not (n.endswith(".bin") and n.startswith(
            ("pytorch_model", "adapter_model")))]
    return weights if len(weights) > 1 else []
