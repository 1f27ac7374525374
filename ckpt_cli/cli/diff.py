"""``ckpt diff``."""


from typing import Annotated

import typer

from ckpt_cli.cli.errors import EXIT_FINDINGS, EXIT_OK, handled
from ckpt_cli.cli.options import (
    Common,
    Location,
    common_options,
    from_options,
    path_argument,
    use_storage,
)
from ckpt_cli.ops.options.diff import DiffOptions


@common_options("quiet", "storage_option", "json")
@from_options(DiffOptions)
def diff_cmd(
    a: Annotated[Location, path_argument("Checkpoint A (file, shard set or directory).", "A")],
    b: Annotated[Location, path_argument("Checkpoint B.", "B")],
    top: Annotated[int, typer.Option("--top", min=0, metavar="N",
                                     help="Rows per table; 0 shows all.")] = 20,
    exit_zero: Annotated[bool, typer.Option(
        "--exit-zero", help="Exit 0 when the checkpoints differ (errors still exit 2).")] = False,
    *,
    options: DiffOptions,
    common: Common,
) -> None:
    """Show what changed between two checkpoints: tensors, shapes, dtypes, values, metadata.

    Works across formats (torch, safetensors, DCP, HF shards...). FP8 weights with their
    scales are compared dequantized (weight x scale), with the relative L2 error per tensor.
    Exit 0 when equal (within tolerance), 1 when different, 2 on error.

    Examples:
      ckpt diff run/step_1000/checkpoint.pt export/model.safetensors
      ckpt diff run/step_400 consolidated.pt --all-tensors
      ckpt diff base.safetensors finetuned.safetensors --by-module --depth 2
      ckpt diff model.pt model-fp16.safetensors --json | jq .summary
      ckpt diff ddp.pt plain.pt --strip-prefix module. --structure-only
      ckpt diff model/ model-fp8/
    """
    from ckpt_cli.ops.diff import diff  # lazy: not loaded by ckpt --help
    from ckpt_cli.render import diff as rd  # lazy: not loaded by ckpt --help

    with handled() as outcome:
        use_storage(common.storage_option, options.concurrency)
        with common.progress("comparing") as bar:
            result = diff(a, b, options, progress=bar)
        outcome.exit_code = code = EXIT_OK if result.equal or exit_zero else EXIT_FINDINGS
        rd.show(result, str(a), str(b), json=common.json, quiet=common.quiet, top=top,
                by_module=options.by_module, depth=options.depth)
    raise typer.Exit(code)
