"""The options of :func:`ckpt_cli.ops.validate.validate`: :class:`ValidateOptions` (the public
one, ``ckpt validate``'s flags with their defaults), and the two it is resolved into once, then
passed to every check: :class:`Options` (what to check, threads, memory, the part's share) and
:class:`Split` (``--part``, ``--finalize``, ``--parts-dir``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_cli.manifest import DEFAULT_ALGORITHM
from ckpt_cli.parts import Part
from ckpt_cli.progress import Progress
from ckpt_cli.storage.reads import MEMORY_BUDGET

if TYPE_CHECKING:
    from ckpt_cli.ops.validate.split import Share


@dataclass(frozen=True, slots=True)
class ValidateOptions:
    """What :func:`~ckpt_cli.ops.validate.validate` checks (``ckpt validate``'s flags; the
    defaults are theirs).

    Attributes:
        fmt: Read the input as this format (skips detection and run-directory handling).
        latest: For a run directory, validate only the checkpoint training would resume from:
            the one a resume pointer names, else the newest by step (never an HF Trainer
            final model while checkpoints lie beside it); the result's ``latest`` says which.
        quick: Structure only: skip the CRC-32 pass and DCP item decoding (no data is read).
        values: Also read every floating tensor and report NaN, Inf and all-zero tensors.
        require: ``optimizer`` and/or ``step``: their absence becomes an error.
        write_manifest: Write (or refresh) the integrity manifest of each valid checkpoint.
        manifest_algorithm: Checksum for a written manifest: one of :data:`ALGORITHMS`.
        jobs: Threads for CRC and hashing (default: usable CPUs, at most 8).
        pattern: For run directories, a regex choosing the checkpoint entries.
        part: Check in depth only this part's share of the files (``K/N``, ``auto`` or a
            :class:`~ckpt_cli.parts.Part`), record it in a receipt, and finalize when every
            part's receipt is there (one checkpoint only; see :mod:`.split`).
        finalize: Merge every part's receipt into the report (and write the manifest);
            parts missing, or planned with other options, are an error.
        parts_dir: Where the parts' receipts go (default: a hidden sibling of the checkpoint),
            for read-only checkpoint storage.
        max_memory: Memory budget in bytes for data being checked (the ``--values`` scan;
            the CRC and hashing buffers, a small one per thread); default 256 MiB, and a
            tensor that must be read whole may add its size.
        allow_globals: Pickle globals the user trusts (``module.name``): their findings
            become notes instead of errors.
    """

    fmt: str | None = None
    latest: bool = False
    quick: bool = False
    values: bool = False
    require: str | Iterable[str] | None = None
    write_manifest: bool = False
    manifest_algorithm: str = DEFAULT_ALGORITHM
    jobs: int | None = None
    pattern: str | None = None
    part: Part | str | None = None
    finalize: bool = False
    parts_dir: str | Path | None = None
    max_memory: int | None = None
    allow_globals: Iterable[str] = ()


@dataclass(frozen=True, slots=True)
class Options:
    """How to validate (see :func:`ckpt_cli.ops.validate.validate`)."""

    fmt: str | None = None
    quick: bool = False
    values: bool = False
    require: tuple[str, ...] = ()
    write_manifest: bool = False
    manifest_algorithm: str = DEFAULT_ALGORITHM
    jobs: int = 1
    on_progress: Progress | None = None
    max_memory: int = MEMORY_BUDGET
    share: Share | None = None
    allow_globals: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Split:
    """A validation split over processes: ``--part``, ``--finalize``, ``--parts-dir``."""

    part: Part | None = None
    finalize: bool = False
    parts_dir: Path | None = None
