"""``ckpt stats RUN --plot FILE``: each module's L2 norm and update ratio per step, drawn with
matplotlib (an optional extra: ``pip install 'ckpt-cli[plot]'``), anomalies marked."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ckpt_cli.errors import UsageError
from ckpt_cli.ops.stats.result import StatsResult
from ckpt_cli.storage.atomic import atomic_file, check_destination

FORMATS = (".png", ".svg", ".pdf")
_LEGEND_MAX = 12  # more modules than this: a legend would hide the curves


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


def write_plot(r: StatsResult, dest: Path) -> None:
    """Draw the run's trends into ``dest`` (written to a temporary name, then renamed).

    Raises:
        UsageError: When ``r`` is not a run's result.
    """
    if not r.run:
        raise UsageError("--plot draws a run directory's trends; this is one checkpoint",
                         path=dest)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [c.step if c.step is not None else i for i, c in enumerate(r.checkpoints)]
    names: list[str] = []
    for c in r.checkpoints:
        names.extend(m.name for m in c.modules if m.name not in names)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 7))
    for name in names:
        norms = [next((m.moments.l2 for m in c.modules if m.name == name), float("nan"))
                 for c in r.checkpoints]
        ratios = [next((m.update_ratio or float("nan") for m in c.modules if m.name == name),
                       float("nan")) for c in r.checkpoints]
        top.plot(steps, norms, label=name, linewidth=1)
        bottom.plot(steps, ratios, label=name, linewidth=1)
    for a in r.anomalies:
        x = a.step if a.step is not None else 0
        for ax in (top, bottom):
            ax.axvline(x, color="red", alpha=0.3, linewidth=1)
        top.annotate(f"{a.kind}: {a.module}", (x, 1), xycoords=("data", "axes fraction"),
                     rotation=90, va="top", ha="right", fontsize=7, color="red")
    top.set_ylabel("L2 norm")
    top.set_yscale("log")
    bottom.set_ylabel("update ratio ||W_t - W_t-1|| / ||W_t-1||")
    bottom.set_yscale("log")
    bottom.set_xlabel("step")
    top.set_title(f"ckpt stats {r.path}")
    if len(names) <= _LEGEND_MAX:
        top.legend(fontsize=7, loc="best")
    fig.tight_layout()
    try:
        with atomic_file(dest, overwrite=True, parents=True) as tmp:
            fig.savefig(tmp, format=dest.suffix.lower()[1:])
    finally:
        plt.close(fig)
