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
import json
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from ckpt_cli import dtypes, storage
from ckpt_cli.documents import Documented
from ckpt_cli.errors import CkptError, UnsupportedError, UsageError
from ckpt_cli.formats import check_exists, deepspeed, read_index
from ckpt_cli.formats.base import refuse_damaged
from ckpt_cli.formats.provenance import source_label
from ckpt_cli.formats.zero import ParamPlan
from ckpt_cli.fp8.scheme import read_quantization_config
from ckpt_cli.model import CheckpointIndex, Finding, TensorInfo
from ckpt_cli.ops import convert_fp8, options_of
from ckpt_cli.parts import Part, source_identity
from ckpt_cli.resolve import resolve
from ckpt_cli.storage.atomic import check_not_input
from ckpt_cli.storage.reads import memory_budget
from ckpt_cli.tensors.cast import (
    CASTABLE,
    FP16_MAX,
    TARGETS,
    CastPlan,
    CastStats,
    cast_array,
    check_overflow,
    piece_caster,
    prefer_torch,
    target_name,
    torch_speeds_up,
)
from ckpt_cli.tensors.gather import zero_metadata, zero_outputs
from ckpt_cli.tensors.select import Selection, hostile_warning, hostile_warnings, select_tensors
from ckpt_cli.tensors.source import TensorSource
from ckpt_cli.writers import (
    FILE_SUFFIXES,
    SIDE_FILES,
    OutTensor,
    check_output,
    names_directory,
    output_format,
    write_checkpoint,
)
from ckpt_cli.writers.parts import PartJob

if TYPE_CHECKING:
    import numpy as np

    from ckpt_cli.runs import Followed
    from ckpt_cli.writers import WriteResult

# -- the result ------------------------------------------------------------------------------------

@dataclass(slots=True)
class ConvertResult(Documented):
    """What ``convert`` did.

    Attributes:
        source: The input path.
        source_format: Its format.
        output: The written file or directory.
        write: Files written and sizes.
        tensors: Output tensors, in order (name -> (dtype, shape)).
        renamed: How names were changed (container and wrapper prefixes stripped).
        dropped: Tensors left out, counted per group.
        casts: ``"F32->F16"`` -> number of tensors.
        aliases: Tied tensors written once: ``{dropped name: kept name}``.
        overflow: Tensors with values beyond FP16's range (count), when casting to FP16.
        clamped: Whether overflowing values were clamped (``--clamp``).
        metadata: The ``__metadata__`` written.
        notes: Plain-words remarks (what was dropped, chosen, copied).
        seconds: Wall time.
        warnings: Source files whose pickles would run code under ``torch.load`` (see
            :func:`hostile_warnings`).
        followed: The run directory's pointer followed to the checkpoint read, if
            ``source`` was a run directory.
        kept: Quantized tensors (FP8...) ``--to`` left as they are, by dtype.
        kept_scales: Their scales, left as they are too, by dtype.
        config_dtype: How the copied ``config.json``'s dtype was rewritten to the output's
            (``{file, keys, from, to}``), or None.
        kept_fp32: Each ``--keep-fp32`` glob and the output tensors it kept in FP32 (an empty
            list: it matched none).
    """

    source: Path
    source_format: str
    output: Path
    write: WriteResult
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    renamed: list[str]
    dropped: dict[str, int]
    casts: dict[str, int]
    aliases: dict[str, str]
    overflow: dict[str, int]
    clamped: bool
    metadata: dict[str, str]
    notes: list[str]
    seconds: float
    warnings: list[Finding] = field(default_factory=list)
    followed: Followed | None = None
    kept: dict[str, int] = field(default_factory=dict)
    kept_scales: dict[str, int] = field(default_factory=dict)
    config_dtype: dict[str, Any] | None = None
    kept_fp32: dict[str, list[str]] = field(default_factory=dict)

    command = "convert"

    def json_body(self) -> dict[str, Any]:
        """The ``convert --json`` document without ``schema_version`` and ``command``."""
        return {
            "source": str(self.source), "source_format": self.source_format,
            "output": str(self.output), "num_tensors": len(self.tensors),
            "tensors": [{"name": n, "dtype": d, "shape": list(s)}
                        for n, (d, s) in self.tensors.items()],
            "renamed": self.renamed, "dropped": self.dropped, "casts": self.casts,
            "aliases": self.aliases, "overflow": self.overflow, "clamped": self.clamped,
            "kept": self.kept, "kept_scales": self.kept_scales, "kept_fp32": self.kept_fp32,
            "config_dtype": self.config_dtype, "metadata": self.metadata, "notes": self.notes,
            "seconds": round(self.seconds, 3),
            "warnings": [w.to_dict() for w in self.warnings],
            "followed": self.followed.to_dict() if self.followed else None,
            **self.write.document()}


@dataclass(frozen=True, slots=True)
class ConvertOptions:
    """What :func:`convert` does (``ckpt convert``'s flags; the defaults are theirs).

    Attributes:
        to: ``fp16``, ``bf16``, ``fp32`` or ``keep``: cast of floating-point model tensors;
            ``dcp``: the training state as a DCP directory (:mod:`ckpt_cli.ops.to_dcp`).
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
        part: Write only this part's share of the output shards (``--part K/N``); the last
            part to finish writes the index (see :mod:`ckpt_cli.writers.parts`).
        finalize: Finalize a split conversion now (an error naming the parts missing).
        max_memory: Memory budget in bytes for data read and cast ahead of the writer
            (default 256 MiB; the largest tensor may add to it).
        fp8_layout: With ``to="fp8"``: ``block``, ``channel`` or ``tensor`` (see
            :mod:`ckpt_cli.fp8`); the tensors not quantized are cast to BF16.
        fp8_activations: With ``to="fp8"`` in the channel/tensor layouts: ``dynamic``
            (per-token FP8 activations at run time, W8A8: the engines' FP8 matmuls) or
            ``none`` (weight-only, W8A16, for GPUs without FP8 matmuls).
        dequantize: With ``to`` ``bf16``/``fp16``/``fp32``: FP8 weights with a recognised
            scale (``weight_scale_inv``, ``weight_scale``, ``scale_weight``) become
            ``weight * scale`` in the target dtype; the scales and ``quantization_config``
            are dropped. A weight without its scale, or a scale of no known shape, is an
            error naming the tensors (nothing written).
        dcp_layout: With ``to="dcp"``: ``torchtitan`` or ``recipe`` top-level keys (see
            :mod:`ckpt_cli.ops.to_dcp.writer`).
    """

    # What is kept, and how it is cast.
    to: str = "keep"
    keep_optimizer: bool = False
    keep_prefix: bool = False
    keep_fp32: tuple[str, ...] = ()
    clamp: bool = False
    container: str | None = None
    input_format: str | None = None
    # The output.
    fmt: str | None = None
    max_shard_size: int | None = None
    overwrite: bool = False
    part: Part | None = None
    finalize: bool = False
    max_memory: int | None = None
    fp8_layout: str = "block"
    fp8_activations: str = "dynamic"
    dequantize: bool = False
    dcp_layout: str = "torchtitan"


# -- the op ----------------------------------------------------------------------------------------

def convert(source: str | Path, output: str | Path, options: ConvertOptions | None = None, *,
            on_progress: Callable[[int], None] | None = None,
            on_start: Callable[[int], None] | None = None, **fields: Any) -> ConvertResult:
    """Convert a checkpoint.

    Args:
        source: Any checkpoint the readers know, or a run directory whose ``latest`` (or
            Megatron tracker) pointer names the checkpoint to read.
        output: A ``.safetensors``/``.pt``/``.bin`` file, or a directory for
            ``model.safetensors`` or HF-style shards + index.
        options: What to do (:class:`ConvertOptions`; default: its defaults).
        on_progress: Called with bytes written.
        on_start: Called once with the total bytes to write.
        **fields: :class:`ConvertOptions` fields, instead of ``options`` (see
            :func:`ckpt_cli.ops.options_of`).

    Returns:
        The :class:`ConvertResult`.

    Raises:
        CkptError: Bad input, unsupported layouts, existing output, values out of FP16 range.
    """
    opts = options_of(ConvertOptions, options, fields)
    if target_name(opts.to) == "dcp":  # a run's training state, not a cast (issue 48)
        from ckpt_cli.ops.to_dcp import convert_to_dcp

        return convert_to_dcp(source, output, opts, on_progress=on_progress, on_start=on_start)
    to, fmt = target_name(opts.to), opts.fmt
    t0 = time.perf_counter()
    src, out = storage.locate(source), storage.locate(output)
    check_exists(src)
    budget = memory_budget(opts.max_memory)  # a bad budget is a usage error before any work
    quant = convert_fp8.wanted(to, opts.fp8_layout, opts.fp8_activations)
    if quant:
        to = "bf16"  # what is not quantized
    elif to not in TARGETS:
        raise UsageError(f"to must be fp16, bf16, fp32, fp8 or keep, not {to!r}", param="to")
    fmt = output_format(out, fmt, directory=names_directory(output))
    given = resolve(src, input_format=opts.input_format)
    followed, src = given.followed, given.checkpoint()
    check_not_input(out, src)
    check_output(out, overwrite=opts.overwrite,
                 finishing=opts.part is not None or opts.finalize)
    index = read_index(src, opts.input_format)
    check_not_input(out, src, (index.path_of(f.path) for f in index.files))
    _check_supported(index, src)
    target = TARGETS[to]
    stats = CastStats()

    def build(globs: tuple[str, ...]) -> _Built:
        if index.format == "deepspeed":
            # ZeRO keeps the FP32 weights partitioned in the optimizer files: gathered the way
            # consolidate gathers them (what training would resume from).
            return _from_zero(src, to, target, globs, opts.keep_optimizer, opts.clamp, stats)
        return _from_index(index, src, to, target, fmt, globs, opts.keep_optimizer,
                           opts.keep_prefix, opts.container, opts.clamp, stats)

    convert_fp8.check_usage(quant, opts.dequantize, target, fmt)
    side_notes: list[str] = []
    side = _side_files(index, storage.locate(source), out, side_notes)
    built = build(opts.keep_fp32)
    quant_config = None
    if quant:
        built, quant_config = convert_fp8.quantized(
            built, build, opts.keep_fp32, opts.fp8_layout, src,
            activations=opts.fp8_activations, config=_json_object(side.get("config.json")))
    elif opts.dequantize:
        assert target is not None
        convert_fp8.dequantized(built, target, src, stats, opts.clamp,
                                config=read_quantization_config(index)[0])
    notes = built.notes
    notes.extend(side_notes)
    config_dtype = None
    if target is not None and "config.json" in side:
        side["config.json"], config_dtype = retype_config(side["config.json"], target)
        kept32 = sum(1 for o in built.outs if o.dtype == "F32" and target != "F32" and any(
            fnmatch.fnmatchcase(o.name, g) for g in opts.keep_fp32) and not
            convert_fp8.is_scale(o.name, quant_config))
        if config_dtype is not None and kept32:
            # The loader casts every weight to the config's dtype unless told otherwise.
            notes.append(f"config.json says {config_dtype['to']}: from_pretrained loads the "
                         f"{kept32} tensor(s) --keep-fp32 kept in FP32 as {config_dtype['to']} "
                         "too, unless the model keeps them (keep_in_fp32_modules) or is loaded "
                         "with dtype=torch.float32")
    convert_fp8.config_files(side, quant_config, opts.dequantize, target, notes)
    kept_fp32 = _kept_fp32(built.outs, opts.keep_fp32, notes)
    if kept_fp32:
        built.meta["ckpt.conversion"] += "; keep_fp32: " + ", ".join(
            f"{g} ({len(n)})" for g, n in kept_fp32.items())
    prefer_torch(built.cast_elements)
    job = None
    if opts.part is not None or opts.finalize:
        job = PartJob(opts.part, opts.finalize,
                      source_identity(index.base, [f.path for f in index.files]))
    try:
        result = write_checkpoint(out, built.outs, fmt=fmt, max_shard_size=opts.max_shard_size,
                                  metadata=built.meta, aliases=built.aliases,
                                  overwrite=opts.overwrite, side_files=side,
                                  on_progress=on_progress,
                                  before_commit=lambda _tmp: check_overflow(stats, opts.clamp),
                                  on_start=on_start, part=job, max_memory=budget)
    finally:
        built.close()
    if opts.clamp and stats.overflow:
        notes.append(f"clamped {sum(stats.overflow.values()):,} value(s) beyond FP16's range "
                     f"to ±{FP16_MAX:g} in {len(stats.overflow)} tensor(s)")
    return ConvertResult(storage.locate(source), index.format, out, result,
                         {o.name: (o.dtype, o.shape) for o in built.outs}, built.renamed,
                         built.dropped, dict(built.casts), built.aliases, dict(stats.overflow),
                         opts.clamp, built.meta, notes, time.perf_counter() - t0, built.warnings,
                         followed, dict(built.plan.kept), dict(built.plan.kept_scales),
                         config_dtype, kept_fp32)


@dataclass(slots=True)
class _Built:
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


def _from_index(index: CheckpointIndex, src: Path, to: str, target: str | None, fmt: str,
                keep_fp32: tuple[str, ...], keep_optimizer: bool, keep_prefix: bool,
                container: str | None, clamp: bool, stats: CastStats) -> _Built:
    """The tensors of a checkpoint the readers index: the model's, selected and renamed."""
    try:
        sel = select_tensors(index, keep_optimizer=keep_optimizer, keep_prefix=keep_prefix,
                             container=container)
    except UsageError:
        # Damage that left nothing to select explains the empty selection better.
        refuse_damaged(index, (), also_files=(f.path for f in index.files))
        raise
    refuse_damaged(index, sel.names.values())
    aliases, order = _dedupe_tied(index, sel)
    casts: Counter[str] = Counter()
    outs: list[OutTensor] = []
    source_reader = TensorSource(index)
    plan = CastPlan(target, _castable(index, sel, keep_optimizer))
    cast_elements = 0
    for out_name in order:
        t = index.tensors[sel.names[out_name]]
        dst = _target_dtype(t, out_name, plan, keep_fp32, keep_optimizer)
        if dst != t.dtype:
            casts[f"{t.dtype}->{dst}"] += 1
            cast_elements += t.numel if torch_speeds_up(t.dtype, dst) else 0
        # A cast reads every value once: map the file rather than copy it (as _loader does).
        pieces_of = partial(source_reader.iter_pieces, mapped=dst != t.dtype)
        outs.append(OutTensor(out_name, dst, t.shape,
                              _loader(source_reader, t, dst, out_name, clamp, stats),
                              piece_caster(pieces_of, t, dst, out_name, clamp, stats)))
    meta = _metadata(index, src, to, sel, keep_optimizer, fmt)
    if keep_optimizer and fmt == "safetensors" and index.objects:
        meta["ckpt.objects"] = orjson.dumps(index.objects, default=str).decode()
    return _Built(outs, aliases, casts, plan, sel.renamed, sel.dropped, meta, list(sel.notes),
                  hostile_warnings(index), source_reader.close, cast_elements)


def _from_zero(src: Path, to: str, target: str | None, keep_fp32: tuple[str, ...],
               keep_optimizer: bool, clamp: bool, stats: CastStats) -> _Built:
    """The full weights of a DeepSpeed ZeRO 1/2/3 checkpoint, gathered from the partitions
    (with ``keep_optimizer``, Adam's moments too, never cast)."""
    plan = CastPlan(target, [])  # ZeRO's master weights are FP32: nothing quantized

    def dtype_for(t: ParamPlan, base: str) -> str:
        if t.kind == "moment" or base not in CASTABLE:
            return base
        if any(fnmatch.fnmatchcase(t.name, g) for g in keep_fp32):
            return "F32"
        return plan.dtype(t.name, base)

    zero = zero_outputs(src, dtype_for, stats, clamp, moments=keep_optimizer)
    casts: Counter[str] = Counter()
    for o, t in zip(zero.outs, zero.plan.tensors, strict=True):
        if o.dtype != t.dtype:
            casts[f"{t.dtype}->{o.dtype}"] += 1
    notes = list(zero.plan.notes) + ([] if keep_optimizer else [
        "optimizer moments are not part of the output (--keep-optimizer keeps them)"])
    warnings = [hostile_warning(p, quals) for p, quals in zero.plan.unsafe.items()]
    return _Built(zero.outs, zero.plan.aliases, casts, plan, [], {},
                  zero_metadata(zero.plan, src, to), notes, warnings, zero.reader.close,
                  zero.cast_elements)


def _kept_fp32(outs: list[OutTensor], globs: tuple[str, ...],
               notes: list[str]) -> dict[str, list[str]]:
    """Each ``--keep-fp32`` glob and the FP32 output tensors it matched (a glob that matched
    none gets a note: a typo would otherwise go unnoticed)."""
    out: dict[str, list[str]] = {}
    for g in globs:
        out[g] = [o.name for o in outs if o.dtype == "F32" and fnmatch.fnmatchcase(o.name, g)]
        if not out[g]:
            notes.append(f"keep_fp32 {g!r} matched no tensor of the output")
    return out


def _check_supported(index: CheckpointIndex, src: Path) -> None:
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


def _side_files(index: CheckpointIndex, given: Path, out: Path,
                notes: list[str]) -> dict[str, bytes]:
    """config.json, tokenizer files...: from the directory the user named (an HF Trainer +
    DeepSpeed ``checkpoint-N`` keeps them beside ``latest`` and ``global_stepN/``), else
    from the directory the weights were read in."""
    if out.suffix.lower() in FILE_SUFFIXES:
        return {}
    dirs = [d for d in dict.fromkeys((given, index.base)) if d.is_dir()]
    found: dict[str, bytes] = {}
    for name in SIDE_FILES:
        for d in dirs:
            p = d / name
            if p.is_file() and p.stat().st_size < 64 << 20:
                data = storage.read_side(p, "json-state")
                if data is not None:
                    if name == "config.json":
                        # rewritten below (dtype, quantization_config): its nesting must be
                        # bounded before anything walks it
                        storage.parse_json(data, what="the JSON", path=p)
                    found[name] = data
                    break
    if found:
        notes.append(f"copied {', '.join(sorted(found))}")
    return found


def _json_object(data: bytes | None) -> dict[str, Any] | None:
    """A side file's JSON object (None: absent, not JSON, or not an object), through the one
    bounded JSON parser."""
    if data is None:
        return None
    try:
        doc = storage.parse_json(data, what="config.json", path=None)
    except CkptError:
        return None
    return doc if isinstance(doc, dict) else None


_DTYPE_KEYS = ("dtype", "torch_dtype")  # transformers 4.56+ writes "dtype", older "torch_dtype"
_FLOAT_NAMES = ("float64", "float32", "float16", "bfloat16", "float", "double", "half")
_DTYPE_VALUE = re.compile(rb'("(?:torch_)?dtype"\s*:\s*)"(?:' + b"|".join(
    n.encode() for n in _FLOAT_NAMES) + rb')"')


def retype_config(data: bytes, target: str) -> tuple[bytes, dict[str, Any] | None]:
    """Make a copied ``config.json`` name the dtype its weights were cast to.

    ``from_pretrained`` loads weights in the dtype the config names (``"dtype"``, or the older
    ``"torch_dtype"``): left at ``float32`` after ``--to fp16``, the FP16 weights would load as
    FP32. Every such key holding a floating dtype is rewritten, at the top level and in nested
    sub-configs (``text_config``...), but not inside ``quantization_config``. Only those
    values change: the rest of the text (key order, spacing, other values) stays byte for byte
    when the file's layout allows, and otherwise its meaning does (re-serialized in order).

    Args:
        data: The file's bytes.
        target: The dtype code the floating weights were cast to (``F16``, ``BF16``, ``F32``).

    Returns:
        The bytes to write, and ``{file, keys, from, to}`` when anything changed (None when
        the file names no floating dtype, already names ``target``'s, or is not a JSON object).
    """
    name = dtypes.get(target).torch_name
    assert name is not None
    try:
        doc = storage.parse_json(data, what="config.json", path=None)  # nesting bounded
    except CkptError:
        return data, None
    if not isinstance(doc, dict):
        return data, None
    changed: dict[str, str] = {}

    def walk(obj: dict[str, Any], path: str) -> None:
        for key, value in obj.items():
            if key in _DTYPE_KEYS and isinstance(value, str) and value in _FLOAT_NAMES:
                if value != name:
                    obj[key] = name
                    changed[path + key] = value
            elif isinstance(value, dict) and key != "quantization_config":
                walk(value, f"{path}{key}.")

    walk(doc, "")
    if not changed:
        return data, None
    new = _DTYPE_VALUE.sub(lambda m: m.group(1) + b'"' + name.encode() + b'"', data)
    try:
        same = json.loads(new) == doc
    except ValueError:
        same = False
    if not same:  # a dtype key in quantization_config, a string holding one: write it anew
        new = (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()
    first = next(iter(changed.values()))
    return new, {"file": "config.json", "keys": list(changed), "from": first, "to": name}
