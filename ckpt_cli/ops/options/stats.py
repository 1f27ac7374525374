"""The options of :func:`ckpt_cli.ops.stats.stats`: :class:`StatsOptions`, each field the one
declaration of a ``ckpt stats`` flag and a ``ckpt_cli.stats()`` keyword (light: the command
line builds its flags from it without importing the op)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckpt_cli.choices import InputFormat
from ckpt_cli.ops.options import common
from ckpt_cli.optionspec import option
from ckpt_cli.parts import Part

DEFAULT_JUMP = 2.0
"""``jump``'s default: a module whose weight norm more than doubles from one checkpoint to the
next. An optimizer step moves each weight by about the learning rate; between two checkpoints
of a healthy run a module's norm changes by a few percent (more in the first steps from
initialization, where norms grow smoothly), while a loss spike, a bad data batch or a
corrupted save multiplies it at once."""


@dataclass(frozen=True, slots=True)
class StatsOptions:
    """What :func:`~ckpt_cli.ops.stats.stats` computes (``ckpt stats``'s options, declared
    once: see :mod:`ckpt_cli.optionspec`). ``max_memory`` is bytes here; the command line and
    the API also take it as text (``512MB``)."""

    all_tensors: bool = option(False, aliases=("--all",), old_keywords=("all",), help=(
        "Every tensor (optimizer state: exp_avg, exp_avg_sq...), not only model weights and "
        "buffers."))
    name_glob: str | None = option(None, metavar="GLOB", aliases=("--filter",),
                                   old_keywords=("filter",), help=(
        "Only tensors whose name matches this glob, e.g. 'layers.*.attn.*'."))
    depth: int | None = option(None, min=1, metavar="N", help=(
        "Name components per module of the roll-up (default: the tensor's own module)."))
    hist: bool = option(False, help=(
        "Show the histogram of |x| (log-spaced: one bin per power of 2; always computed and "
        "cached)."))
    every: int | None = option(None, min=1, metavar="N", help=(
        "Run directory: every Nth checkpoint, counted back from the newest."))
    last: int | None = option(None, min=1, metavar="N", help=(
        "Run directory: only the newest N checkpoints (after `every`)."))
    jump: float = option(DEFAULT_JUMP, metavar="X", help=(
        "Run directory: flag a module whose L2 norm grows more than X times from one "
        "checkpoint to the next."))
    no_cache: bool = option(False, help="Read every value again; keep nothing in the cache.")
    cache_dir: Path | None = option(None, metavar="DIR", kind="path", help=(
        "Where figures are kept (default: $CKPT_CACHE_DIR, else ~/.cache/ckpt); give `part`'s "
        "processes one they share, owned by the user they run as and writable by no one "
        "else."))
    jobs: int | None = option(None, short="-j", min=1, metavar="N", help=(
        "Tensors read at once (default: CPUs)."))
    part: Part | None = common.part()
    pattern: str | None = common.pattern()
    input_format: InputFormat | None = common.input_format()
    allow_global: tuple[str, ...] = common.allow_global()
    max_memory: int | None = common.max_memory("the values being read")
    concurrency: int | None = common.concurrency()
