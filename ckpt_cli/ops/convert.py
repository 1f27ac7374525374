"""``convert``: training -> inference, FP32 -> FP16/BF16, torch -> safetensors.

From any checkpoint the readers know, keep the model weights and buffers (found inside the
usual containers, with wrapper prefixes stripped), drop optimizer state, schedulers and RNG
state, cast floating tensors, and write safetensors (or a torch zip), sharded HF-style when
asked. Values stream one tensor at a time (a large tensor in pieces, so memory stays within a
fixed budget) through a cast that checks FP16's range across the whole tensor; the output
appears only when complete.
"""

from __future__ import annotations

import fnmatch
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from ckpt_cli import storage
from ckpt_cli.atomic import check_not_input
from ckpt_cli.cast import (
    FP16_MAX,
    TARGETS,
    CastStats,
    cast_array,
    check_overflow,
    piece_caster,
    prefer_torch,
)
from ckpt_cli.errors import UnsupportedError, UsageError
from ckpt_cli.formats import check_exists, read_index
from ckpt_cli.formats.base import refuse_damaged
from ckpt_cli.formats.provenance import source_label
from ckpt_cli.model import CheckpointIndex, TensorInfo
from ckpt_cli.parts import Part, source_identity
from ckpt_cli.results import ConvertResult
from ckpt_cli.runs import follow_pointer, is_run_dir
from ckpt_cli.selection import Selection, hostile_warnings, select_tensors
from ckpt_cli.streaming import memory_budget
from ckpt_cli.tensors import TensorSource
from ckpt_cli.writers import SIDE_FILES, OutTensor, output_format, write_checkpoint
from ckpt_cli.writers.parts import PartJob

if TYPE_CHECKING:
    import numpy as np

_CASTABLE = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
             "F8_E8M0"}




def convert(source: str | Path, output: str | Path, *, to: str = "keep",
            fmt: str | None = None, max_shard_size: int | None = None,
            keep_optimizer: bool = False, keep_prefix: bool = False,
            keep_fp32: tuple[str, ...] = (), clamp: bool = False, overwrite: bool = False,
            container: str | None = None, input_format: str | None = None,
            on_progress: Callable[[int], None] | None = None,
            on_start: Callable[[int], None] | None = None, part: Part | None = None,
            finalize: bool = False, max_memory: int | None = None) -> ConvertResult:
    """Convert a checkpoint.

    Args:
        source: Any checkpoint the readers know, or a run directory whose ``latest`` (or
            Megatron tracker) pointer names the checkpoint to read.
        output: A ``.safetensors``/``.pt``/``.bin`` file, or a directory for
            ``model.safetensors`` or HF-style shards + index.
        to: ``fp16``, ``bf16``, ``fp32`` or ``keep``: cast of floating-point model tensors.
        fmt: ``safetensors`` or ``pt``; None infers it from ``output``'s suffix.
        max_shard_size: Largest output shard in bytes (None: one file).
        keep_optimizer: Keep every tensor (optimizer state included) under its own name: a
            pure format change. Non-tensor values go to ``__metadata__["ckpt.objects"]``.
        keep_prefix: Keep wrapper prefixes (``module.``, ``_orig_mod.``).
        keep_fp32: Globs of tensor names kept in (or cast to) FP32.
        clamp: Clamp values beyond FP16's range instead of refusing.
        overwrite: Replace an existing output.
        container: Which top-level container holds the weights when there are several.
        input_format: Force the input format.
        on_progress: Called with bytes written.
        on_start: Called once with the total bytes to write.
        part: Write only this part's share of the output shards (``--part K/N``); the last
            part to finish writes the index (see :mod:`ckpt_cli.writers.parts`).
        finalize: Finalize a split conversion now (an error naming the parts missing).
        max_memory: Memory budget in bytes for data read and cast ahead of the writer
            (default 256 MiB; the largest tensor may add to it).

    Returns:
        The :class:`ConvertResult`.

    Raises:
        CkptError: Bad input, unsupported layouts, existing output, values out of FP16 range.
    """
    t0 = time.perf_counter()
    src, out = storage.locate(source), storage.locate(output)
    check_exists(src)
    memory_budget(max_memory)  # a bad budget is a usage error before any work
    if to not in TARGETS:
        raise UsageError(f"--to must be fp16, bf16, fp32 or keep, not {to!r}")
    fmt = output_format(out, fmt)
    followed = follow_pointer(src) if input_format is None else None
    if followed is not None:
        src = followed.path
    elif input_format is None and is_run_dir(src):
        raise UsageError(f"{src} is a run directory; name one of its checkpoints",
                         hint=f"ckpt inspect {src} lists them")
    check_not_input(out, src)
    index = read_index(src, input_format)
    check_not_input(out, src, (index.path_of(f.path) for f in index.files))
    _check_supported(index)
    try:
        sel = select_tensors(index, keep_optimizer=keep_optimizer, keep_prefix=keep_prefix,
                             container=container)
    except UsageError:
        # Damage that left nothing to select explains the empty selection better.
        refuse_damaged(index, (), also_files=(f.path for f in index.files))
        raise
    refuse_damaged(index, sel.names.values())
    target = TARGETS[to]
    stats = CastStats()
    aliases, order = _dedupe_tied(index, sel)
    casts: Counter[str] = Counter()
    outs: list[OutTensor] = []
    source_reader = TensorSource(index)
    for out_name in order:
        t = index.tensors[sel.names[out_name]]
        dst = _target_dtype(t, out_name, target, keep_fp32, keep_optimizer)
        if dst != t.dtype:
            casts[f"{t.dtype}->{dst}"] += 1
        # A cast reads every value once: map the file rather than copy it (as _loader does).
        pieces_of = partial(source_reader.iter_pieces, mapped=dst != t.dtype)
        outs.append(OutTensor(out_name, dst, t.shape,
                              _loader(source_reader, t, dst, out_name, clamp, stats),
                              piece_caster(pieces_of, t, dst, out_name, clamp, stats)))
    meta = _metadata(index, src, to, sel, keep_optimizer, fmt)
    if keep_optimizer and fmt == "safetensors" and index.objects:
        meta["ckpt.objects"] = orjson.dumps(index.objects, default=str).decode()
    notes = list(sel.notes)
    side = _side_files(index, out, notes)
    prefer_torch(sum(index.tensors[sel.names[o.name]].numel for o in outs
                     if o.dtype != index.tensors[sel.names[o.name]].dtype))
    job = None
    if part is not None or finalize:
        job = PartJob(part, finalize, source_identity(index.base, [f.path for f in index.files]))
    try:
        result = write_checkpoint(out, outs, fmt=fmt, max_shard_size=max_shard_size,
                                  metadata=meta, aliases=aliases, overwrite=overwrite,
                                  side_files=side, on_progress=on_progress,
                                  before_commit=lambda _tmp: check_overflow(stats, clamp),
                                  on_start=on_start, part=job, max_memory=max_memory)
    finally:
        source_reader.close()
    if clamp and stats.overflow:
        notes.append(f"clamped {sum(stats.overflow.values()):,} value(s) beyond FP16's range "
                     f"to ±{FP16_MAX:g} in {len(stats.overflow)} tensor(s)")
    return ConvertResult(storage.locate(source), index.format, out, result,
                         {o.name: (o.dtype, o.shape) for o in outs}, sel.renamed, sel.dropped,
                         dict(casts), aliases, dict(stats.overflow), clamp, meta, notes,
                         time.perf_counter() - t0, hostile_warnings(index),
                         followed)


def _check_supported(index: CheckpointIndex) -> None:
    if index.format == "deepspeed":
        raise UnsupportedError(
            "DeepSpeed ZeRO checkpoints keep the full-precision weights partitioned in the "
            "optimizer files", path=index.root,
            hint=f"ckpt consolidate {index.root} -o OUT rebuilds them")
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


def _target_dtype(t: TensorInfo, name: str, target: str | None, keep_fp32: tuple[str, ...],
                  keep_optimizer: bool) -> str:
    if t.dtype not in _CASTABLE or (keep_optimizer and t.group not in ("model", "buffer")):
        return t.dtype
    if any(fnmatch.fnmatchcase(name, g) for g in keep_fp32):
        return "F32"
    return target or t.dtype


def _loader(src: TensorSource, t: TensorInfo, dst: str, name: str, clamp: bool,
            stats: CastStats) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        if dst == t.dtype:
            return src.read(t)
        # The cast reads every value once: map the file instead of copying it first.
        return cast_array(src.read(t, mapped=True), dst, name=name, clamp=clamp, stats=stats)
    return load


def _metadata(index: CheckpointIndex, src: Path, to: str, sel: Selection,
              keep_optimizer: bool, fmt: str) -> dict[str, str]:
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


def _side_files(index: CheckpointIndex, out: Path, notes: list[str]) -> dict[str, bytes]:
    if out.suffix in (".safetensors", ".pt", ".pth", ".bin") or not index.base.is_dir():
        return {}
    found: dict[str, bytes] = {}
    for name in SIDE_FILES:
        p = index.base / name
        if p.is_file() and p.stat().st_size < 64 << 20:
            found[name] = p.read_bytes()
    if found:
        notes.append(f"copied {', '.join(sorted(found))}")
    return found
