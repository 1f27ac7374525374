"""The options of :func:`ckpt_cli.ops.diff.diff`: :class:`DiffOptions`, each field the one
declaration of a ``ckpt diff`` flag and a ``ckpt_cli.diff()`` keyword (light: the command
line builds its flags from it without importing the op)."""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_cli.choices import InputFormat
from ckpt_cli.ops.options import common
from ckpt_cli.optionspec import option

BLOCK_ELEMENTS = 1 << 18
"""Elements per block when comparing values: 1 MB of float32, small enough to stay in cache."""


@dataclass(frozen=True, slots=True)
class DiffOptions:
    """What :func:`~ckpt_cli.ops.diff.diff` compares and how (``ckpt diff``'s options,
    declared once: see :mod:`ckpt_cli.optionspec`). ``max_memory`` is bytes here; the command
    line and the API also take it as text (``512MB``).

    Attributes:
        block: Elements per block when comparing values (no option: a tuning knob for tests).
    """

    structure_only: bool = option(False, help=(
        "Compare names, shapes and dtypes only; read no tensor data."))
    all_tensors: bool = option(False, aliases=("--all",), old_keywords=("all",), help=(
        "Compare every tensor (optimizer state, RNG state...), not only model weights and "
        "buffers."))
    strip_prefix: tuple[str, ...] = option((), metavar="PREFIX", kind="names", help=(
        "Remove PREFIX from tensor names on both sides before matching (repeatable; in "
        "order)."))
    exact_names: bool = option(False, help=(
        "Do not strip wrapper prefixes (module., _orig_mod., model., state_dict., "
        "model_state_dict.) automatically."))
    rtol: float | None = option(None, min=0, metavar="X", help=(
        "Relative tolerance for floats. Default: exact for the same dtype, the coarser "
        "dtype's epsilon across dtypes."))
    atol: float | None = option(None, min=0, metavar="X", help=(
        "Absolute tolerance for floats. Default: 0 for the same dtype, the coarser dtype's "
        "smallest subnormal across dtypes."))
    name_glob: str | None = option(None, metavar="GLOB", aliases=("--filter",),
                                   old_keywords=("filter",), help=(
        "Only tensors whose name (after prefix stripping) matches this glob, e.g. "
        "'layers.*.attn.*'."))
    by_module: bool = option(False, help="Add a roll-up of changes per module.")
    depth: int | None = option(None, min=1, metavar="N", help=(
        "Name components per module of `by_module` (default: the tensor's own module)."))
    metadata: bool = option(True, help=(
        "Compare non-tensor values (step, epoch, lr, hyper-parameters)."))
    input_format_a: InputFormat | None = option(None, metavar="NAME", help=(
        f"Skip detection and read A as this format: {common.INPUT_FORMATS}."))
    input_format_b: InputFormat | None = option(None, metavar="NAME", help=(
        f"Skip detection and read B as this format: {common.INPUT_FORMATS}."))
    max_memory: int | None = common.max_memory("the tensors compared at once")
    concurrency: int | None = common.concurrency()
    block: int = BLOCK_ELEMENTS
