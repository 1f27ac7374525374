"""Output of ``ckpt plan``: the JSON document, or the figures, the interval table and a plot."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ckpt_cli.optionspec import word
from ckpt_cli.render import json as rj

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from ckpt_cli.ops.plan.result import IntervalFigures, PlanResult


def show(result: PlanResult, *, json: bool, quiet: bool, err: Console | None = None) -> None:
    """Print the plan (stdout) and its notes (stderr, unless ``quiet``)."""
    if json:
        rj.emit_result(result)
    else:
        _render(result)
        if not quiet:
            from ckpt_cli.render import human  # lazy: pulls rich; --json output never does

            err = err or human.stderr()
            for note in result.notes:
                err.print(f"note: {word(note, 'cli')}", soft_wrap=True)


_PRECISION_LABEL = {"fp32": "fp32", "bf16": "pure bf16",
                    "mixed": "mixed precision (bf16 weights, fp32 master and state)"}
_STATE_LABEL = {"adam": "m, v in {state}", "adamw": "m, v in {state}",
                "sgd": "momentum in {state}", "adafactor": "factored, not counted"}
_OPTIMIZER_LABEL = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD with momentum",
                    "adafactor": "Adafactor"}


def _render(r: PlanResult) -> None:
    from rich.text import Text  # heavy: rich

    from ckpt_cli.render import human  # lazy: pulls rich; --json output never does

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

    grid = human.grid()
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
            f"measured: {human.size(m.bytes)} in {m.streams} streams, {_d(m.seconds)}")
        grid.add_row("Bandwidth", f"{human.rate(r.bandwidth)}  ({how})")
        grid.add_row("Write time", _d(r.write_seconds))
    if r.async_save:
        grid.add_row("Snapshot (blocks)",
                     f"{_d(r.snapshot_seconds)}  ({human.rate(r.snapshot_bandwidth)} "
                     f"per rank x {r.files_per_checkpoint:,} ranks); the write overlaps compute")
    if r.mtbf is not None:
        how = "job" if r.gpus is None else (
            f"{_d(r.gpu_mtbf)} per GPU / {r.gpus:,} GPUs")
        grid.add_row("MTBF", f"{_d(r.mtbf)}  ({how})")
    if r.restart:
        grid.add_row("Restart", _d(r.restart))
    if r.keep is not None:
        thinned = r.keep - (r.kept_whole if r.kept_whole is not None else r.keep)
        held = f" ({r.kept_whole} whole, {thinned} thinned)" if thinned else ""
        grid.add_row(f"Retention (--keep {r.keep})",
                     f"{human.size(r.steady_bytes)}{held}, {r.steady_files:,} files "
                     f"({human.size(r.peak_bytes)} while the next one is written)")
    day = r.thinning_day()
    if r.thin_after is not None:
        label = f"Thinning (--thin-after {r.thin_after}{' --thin-to bf16' if r.thin_to else ''})"
        text = f"{human.size(r.thinned_bytes)} per thinned checkpoint"
        if day is not None:
            text += (f"; {human.size(day['bytes_per_day_thinned'])} per day against "
                     f"{human.size(day['bytes_per_day_whole'])} kept whole "
                     f"({day['checkpoints_per_day']:.1f} saves a day)")
        else:
            text += "; give --interval (or --bandwidth and --mtbf) for storage per day"
        grid.add_row(label, text)
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
    from ckpt_cli.render import human  # lazy: pulls rich; --json output never does

    table = human.table(human.Col("Checkpoint every", kind="name"),
                        *(human.Col(name, "right") for name, _f in cols))

    def row(label: str, cell: Any) -> None:
        table.add_row(label, *(cell(f) for _name, f in cols))

    row("Compute between saves", lambda f: _d(f.seconds))
    if r.async_save:
        row("Training blocked per save", lambda f: _d(f.blocking))
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


def _d(seconds: float | None) -> str:
    """Every duration in plan's output in one form: ``0.573s``, ``3m 30s``, ``4h``."""
    from ckpt_cli.render import human  # lazy: pulls rich; --json output never does

    return human.duration(seconds, short=True)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _plot(r: PlanResult, optimum: IntervalFigures, best: float, columns: int) -> Text:
    from rich.text import Text  # heavy: rich

    from ckpt_cli.render.plot import Mark, log_x_plot  # lazy: pulls rich; --json output never does

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
                           height=10, marks=marks, fmt_x=lambda x: _d(x),
                           fmt_y=lambda y: f"{100 * y:.{0 if top >= 0.05 else 1}f}%"))
    text.append("\n◆ ", style="bold green")
    text.append(f"optimum (Daly) {_d(optimum.seconds)}: {_pct(best)} lost")
    if r.current is not None and r.current.overhead is not None:
        text.append("\n● ", style="bold yellow")
        text.append(f"--interval {_d(r.current.seconds)}: "
                    f"{_pct(r.current.overhead.total)} lost")
    return text


def plan_dict(result: PlanResult) -> dict[str, Any]:
    """The ``plan --json`` document body (see docs/json-schema.md): ``result.json_body()``."""
    return result.json_body()
