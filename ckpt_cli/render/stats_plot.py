"""``ckpt stats RUN --plot FILE``: each module's L2 norm and update ratio per step, drawn with
matplotlib (an optional extra: ``pip install 'ckpt-cli[plot]'``), anomalies marked.

Up to :data:`COLOURED` modules get a colour and a legend entry, outside the axes; with more,
those that change most (and every module with an anomaly) do, and the others are drawn thin
and grey under one legend entry that names ``--depth``. Anomalies are marked by one line per
step and one label per step, labels stacked so that none overlaps another; a checkpoint that
dropped out (unreadable, or missing from the run's step spacing) is a dotted grey line.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli.errors import UsageError
from ckpt_cli.ops.stats.result import StatsResult
from ckpt_cli.render.stats import timeline
from ckpt_cli.storage.atomic import atomic_file, check_destination

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FORMATS = (".png", ".svg", ".pdf")
COLOURED = 10
"""Modules drawn in colour, with a legend entry; the others are grey."""
_PER_LABEL = 3  # anomalies listed per step's label, then "+N more"


def check_plot(dest: Path) -> None:
    """Refuse, before any reading, a plot that cannot be written.

    Raises:
        UsageError: For another suffix, or matplotlib not installed.
        DestinationError: A destination ckpt does not write (a link, FIFO, device, a place
            that cannot be written; :func:`ckpt_cli.storage.atomic.check_destination`).
        DestinationExistsError: A directory.
    """
    if dest.suffix.lower() not in FORMATS:
        raise UsageError(f"--plot writes {', '.join(FORMATS)} files, not {dest.name!r}",
                         path=dest)
    check_destination(dest, overwrite=True, parents=True)
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib, which is not installed",
                         hint="pip install 'ckpt-cli[plot]' (or matplotlib)")


def _change(norms: list[float], ratios: list[float]) -> float:
    """How much a module changes over the run: its largest update ratio, or its norm's
    largest factor from the first value (what catches the eye on a log scale)."""
    finite = [x for x in norms if math.isfinite(x) and x > 0]
    growth = max((abs(math.log(x / finite[0])) for x in finite), default=0.0)
    upd = max((x for x in ratios if math.isfinite(x)), default=0.0)
    return max(growth, upd)


def build_figure(r: StatsResult) -> Figure:
    """Draw the run's trends (see the module notes).

    Args:
        r: A run directory's result.

    Returns:
        The matplotlib figure (closing it is the caller's).

    Raises:
        UsageError: When ``r`` is not a run's result.
    """
    if not r.run:
        raise UsageError("--plot draws a run directory's trends; this is one checkpoint")
    import matplotlib  # heavy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    slots = timeline(r)
    xs = [s.step if s.step is not None else i for i, s in enumerate(slots)]
    names = list(dict.fromkeys(m.name for c in r.checkpoints for m in c.modules))
    nan = float("nan")
    per = [{m.name: m for m in s.stats.modules} if s.stats else {} for s in slots]
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for name in names:
        norms, ratios = [], []
        for mods in per:
            m = mods.get(name)
            norms.append(m.moments.l2 if m is not None and m.moments.count else nan)
            ratios.append(m.update_ratio if m is not None and m.update_ratio else nan)
        curves[name] = (norms, ratios)
    flagged = {a.module for a in r.anomalies}
    if len(names) <= COLOURED + 2:
        coloured = list(names)
    else:
        ranked = sorted(names, key=lambda n: (n not in flagged, -_change(*curves[n])))
        coloured = [n for n in names if n in set(ranked[:COLOURED])]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 7))
    grey = [n for n in names if n not in coloured]
    for name in grey:
        for ax, ys in zip((top, bottom), curves[name], strict=True):
            ax.plot(xs, ys, color="0.75", linewidth=0.7, zorder=1)
    palette = plt.get_cmap("tab10" if len(coloured) <= 10 else "tab20")
    handles: list[Any] = []
    for k, name in enumerate(coloured):
        colour = palette(k % palette.N)
        (h,) = top.plot(xs, curves[name][0], color=colour, linewidth=1.3, label=name,
                        marker=".", markersize=3, zorder=2)
        bottom.plot(xs, curves[name][1], color=colour, linewidth=1.3, marker=".",
                    markersize=3, zorder=2)
        handles.append(h)
    if grey:
        from matplotlib.lines import Line2D  # heavy: matplotlib

        deepest = max(len(n.split(".")) for n in names)
        fewer = deepest - 1 if r.depth is None else min(r.depth, deepest) - 1
        hint = f"\n(--depth {fewer} groups them)" if fewer >= 1 else "\n(--filter picks some)"
        handles.append(Line2D([], [], color="0.75", linewidth=0.7,
                              label=f"{len(grey):,} other modules{hint}"))
    for s, x in zip(slots, xs, strict=True):
        if s.gap is not None:
            for ax in (top, bottom):
                ax.axvline(x, color="0.5", linestyle=":", linewidth=1, zorder=0)
    top.set_ylabel("L2 norm")
    top.set_yscale("log")
    bottom.set_ylabel("update ratio\n||W_t - W_t-1|| / ||W_t-1||")
    bottom.set_yscale("log")
    bottom.set_xlabel("step")
    top.set_title(f"ckpt stats {r.path}", fontsize=9)
    # Outside the axes, on the right: a legend inside hides the curves it names.
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.80, 0.95), fontsize=7,
               title="module", title_fontsize=8, frameon=False)
    fig.subplots_adjust(left=0.08, right=0.79, top=0.93, bottom=0.08, hspace=0.08)
    _mark_anomalies(fig, top, bottom, r, slots, xs)
    return fig


def _mark_anomalies(fig: Figure, top: Any, bottom: Any, r: StatsResult, slots: list[Any],
                    xs: list[int]) -> None:
    """One red line per step with anomalies, and one label per step listing them, stacked
    downward where it would overlap a label already placed."""
    at: dict[int, list[str]] = {}
    where = {s.name: x for s, x in zip(slots, xs, strict=True)}
    for a in r.anomalies:
        x = a.step if a.step is not None else where.get(a.checkpoint, xs[0] if xs else 0)
        at.setdefault(x, []).append(f"{a.kind}: {a.module}")
    if not at:
        return
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    placed: list[Any] = []
    for x in sorted(at):
        for ax in (top, bottom):
            ax.axvline(x, color="red", alpha=0.35, linewidth=1, zorder=0)
        what = at[x]
        text = "\n".join(what[:_PER_LABEL]) + (
            f"\n+{len(what) - _PER_LABEL} more" if len(what) > _PER_LABEL else "")
        label = top.annotate(text, (x, 1), xycoords=("data", "axes fraction"),
                             xytext=(3, -3), textcoords="offset points", va="top", ha="left",
                             fontsize=6.5, color="darkred", gid="anomaly-label",
                             bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none",
                                   "alpha": 0.8})
        box = label.get_window_extent(renderer)
        down = 0.0
        while any(box.overlaps(b) for b in placed):
            down += 4.0  # points: move below the labels in the way
            label.set_position((3, -3 - down))
            box = label.get_window_extent(renderer)
        placed.append(box)


def write_plot(r: StatsResult, dest: Path) -> None:
    """Draw the run's trends into ``dest`` (written to a temporary name, then renamed).

    Raises:
        UsageError: When ``r`` is not a run's result.
    """
    if not r.run:
        raise UsageError("--plot draws a run directory's trends; this is one checkpoint",
                         path=dest)
    fig = build_figure(r)
    import matplotlib.pyplot as plt  # heavy: matplotlib

    try:
        with atomic_file(dest, overwrite=True, parents=True) as tmp:
            fig.savefig(tmp, format=dest.suffix.lower()[1:], bbox_inches="tight")
    finally:
        plt.close(fig)
