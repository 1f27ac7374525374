"""``ckpt convert``."""


from typing import Annotated

import typer

from ckpt_cli.cli.errors import EXIT_OK, handled
from ckpt_cli.cli.options import (
    Common,
    Location,
    common_options,
    from_options,
    output_location,
    path_argument,
    use_storage,
)
from ckpt_cli.ops.options.convert import ConvertOptions


@common_options("quiet", "storage_option", "json")
@from_options(ConvertOptions)
def convert_cmd(
    source: Annotated[Location, path_argument("Checkpoint to convert (file or directory).")],
    output: Annotated[Location, typer.Option(
        "--output", "-o", help="Output: a .safetensors/.pt/.bin file, or a directory for "
                               "model.safetensors or HF-style shards.", show_default=False,
        parser=output_location)],
    *,
    options: ConvertOptions,
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
    with handled() as outcome:
        use_storage(common.storage_option, options.concurrency)
        from ckpt_cli.ops.convert import convert  # lazy: not loaded by ckpt --help

        with common.progress("converting") as bar:
            result = convert(source, output, options, progress=bar)
        result.caller = "cli"  # its notes name --flags, in the --json document too
        outcome.exit_code = EXIT_OK  # written: a closed pipe only loses the summary
        from ckpt_cli.render.convert import show  # lazy: not loaded by ckpt --help

        show(result, json=common.json, quiet=common.quiet)
