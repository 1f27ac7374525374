"""``ckpt inspect``."""


from typing import Annotated

import typer

from ckpt_cli.cli.errors import EXIT_OK
from ckpt_cli.cli.options import CheckpointArg, Common, common_options, from_options
from ckpt_cli.ops.options.inspect import InspectOptions


@common_options("storage_option", "json")
@from_options(InspectOptions)
def inspect_cmd(
    path: CheckpointArg,
    all_rows: Annotated[bool, typer.Option(
        "--all-rows", "--all", help="A row for every checkpoint of a run directory and every "
                                    "tensor of --tensors (by default a long list shows its "
                                    "first and last rows).")] = False,
    *,
    options: InspectOptions,
    common: Common,
) -> None:
    """Show what is in a checkpoint: format, tensors, parameters, dtypes, bytes, step.

    Reads headers and pickles only (never tensor data, never torch), so it is fast on
    checkpoints of any size. A run directory gets a table of its checkpoints (and an HF
    Trainer output directory its final model too). An FP8 checkpoint's quantization scheme
    (layout, scales paired with weights, bytes saved vs BF16, quantization_config) is shown.

    Examples:
      ckpt inspect model.safetensors
      ckpt inspect run/step_1000 --tree --depth 2
      ckpt inspect train.pt --tensors --name-glob '*.attn.*' --sort size
      ckpt inspect run/ --json
      ckpt inspect run/ --all
      ckpt inspect model-fp8/
    """
    from ckpt_cli.ops.inspect import inspect  # lazy: not loaded by ckpt --help

    with common.handled() as outcome:
        result = inspect(path, options)
        outcome.exit_code = EXIT_OK
        from ckpt_cli.render.inspect import show  # lazy: not loaded by ckpt --help

        show(result, json=common.json, all_rows=all_rows)
