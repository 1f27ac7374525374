"""ckpt_cli.render.plot: braille line plots on a log x axis."""

from __future__ import annotations

import math

import pytest

from ckpt_cli.render.plot import Mark, log_x_plot

_BRAILLE = 0x2800


def _grid(text: str, width: int, height: int) -> list[str]:
    """The plot cells of each row (labels and axis stripped)."""
    lines = text.split("\n")
    assert len(lines) == height + 2  # rows, the axis line, the x labels
    rows = []
    for line in lines[:height]:
        sep = max(line.rfind("┤"), line.rfind("│"))
        cells = line[sep + 1:]
        assert len(cells) == width
        rows.append(cells)
    assert lines[height].endswith("└" + "─" * width)
    return rows


def test_zero_curve_lies_on_the_bottom_dot_row() -> None:
    rows = _grid(log_x_plot(lambda x: 0.0, 1, 100, y_max=1, width=10, height=3).plain, 10, 3)
    assert rows[0] == rows[1] == " " * 10
    assert rows[2] == chr(_BRAILLE + 0x40 + 0x80) * 10  # both bottom dots of every cell


def test_curve_at_y_max_lies_on_the_top_dot_row() -> None:
    rows = _grid(log_x_plot(lambda x: 5.0, 1, 10, y_max=5, width=6, height=2).plain, 6, 2)
    assert rows[0] == chr(_BRAILLE + 0x01 + 0x08) * 6
    assert rows[1] == " " * 6


def test_height_is_proportional_to_y() -> None:
    height, width = 5, 8
    for y in (0.0, 0.25, 0.5, 0.75, 1.0):
        rows = _grid(log_x_plot(lambda x, y=y: y, 1, 10, y_max=1, width=width,
                                height=height).plain, width, height)
        filled = [r for r, cells in enumerate(rows) if cells.strip()]
        assert len(filled) == 1
        want_dot_row = (4 * height - 1) - round(y * (4 * height - 1))
        assert filled[0] == want_dot_row // 4


def test_points_above_y_max_or_not_finite_are_left_out() -> None:
    width = 10

    def f(x: float) -> float:
        if x < 3:
            return 0.0
        return math.nan if x < 10 else 1e9

    rows = _grid(log_x_plot(f, 1, 100, y_max=1, width=width, height=2).plain, width, 2)
    assert rows[0] == " " * width  # 1e9 did not squash the plot: it left the top
    bottom = rows[1]
    assert bottom[0] != " " and bottom[-1] == " "
    assert bottom.rstrip() and len(bottom.rstrip()) < width // 2


def test_increasing_curve_climbs_without_gaps() -> None:
    width, height = 20, 6
    rows = _grid(log_x_plot(math.log10, 1, 1000, y_max=3, width=width, height=height).plain,
                 width, height)
    tops = []
    for col in range(width):
        filled = [r for r in range(height) if rows[r][col] != " "]
        assert filled, f"column {col} is empty"
        assert filled == list(range(filled[0], filled[-1] + 1))  # joined vertically
        tops.append(filled[0])
    assert tops == sorted(tops, reverse=True)
    assert tops[0] == height - 1 and tops[-1] == 0


def test_marks_and_labels() -> None:
    text = log_x_plot(lambda x: 0.0, 1, 100, y_max=1, width=10, height=3,
                      marks=[Mark(10, "*"), Mark(1000, "!")], fmt_x=lambda x: f"{x:g}",
                      fmt_y=lambda y: f"{y:g}")
    rows = _grid(text.plain, 10, 3)
    assert rows[2][4] == "*"  # log10(10)/log10(100) of the way across 9 gaps, rounded
    assert "!" not in text.plain  # outside the x range
    lines = text.plain.split("\n")
    assert lines[0].startswith("  1 ┤") and lines[1].startswith("0.5 ┤")
    assert lines[2].startswith("  0 ┤")
    assert lines[-1].split() == ["1", "10", "100"]
    assert any(span.style == "bold" for span in text.spans)


@pytest.mark.parametrize("lo,hi,y_max,width,height", [(0, 10, 1, 10, 3), (5, 5, 1, 10, 3),
                                                      (1, 10, 0, 10, 3), (1, 10, 1, 1, 3),
                                                      (1, 10, 1, 10, 1)])
def test_bad_ranges_are_refused(lo: float, hi: float, y_max: float, width: int,
                                height: int) -> None:
    with pytest.raises(ValueError):
        log_x_plot(lambda x: 0.0, lo, hi, y_max=y_max, width=width, height=height)
