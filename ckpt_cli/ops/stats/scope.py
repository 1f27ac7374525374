"""Which tensors of a checkpoint ``ckpt stats`` reads, and how: model weights and buffers by
default (every tensor with ``everything``), FP8 weights with a scale dequantized and their
scales not on their own, tied names (views of the same bytes) read once."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from ckpt_cli import dtypes
from ckpt_cli.fp8 import scheme as fp8_scheme
from ckpt_cli.model import CheckpointIndex
from ckpt_cli.ops.stats.engine import Target

WEIGHT_GROUPS = ("model", "buffer")


@dataclass(slots=True)
class Scope:
    """What is read of one checkpoint.

    Attributes:
        targets: Tensors read, by name.
        aliases: Names that view the same bytes as a name read (tied weights): name -> it.
        skipped: Tensors in scope whose values cannot be read, with why.
        scales: Scales read with their FP8 weight, not on their own.
        widened: The scope is every tensor because the checkpoint holds no model weights.
    """

    targets: dict[str, Target] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    scales: set[str] = field(default_factory=set)
    widened: bool = False


def scope_of(index: CheckpointIndex, *, everything: bool = False,
             filter_glob: str | None = None) -> Scope:
    """The tensors of ``index`` that ``ckpt stats`` reads.

    Args:
        index: The checkpoint.
        everything: Every tensor, not only model weights and buffers.
        filter_glob: Only names matching this glob.

    Returns:
        The :class:`Scope`.
    """
    out = Scope()
    tensors = index.tensors
    names = list(tensors) if everything else [n for n, t in tensors.items()
                                               if t.group in WEIGHT_GROUPS]
    if not names and not everything and tensors:
        names, out.widened = list(tensors), True  # an optimizer-only file: its state
    pairs: dict[str, fp8_scheme.Pair] = {}
    if any(t.dtype in fp8_scheme.FP8_DTYPES for t in tensors.values()):
        qc, _ = fp8_scheme.read_quantization_config(index)
        pairing = fp8_scheme.pair_scales(tensors, qc)
        pairs = pairing.pairs
        out.scales = pairing.scale_names()
    seen: dict[tuple[object, ...], str] = {}
    for name in names:
        if name in out.scales:
            continue
        if filter_glob is not None and not fnmatch.fnmatchcase(name, filter_glob):
            continue
        t = tensors[name]
        if t.kind != "dense":
            out.skipped[name] = f"a {t.kind} tensor (no dense values to read)"
            continue
        info = dtypes.DTYPES.get(t.dtype)
        if info is None or info.numpy_name is None:
            out.skipped[name] = f"{t.dtype} values are packed below a byte (not read)"
            continue
        key = (t.file, t.offset, t.shape, t.stride, t.dtype, t.chunks)
        if t.file is not None and key in seen:
            out.aliases[name] = seen[key]
            continue
        seen[key] = name
        pair = pairs.get(name)
        out.targets[name] = Target(t, pair.scale if pair is not None else None)
    return out
