"""The options of :func:`ckpt_cli.ops.convert.convert`: :class:`ConvertOptions`, each field
the one declaration of a ``ckpt convert`` flag and a ``ckpt_cli.convert()`` keyword (light:
``ckpt convert --help`` builds its flags from it without importing the op)."""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_cli.choices import (
    ConvertTarget,
    DcpLayout,
    Fp8Activations,
    Fp8Layout,
    InputFormat,
    OutputFormat,
)
from ckpt_cli.ops.options import common
from ckpt_cli.optionspec import option
from ckpt_cli.parts import Part


@dataclass(frozen=True, slots=True)
class ConvertOptions:
    """What :func:`~ckpt_cli.ops.convert.convert` does (``ckpt convert``'s options, declared
    once: see :mod:`ckpt_cli.optionspec`). Sizes are bytes here; the command line and the API
    also take them as text (``5GB``).

    ``to="fp8"`` quantizes with the scales of ``fp8_layout`` (:mod:`ckpt_cli.fp8`) and casts
    what it does not quantize to BF16; ``to="dcp"`` writes the training state as a DCP
    directory (:mod:`ckpt_cli.ops.to_dcp`), where the options shaping a file output are
    refused. ``dequantize`` refuses a weight without its scale, or a scale of no known shape,
    naming the tensors (nothing written).
    """

    # What is kept, and how it is cast.
    to: ConvertTarget = option("keep", metavar="fp16|bf16|fp32|fp8|keep|dcp", help=(
        "Cast floating-point model tensors (fp8: quantize Linear weights to E4M3 with "
        "scales, the rest to BF16; see `fp8_layout`). dcp: move the training state "
        "(weights, optimizer moments, LR schedule, step) into a torch.distributed.checkpoint "
        "directory; see `dcp_layout`."))
    fp8_layout: Fp8Layout = option("block", metavar="block|channel|tensor", help=(
        "With `to=fp8`: 128x128 blocks (weight_scale_inv, transformers/DeepSeek 'fp8') or "
        "one scale per output channel or per tensor (weight_scale, compressed-tensors)."))
    fp8_activations: Fp8Activations = option("dynamic", metavar="dynamic|none", help=(
        "With `to=fp8` and `fp8_layout` channel or tensor: dynamic per-token FP8 activations "
        "(W8A8, the engines' FP8 matmuls) or none (weight-only W8A16, for GPUs without FP8 "
        "matmuls)."))
    dequantize: bool = option(False, help=(
        "With `to` bf16, fp16 or fp32: turn FP8 weights with a scale (weight_scale_inv, "
        "weight_scale, scale_weight) into weight * scale; drop the scales and "
        "quantization_config."))
    dcp_layout: DcpLayout = option("torchtitan", metavar="torchtitan|recipe", help=(
        "With `to=dcp`: torchtitan's top-level keys (model FQNs, optimizer, lr_scheduler, "
        "train_state) or the PyTorch DCP recipe's {model, optim}."))
    # The output.
    output_format: OutputFormat | None = common.output_format()
    max_shard_size: int | None = option(None, metavar="SIZE", kind="size", help=(
        "Split into HF-style shards of at most SIZE (e.g. 5GB) with an index."))
    keep_optimizer: bool = option(False, help=(
        "Keep every tensor, optimizer state included, under its original name: a pure "
        "format change (non-tensor values go to the metadata)."))
    keep_prefix: bool = option(False, help="Keep wrapper prefixes (module., _orig_mod.).")
    keep_fp32: tuple[str, ...] = option((), metavar="GLOB", kind="names", help=(
        "Keep matching tensors in FP32, e.g. '*norm*' (repeatable)."))
    clamp: bool = option(False, help=(
        "Clamp values beyond FP16's range to ±65504 instead of refusing."))
    container: str | None = option(None, metavar="NAME", help=(
        "Which top-level container holds the weights when there are several (model, "
        "ema...)."))
    overwrite: bool = common.overwrite()
    part: Part | None = common.part()
    finalize: bool = common.finalize()
    input_format: InputFormat | None = common.input_format()
    max_memory: int | None = common.max_memory("data read ahead and written behind")
    concurrency: int | None = common.concurrency()
