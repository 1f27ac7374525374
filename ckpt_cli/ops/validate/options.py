"""How one validation is run: :class:`Options` (what to check, threads, memory, the part's
share) and :class:`Split` (``--part``, ``--finalize``, ``--parts-dir``), built once by
:func:`ckpt_cli.ops.validate.validate` and passed to every check."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_cli.manifest import DEFAULT_ALGORITHM
from ckpt_cli.storage.reads import MEMORY_BUDGET, ProgressFn

if TYPE_CHECKING:
    from ckpt_cli.ops.validate.split import Share
    from ckpt_cli.parts import Part


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
    on_progress: ProgressFn | None = None
    max_memory: int = MEMORY_BUDGET
    share: Share | None = None
    allow_globals: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Split:
    """A validation split over processes: ``--part``, ``--finalize``, ``--parts-dir``."""

    part: Part | None = None
    finalize: bool = False
    parts_dir: Path | None = None
