"""``ckpt plan``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckpt_cli.cli.errors import EXIT_OK, handled
from ckpt_cli.cli.options import (
    InputFormatOpt,
    JsonOpt,
    Location,
    QuietOpt,
    count_parser,
    duration_parser,
    local_only,
    location,
    rate_parser,
    size_parser,
)

if TYPE_CHECKING:
    from rich.console import Console

_Dur = "DURATION"


def plan_cmd(
    params: Annotated[int | None, typer.Option(
        "--params", parser=count_parser("--params"),
        metavar="N", help="Model parameters, e.g. 175B, 7.5B, 350M.",
        show_default=False)] = None,
    precision: Annotated[str | None, typer.Option(
        "--precision", metavar="fp32|bf16|mixed",
        help="With --params. fp32: 4 bytes/param weights, fp32 state. bf16: 2, state in bf16, "
             "no fp32 copy. mixed: 2 + a 4-byte fp32 master copy, fp32 state. "
             "Default: mixed.", show_default=False)] = None,
    optimizer: Annotated[str | None, typer.Option(
        "--optimizer", metavar="adam|adamw|sgd|adafactor",
        help="With --params. adam/adamw: 2 state values per param (m, v); sgd: 1 (momentum); "
             "adafactor: 0 (factored, O(rows+cols) per matrix). Default: adamw.",
        show_default=False)] = None,
    from_path: Annotated[Location | None, typer.Option(
        "--from", metavar="PATH", help="Take the sizes from an existing checkpoint (a run "
                                       "directory: its latest complete one).",
        show_default=False, parser=location)] = None,
    input_format: InputFormatOpt = None,
    bandwidth: Annotated[float | None, typer.Option(
        "--bandwidth", parser=rate_parser("--bandwidth"),
        metavar="RATE", help="Aggregate storage write bandwidth, e.g. 10GB/s.",
        show_default=False)] = None,
    measure: Annotated[Location | None, typer.Option(
        "--measure", metavar="DIR", help="Measure the write bandwidth by writing and fsyncing "
                                         "a test file in DIR (removed afterwards).",
        show_default=False, parser=location)] = None,
    measure_size: Annotated[int | None, typer.Option(
        "--measure-size", parser=size_parser("--measure-size"),
        metavar="SIZE", help="Bytes --measure writes. Default: 1GB.",
        show_default=False)] = None,
    measure_streams: Annotated[int | None, typer.Option(
        "--measure-streams", parser=count_parser("--measure-streams", whole=True),
        metavar="N", help="Parallel writers of --measure. Default: 4.",
        show_default=False)] = None,
    mtbf: Annotated[float | None, typer.Option(
        "--mtbf", parser=duration_parser("--mtbf"),
        metavar=_Dur, help="The job's mean time between failures, e.g. 4h.",
        show_default=False)] = None,
    gpus: Annotated[int | None, typer.Option(
        "--gpus", parser=count_parser("--gpus", whole=True),
        metavar="N", help="Devices in the job; with --gpu-mtbf, job MTBF = "
                                    "--gpu-mtbf / N.", show_default=False)] = None,
    gpu_mtbf: Annotated[float | None, typer.Option(
        "--gpu-mtbf", parser=duration_parser("--gpu-mtbf"),
        metavar=_Dur, help="One device's mean time between failures, e.g. 5y.",
        show_default=False)] = None,
    ranks: Annotated[int | None, typer.Option(
        "--ranks", parser=count_parser("--ranks", whole=True),
        metavar="N", help="Ranks writing in parallel, one file each (files per "
                                     "checkpoint). Default: 1, or the files of --from.",
        show_default=False)] = None,
    keep: Annotated[int | None, typer.Option(
        "--keep", parser=count_parser("--keep", whole=True),
        metavar="N", help="Checkpoints retained: steady-state storage and files.",
        show_default=False)] = None,
    thin_after: Annotated[int | None, typer.Option(
        "--thin-after", parser=count_parser("--thin-after", whole=True),
        metavar="N", help="Storage per day when all but the newest N checkpoints "
        "are thinned (prune --thin-after).", show_default=False)] = None,
    thin_to: Annotated[str | None, typer.Option(
        "--thin-to", metavar="bf16", help="Thinned checkpoints keep BF16 weights.",
        show_default=False)] = None,
    async_save: Annotated[bool, typer.Option(
        "--async", help="Asynchronous saves: only the copy to host memory blocks training; "
                        "the write overlaps compute.")] = False,
    snapshot_bandwidth: Annotated[float | None, typer.Option(
        "--snapshot-bandwidth", parser=rate_parser("--snapshot-bandwidth"),
        metavar="RATE",
        help="With --async: device-to-host copy rate of each rank. Default: 10GB/s.",
        show_default=False)] = None,
    interval: Annotated[float | None, typer.Option(
        "--interval", parser=duration_parser("--interval"),
        metavar=_Dur, help="Your current interval (compute time between saves), "
                                         "to compare, e.g. 30m.", show_default=False)] = None,
    restart: Annotated[float | None, typer.Option(
        "--restart", parser=duration_parser("--restart", allow_zero=True),
        metavar=_Dur, help="Time to restart after a failure, counted as lost. "
                                        "Default: not counted.", show_default=False)] = None,
    quiet: QuietOpt = False,
    json: JsonOpt = False,
) -> None:
    """Plan checkpointing: checkpoint size, write time, optimal interval, storage and files.

    Bytes per parameter of a training checkpoint (--params; inference: the weights only):

      precision   weights  fp32 master  adam/adamw  sgd  adafactor
      fp32        4        0            8           4    0
      bf16        2        0            4           2    0
      mixed       2        4            8           4    0

    Training = weights + master + optimizer state (175B in fp32 with Adam: 12 x 175B = 2.1 TB);
    gradients, RNG and scheduler state are not counted.

    The optimal interval is Young's sqrt(2CM) and Daly's higher-order refinement, where C is
    the time one checkpoint blocks training (the write, or with --async the copy to host
    memory) and M the MTBF; the time lost counts checkpoint stalls plus rework after failures.

    Examples:
      ckpt plan --params 175B --precision fp32 --bandwidth 10GB/s --mtbf 4h
      ckpt plan --params 70B --measure /lustre/ckpt --gpus 1024 --gpu-mtbf 5y
      ckpt plan --params 7B --bandwidth 2GB/s --mtbf 12h --keep 5 --interval 30m
      ckpt plan --from run/step_1000 --bandwidth 2GB/s --mtbf 12h --async
    """
    from rich.markup import escape

    from ckpt_cli.ops.plan import plan
    from ckpt_cli.ops.plan.options import PlanOptions
    from ckpt_cli.render.human import size as human_size

    with handled() as outcome:
        local_only(measure, '--measure')
        err = None if quiet or json else _stderr()

        def progress(done: int, total: int) -> None:
            if err is not None and done == 0:
                err.print(f"[dim]plan:[/] measuring: writing {human_size(total)} to "
                          f"{escape(str(measure))} and fsyncing ...")

        options = PlanOptions(
            params=params, precision=precision, optimizer=optimizer, from_path=from_path,
            input_format=input_format, bandwidth=bandwidth, measure_dir=measure,
            measure_size=measure_size, measure_streams=measure_streams, mtbf=mtbf, gpus=gpus,
            gpu_mtbf=gpu_mtbf, ranks=ranks, keep=keep, async_save=async_save,
            thin_after=thin_after, thin_to=thin_to, snapshot_bandwidth=snapshot_bandwidth,
            interval=interval, restart=restart)
        result = plan(options, on_progress=progress)
        outcome.exit_code = EXIT_OK
        from ckpt_cli.render.plan import show

        show(result, json=json, quiet=quiet, err=err)

def _stderr() -> Console:
    from ckpt_cli.render import human

    return human.stderr()
