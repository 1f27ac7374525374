"""``ckpt convert``."""


from typing import Annotated

import typer

from ckpt_cli.cli.errors import EXIT_OK
from ckpt_cli.cli.options import (
    STREAMING,
    Common,
    FinalizeOpt,
    ForceOpt,
    InputFormatOpt,
    Location,
    OutputFormatOpt,
    PartOpt,
    common_options,
    output_location,
    path_argument,
    size_parser,
)


def _targets(incomplete: str) -> list[str]:
    return [t for t in ("fp16", "bf16", "fp32", "fp8", "keep", "dcp") if t.startswith(incomplete)]


def _dcp_layouts(incomplete: str) -> list[str]:
    return [t for t in ("torchtitan", "recipe") if t.startswith(incomplete)]


def _layouts(incomplete: str) -> list[str]:
    return [t for t in ("block", "channel", "tensor") if t.startswith(incomplete)]


def _activations(incomplete: str) -> list[str]:
    return [t for t in ("dynamic", "none") if t.startswith(incomplete)]


@common_options(*STREAMING)
def convert_cmd(
    source: Annotated[Location, path_argument("Checkpoint to convert (file or directory).")],
    output: Annotated[Location, typer.Option(
        "--output", "-o", help="Output: a .safetensors/.pt/.bin file, or a directory for "
                               "model.safetensors or HF-style shards.", show_default=False,
        parser=output_location)],
    to: Annotated[str, typer.Option(
        "--to", metavar="fp16|bf16|fp32|fp8|keep|dcp",
        help="Cast floating-point model tensors (fp8: quantize Linear weights to E4M3 with "
             "scales, the rest to BF16; see --fp8-layout). dcp: move the training state "
             "(weights, optimizer moments, LR schedule, step) into a "
             "torch.distributed.checkpoint directory; see --dcp-layout.",
        autocompletion=_targets)] = "keep",
    fp8_layout: Annotated[str, typer.Option(
        "--fp8-layout", metavar="block|channel|tensor",
        help="With --to fp8: 128x128 blocks (weight_scale_inv, transformers/DeepSeek 'fp8') "
             "or one scale per output channel or per tensor (weight_scale, "
             "compressed-tensors).", autocompletion=_layouts)] = "block",
    fp8_activations: Annotated[str, typer.Option(
        "--fp8-activations", metavar="dynamic|none",
        help="With --to fp8 --fp8-layout channel|tensor: dynamic per-token FP8 activations "
             "(W8A8, the engines' FP8 matmuls) or none (weight-only W8A16, for GPUs without "
             "FP8 matmuls).", autocompletion=_activations)] = "dynamic",
    dequantize: Annotated[bool, typer.Option(
        "--dequantize", help="With --to bf16|fp16|fp32: turn FP8 weights with a scale "
                             "(weight_scale_inv, weight_scale, scale_weight) into weight * "
                             "scale; drop the scales and quantization_config.")] = False,
    dcp_layout: Annotated[str, typer.Option(
        "--dcp-layout", metavar="torchtitan|recipe",
        help="With --to dcp: torchtitan's top-level keys (model FQNs, optimizer, "
             "lr_scheduler, train_state) or the PyTorch DCP recipe's {model, optim}.",
        autocompletion=_dcp_layouts)] = "torchtitan",
    output_format: OutputFormatOpt = None,
    max_shard_size: Annotated[int | None, typer.Option(
        "--max-shard-size", metavar="SIZE",
        parser=size_parser("--max-shard-size", empty_is_none=True),
        help="Split into HF-style shards of at most SIZE "
                                                 "(e.g. 5GB) with an index.")] = None,
    keep_optimizer: Annotated[bool, typer.Option(
        "--keep-optimizer", help="Keep every tensor, optimizer state included, under its "
                                 "original name: a pure format change.")] = False,
    keep_prefix: Annotated[bool, typer.Option(
        "--keep-prefix", help="Keep wrapper prefixes (module., _orig_mod.).")] = False,
    keep_fp32: Annotated[list[str] | None, typer.Option(
        "--keep-fp32", metavar="GLOB", help="Keep matching tensors in FP32, e.g. "
                                            "'*norm*' (repeatable).")] = None,
    clamp: Annotated[bool, typer.Option(
        "--clamp", help="Clamp values beyond FP16's range to ±65504 instead of "
                        "refusing.")] = False,
    container: Annotated[str | None, typer.Option(
        "--container", metavar="NAME", help="Which top-level container holds the weights "
                                            "when there are several (model, ema...).")] = None,
    overwrite: ForceOpt = False,
    part: PartOpt = None,
    finalize: FinalizeOpt = False,
    input_format: InputFormatOpt = None,
    *,
    common: Common,
) -> None:
    """Convert a checkpoint: training -> inference, FP32 -> FP16/BF16, torch -> safetensors.

    Keeps the model weights and buffers (found inside model/state_dict/module containers,
    wrapper prefixes stripped), drops optimizer state, schedulers and RNG state, casts, and
    writes safetensors (or a torch zip). Streams one tensor at a time; the output appears
    only when complete, and an existing one is replaced only with --overwrite.

    Examples:
      ckpt convert run/step_9000 --to fp16 -o model/
      ckpt convert train.ckpt --to bf16 -o model.safetensors
      ckpt convert dcp_dir/ --max-shard-size 5GB -o export/
      ckpt convert model.bin --keep-fp32 '*norm*' --to fp16 -o model.safetensors
      ckpt convert dcp/ --to bf16 -o out/ --part auto
      ckpt convert train.pt --to dcp -o run-dcp/
    """
    with common.handled() as outcome:
        from ckpt_cli.ops.convert import ConvertOptions, convert
        with common.progress("converting") as bar:
            options = ConvertOptions(
                to=to, fmt=output_format, max_shard_size=max_shard_size,
                keep_optimizer=keep_optimizer,
                keep_prefix=keep_prefix, keep_fp32=tuple(keep_fp32 or ()), clamp=clamp,
                overwrite=overwrite, container=container, input_format=input_format, part=part,
                finalize=finalize, max_memory=common.max_memory, fp8_layout=fp8_layout,
                fp8_activations=fp8_activations, dequantize=dequantize, dcp_layout=dcp_layout)
            result = convert(source, output, options, progress=bar)
        outcome.exit_code = EXIT_OK  # written: a closed pipe only loses the summary
        from ckpt_cli.render.convert import show

        show(result, json=common.json, quiet=common.quiet)
