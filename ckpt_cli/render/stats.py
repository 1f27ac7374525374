"""``ckpt stats`` output: tables of figures per tensor and module, trends across a run drawn
as sparklines, the anomalies, or the ``--json`` document."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckpt_cli.ops.stats.result import CheckpointStats, ModuleStats, StatsResult, TensorStats
from ckpt_cli.render import human

_Col = human.Col
_add = human.add_row
_section = human.section
_BAR = 12
_SPARKS = "▁▂▃▄▅▆▇█"

SORT_KEYS = ("name", "l2", "absmax", "std", "mean", "zeros", "nan", "numel")
"""What ``--sort`` accepts: model order, or largest first by a figure."""


def sparkline(values: Sequence[float | None], *, log: bool = False) -> Text:
    """One character per value, its height the value's place between the smallest and the
    largest (``log``: on a log scale; values <= 0 drawn lowest); an unknown value is a space,
    a value that is not finite a red ``!``."""
    usable = [v for v in values if v is not None and math.isfinite(v) and (v > 0 or not log)]
    tr = [math.log10(v) if log else v for v in usable]
    lo, hi = (min(tr), max(tr)) if tr else (0.0, 0.0)
    out = Text()
    for v in values:
        if v is None:
            out.append(" ")
        elif not math.isfinite(v):
            out.append("!", style="bold red")
        elif log and v <= 0:
            out.append(_SPARKS[0], style="dim")
        else:
            x = math.log10(v) if log else v
            k = 0 if hi == lo else round((x - lo) / (hi - lo) * (len(_SPARKS) - 1))
            out.append(_SPARKS[k], style="cyan")
    return out


def _g(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.4g}"


def _bad(nan: int, inf: int) -> Text:
    if not nan and not inf:
        return Text("-", style="dim")
    return Text(" ".join(x for x in (f"{nan:,} NaN" if nan else "", f"{inf:,} Inf" if inf
                                     else "") if x), style="bold red")


def _zeros(numel: int, zeros: int) -> str:
    return "-" if not numel else f"{100 * zeros / numel:.3g}%"


def _hist(t: TensorStats | ModuleStats) -> Text:
    m = t.moments
    if m is None:
        return Text("")
    used = [i for i, c in enumerate(m.hist) if c]
    if not used:
        return Text("")
    counts = m.hist[used[0]:used[-1] + 1]
    return sparkline([float(c) if c else None for c in counts], log=True)


def _sort_key(sort: str) -> Any:
    def key(t: TensorStats) -> Any:
        m = t.moments
        if m is None:
            return -math.inf
        v = {"l2": m.l2, "absmax": m.absmax, "std": m.std, "mean": abs(m.mean) if m.count
             else None, "zeros": m.zeros / m.numel if m.numel else 0.0, "nan": m.nan + m.inf,
             "numel": m.numel}[sort]
        return -math.inf if v is None or (isinstance(v, float) and math.isnan(v)) else v
    return key


def tensor_table(tensors: list[TensorStats], *, hist: bool) -> Table:
    """Per tensor: dtype, shape, moments, extremes, L2, zeros and non-finite counts."""
    cols = [_Col("Tensor", kind="name"), _Col("Dtype", drop=3), _Col("Shape", drop=2),
            _Col("Mean", "right", drop=5), _Col("Std", "right", drop=6),
            _Col("Min", "right", drop=4), _Col("Max", "right", drop=4),
            _Col("Absmax", "right", drop=7), _Col("L2", "right", drop=8),
            _Col("Zeros", "right", drop=5), _Col("NaN/Inf", "right", drop=9)]
    if hist:
        cols.append(_Col("|x| by binade", kind="bar", drop=1))
    table = human.table(*cols)
    for t in tensors:
        m = t.moments
        dtype = t.dtype + (" (dequant.)" if t.dequantized else "")
        shape = "[" + ", ".join(str(d) for d in t.shape) + "]"
        if m is None:
            why = f"same as {t.same_as}" if t.same_as else (t.error or "not read")
            _add(table, t.name, dtype, shape, Text(why, style="yellow"), "", "", "", "", "",
                 "", "", *([""] if hist else []))
            continue
        _add(table, t.name, dtype, shape, _g(m.mean if m.count else None), _g(m.std),
             _g(m.min if m.count else None), _g(m.max if m.count else None), _g(m.absmax),
             _g(m.l2 if m.count else None), _zeros(m.numel, m.zeros), _bad(m.nan, m.inf),
             *([_hist(t)] if hist else []))
    return table


def module_table(mods: list[ModuleStats], *, hist: bool) -> Table:
    """Per module: tensors, values, moments, L2 with a bar relative to the largest."""
    scale = max((m.moments.l2 for m in mods if math.isfinite(m.moments.l2)), default=0.0)
    cols = [_Col("Module", kind="name"), _Col("Tensors", "right", drop=2),
            _Col("Values", "right", drop=3), _Col("Mean", "right", drop=4),
            _Col("Std", "right", drop=5), _Col("Absmax", "right", drop=6),
            _Col("L2", "right", drop=8), _Col(kind="bar", drop=1),
            _Col("NaN/Inf", "right", drop=9)]
    if hist:
        cols.append(_Col("|x| by binade", kind="bar", drop=0))
    table = human.table(*cols)
    for m in mods:
        mo = m.moments
        frac = mo.l2 / scale if scale and math.isfinite(mo.l2) else 0.0
        _add(table, m.name, f"{m.tensors:,}", human.count(mo.numel),
             _g(mo.mean if mo.count else None), _g(mo.std), _g(mo.absmax),
             _g(mo.l2 if mo.count else None),
             human.bar(frac, _BAR), _bad(mo.nan, mo.inf), *([_hist(m)] if hist else []))
    return table


def trend_table(checkpoints: list[CheckpointStats], flagged: dict[str, list[str]]) -> Table:
    """Per module across the run: the norm and the update ratio as sparklines, their last
    values, and what was flagged."""
    names: list[str] = []
    seen: set[str] = set()
    for c in checkpoints:
        for m in c.modules:
            if m.name not in seen:
                seen.add(m.name)
                names.append(m.name)
    table = human.table(_Col("Module", kind="name"), _Col("L2 norm", kind="bar", drop=3),
                        _Col("Last", "right", drop=4), _Col("Update ratio", kind="bar", drop=2),
                        _Col("Last", "right", drop=5), _Col("Flags", kind="text", drop=6))
    per = [{m.name: m for m in c.modules} for c in checkpoints]
    for name in names:
        norms = [p[name].moments.l2 if name in p and p[name].moments.count else None
                 for p in per]
        ratios = [p[name].update_ratio if name in p else None for p in per]
        flags = flagged.get(name, [])
        # "Last" is the newest checkpoint's figure ("-" when unknown there), never an older one.
        _add(table, name, sparkline(norms), _g(norms[-1]), sparkline(ratios, log=True),
             _g(ratios[-1]),
             Text(", ".join(flags), style="bold red") if flags else Text("-", style="dim"))
    return table


def _summary(r: StatsResult) -> Table:
    g = human.grid()
    c = r.checkpoints
    if r.run:
        steps = [x.step for x in c if x.step is not None]
        span = f" (steps {steps[0]:,} … {steps[-1]:,})" if steps else ""
        g.add_row("Run", Text(str(r.path)))
        g.add_row("Checkpoints", f"{len(c):,}{span}" + (
            f"; {len(r.skipped):,} not read (incomplete or unreadable)" if r.skipped else ""))
    else:
        one = c[0]
        g.add_row("Checkpoint", Text(str(one.path)))
        g.add_row("Format", one.format + (f", step {one.step:,}" if one.step is not None
                                          else ""))
        params = sum(t.moments.numel for t in one.tensors if t.moments is not None
                     and t.same_as is None)
        g.add_row("Tensors", f"{len(one.tensors):,} ({human.count(params)} values)")
    g.add_row("Scope", "model weights and buffers" if r.scope == "weights" else "every tensor")
    cached = sum(x.cached for x in c)
    computed = sum(x.computed for x in c)
    rate = f" ({human.rate(r.bytes_read / r.seconds)})" if r.seconds > 0 and r.bytes_read else ""
    g.add_row("Read", f"{human.size(r.bytes_read)} in {human.duration(r.seconds, short=True)}"
              f"{rate}; {computed:,} tensor figures computed, {cached:,} from the cache")
    if r.part is not None:
        p = r.part
        state = ("every part's figures are in the cache: the whole is reported" if p["complete"]
                 else "other parts' figures are not in the cache yet: this part's share only")
        g.add_row("Part", f"{p['part']}/{p['parts']}: {state}")
    return g


def render(r: StatsResult, *, top: int | None = 20, sort: str = "name", hist: bool = False,
           console: Console | None = None) -> None:
    """Print the summary and the tables.

    Args:
        r: The result.
        top: Rows per table (None or 0: all).
        sort: Tensor order (:data:`SORT_KEYS`).
        hist: Add the histogram of ``|x|`` by binade.
        console: Where to print (default stdout).
    """
    out = console or human.stdout()
    top = top or None
    out.print(_summary(r))
    if r.run:
        flagged: dict[str, list[str]] = {}
        for a in r.anomalies:
            flagged.setdefault(a.module, []).append(
                f"{a.kind}@{a.step:,}" if a.step is not None else a.kind)
        n_mods = len({m.name for c in r.checkpoints for m in c.modules})
        _section(out, f"Modules ({n_mods:,}) across {len(r.checkpoints):,} checkpoints, oldest "
                 "to newest", n_mods, n_mods, trend_table(r.checkpoints, flagged))
    else:
        one = r.checkpoints[0]
        rows = list(one.tensors)
        if sort != "name":
            rows.sort(key=_sort_key(sort), reverse=True)
        n = len(rows)
        shown = min(n, top) if top else n
        order = "model order" if sort == "name" else f"largest {sort} first"
        _section(out, f"Tensors ({n:,}, {order})", n, shown,
                 tensor_table(rows[:shown], hist=hist))
        mods = one.modules
        ms = min(len(mods), top) if top else len(mods)
        _section(out, f"Modules ({len(mods):,})", len(mods), ms,
                 module_table(mods[:ms], hist=hist))
    out.print()
    if r.anomalies:
        table = human.table(_Col("Step", "right"), _Col("Checkpoint", kind="name", drop=2),
                            _Col("Module", kind="name"), _Col("Kind"),
                            _Col("What", kind="text", drop=1))
        for a in r.anomalies:
            _add(table, "-" if a.step is None else f"{a.step:,}", a.checkpoint, a.module,
                 Text(a.kind, style="bold red"), a.message)
        out.print(Text(f"Anomalies ({len(r.anomalies):,})", style="bold red"))
        out.print(table)
        if r.run:
            good = r.last_good
            first = r.anomalies[0]
            at = f"step {first.step:,}" if first.step is not None else first.checkpoint
            out.print()
            out.print(Text(f"Last good: {good.path} (the newest checkpoint before {at})"
                           if good is not None else
                           f"Last good: none (the first checkpoint read, {at}, has an anomaly)",
                           style="bold"))
    elif r.exit_code:  # the values are fine; the files are not (findings on stderr)
        out.print(Text("No anomaly in the values, but unsafe content in the files (see the "
                       "errors).", style="bold red"))
    elif r.part is None or r.part["complete"]:
        out.print(Text("No anomaly found.", style="green"))


def show(r: StatsResult, *, json: bool, quiet: bool, top: int, sort: str) -> None:
    """Print the result: notes on stderr, the tables or the JSON document on stdout."""
    if not quiet and r.skipped:
        err = human.stderr()
        for name, why in r.skipped.items():
            err.print(Text(f"note: {name}: not read: {why}"), soft_wrap=True)
    if not quiet:
        human.print_findings(r.findings)  # what the reads found unsafe, as inspect says it
    if json:
        from ckpt_cli.render.json import emit_result

        emit_result(r)
    else:
        render(r, top=top, sort=sort, hist=r.hist)
