"""``convert``'s plan: every output tensor and the dtype it is written in, decided before
anything is read or built.

A :class:`Plan` holds one :class:`Step` per output tensor (its output name, the source tensor,
the dtype written) and what the summary says about the selection (renames, drops, tied
aliases, notes, provenance). ``--to fp8`` then picks its weights on the plan
(:mod:`ckpt_cli.ops.convert.fp8`: :meth:`Plan.quantize`) and :mod:`~ckpt_cli.ops.convert.build`
builds the outputs once.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ckpt_cli.errors import UnsupportedError, UsageError
from ckpt_cli.formats import deepspeed
from ckpt_cli.formats.base import refuse_damaged
from ckpt_cli.formats.provenance import source_label
from ckpt_cli.formats.zero import ParamPlan, ZeroPlan, plan_zero
from ckpt_cli.model import CheckpointIndex, Finding, TensorInfo
from ckpt_cli.tensors.cast import CASTABLE, CastPlan, torch_speeds_up
from ckpt_cli.tensors.gather import restored_dtype, zero_metadata
from ckpt_cli.tensors.select import Selection, hostile_warning, hostile_warnings, select_tensors


@dataclass(slots=True)
class Step:
    """One output tensor.

    Attributes:
        name: Its output name.
        source: The tensor read (an index's :class:`TensorInfo` or a ZeRO :class:`ParamPlan`).
        dtype: The dtype written (for a weight to quantize, the dtype it is read in: FP32).
        plain: The dtype the cast plan alone gives it (before ``--to fp8`` picks weights).
        quantize: Written as an FP8 weight and its scale.
    """

    name: str
    source: TensorInfo | ParamPlan
    dtype: str
    plain: str
    quantize: bool = False


@dataclass(slots=True)
class Plan:
    """Every output tensor of a conversion, and what the summary says about them.

    Attributes:
        steps: One :class:`Step` per output tensor, in order.
        aliases: Tied tensors written once: ``{dropped name: kept name}``.
        cast: The cast plan (what it kept uncast is counted for the summary).
        renamed: How names were changed.
        dropped: Tensors left out, counted per group.
        meta: The ``__metadata__`` to write.
        notes: Plain-words remarks.
        warnings: Source files whose pickles would run code under ``torch.load``.
        index: The index read (None for ZeRO, gathered from its partitions).
        zero: The ZeRO reconstruction plan (None for an index).
        keep_optimizer: Optimizer state is kept (never cast).
    """

    steps: list[Step]
    aliases: dict[str, str]
    cast: CastPlan
    renamed: list[str]
    dropped: dict[str, int]
    meta: dict[str, str]
    notes: list[str]
    warnings: list[Finding]
    index: CheckpointIndex | None = None
    zero: ZeroPlan | None = None
    keep_optimizer: bool = False
    _fp8: list[str] = field(default_factory=list)

    def quantize(self, names: list[str]) -> None:
        """Mark the weights ``names`` to be quantized: each is read in FP32 (not rounded to
        BF16 first), as a ``--keep-fp32`` glob naming it would read it."""
        chosen = set(names)
        for s in self.steps:
            if s.name in chosen:
                s.quantize, s.dtype = True, self._read_dtype(s)
        self._fp8 = list(names)

    def _read_dtype(self, s: Step) -> str:
        t = s.source
        if isinstance(t, ParamPlan):
            base = restored_dtype(t)
            return base if t.kind == "moment" or base not in CASTABLE else "F32"
        if self.keep_optimizer and t.group not in ("model", "buffer"):
            return t.dtype
        if self.cast.is_kept(t.name):  # counted once, in the plain plan
            return s.plain
        return "F32" if t.is_floating else t.dtype

    def casts(self) -> Counter[str]:
        """``"F32->BF16"`` -> tensors. A quantized weight counts as ``->F8_E4M3`` only (and in
        ``->F32`` when ``--keep-fp32`` kept it in FP32, as it would have been)."""
        out: Counter[str] = Counter()
        for s in self.steps:
            src = s.source.dtype
            if not s.quantize:
                if s.dtype != src:
                    out[f"{src}->{s.dtype}"] += 1
                continue
            if s.plain == "F32" != src:
                out[f"{src}->F32"] += 1
            if s.dtype not in ("F32", src):
                out[f"{src}->{s.dtype}"] += 1
        if self._fp8:
            out["->F8_E4M3"] = len(self._fp8)
        return out

    def cast_elements(self) -> int:
        """Elements whose cast torch's kernels speed up (see ``prefer_torch``)."""
        return sum(s.source.numel for s in self.steps
                   if torch_speeds_up(s.source.dtype, s.dtype))


def plan_index(index: CheckpointIndex, src: Path, to: str, target: str | None, fmt: str,
               keep_fp32: tuple[str, ...], keep_optimizer: bool, keep_prefix: bool,
               container: str | None) -> Plan:
    """The plan for a checkpoint the readers index: the model's tensors, selected and renamed.

    Args:
        index: The source's index.
        src: The source, for the provenance.
        to: The ``--to`` choice as the provenance names it (``bf16``, ``fp8 (block)``...).
        target: The dtype floating tensors are cast to (None: kept).
        fmt: The output format.
        keep_fp32: Globs of output names kept in FP32.
        keep_optimizer: Keep every tensor under its own name.
        keep_prefix: Keep wrapper prefixes.
        container: The top-level container holding the weights.

    Raises:
        CkptError: Damage, or nothing to select.
    """
    try:
        sel = select_tensors(index, keep_optimizer=keep_optimizer, keep_prefix=keep_prefix,
                             container=container)
    except UsageError:
        # Damage that left nothing to select explains the empty selection better.
        refuse_damaged(index, (), also_files=(f.path for f in index.files))
        raise
    refuse_damaged(index, sel.names.values())
    aliases, order = _dedupe_tied(index, sel)
    cast = CastPlan(target, _castable(index, sel, keep_optimizer))
    steps = []
    for out_name in order:
        t = index.tensors[sel.names[out_name]]
        dst = _target_dtype(t, out_name, cast, keep_fp32, keep_optimizer)
        steps.append(Step(out_name, t, dst, dst))
    meta = _metadata(index, src, to, sel, keep_optimizer)
    if keep_optimizer and fmt == "safetensors" and index.objects:
        meta["ckpt.objects"] = orjson.dumps(index.objects, default=str).decode()
    return Plan(steps, aliases, cast, sel.renamed, sel.dropped, meta, list(sel.notes),
                hostile_warnings(index), index=index, keep_optimizer=keep_optimizer)


def plan_zero_gather(src: Path, to: str, target: str | None, keep_fp32: tuple[str, ...],
                     keep_optimizer: bool) -> Plan:
    """The plan for a DeepSpeed ZeRO 1/2/3 checkpoint: its full weights, gathered from the
    partitions (with ``keep_optimizer``, Adam's moments too, never cast).

    Args:
        src: A tag directory or a save directory with ``latest``.
        to: The ``--to`` choice as the provenance names it.
        target: The dtype floating tensors are cast to (None: kept).
        keep_fp32: Globs of output names kept in FP32.
        keep_optimizer: Gather the moments too.
    """
    zero = plan_zero(src, moments=keep_optimizer)
    cast = CastPlan(target, [])  # ZeRO's master weights are FP32: nothing quantized
    steps = []
    for t in zero.tensors:
        base = restored_dtype(t)
        if t.kind == "moment" or base not in CASTABLE:
            dst = base
        elif any(fnmatch.fnmatchcase(t.name, g) for g in keep_fp32):
            dst = "F32"
        else:
            dst = cast.dtype(t.name, base)
        steps.append(Step(t.name, t, dst, dst))
    notes = list(zero.notes) + ([] if keep_optimizer else [
        "optimizer moments are not part of the output (`keep_optimizer` keeps them)"])
    warnings = [hostile_warning(p, quals) for p, quals in zero.unsafe.items()]
    return Plan(steps, zero.aliases, cast, [], {}, zero_metadata(zero, src, to), notes,
                warnings, zero=zero, keep_optimizer=keep_optimizer)


def check_supported(index: CheckpointIndex, src: Path) -> None:
    """Refuse what convert cannot gather: one rank's ZeRO-3 placeholders, Megatron split
    over model-parallel ranks."""
    if index.format != "deepspeed" and src.is_file():
        tag = deepspeed.zero3_rank_file(src, index.metadata)
        if tag is not None:
            raise UsageError(
                f"{src}: one rank's ZeRO-3 model states; its weights are empty placeholders "
                "(the values are partitioned in the optimizer files)",
                hint=f"convert the tag directory ({tag}) or the save directory "
                     f"({tag.parent}), which are gathered whole")
    if index.format == "megatron" and index.layout.get("world_size", 1) > 1:
        raise UnsupportedError(
            f"Megatron checkpoint split over {index.layout['world_size']} model-parallel "
            "ranks; merging tensor/pipeline-parallel shards is not supported", path=index.root)


def _dedupe_tied(index: CheckpointIndex, sel: Selection) -> tuple[dict[str, str], list[str]]:
    """Tied tensors (one storage, identical view) are written once; the rest become aliases.

    The first name in checkpoint order is kept (the embedding, typically, whose output head
    alias transformers re-ties on load) and ``{alias: kept}`` recorded.
    """
    first: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    order: list[str] = []
    for out_name, src_name in sel.names.items():
        t = index.tensors[src_name]
        if t.storage is not None:
            key = (t.storage.file, t.storage.key, t.storage_offset, t.shape, t.stride, t.dtype)
            if key in first:
                aliases[out_name] = first[key]
                continue
            first[key] = out_name
        order.append(out_name)
    return aliases, order


def _castable(index: CheckpointIndex, sel: Selection,
              keep_optimizer: bool) -> list[tuple[str, str]]:
    """``(name, dtype)`` of the selected tensors ``--to`` may cast (model and buffers)."""
    tensors = (index.tensors[n] for n in sel.names.values())
    return [(t.name, t.dtype) for t in tensors
            if not keep_optimizer or t.group in ("model", "buffer")]


def _target_dtype(t: TensorInfo, name: str, plan: CastPlan, keep_fp32: tuple[str, ...],
                  keep_optimizer: bool) -> str:
    if keep_optimizer and t.group not in ("model", "buffer"):
        return t.dtype
    if plan.is_kept(t.name):  # quantized, or a quantized tensor's scale: never cast
        return plan.dtype(t.name, t.dtype)
    if not t.is_floating:
        return t.dtype
    if any(fnmatch.fnmatchcase(name, g) for g in keep_fp32):
        return "F32"
    return plan.dtype(t.name, t.dtype)


def _metadata(index: CheckpointIndex, src: Path, to: str, sel: Selection,
              keep_optimizer: bool) -> dict[str, str]:
    steps = [f"to={to}"]
    if not keep_optimizer:
        dropped = ", ".join(f"{g} {n}" for g, n in sorted(sel.dropped.items()) if n)
        steps.append(f"dropped: {dropped or 'nothing'}")
    steps.extend(sel.renamed)
    meta = {"ckpt.source": source_label(src), "ckpt.source_format": index.format,
            "ckpt.conversion": "; ".join(steps)}
    for key in ("step", "epoch"):
        if key in index.metadata:
            meta[f"ckpt.{key}"] = str(index.metadata[key])
    return meta
