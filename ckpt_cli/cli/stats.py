"""``ckpt stats``."""


from typing import Annotated

import typer

from ckpt_cli.cli.errors import handled
from ckpt_cli.cli.options import (
    CheckpointArg,
    Common,
    Location,
    common_options,
    from_options,
    local_only,
    output_file,
    use_storage,
)
from ckpt_cli.errors import UsageError
from ckpt_cli.ops.options.stats import StatsOptions


def _sort_keys(incomplete: str) -> list[str]:
    from ckpt_cli.render.stats import SORT_KEYS  # lazy: not loaded by ckpt --help

    return [k for k in SORT_KEYS if k.startswith(incomplete)]


@common_options("quiet", "storage_option", "json")
@from_options(StatsOptions)
def stats_cmd(
    path: CheckpointArg,
    sort: Annotated[str, typer.Option(
        "--sort", metavar="KEY", autocompletion=_sort_keys,
        help="Tensor order: name (model order), l2, absmax, std, mean, zeros, nan or numel "
             "(largest first).")] = "name",
    top: Annotated[int, typer.Option("--top", min=0, metavar="N",
                                     help="Rows per table; 0 shows all.")] = 20,
    plot: Annotated[Location | None, typer.Option(
        "--plot", metavar="FILE", parser=output_file,
        help="Run directory: also draw each module's norm and update ratio per step into "
             "FILE (.png, .svg or .pdf; needs matplotlib).")] = None,
    *,
    options: StatsOptions,
    common: Common,
) -> None:
    """Show the health of the weights, in one checkpoint and across a run.

    Per tensor and module: mean, std, min, max, absmax, L2 norm, zeros, NaN and Inf, read
    once, streaming, on every core, in FP64 (FP8 weights dequantized). A run directory adds,
    per checkpoint, each module's update ||W_t - W_t-1|| / ||W_t-1|| and flags NaN/Inf
    appearing, norm jumps (--jump), modules that stopped changing and tensors that became
    all zeros. Figures are cached per checkpoint in the user's cache directory, so asking
    again reads only new checkpoints. Exit status: 0 healthy, 1 anomalies found, 2 usage
    error or unreadable input.

    Examples:
      ckpt stats model.safetensors --sort absmax
      ckpt stats run/step_1000 --all-tensors --name-glob '*exp_avg_sq'
      ckpt stats run/ --last 10
      ckpt stats run/ --json | jq '.anomalies'
      ckpt stats run/ --plot trends.png --depth 3
    """
    from ckpt_cli.ops.stats import stats  # lazy: not loaded by ckpt --help
    from ckpt_cli.render import stats as rs  # lazy: not loaded by ckpt --help

    with handled() as outcome:
        use_storage(common.storage_option, options.concurrency)
        local_only(plot, "--plot's file")
        local_only(options.cache_dir, "--cache-dir")
        if sort not in rs.SORT_KEYS:
            raise UsageError(f"--sort must be one of {', '.join(rs.SORT_KEYS)}, not {sort!r}")
        if plot is not None:
            from ckpt_cli.render.stats_plot import check_plot  # lazy: not loaded by ckpt --help

            check_plot(plot)
        with common.progress("reading") as bar:
            result = stats(path, options, progress=bar)
        outcome.exit_code = code = result.exit_code
        if plot is not None:
            from ckpt_cli.render.stats_plot import write_plot  # lazy: not loaded by ckpt --help

            write_plot(result, plot)
        rs.show(result, json=common.json, quiet=common.quiet, top=top, sort=sort)
    raise typer.Exit(code)
