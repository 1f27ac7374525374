"""The options of :func:`ckpt_cli.ops.validate.validate`: :class:`ValidateOptions` (the public
one, declared in :mod:`ckpt_cli.ops.options.validate` and re-exported here), and the two it is
resolved into once, then passed to every check: :class:`Options` (what to check, threads,
memory, the part's share) and :class:`Split` (``part``, ``finalize``, ``parts_dir``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_cli.manifest import DEFAULT_ALGORITHM
from ckpt_cli.ops.options.validate import ValidateOptions as ValidateOptions
from ckpt_cli.parts import Part
from ckpt_cli.progress import Progress
from ckpt_cli.storage.reads import MEMORY_BUDGET

if TYPE_CHECKING:
    from ckpt_cli.ops.validate.split import Share


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
