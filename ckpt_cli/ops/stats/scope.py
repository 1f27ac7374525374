"""Which tensors of a checkpoint ``ckpt stats`` reads, and how: model weights and buffers by
default (every tensor with ``everything``), FP8 weights with a scale dequantized and their
scales not on their own, tied names (views of the same bytes) read once.

DeepSpeed ZeRO-3 keeps no parameter whole: the model states hold ``[0]`` placeholders and the
weights are flat FP32 partitions in every rank's optimizer file, each padded (the padding is
whatever memory held), and frozen parameters as fragments in every rank's model states. Each
placeholder is read as its parameter gathered from them (:mod:`ckpt_cli.formats.zero`, as
zero_to_fp32 and ``consolidate`` rebuild it), and its entry in the index becomes the gathered
parameter's (its real shape and dtype). By default the partitions and fragments themselves and
the other ranks' copies of the model states are left out (they are the same weights again,
padding included); ``everything`` reads them as stored.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from ckpt_cli import dtypes
from ckpt_cli.errors import CkptError
from ckpt_cli.formats import deepspeed
from ckpt_cli.formats.zero import plan_zero
from ckpt_cli.fp8 import scheme as fp8_scheme
from ckpt_cli.model import CheckpointIndex, TensorInfo
from ckpt_cli.ops.stats.engine import Target

if TYPE_CHECKING:
    from ckpt_cli.formats.zero import ParamPlan

WEIGHT_GROUPS = ("model", "buffer")


@dataclass(slots=True)
class Scope:
    """What is read of one checkpoint.

    Attributes:
        targets: Tensors read, by name.
        aliases: Names that view the same bytes as a name read (tied weights): name -> it.
        skipped: Tensors in scope whose values cannot be read, with why.
        damaged: Those of them that cannot be read because the checkpoint is damaged (ZeRO-3
            partitions that cannot be gathered), not because of what they are: anomalies.
        scales: Scales read with their FP8 weight, not on their own.
        widened: The scope is every tensor because the checkpoint holds no model weights.
    """

    targets: dict[str, Target] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    damaged: dict[str, str] = field(default_factory=dict)
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
    zero = _zero3(index, everything)
    tensors = index.tensors
    names = list(tensors) if everything else [n for n, t in tensors.items()
                                               if t.group in WEIGHT_GROUPS and n not in zero.hidden]
    if not names and not everything and tensors:
        names, out.widened = list(tensors), True  # an optimizer-only file: its state
    pairs: dict[str, fp8_scheme.Pair] = {}
    if any(t.dtype in fp8_scheme.FP8_DTYPES for t in tensors.values()):
        qc, _ = fp8_scheme.read_quantization_config(index)
        pairing = fp8_scheme.pair_scales(tensors, qc)
        pairs = pairing.pairs
        out.scales = pairing.scale_names()
    # Tied names view the same bytes the same way (TensorInfo.view_key). Keys are compared
    # only between tensors starting at the same place of a file: a million tensors' keys,
    # each a tuple, are not all made and kept.
    first_at: dict[str | None, dict[int | None, str]] = {}
    keys_at: dict[tuple[str | None, int | None], dict[tuple[object, ...], str]] = {}
    zeroed = bool(zero.plans or zero.tied or zero.unread)
    targets = out.targets
    packed: dict[str, bool] = {}  # dtype -> whether its values are packed below a byte
    for name in names:
        if out.scales and name in out.scales:
            continue
        if filter_glob is not None and not fnmatch.fnmatchcase(name, filter_glob):
            continue
        t = tensors[name]
        if zeroed:
            if name in zero.plans:
                targets[name] = Target(t, zero=zero.plans[name])
                continue
            if name in zero.tied:
                out.aliases[name] = zero.tied[name]
                continue
            if name in zero.unread:
                out.skipped[name] = out.damaged[name] = zero.unread[name]
                continue
        if t.kind != "dense":
            out.skipped[name] = f"a {t.kind} tensor (no dense values to read)"
            continue
        below = packed.get(t.dtype)
        if below is None:
            info = dtypes.DTYPES.get(t.dtype)
            below = packed[t.dtype] = info is None or info.numpy_name is None
        if below:
            out.skipped[name] = f"{t.dtype} values are packed below a byte (not read)"
            continue
        if t.file is not None:
            at = first_at.get(t.file)
            if at is None:
                at = first_at[t.file] = {}
            other = at.get(t.offset)
            if other is None:
                at[t.offset] = name
            else:
                keys = keys_at.get((t.file, t.offset))
                if keys is None:
                    k0 = tensors[other].view_key
                    keys = keys_at[(t.file, t.offset)] = {k0: other} if k0 is not None else {}
                key = t.view_key
                if key is not None:
                    if key in keys:
                        out.aliases[name] = keys[key]
                        continue
                    keys[key] = name
        pair = pairs.get(name) if pairs else None
        targets[name] = Target(t, pair.scale if pair is not None else None)
    for name, same in index.aliases.items():  # tied copies found by value (DCP): read once
        if name in out.targets and same in out.targets:
            del out.targets[name]
            out.aliases[name] = same
    return out


_FLAT_GROUP = re.compile(r"(?:^|\.)fp32_flat_groups\.\d+$")
_FROZEN = "frozen_param_fragments."  # a rank's share of the frozen parameters


@dataclass(slots=True)
class _Zero3:
    """How a ZeRO-3 checkpoint's parameters are read (empty for any other checkpoint).

    Attributes:
        plans: Placeholder name -> how to gather its parameter.
        tied: Shared parameters: name -> the name read.
        unread: Placeholders whose partitions cannot be gathered, with why.
        hidden: Names left out of the default scope.
    """

    plans: dict[str, ParamPlan] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    unread: dict[str, str] = field(default_factory=dict)
    hidden: set[str] = field(default_factory=set)


def _zero3(index: CheckpointIndex, everything: bool) -> _Zero3:
    """A ZeRO-3 checkpoint's parameters as gathered from its partitions (see the module
    notes); the index's entries of the placeholders become the gathered parameters'."""

    out = _Zero3()
    if not deepspeed.is_zero3(index):
        return out

    if not everything:
        stems = [PurePosixPath(f.path).stem + "." for f in index.files
                 if deepspeed.MODEL_STATES.match(PurePosixPath(f.path).name)]
        out.hidden = {n for n in index.tensors
                      if _FLAT_GROUP.search(n) or n.startswith(_FROZEN)
                      or any(n.startswith(s) for s in stems)}
    try:
        plan = plan_zero(index.root)
    except CkptError as e:
        where = f" ({PurePosixPath(e.path).name})" if e.path else ""
        out.unread = {n: f"its ZeRO-3 partitions cannot be gathered: {e.message}{where}"
                      for n, t in index.tensors.items()
                      if n.startswith("module.") and t.numel == 0}
        return out
    for p in plan.tensors:
        name = f"module.{p.name}"
        t = index.tensors.get(name)
        if p.kind not in ("param", "frozen") or t is None:
            continue
        if t.file is not None:  # the placeholder (not yet replaced by an earlier call)
            index.tensors[name] = TensorInfo(
                name, p.dtype, p.shape, p.numel * dtypes.DTYPES[p.dtype].itemsize,
                group=t.group)
        out.plans[name] = p
    out.tied = {f"module.{a}": f"module.{b}" for a, b in plan.aliases.items()
                if f"module.{a}" in index.tensors and f"module.{b}" in out.plans}
    for a, b in out.tied.items():
        out.plans.pop(a, None)
        if index.tensors[a].file is not None:
            index.tensors[a] = dataclasses.replace(index.tensors[b], name=a,
                                                   group=index.tensors[a].group)
    return out
