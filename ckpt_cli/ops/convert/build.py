"""``convert``'s build: the output tensors of a :class:`~ckpt_cli.ops.convert.plan.Plan`,
each a loader (whole, or in pieces within the memory budget) that reads, casts and, for a
weight the plan quantizes, rounds to FP8 beside its scale. Built once; nothing is read until
the writer asks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_cli import fp8
from ckpt_cli.model import Finding, TensorInfo
from ckpt_cli.ops.convert.plan import Plan
from ckpt_cli.tensors.cast import CastPlan, CastStats, cast_array, piece_caster
from ckpt_cli.tensors.gather import zero_outputs
from ckpt_cli.tensors.source import TensorSource
from ckpt_cli.writers import OutTensor

if TYPE_CHECKING:
    import numpy as np


@dataclass(slots=True)
class Built:
    """The output tensors of a conversion and what the summary says about them."""

    outs: list[OutTensor]
    aliases: dict[str, str]
    casts: Counter[str]
    plan: CastPlan
    renamed: list[str]
    dropped: dict[str, int]
    meta: dict[str, str]
    notes: list[str]
    warnings: list[Finding]
    close: Callable[[], None]
    cast_elements: int


def build(plan: Plan, src: Path, clamp: bool, stats: CastStats, layout: str) -> Built:
    """The output tensors of ``plan``, once.

    Args:
        plan: What to write, tensor by tensor.
        src: The source (a ZeRO checkpoint's directory).
        clamp: Clamp FP16 overflow instead of counting it for a refusal.
        stats: Where FP16 overflow is counted.
        layout: The FP8 layout of the weights the plan quantizes.

    Returns:
        The :class:`Built` outputs (close them when written).
    """
    if plan.zero is not None:
        dtypes = {s.name: s.dtype for s in plan.steps}
        zero = zero_outputs(src, lambda t, _base: dtypes[t.name], stats, clamp,
                            moments=plan.keep_optimizer, plan=plan.zero)
        outs, close = zero.outs, zero.reader.close
    else:
        assert plan.index is not None
        reader = TensorSource(plan.index)
        outs = [_index_out(reader, s.source, s.name, s.dtype, clamp, stats)  # type: ignore[arg-type]
                for s in plan.steps]
        close = reader.close
    quantized = {s.name for s in plan.steps if s.quantize}
    if quantized:
        outs = [q for o in outs for q in (_fp8_outs(o, layout) if o.name in quantized else (o,))]
    return Built(outs, plan.aliases, plan.casts(), plan.cast, plan.renamed, plan.dropped,
                 plan.meta, plan.notes, plan.warnings, close, plan.cast_elements())


def _index_out(reader: TensorSource, t: TensorInfo, name: str, dst: str, clamp: bool,
               stats: CastStats) -> OutTensor:
    # A cast reads every value once: map the file rather than copy it (as _loader does).
    pieces_of = partial(reader.iter_pieces, mapped=dst != t.dtype)
    return OutTensor(name, dst, t.shape, _loader(reader, t, dst, name, clamp, stats),
                     piece_caster(pieces_of, t, dst, name, clamp, stats))


def _loader(src: TensorSource, t: TensorInfo, dst: str, name: str, clamp: bool,
            stats: CastStats) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        if dst == t.dtype:
            return src.read(t)
        # The cast reads every value once: map the file instead of copying it first.
        return cast_array(src.read(t, mapped=True), dst, name=name, clamp=clamp, stats=stats)
    return load


def _fp8_outs(o: OutTensor, layout: str) -> tuple[OutTensor, OutTensor]:
    """A weight read in FP32 as its FP8 weight and its scale."""
    q = fp8.Quantized(o.load, layout, o.name, pieces=o.pieces, shape=o.shape)
    module = o.name[: -len(".weight")]
    return (OutTensor(o.name, "F8_E4M3", o.shape, q.weight, q.weight_pieces),
            OutTensor(f"{module}.{fp8.scale_name(layout)}", "F32",
                      fp8.scale_shape(o.shape, layout), q.scale))
