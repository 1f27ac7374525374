"""The options of :func:`ckpt_cli.ops.inspect.inspect` (light: the command line builds
``ckpt inspect``'s flags from it without importing the op)."""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_cli.choices import InputFormat, InspectSort
from ckpt_cli.optionspec import option


@dataclass(frozen=True, slots=True)
class InspectOptions:
    """What :func:`inspect` shows (``ckpt inspect``'s options, declared once: see
    :mod:`ckpt_cli.optionspec`)."""

    tensors: bool = option(False, short="-t", help=(
        "List the tensors (over 1,000: the first and last 500 and a row counting the rest)."))
    name_glob: str | None = option(None, metavar="GLOB", aliases=("--filter",),
                                   old_keywords=("filter",), help=(
        "Only tensors whose name matches this glob (e.g. '*.attn.*'); implies `tensors`."))
    sort: InspectSort = option("name", metavar="size|name", help=(
        "Order of the tensors: name (file order) or size (largest first)."))
    tree: bool = option(False, help="Parameters grouped by module prefix.")
    depth: int = option(3, min=1, help="Levels of `tree`.")
    pattern: str | None = option(None, metavar="REGEX", help=(
        "Run directories: which entries are checkpoints (a 'step' group gives the step)."))
    input_format: InputFormat | None = option(None, short="-F", metavar="NAME", help=(
        "Skip detection and read the input as this format: safetensors, hf-index, torch, "
        "dcp, deepspeed, megatron or dir."))
    allow_global: tuple[str, ...] = option((), metavar="MODULE.NAME", kind="names", help=(
        "Trust this pickle global (repeatable), like torch's add_safe_globals; every other "
        "global outside ckpt's allowlist is an error."))
