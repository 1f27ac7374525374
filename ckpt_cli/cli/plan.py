"""``ckpt plan``."""


from functools import partial
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
    valued,
    whole_parser,
)

if TYPE_CHECKING:
    from rich.console import Console

_Dur = "DURATION"


def plan_cmd(
    params: Annotated[int | None, valued(
        "--params", "N", "Model parameters, e.g. 175B, 7.5B, 350M.",
        count_parser)] = None,
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
    bandwidth: Annotated[float | None, valued(
        "--bandwidth", "RATE", "Aggregate storage write bandwidth, e.g. 10GB/s.",
        rate_parser)] = None,
    measure: Annotated[Location | None, typer.Option(
        "--measure", metavar="DIR", help="Measure the write bandwidth by writing and fsyncing "
                                         "a test file in DIR (removed afterwards).",
        show_default=False, parser=location)] = None,
    measure_size: Annotated[int | None, valued(
        "--measure-size", "SIZE", "Bytes --measure writes. Default: 1GB.",
        size_parser)] = None,
    measure_streams: Annotated[int | None, valued(
        "--measure-streams", "N", "Parallel writers of --measure. Default: 4.",
        whole_parser)] = None,
    mtbf: Annotated[float | None, valued(
        "--mtbf", _Dur, "The job's mean time between failures, e.g. 4h.",
        duration_parser)] = None,
    gpus: Annotated[int | None, valued(
        "--gpus", "N", "Devices in the job; with --gpu-mtbf, job MTBF = --gpu-mtbf / N.",
        whole_parser)] = None,
    gpu_mtbf: Annotated[float | None, valued(
        "--gpu-mtbf", _Dur, "One device's mean time between failures, e.g. 5y.",
        duration_parser)] = None,
    ranks: Annotated[int | None, valued(
        "--ranks", "N", "Ranks writing in parallel, one file each (files per checkpoint). "
                        "Default: 1, or the files of --from.",
        whole_parser)] = None,
    keep: Annotated[int | None, valued(
        "--keep", "N", "Checkpoints retained: steady-state storage and files.",
        whole_parser)] = None,
    thin_after: Annotated[int | None, valued(
        "--thin-after", "N", "Storage per day when all but the newest N checkpoints are thinned "
                             "(prune --thin-after).",
        whole_parser)] = None,
    thin_to: Annotated[str | None, typer.Option(
        "--thin-to", metavar="bf16", help="Thinned checkpoints keep BF16 weights.",
        show_default=False)] = None,
    async_save: Annotated[bool, typer.Option(
        "--async", help="Asynchronous saves: only the copy to host memory blocks training; "
                        "the write overlaps compute.")] = False,
    snapshot_bandwidth: Annotated[float | None, valued(
        "--snapshot-bandwidth", "RATE", "With --async: device-to-host copy rate of each rank. "
                                        "Default: 10GB/s.",
        rate_parser)] = None,
    interval: Annotated[float | None, valued(
        "--interval", _Dur, "Your current interval (compute time between saves), to compare, "
                            "e.g. 30m.",
        duration_parser)] = None,
    restart: Annotated[float | None, valued(
        "--restart", _Dur, "Time to restart after a failure, counted as lost. Default: not "
                           "counted.",
        partial(duration_parser, allow_zero=True))] = None,
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

        def progress(_phase: str, done: int, total: int) -> None:
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
        result = plan(options, progress=progress)
        outcome.exit_code = EXIT_OK
        from ckpt_cli.render.plan import show

        show(result, json=json, quiet=quiet, err=err)

def _stderr() -> "Console":
    from ckpt_cli.render import human

    return human.stderr()
