"""Human formatting used by ``ckpt plan``: durations, rates and the braille plot."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from ckpt_cli.render.human import duration, rate
from ckpt_cli.render.plot import Mark, log_x_plot


@pytest.mark.parametrize("seconds,long,short", [
    (0.153, "0.153 seconds", "0.153s"), (1, "1 second", "1s"), (59.9, "59.9 seconds", "59.9s"),
    (210, "3 minutes and 30 seconds", "3m 30s"), (2459.27, "40 minutes and 59 seconds", "40m 59s"),
    (3599.6, "1 hour", "1h"), (14400, "4 hours", "4h"),
    (153984.375, "1 day and 19 hours", "1d 19h"), (5 * 365 * 86400, "5 years", "5y"),
])
def test_duration(seconds: float, long: str, short: str) -> None:
    assert duration(seconds) == long
    assert duration(seconds, short=True) == short


def test_duration_and_rate_of_nothing() -> None:
    assert duration(None) == "-" and rate(None) == "-"
    assert rate(10e9) == "10.0 GB/s"


def _lines(text: object) -> list[str]:
    console = Console(width=200, no_color=True, highlight=False)
    with console.capture() as cap:
        console.print(text)
    return cap.get().rstrip("\n").split("\n")


def test_plot_of_a_parabola_in_log_x() -> None:
    # y = (log10 x)^2 on x in [0.01, 100]: a U with its minimum 0 at x = 1, y = 4 at both ends.
    lines = _lines(log_x_plot(lambda x: math.log10(x) ** 2, 0.01, 100, y_max=4, width=41,
                              height=8, marks=[Mark(1.0, "◆"), Mark(10.0, "●")],
                              fmt_x=lambda x: f"{x:g}", fmt_y=lambda y: f"{y:g}"))
    assert len(lines) == 8 + 2
    assert lines[0].startswith("4 ┤") and lines[7].startswith("0 ┤")
    assert lines[4].startswith("2 ┤") and lines[1].startswith("  │")
    # The minimum is marked on the bottom row, in the middle column.
    assert lines[7].index("◆") == len("0 ┤") + 20
    # y(10) = 1: a quarter of the way up, three quarters of the way across.
    row = next(i for i, line in enumerate(lines) if "●" in line)
    assert row == 5 and lines[row].index("●") == len("0 ┤") + 30
    # Both ends reach the top row; the axis labels sit under the ends and the middle.
    assert lines[0][len("4 ┤")] != " " and lines[0].rstrip()[-1] != "┤"
    assert lines[8] == "  └" + "─" * 41
    assert lines[9].split() == ["0.01", "1", "100"]


def test_plot_leaves_out_points_above_the_top() -> None:
    lines = _lines(log_x_plot(lambda x: x, 1, 100, y_max=10, width=30, height=4))
    # y = x passes the top at x = 10, half way across on a log scale: the right half is empty.
    body = [line[len("10 ┤"):] for line in lines[:4]]
    assert all(cell == " " for line in body for cell in line[16:30])
    assert any(cell != " " for line in body for cell in line[:15])


@pytest.mark.parametrize("lo,hi,y_max,width", [(0, 1, 1, 10), (2, 1, 1, 10), (1, 2, 0, 10),
                                               (1, 2, 1, 1)])
def test_plot_refuses_degenerate_ranges(lo: float, hi: float, y_max: float, width: int) -> None:
    with pytest.raises(ValueError, match="log_x_plot needs"):
        log_x_plot(lambda x: x, lo, hi, y_max=y_max, width=width)
