"""What ``ckpt stats`` computes and shows: :class:`StatsOptions`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckpt_cli.parts import Part

DEFAULT_JUMP = 2.0
"""``jump``'s default: a module whose weight norm more than doubles from one checkpoint to the
next. An optimizer step moves each weight by about the learning rate; between two checkpoints
of a healthy run a module's norm changes by a few percent (more in the first steps from
initialization, where norms grow smoothly), while a loss spike, a bad data batch or a
corrupted save multiplies it at once."""


@dataclass(frozen=True, slots=True)
class StatsOptions:
    """Options of :func:`ckpt_cli.ops.stats.stats`.

    Attributes:
        everything: Every tensor (optimizer state, buffers, other state), not only model
            weights and buffers.
        filter_glob: Only tensors whose name matches this glob.
        depth: Name components per module of the roll-up (None: the tensor's own module).
        hist: Put each tensor's and module's histogram of ``|x|`` (by binade) in the result's
            document (it is always computed, and cached).
        every: Run directories: every Nth checkpoint, counted back from the newest.
        last: Run directories: only the newest N checkpoints (after ``every``).
        jump: Run directories: flag a module whose norm grows by more than this factor from
            one checkpoint to the next.
        cache: Keep and reuse figures in the cache directory.
        cache_dir: The cache directory (default: ``$CKPT_CACHE_DIR``, else
            ``$XDG_CACHE_HOME/ckpt``, else ``~/.cache/ckpt``).
        fmt: Read the input as this format instead of detecting it.
        pattern: Run directories: a regex choosing which entries are checkpoints.
        jobs: Tensors read at once (default: the usable CPUs).
        max_memory: Memory budget in bytes for the values being read (default 256 MiB).
        part: Compute only this part's share of the figures (into the cache).
        allow_globals: Pickle globals the user trusts: their findings become notes.
    """

    everything: bool = False
    filter_glob: str | None = None
    depth: int | None = None
    hist: bool = False
    every: int | None = None
    last: int | None = None
    jump: float = DEFAULT_JUMP
    cache: bool = True
    cache_dir: Path | None = None
    fmt: str | None = None
    pattern: str | None = None
    jobs: int | None = None
    max_memory: int | None = None
    part: Part | None = None
    allow_globals: tuple[str, ...] = ()
