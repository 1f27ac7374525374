"""``ckpt diff``."""


from typing import Annotated

import typer

from ckpt_cli.cli.errors import EXIT_FINDINGS, EXIT_OK
from ckpt_cli.cli.options import STREAMING, Common, Location, common_options, path_argument

_FORMAT_HELP = ("Skip detection and read {side} as this format: safetensors, hf-index, torch, "
                "dcp, deepspeed, megatron or dir.")


@common_options(*STREAMING)
def diff_cmd(
    a: Annotated[Location, path_argument("Checkpoint A (file, shard set or directory).", "A")],
    b: Annotated[Location, path_argument("Checkpoint B.", "B")],
    structure_only: Annotated[bool, typer.Option(
        "--structure-only", help="Compare names, shapes and dtypes only; read no tensor "
                                 "data.")] = False,
    all_tensors: Annotated[bool, typer.Option(
        "--all-tensors", "--all", help="Compare every tensor (optimizer state, RNG "
        "state...), not only model weights and buffers.")] = False,
    strip_prefix: Annotated[list[str] | None, typer.Option(
        "--strip-prefix", metavar="PREFIX", help="Remove PREFIX from tensor names on both "
                                                 "sides before matching (repeatable).")] = None,
    exact_names: Annotated[bool, typer.Option(
        "--exact-names", help="Do not strip wrapper prefixes (module., _orig_mod., model., "
                              "state_dict., model_state_dict.) automatically.")] = False,
    rtol: Annotated[float | None, typer.Option(
        "--rtol", min=0.0, metavar="X",
        help="Relative tolerance for floats. Default: exact for the same dtype, the coarser "
             "dtype's epsilon across dtypes.",
        show_default=False)] = None,
    atol: Annotated[float | None, typer.Option(
        "--atol", min=0.0, metavar="X",
        help="Absolute tolerance for floats. Default: 0 for the same dtype, the coarser "
             "dtype's smallest subnormal across dtypes.",
        show_default=False)] = None,
    name_glob: Annotated[str | None, typer.Option(
        "--name-glob", "--filter", metavar="GLOB", help="Only tensors whose name (after "
        "prefix stripping) matches GLOB, e.g. 'layers.*.attn.*'.")] = None,
    top: Annotated[int, typer.Option("--top", min=0, metavar="N",
                                     help="Rows per table; 0 shows all.")] = 20,
    by_module: Annotated[bool, typer.Option(
        "--by-module", help="Add a roll-up of changes per module.")] = False,
    depth: Annotated[int | None, typer.Option(
        "--depth", min=1, metavar="N", help="Name components per module in --by-module "
                                            "(default: the tensor's own module).",
        show_default=False)] = None,
    metadata: Annotated[bool, typer.Option(
        "--metadata/--no-metadata", help="Compare non-tensor values (step, epoch, lr, "
                                         "hyper-parameters).")] = True,
    exit_zero: Annotated[bool, typer.Option(
        "--exit-zero", help="Exit 0 when the checkpoints differ (errors still exit 2).")] = False,
    input_format_a: Annotated[str | None, typer.Option(
        "--input-format-a", metavar="NAME", help=_FORMAT_HELP.format(side="A"))] = None,
    input_format_b: Annotated[str | None, typer.Option(
        "--input-format-b", metavar="NAME", help=_FORMAT_HELP.format(side="B"))] = None,
    *,
    common: Common,
) -> None:
    """Show what changed between two checkpoints: tensors, shapes, dtypes, values, metadata.

    Works across formats (torch, safetensors, DCP, HF shards...). FP8 weights with their
    scales are compared dequantized (weight x scale), with the relative L2 error per tensor.
    Exit 0 when equal (within tolerance), 1 when different, 2 on error.

    Examples:
      ckpt diff run/step_1000/checkpoint.pt export/model.safetensors
      ckpt diff run/step_400 consolidated.pt --all
      ckpt diff base.safetensors finetuned.safetensors --by-module --depth 2
      ckpt diff model.pt model-fp16.safetensors --json | jq .summary
      ckpt diff ddp.pt plain.pt --strip-prefix module. --structure-only
      ckpt diff model/ model-fp8/
    """
    from ckpt_cli.ops.diff import DiffOptions, diff
    from ckpt_cli.render import diff as rd

    with common.handled() as outcome:
        options = DiffOptions(everything=all_tensors, values=not structure_only, rtol=rtol,
                              atol=atol, strip_prefixes=tuple(strip_prefix or ()),
                              auto_names=not exact_names, metadata=metadata,
                              filter_glob=name_glob, by_module=by_module, depth=depth)
        with common.progress("comparing") as bar:
            result = diff(a, b, options, fmt_a=input_format_a, fmt_b=input_format_b,
                          progress=bar, max_memory=common.max_memory)
        outcome.exit_code = code = EXIT_OK if result.equal or exit_zero else EXIT_FINDINGS
        rd.show(result, str(a), str(b), json=common.json, quiet=common.quiet, top=top,
                by_module=by_module, depth=depth)
    raise typer.Exit(code)
