"""``ckpt stats``."""


from typing import Annotated

import typer

from ckpt_cli.cli.options import (
    STREAMING,
    AllowGlobalOpt,
    CheckpointArg,
    Common,
    InputFormatOpt,
    Location,
    PartOpt,
    RunPatternOpt,
    common_options,
    local_only,
    location,
    output_file,
)


def _sort_keys(incomplete: str) -> list[str]:
    from ckpt_cli.render.stats import SORT_KEYS

    return [k for k in SORT_KEYS if k.startswith(incomplete)]


@common_options(*STREAMING)
def stats_cmd(
    path: CheckpointArg,
    all_tensors: Annotated[bool, typer.Option(
        "--all-tensors", "--all", help="Every tensor (optimizer state: exp_avg, "
        "exp_avg_sq...), not only model weights and buffers.")] = False,
    name_glob: Annotated[str | None, typer.Option(
        "--name-glob", "--filter", metavar="GLOB", help="Only tensors whose name matches "
        "GLOB, e.g. 'layers.*.attn.*'.")] = None,
    depth: Annotated[int | None, typer.Option(
        "--depth", min=1, metavar="N", help="Name components per module of the roll-up "
                                            "(default: the tensor's own module).",
        show_default=False)] = None,
    hist: Annotated[bool, typer.Option(
        "--hist", help="Show the histogram of |x| (log-spaced: one bin per power of 2).")
    ] = False,
    sort: Annotated[str, typer.Option(
        "--sort", metavar="KEY", autocompletion=_sort_keys,
        help="Tensor order: name (model order), l2, absmax, std, mean, zeros, nan or numel "
             "(largest first).")] = "name",
    top: Annotated[int, typer.Option("--top", min=0, metavar="N",
                                     help="Rows per table; 0 shows all.")] = 20,
    every: Annotated[int | None, typer.Option(
        "--every", min=1, metavar="N", help="Run directory: every Nth checkpoint, counted "
                                            "back from the newest.", show_default=False)] = None,
    last: Annotated[int | None, typer.Option(
        "--last", min=1, metavar="N", help="Run directory: only the newest N checkpoints.",
        show_default=False)] = None,
    jump: Annotated[float, typer.Option(
        "--jump", metavar="X", help="Run directory: flag a module whose L2 norm grows more "
                                    "than X times from one checkpoint to the next.")] = 2.0,
    plot: Annotated[Location | None, typer.Option(
        "--plot", metavar="FILE", parser=output_file,
        help="Run directory: also draw each module's norm and update ratio per step into "
             "FILE (.png, .svg or .pdf; needs matplotlib).")] = None,
    no_cache: Annotated[bool, typer.Option(
        "--no-cache", help="Read every value again; keep nothing in the cache.")] = False,
    cache_dir: Annotated[Location | None, typer.Option(
        "--cache-dir", metavar="DIR", parser=location,
        help="Where figures are kept (default: $CKPT_CACHE_DIR, else ~/.cache/ckpt); give "
             "--part's processes one they share, owned by the user they run as and writable "
             "by no one else.", show_default=False)] = None,
    jobs: Annotated[int | None, typer.Option(
        "--jobs", "-j", min=1, metavar="N", help="Tensors read at once (default: CPUs).",
        show_default=False)] = None,
    part: PartOpt = None,
    pattern: RunPatternOpt = None,
    input_format: InputFormatOpt = None,
    allow_global: AllowGlobalOpt = None,
    *,
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
      ckpt stats run/step_1000 --all --filter '*exp_avg_sq'
      ckpt stats run/ --last 10
      ckpt stats run/ --json | jq '.anomalies'
      ckpt stats run/ --plot trends.png --depth 3
    """
    from ckpt_cli.ops.stats import StatsOptions, stats
    from ckpt_cli.render import stats as rs

    with common.handled() as outcome:
        local_only(plot, "--plot's file")
        local_only(cache_dir, "--cache-dir")
        if sort not in rs.SORT_KEYS:
            from ckpt_cli.errors import UsageError

            raise UsageError(f"--sort must be one of {', '.join(rs.SORT_KEYS)}, not {sort!r}")
        if plot is not None:
            from ckpt_cli.render.stats_plot import check_plot

            check_plot(plot)
        options = StatsOptions(everything=all_tensors, filter_glob=name_glob, depth=depth,
                               hist=hist, every=every, last=last, jump=jump,
                               cache=not no_cache, cache_dir=cache_dir, fmt=input_format,
                               pattern=pattern, jobs=jobs, max_memory=common.max_memory,
                               part=part, allow_globals=tuple(allow_global or ()))
        with common.progress("reading") as bar:
            result = stats(path, options, progress=bar)
        outcome.exit_code = code = result.exit_code
        if plot is not None:
            from ckpt_cli.render.stats_plot import write_plot

            write_plot(result, plot)
        rs.show(result, json=common.json, quiet=common.quiet, top=top, sort=sort)
    raise typer.Exit(code)
