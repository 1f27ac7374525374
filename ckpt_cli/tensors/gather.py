"""Full tensors rebuilt from DeepSpeed ZeRO partitions, for the commands that write them.

``consolidate`` and ``convert`` both take a ZeRO 1/2/3 checkpoint: the plan
(:func:`ckpt_cli.formats.zero.plan_zero`) says where each parameter's pieces lie in the rank
files, and each output tensor is gathered with positioned reads when the writer asks for it,
cast on the way (:mod:`ckpt_cli.tensors.cast`). No rank's optimizer state is ever loaded whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli.formats.provenance import source_label
from ckpt_cli.formats.zero import ParamPlan, PieceReader, ZeroPlan, plan_zero
from ckpt_cli.tensors.cast import CastStats, cast_array, piece_caster, torch_speeds_up
from ckpt_cli.tensors.source import split_pieces
from ckpt_cli.writers import OutTensor

if TYPE_CHECKING:
    import numpy as np


@dataclass(slots=True)
class ZeroOutputs:
    """The output tensors of a ZeRO checkpoint and what gathering them needs.

    Attributes:
        plan: The reconstruction plan (stage, world size, step, aliases, notes, unsafe files).
        outs: One :class:`OutTensor` per planned tensor, in zero_to_fp32's order.
        loads: Each output's loader by name (``consolidate --verify`` re-reads through it).
        cast_elements: Elements whose cast torch's kernels speed up (``torch_speeds_up``).
        reader: The open rank files; close it when the write is done.
    """

    plan: ZeroPlan
    outs: list[OutTensor] = field(default_factory=list)
    loads: dict[str, Callable[[], np.ndarray]] = field(default_factory=dict)
    cast_elements: int = 0
    reader: PieceReader = field(default_factory=PieceReader)


def restored_dtype(t: ParamPlan) -> str:
    """The dtype a planned tensor is gathered in: floating buffers saved in FP16/BF16 are
    restored to FP32, as zero_to_fp32 does (parameters already are FP32)."""
    return "F32" if t.kind == "buffer" and t.dtype in ("F16", "BF16") else t.dtype


def zero_outputs(src: Path, dtype_for: Callable[[ParamPlan, str], str], stats: CastStats,
                 clamp: bool, *, moments: bool = False,
                 plan: ZeroPlan | None = None) -> ZeroOutputs:
    """Plan a ZeRO checkpoint's full tensors and how each is gathered and cast.

    Floating buffers saved in FP16/BF16 are restored to FP32 first, as zero_to_fp32 does
    (parameters already are FP32: the optimizer's master copy).

    Args:
        src: A tag directory (``global_stepN``) or a save directory with ``latest``.
        dtype_for: The dtype to write for a planned tensor, given it and its (restored) dtype.
        stats: Where FP16 overflow is counted.
        clamp: Clamp FP16 overflow instead of counting it for a refusal.
        moments: Also gather Adam's moments (``optimizer.state.<param>.exp_avg``...).
        plan: The plan, when already made (``plan_zero(src, moments=moments)``).

    Returns:
        The :class:`ZeroOutputs`.

    Raises:
        CkptError: Missing or damaged rank files, an unknown layout.
    """
    res = ZeroOutputs(plan if plan is not None else plan_zero(src, moments=moments))
    read = res.reader.read
    for t in res.plan.tensors:
        dst = dtype_for(t, restored_dtype(t))
        res.cast_elements += t.numel if torch_speeds_up(t.dtype, dst) else 0
        load = cast_loader(read, t, dst, stats, clamp)
        res.outs.append(OutTensor(t.name, dst, t.shape, load, piece_caster(
            lambda p: split_pieces(read(p)), t, dst, t.name, clamp, stats)))
        res.loads[t.name] = load
    return res


def cast_loader(read: Callable[[Any], np.ndarray], t: Any, dst: str, stats: CastStats,
                clamp: bool) -> Callable[[], np.ndarray]:
    """A loader: read ``t`` and cast it to ``dst`` (counting FP16 overflow in ``stats``).

    Args:
        read: Reads a tensor whole.
        t: The tensor (its ``dtype`` and ``name``).
        dst: The dtype to return.
        stats: Where FP16 overflow is counted.
        clamp: Clamp FP16 overflow.

    Returns:
        A function returning the values in ``dst``.
    """
    def load() -> np.ndarray:
        arr = read(t)
        return arr if dst == t.dtype else cast_array(arr, dst, name=t.name, clamp=clamp,
                                                     stats=stats)
    return load


def zero_metadata(plan: ZeroPlan, src: Path, to: str | None) -> dict[str, str]:
    """The ``__metadata__`` of an output gathered from ZeRO partitions.

    Args:
        plan: The reconstruction plan.
        src: The checkpoint read.
        to: The ``--to`` choice (None or ``keep``: no cast).

    Returns:
        ``ckpt.source``, ``ckpt.source_format``, ``ckpt.conversion`` and ``ckpt.step``.
    """
    meta = {"ckpt.source": source_label(src), "ckpt.source_format": "deepspeed",
            "ckpt.conversion": f"ZeRO-{plan.stage} partitions of {plan.world_size} ranks "
                               f"gathered; to={to or 'keep'}"}
    if plan.step is not None:
        meta["ckpt.step"] = str(plan.step)
    return meta
