"""``ckpt inspect``."""


from typing import Annotated

import typer

from ckpt_cli.cli.errors import EXIT_OK
from ckpt_cli.cli.options import (
    AllowGlobalOpt,
    CheckpointArg,
    Common,
    InputFormatOpt,
    RunPatternOpt,
    common_options,
)


@common_options("storage_option", "json")
def inspect_cmd(
    path: CheckpointArg,
    tensors: Annotated[bool, typer.Option(
        "--tensors", "-t", help="List the tensors (over 1,000: the first and last 500 and a "
                                "row counting the rest; --all lists every one).")] = False,
    filter_glob: Annotated[str | None, typer.Option(
        "--filter", metavar="GLOB", help="Only tensors whose name matches GLOB "
                                         "(e.g. '*.attn.*'); implies --tensors.")] = None,
    sort: Annotated[str, typer.Option("--sort", metavar="size|name",
                                      help="Order of --tensors rows.")] = "name",
    tree: Annotated[bool, typer.Option("--tree", help="Parameters grouped by module "
                                                      "prefix.")] = False,
    depth: Annotated[int, typer.Option("--depth", min=1, help="Levels of --tree.")] = 3,
    pattern: RunPatternOpt = None,
    all_rows: Annotated[bool, typer.Option(
        "--all", help="A row for every checkpoint of a run directory and every tensor of "
                      "--tensors (by default a long list shows its first and last rows).")
    ] = False,
    input_format: InputFormatOpt = None,
    allow_global: AllowGlobalOpt = None,
    *,
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
      ckpt inspect train.pt --tensors --filter '*.attn.*' --sort size
      ckpt inspect run/ --json
      ckpt inspect run/ --all
      ckpt inspect model-fp8/
    """
    from ckpt_cli.ops.inspect import inspect

    with common.handled() as outcome:
        result = inspect(path, fmt=input_format, tensors=tensors, filter_glob=filter_glob,
                         sort=sort, tree=tree, depth=depth, pattern=pattern,
                         allow_globals=allow_global or ())
        outcome.exit_code = EXIT_OK
        from ckpt_cli.render.inspect import show

        show(result, json=common.json, all_rows=all_rows)
