"""``ckpt plan``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckpt_cli.cli.errors import EXIT_OK, handled
from ckpt_cli.cli.options import InputFormatOpt, JsonOpt, QuietOpt

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from ckpt_cli.results import IntervalFigures, PlanResult

_Dur = "DURATION"


def plan_cmd(
    params: Annotated[str | None, typer.Option(
        "--params", metavar="N", help="Model parameters, e.g. 175B, 7.5B, 350M.",
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
    from_path: Annotated[Path | None, typer.Option(
        "--from", metavar="PATH", help="Take the sizes from an existing checkpoint (a run "
                                       "directory: its latest complete one).",
        show_default=False)] = None,
    input_format: InputFormatOpt = None,
    bandwidth: Annotated[str | None, typer.Option(
        "--bandwidth", metavar="RATE", help="Aggregate storage write bandwidth, e.g. 10GB/s.",
        show_default=False)] = None,
    measure: Annotated[Path | None, typer.Option(
        "--measure", metavar="DIR", help="Measure the write bandwidth by writing and fsyncing "
                                         "a test file in DIR (removed afterwards).",
        show_default=False)] = None,
    measure_size: Annotated[str | None, typer.Option(
        "--measure-size", metavar="SIZE", help="Bytes --measure writes. Default: 1GB.",
        show_default=False)] = None,
    measure_streams: Annotated[str | None, typer.Option(
        "--measure-streams", metavar="N", help="Parallel writers of --measure. Default: 4.",
        show_default=False)] = None,
    mtbf: Annotated[str | None, typer.Option(
        "--mtbf", metavar=_Dur, help="The job's mean time between failures, e.g. 4h.",
        show_default=False)] = None,
    gpus: Annotated[str | None, typer.Option(
        "--gpus", metavar="N", help="Devices in the job; with --gpu-mtbf, job MTBF = "
                                    "--gpu-mtbf / N.", show_default=False)] = None,
    gpu_mtbf: Annotated[str | None, typer.Option(
        "--gpu-mtbf", metavar=_Dur, help="One device's mean time between failures, e.g. 5y.",
        show_default=False)] = None,
    ranks: Annotated[str | None, typer.Option(
        "--ranks", metavar="N", help="Ranks writing in parallel, one file each (files per "
                                     "checkpoint). Default: 1, or the files of --from.",
        show_default=False)] = None,
    keep: Annotated[str | None, typer.Option(
        "--keep", metavar="N", help="Checkpoints retained: steady-state storage and files.",
        show_default=False)] = None,
    async_save: Annotated[bool, typer.Option(
        "--async", help="Asynchronous saves: only the copy to host memory blocks training; "
                        "the write overlaps compute.")] = False,
    snapshot_bandwidth: Annotated[str | None, typer.Option(
        "--snapshot-bandwidth", metavar="RATE",
        help="With --async: device-to-host copy rate of each rank. Default: 10GB/s.",
        show_default=False)] = None,
    interval: Annotated[str | None, typer.Option(
        "--interval", metavar=_Dur, help="Your current interval (compute time between saves), "
                                         "to compare, e.g. 30m.", show_default=False)] = None,
    restart: Annotated[str | None, typer.Option(
        "--restart", metavar=_Dur, help="Time to restart after a failure, counted as lost. "
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
    from ckpt_cli.render.human import size as human_size
    from ckpt_cli.units import parse_count, parse_duration, parse_rate, parse_size

    with handled() as outcome:
        err = None if quiet or json else _stderr()

        def progress(done: int, total: int) -> None:
            if err is not None and done == 0:
                err.print(f"[dim]plan:[/] measuring: writing {human_size(total)} to "
                          f"{escape(str(measure))} and fsyncing ...")

        result = plan(
            params=None if params is None else parse_count(params, what="--params"),
            precision=precision, optimizer=optimizer, from_path=from_path,
            input_format=input_format,
            bandwidth=None if bandwidth is None else parse_rate(bandwidth, what="--bandwidth"),
            measure_dir=measure,
            measure_size=None if measure_size is None else parse_size(
                measure_size, what="--measure-size"),
            measure_streams=_whole(measure_streams, "--measure-streams"),
            mtbf=None if mtbf is None else parse_duration(mtbf, what="--mtbf"),
            gpus=_whole(gpus, "--gpus"),
            gpu_mtbf=None if gpu_mtbf is None else parse_duration(gpu_mtbf, what="--gpu-mtbf"),
            ranks=_whole(ranks, "--ranks"), keep=_whole(keep, "--keep"), async_save=async_save,
            snapshot_bandwidth=None if snapshot_bandwidth is None else parse_rate(
                snapshot_bandwidth, what="--snapshot-bandwidth"),
            interval=None if interval is None else parse_duration(interval, what="--interval"),
            restart=None if restart is None else parse_duration(restart, what="--restart",
                                                                allow_zero=True),
            on_progress=progress)
        outcome.exit_code = EXIT_OK
        if json:
            from ckpt_cli.render import json as rj

            rj.emit("plan", result.to_dict())
        else:
            _render(result)
            if not quiet:
                err = err or _stderr()
                for note in result.notes:
                    err.print(f"note: {note}", soft_wrap=True)


def _whole(text: str | None, what: str) -> int | None:
    from ckpt_cli.units import parse_count

    return None if text is None else parse_count(text, what=what, whole=True)


def _stderr() -> Console:
    from ckpt_cli.render import human

    return human.stderr()


_PRECISION_LABEL = {"fp32": "fp32", "bf16": "pure bf16",
                    "mixed": "mixed precision (bf16 weights, fp32 master and state)"}
_STATE_LABEL = {"adam": "m, v in {state}", "adamw": "m, v in {state}",
                "sgd": "momentum in {state}", "adafactor": "factored, not counted"}
_OPTIMIZER_LABEL = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD with momentum",
                    "adafactor": "Adafactor"}


def _render(r: PlanResult) -> None:
    from rich.table import Table
    from rich.text import Text

    from ckpt_cli.render import human

    out = human.stdout()
    s = r.size
    precision, optimizer = s.precision or "", s.optimizer_name or ""  # both set with --params
    if s.path is None:
        title = (f"{human.count(s.parameters)} parameters, {_PRECISION_LABEL[precision]}, "
                 f"{_OPTIMIZER_LABEL[optimizer]}")
    else:
        title = f"{s.path} ({s.format}, {human.count(s.parameters)} parameters)"
    out.print(Text(f"Plan for {title}", style="bold"), soft_wrap=True)
    out.print()

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    parts = f"weights {human.size(s.weights)}"
    if s.master:
        parts += f" + master {human.size(s.master)}"
    parts += f" + optimizer {human.size(s.optimizer)}"
    if s.path is not None:
        parts += f" + other {human.size(s.other)}"
    grid.add_row("Training checkpoint", f"{human.size(s.training)}  ({parts})")
    grid.add_row("Inference checkpoint", f"{human.size(s.inference)}  (weights only)")
    if s.per_parameter is not None:
        b = s.per_parameter
        state = "fp32" if precision == "mixed" else precision
        weights = "bf16" if precision != "fp32" else "fp32"
        what = (f"{b.training} = {b.weights} weights ({weights})"
                + (f" + {b.master} fp32 master" if b.master else "")
                + f" + {b.optimizer} optimizer ({_OPTIMIZER_LABEL[optimizer]} "
                + _STATE_LABEL[optimizer].format(state=state) + ")")
        grid.add_row("Bytes per parameter", f"{what}; inference {b.inference}")
    files = f"{r.files_per_checkpoint:,} per checkpoint"
    if r.inodes_per_checkpoint != r.files_per_checkpoint:
        files += f" ({r.inodes_per_checkpoint:,} inodes with their directories)"
    grid.add_row("Files", files)
    if r.bandwidth is not None:
        m = r.measurement
        how = "given" if m is None else (
            f"measured: {human.size(m.bytes)} in {m.streams} streams, {m.seconds:.2f} s")
        grid.add_row("Bandwidth", f"{human.rate(r.bandwidth)}  ({how})")
        grid.add_row("Write time", human.duration(r.write_seconds))
    if r.async_save:
        grid.add_row("Snapshot (blocks)",
                     f"{human.duration(r.snapshot_seconds)}  ({human.rate(r.snapshot_bandwidth)} "
                     f"per rank x {r.files_per_checkpoint:,} ranks); the write overlaps compute")
    if r.mtbf is not None:
        how = "job" if r.gpus is None else (
            f"{human.duration(r.gpu_mtbf)} per GPU / {r.gpus:,} GPUs")
        grid.add_row("MTBF", f"{human.duration(r.mtbf)}  ({how})")
    if r.restart:
        grid.add_row("Restart", human.duration(r.restart))
    if r.keep is not None:
        grid.add_row(f"Retention (--keep {r.keep})",
                     f"{human.size(r.steady_bytes)}, {r.steady_files:,} files "
                     f"({human.size(r.peak_bytes)} while the next one is written)")
    out.print(grid)

    cols = [(name, f) for name, f in (("Young sqrt(2CM)", r.young), ("Daly (optimum)", r.daly),
                                      ("--interval", r.current)) if f is not None]
    if cols:
        out.print()
        out.print(_interval_table(r, cols))
    if r.daly is not None and r.daly.overhead is not None:
        out.print()
        out.print(_plot(r, r.daly, r.daly.overhead.total, out.width))


def _interval_table(r: PlanResult, cols: list[tuple[str, IntervalFigures]]) -> Table:
    from rich.table import Table

    from ckpt_cli.render import human

    table = Table(box=None, pad_edge=False, show_edge=False)
    table.add_column("Checkpoint every")
    for name, _f in cols:
        table.add_column(name, justify="right")

    def row(label: str, cell: Any) -> None:
        table.add_row(label, *(cell(f) for _name, f in cols))

    row("Compute between saves", lambda f: human.duration(f.seconds, short=True))
    if r.async_save:
        row("Training blocked per save", lambda f: human.duration(f.blocking, short=True))
    if any(f.overhead is not None for _n, f in cols):
        row("Expected time lost", lambda f: _pct(f.overhead and f.overhead.total))
        row("  stalled by saves", lambda f: _pct(f.overhead and f.overhead.checkpointing))
        row("  to failures", lambda f: _pct(f.overhead and f.overhead.failures))
    row("Saves per day", lambda f: f"{f.checkpoints_per_day:,.1f}")
    row("Written per day", lambda f: human.size(f.bytes_per_day))
    row("Files per day", lambda f: f"{f.files_per_day:,.0f}")
    if r.inodes_per_checkpoint != r.files_per_checkpoint:
        row("Inodes per day", lambda f: f"{f.inodes_per_day:,.0f}")
    return table


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _plot(r: PlanResult, optimum: IntervalFigures, best: float, columns: int) -> Text:
    from rich.text import Text

    from ckpt_cli.render import human
    from ckpt_cli.render.plot import Mark, log_x_plot

    lo, hi = r.curve_range()
    # Room above the optimum (and above --interval) so the bottom of the curve is visible.
    top = 2.5 * best
    if r.current is not None and r.current.overhead is not None:
        top = max(top, 1.2 * r.current.overhead.total)
    top = min(1.0, max(top, 0.01))
    marks = [Mark(optimum.seconds, "◆", "bold green")]
    if r.current is not None:
        marks.append(Mark(r.current.seconds, "●", "bold yellow"))

    def lost(tau: float) -> float:
        over = r.overhead_at(tau)
        return math.nan if over is None else over.total

    text = Text("Expected time lost vs interval (log scale)\n", style="bold")
    text.append(log_x_plot(lost, lo, hi, y_max=top, width=max(20, min(72, columns - 10)),
                           height=10, marks=marks, fmt_x=lambda x: human.duration(x, short=True),
                           fmt_y=lambda y: f"{100 * y:.{0 if top >= 0.05 else 1}f}%"))
    text.append("\n◆ ", style="bold green")
    text.append(f"optimum (Daly) {human.duration(optimum.seconds)}: {_pct(best)} lost")
    if r.current is not None and r.current.overhead is not None:
        text.append("\n● ", style="bold yellow")
        text.append(f"--interval {human.duration(r.current.seconds)}: "
                    f"{_pct(r.current.overhead.total)} lost")
    return text
