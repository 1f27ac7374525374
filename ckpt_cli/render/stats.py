"""``ckpt stats`` output: tables of figures per tensor and module, trends across a run drawn
as sparklines, the anomalies, or the ``--json`` document."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckpt_cli.ops.stats.result import (
    CHECKPOINT,
    CheckpointStats,
    ModuleStats,
    StatsResult,
    TensorStats,
    hist_bins,
)
from ckpt_cli.render import human
from ckpt_cli.render.json import emit_result

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


def _edge(k: int) -> str:
    """``2**k`` as a short decimal (a binade's edge)."""
    return f"{2.0 ** k:.3g}"


def bins(ms: ModuleStats) -> list[tuple[str, int]]:
    """The used binades of a module's histogram of ``|x|``, smallest first: each bin's range
    (``[lo, hi)``; the first bin of all also holds what is below it, the last what is above)
    and its count."""
    def rng(lo: int | None, hi: int | None) -> str:
        if lo is None:
            return "any" if hi is None else f"< {_edge(hi)}"
        return f">= {_edge(lo)}" if hi is None else f"[{_edge(lo)}, {_edge(hi)})"

    return [(rng(lo, hi), c) for lo, hi, c in hist_bins(ms.moments)]


def _hist(t: TensorStats | ModuleStats) -> Text:
    """The histogram as a sparkline between the edges of its first and last bar (each bar one
    power of 2: its range follows from the edges)."""
    m = t.moments
    rows = hist_bins(m) if m is not None else []
    if not rows:
        return Text("")
    lo, hi = rows[0][0], rows[-1][1]
    out = Text(("0" if lo is None else _edge(lo)) + " ", style="dim")
    out.append_text(sparkline([float(c) if c else None for _, _, c in rows], log=True))
    out.append(" " + ("inf" if hi is None else _edge(hi)), style="dim")
    return out


def hist_lines(mods: list[ModuleStats]) -> Text:
    """Each module's histogram of ``|x|``, one line per bar labelled with its bin's range."""
    out = Text()
    for ms in mods:
        rows = bins(ms)
        if not rows:
            continue
        out.append(f"{ms.name}\n", style="bold")
        width = max(len(r) for r, _ in rows)
        top = max(c for _, c in rows)
        for rng, c in rows:
            out.append(f"  {rng:<{width}}  ")
            out.append_text(human.bar(c / top if top else 0.0, _BAR))
            out.append(f"  {c:,}\n")
    return out


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
        cols.append(_Col("|x| by power of 2", kind="bar", drop=1))
    table = human.table(*cols)
    for t in tensors:
        m = t.moments
        dtype = t.dtype + (" (dequant.)" if t.dequantized else "")
        shape = "[" + ", ".join(str(d) for d in t.shape) + "]"
        if m is None:
            if t.same_as is None:
                continue  # not read: a line under the table (not_read), not a row
            _add(table, t.name, dtype, shape, Text(f"same as {t.same_as}", style="yellow"), "",
                 "", "", "", "", "", "", *([""] if hist else []))
            continue
        _add(table, t.name, dtype, shape, _g(m.mean if m.count else None), _g(m.std),
             _g(m.min if m.count else None), _g(m.max if m.count else None), _g(m.absmax),
             _g(m.l2 if m.count else None), _zeros(m.numel, m.zeros), _bad(m.nan, m.inf),
             *([_hist(t)] if hist else []))
    return table


def not_read(tensors: list[TensorStats]) -> Text | None:
    """One line per tensor whose values were not read, with why (None: every one was)."""
    bad = [t for t in tensors if t.moments is None and t.same_as is None]
    if not bad:
        return None
    out = Text(f"Not read ({len(bad):,}):", style="bold yellow")
    for t in bad:
        out.append("\n  ")
        out.append(t.name)
        out.append(f": {t.error or 'not read'}", style="yellow")
    return out


def module_table(mods: list[ModuleStats], *, hist: bool) -> Table:
    """Per module: tensors, values, moments, L2 with a bar relative to the largest."""
    scale = max((m.moments.l2 for m in mods if math.isfinite(m.moments.l2)), default=0.0)
    cols = [_Col("Module", kind="name"), _Col("Tensors", "right", drop=2),
            _Col("Values", "right", drop=3), _Col("Mean", "right", drop=4),
            _Col("Std", "right", drop=5), _Col("Absmax", "right", drop=6),
            _Col("L2", "right", drop=8), _Col(kind="bar", drop=1),
            _Col("NaN/Inf", "right", drop=9)]
    if hist:
        cols.append(_Col("|x| by power of 2", kind="bar", drop=0))
    table = human.table(*cols)
    for m in mods:
        mo = m.moments
        frac = mo.l2 / scale if scale and math.isfinite(mo.l2) else 0.0
        _add(table, m.name, f"{m.tensors:,}", human.count(mo.numel),
             _g(mo.mean if mo.count else None), _g(mo.std), _g(mo.absmax),
             _g(mo.l2 if mo.count else None),
             human.bar(frac, _BAR), _bad(mo.nan, mo.inf), *([_hist(m)] if hist else []))
    return table


GAP_GLYPHS = {"unreadable": ("✗", "bold red"), "missing": ("·", "dim")}
"""How a sparkline marks a checkpoint that dropped out: not readable, or missing from the run's
regular step spacing."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One checkpoint's place on a run's time line.

    Attributes:
        step: Its step (None: unknown).
        name: Its name (empty for a missing one).
        stats: Its figures; None when it dropped out.
        gap: Why it dropped out: ``unreadable`` or ``missing`` (None: read).
    """

    step: int | None
    name: str
    stats: CheckpointStats | None
    gap: str | None = None


def timeline(r: StatsResult) -> list[Slot]:
    """The run's checkpoints in step order, with those that dropped out: one that could not be
    opened (an ``unreadable`` anomaly of the whole checkpoint), and steps missing from a
    regular spacing (the most common step between neighbours, when at least half of them
    have it: steps 0, 2, 4, 8 miss 6)."""
    slots = [Slot(c.step, c.name, c) for c in r.checkpoints]
    names = {c.name for c in r.checkpoints}
    for a in r.anomalies:
        if a.kind == "unreadable" and a.module == CHECKPOINT and a.checkpoint not in names:
            names.add(a.checkpoint)
            slots.append(Slot(a.step, a.checkpoint, None, "unreadable"))
    known = sorted((s for s in slots if s.step is not None), key=lambda s: s.step or 0)
    steps = [s.step for s in known if s.step is not None]
    diffs = [b - a for a, b in itertools.pairwise(steps) if b > a]
    if diffs:
        d, k = Counter(diffs).most_common(1)[0]
        if 2 * k >= len(diffs):
            gaps = [x for a, b in itertools.pairwise(steps) if b - a > d and (b - a) % d == 0
                    for x in range(a + d, b, d)]
            if len(gaps) <= 2 * len(steps):  # a thinned run, not a sparse time line
                known += [Slot(x, "", None, "missing") for x in gaps]
    known.sort(key=lambda s: s.step or 0)
    return known + [s for s in slots if s.step is None]


def _step(s: Slot) -> str:
    return "-" if s.step is None else f"{s.step:,}"


def _axis(slots: list[Slot]) -> str:
    """The first and last step at either end of a sparkline of ``len(slots)`` characters
    (side by side when they do not fit)."""
    first, last = _step(slots[0]), _step(slots[-1])
    if len(slots) == 1:
        return first
    gap = len(slots) - len(first) - len(last)
    return first + " " * gap + last if gap >= 1 else f"{first}…{last}"


def _along(slots: list[Slot], spark: Text) -> Text:
    """``spark`` (a character per read checkpoint) spread over ``slots``, dropped ones marked."""
    out = Text()
    k = 0
    for s in slots:
        if s.gap is None:
            out.append_text(spark[k:k + 1])
            k += 1
        else:
            glyph, style = GAP_GLYPHS[s.gap]
            out.append(glyph, style=style)
    return out


def trend_table(slots: list[Slot], flagged: dict[str, list[str]]) -> Table:
    """Per module across the run: the norm and the update ratio as sparklines (a character per
    checkpoint of ``slots``, the first and last step above them), their last values, and what
    was flagged."""
    checkpoints = [s.stats for s in slots if s.stats is not None]
    names: list[str] = []
    seen: set[str] = set()
    for c in checkpoints:
        for m in c.modules:
            if m.name not in seen:
                seen.add(m.name)
                names.append(m.name)
    axis = _axis(slots)
    table = human.table(_Col("Module", kind="name"),
                        _Col(f"L2 norm\n{axis}", kind="bar", drop=3),
                        _Col("Last", "right", drop=4),
                        _Col(f"Update ratio\n{axis}", kind="bar", drop=2),
                        _Col("Last", "right", drop=5), _Col("Flags", kind="text", drop=6))
    per = [{m.name: m for m in c.modules} for c in checkpoints]
    for name in names:
        norms = [p[name].moments.l2 if name in p and p[name].moments.count else None
                 for p in per]
        ratios = [p[name].update_ratio if name in p else None for p in per]
        flags = flagged.get(name, [])
        # "Last" is the newest checkpoint's figure ("-" when unknown there), never an older one.
        _add(table, name, _along(slots, sparkline(norms)), _g(norms[-1]),
             _along(slots, sparkline(ratios, log=True)), _g(ratios[-1]),
             Text(", ".join(flags), style="bold red") if flags else Text("-", style="dim"))
    return table


def _legend(slots: list[Slot]) -> Text:
    """What the sparklines' characters are: the steps they span, and the gaps."""
    read = sum(1 for s in slots if s.gap is None)
    out = Text(f"One character per checkpoint, oldest to newest: steps {_step(slots[0])} to "
               f"{_step(slots[-1])}, {read:,} read", style="dim")
    for gap, what in (("unreadable", "not readable"), ("missing", "missing")):
        dropped = [s for s in slots if s.gap == gap]
        if dropped:
            glyph, _ = GAP_GLYPHS[gap]
            at = ", ".join(f"{s.step:,}" if s.step is not None else s.name for s in dropped[:8])
            more = f" and {len(dropped) - 8:,} more" if len(dropped) > 8 else ""
            out.append(f"; {glyph} {what}: step {at}{more}", style="dim")
    out.append(".", style="dim")
    return out


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
    of = f" of {human.size(r.files_bytes)}" if r.files_bytes else ""
    g.add_row("Read", f"{human.size(r.bytes_read)}{of} in "
              f"{human.duration(r.seconds, short=True)}{rate}; {computed:,} tensor figures "
              f"computed, {cached:,} from the cache")
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
        slots = timeline(r)
        _section(out, f"Modules ({n_mods:,}) across {len(r.checkpoints):,} checkpoints, oldest "
                 "to newest", n_mods, n_mods, trend_table(slots, flagged))
        out.print(_legend(slots), soft_wrap=True)
    else:
        one = r.checkpoints[0]
        rows = [t for t in one.tensors if t.moments is not None or t.same_as is not None]
        if sort != "name":
            rows.sort(key=_sort_key(sort), reverse=True)
        n = len(one.tensors)
        shown = min(len(rows), top) if top else len(rows)
        order = "model order" if sort == "name" else f"largest {sort} first"
        if rows:
            _section(out, f"Tensors ({n:,}, {order})", len(rows), shown,
                     tensor_table(rows[:shown], hist=hist))
        else:
            out.print()
            out.print(Text(f"Tensors ({n:,}): none read", style="bold"))
        bad = [t for t in one.tensors if t.moments is None and t.same_as is None]
        lines = not_read(bad[:top] if top else bad)
        if lines is not None:
            out.print(lines, soft_wrap=True)
            if top and len(bad) > top:
                out.print(Text(f"  … {len(bad) - top:,} more (--top 0 shows all)", style="dim"))
        mods = one.modules
        ms = min(len(mods), top) if top else len(mods)
        if mods:
            _section(out, f"Modules ({len(mods):,})", len(mods), ms,
                     module_table(mods[:ms], hist=hist))
        if hist and mods:
            out.print()
            out.print(Text("|x| per module, one bar per power of 2 (zeros, NaN, Inf apart)",
                           style="bold"))
            out.print(hist_lines(mods[:ms]), soft_wrap=True)
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
        emit_result(r)
    else:
        render(r, top=top, sort=sort, hist=r.hist)
