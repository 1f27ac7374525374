"""``convert``: training -> inference, FP32 -> FP16/BF16/FP8, torch -> safetensors.

From any checkpoint the readers know, keep the model weights and buffers (found inside the
usual containers, with wrapper prefixes stripped), drop optimizer state, schedulers and RNG
state, cast floating tensors, and write safetensors (or a torch zip), sharded HF-style when
asked. Values stream one tensor at a time (a large tensor in pieces, so memory stays within a
fixed budget) through a cast that checks FP16's range across the whole tensor; the output
appears only when complete.

The steps, one module each: :mod:`~ckpt_cli.ops.convert.plan` decides every output tensor
and its dtype before anything is read; :mod:`~ckpt_cli.ops.convert.fp8` picks ``--to fp8``'s
weights on that plan (and dequantizes); :mod:`~ckpt_cli.ops.convert.build` builds the outputs
once; :mod:`~ckpt_cli.ops.convert.config` copies and retypes the side files. The options and
result are in :mod:`~ckpt_cli.ops.convert.result`.
"""

from __future__ import annotations

import fnmatch
import time
from pathlib import Path
from typing import Any

from ckpt_cli import storage
from ckpt_cli.errors import UsageError
from ckpt_cli.formats import check_exists, read_index
from ckpt_cli.fp8.scheme import read_quantization_config
from ckpt_cli.ops import options_of
from ckpt_cli.ops.convert import fp8
from ckpt_cli.ops.convert.build import build
from ckpt_cli.ops.convert.config import json_object, retype_config, side_files
from ckpt_cli.ops.convert.config import kept_fp32 as kept_fp32_of
from ckpt_cli.ops.convert.plan import check_supported, plan_index, plan_zero_gather
from ckpt_cli.ops.convert.result import ConvertOptions, ConvertResult
from ckpt_cli.parts import source_identity
from ckpt_cli.progress import Progress, Tally
from ckpt_cli.resolve import resolve
from ckpt_cli.storage.atomic import check_not_input
from ckpt_cli.storage.reads import memory_budget
from ckpt_cli.tensors.cast import (
    FP16_MAX,
    TARGETS,
    CastStats,
    cast_array,
    check_overflow,
    prefer_torch,
    target_name,
)
from ckpt_cli.writers import check_output, names_directory, output_format, write_checkpoint
from ckpt_cli.writers.parts import PartJob

__all__ = ["ConvertOptions", "ConvertResult", "cast_array", "convert", "retype_config"]


def convert(source: str | Path, output: str | Path, options: ConvertOptions | None = None, *,
            progress: Progress | None = None, **fields: Any) -> ConvertResult:
    """Convert a checkpoint.

    Args:
        source: Any checkpoint the readers know, or a run directory whose ``latest`` (or
            Megatron tracker) pointer names the checkpoint to read.
        output: A ``.safetensors``/``.pt``/``.bin`` file, or a directory for
            ``model.safetensors`` or HF-style shards + index.
        options: What to do (:class:`ConvertOptions`; default: its defaults).
        progress: Called as bytes are written: ``("writing", bytes_done, bytes_total)``
            (:class:`ckpt_cli.progress.Progress`).
        **fields: :class:`ConvertOptions` fields, instead of ``options`` (see
            :func:`ckpt_cli.ops.options_of`).

    Returns:
        The :class:`ConvertResult`.

    Raises:
        CkptError: Bad input, unsupported layouts, existing output, values out of FP16 range.
    """
    opts = options_of(ConvertOptions, options, fields)
    if target_name(opts.to) == "dcp":  # a run's training state, not a cast (issue 48)
        # to_dcp imports convert.result, which runs this package's __init__ first.
        from ckpt_cli.ops.to_dcp import convert_to_dcp  # lazy: to_dcp imports convert.result

        return convert_to_dcp(source, output, opts, progress=progress)
    to = target_name(opts.to)
    fmt: str | None = opts.output_format
    t0 = time.perf_counter()
    src, out = storage.locate(source), storage.locate(output)
    check_exists(src)
    budget = memory_budget(opts.max_memory)  # a bad budget is a usage error before any work
    quant = fp8.wanted(to, opts.fp8_layout, opts.fp8_activations)
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
    check_supported(index, src)
    target = TARGETS[to]
    stats = CastStats()
    fp8.check_usage(quant, opts.dequantize, target, fmt)
    side_notes: list[str] = []
    side = side_files(index, storage.locate(source), out, side_notes)
    label = f"fp8 ({opts.fp8_layout})" if quant else to
    if index.format == "deepspeed":
        # ZeRO keeps the FP32 weights partitioned in the optimizer files: gathered the way
        # consolidate gathers them (what training would resume from).
        plan = plan_zero_gather(src, label, target, opts.keep_fp32, opts.keep_optimizer)
    else:
        plan = plan_index(index, src, label, target, fmt, opts.keep_fp32, opts.keep_optimizer,
                          opts.keep_prefix, opts.container)
    quant_config = None
    if quant:  # decided per tensor before anything is built
        quant_config = fp8.choose(plan, opts.fp8_layout, src, activations=opts.fp8_activations,
                                  config=json_object(side.get("config.json")))
    built = build(plan, src, opts.clamp, stats, opts.fp8_layout)
    if opts.dequantize:
        assert target is not None
        fp8.dequantized(built, target, src, stats, opts.clamp,
                        config=read_quantization_config(index)[0])
    notes = built.notes
    notes.extend(side_notes)
    config_dtype = None
    if target is not None and "config.json" in side:
        side["config.json"], config_dtype = retype_config(side["config.json"], target)
        kept32 = sum(1 for o in built.outs if o.dtype == "F32" and target != "F32" and any(
            fnmatch.fnmatchcase(o.name, g) for g in opts.keep_fp32) and not
            fp8.is_scale(o.name, quant_config))
        if config_dtype is not None and kept32:
            # The loader casts every weight to the config's dtype unless told otherwise.
            notes.append(f"config.json says {config_dtype['to']}: from_pretrained loads the "
                         f"{kept32} tensor(s) `keep_fp32` kept in FP32 as {config_dtype['to']} "
                         "too, unless the model keeps them (keep_in_fp32_modules) or is loaded "
                         "with dtype=torch.float32")
    fp8.config_files(side, quant_config, opts.dequantize, target, notes)
    kept_fp32 = kept_fp32_of(built.outs, opts.keep_fp32, notes)
    if kept_fp32:
        built.meta["ckpt.conversion"] += "; keep_fp32: " + ", ".join(
            f"{g} ({len(n)})" for g, n in kept_fp32.items())
    prefer_torch(built.cast_elements)
    job = None
    if opts.part is not None or opts.finalize:
        job = PartJob(opts.part, opts.finalize,
                      source_identity(index.base, [f.path for f in index.files]))
    tally = Tally.of(progress, "writing")
    try:
        result = write_checkpoint(out, built.outs, fmt=fmt, max_shard_size=opts.max_shard_size,
                                  metadata=built.meta, aliases=built.aliases,
                                  overwrite=opts.overwrite, side_files=side,
                                  on_progress=tally.advance if tally else None,
                                  before_commit=lambda _tmp: check_overflow(stats, opts.clamp),
                                  on_start=tally.start if tally else None, part=job,
                                  max_memory=budget)
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
