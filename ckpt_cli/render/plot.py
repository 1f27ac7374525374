"""Terminal line plots drawn with braille dots (2 x 4 dots per character cell).

Rich has no plot widget; a curve reads better than a table for "how does the cost change if I
move this knob", so this draws one as rich ``Text`` (which honours ``NO_COLOR``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.text import Text

# Bit of each dot in a braille cell, by [dot row][dot column] (Unicode braille patterns).
_DOT_BITS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))
_BRAILLE = 0x2800


@dataclass(frozen=True, slots=True)
class Mark:
    """A point to mark on the curve.

    Attributes:
        x: Where, in x units.
        glyph: One character drawn there (distinct glyphs keep marks apart without colour).
        style: Rich style of the glyph.
    """

    x: float
    glyph: str
    style: str = "bold"


def log_x_plot(f: Callable[[float], float], lo: float, hi: float, *, y_max: float,
               width: int = 60, height: int = 10, marks: Sequence[Mark] = (),
               fmt_x: Callable[[float], str] = str, fmt_y: Callable[[float], str] = str,
               style: str = "cyan") -> Text:
    """Plot ``y = f(x)`` for x from ``lo`` to ``hi`` on a log scale, y from 0 to ``y_max``.

    Points above ``y_max`` (or not finite) are left out, so a steep curve leaves the top of the
    plot instead of squashing the interesting part.

    Args:
        f: The function.
        lo: Smallest x (positive).
        hi: Largest x (above ``lo``).
        y_max: Top of the y axis (positive).
        width: Plot width in character cells.
        height: Plot height in character cells.
        marks: Points to mark with a glyph on the curve.
        fmt_x: Formats x tick labels.
        fmt_y: Formats y tick labels.
        style: Style of the curve.

    Returns:
        The plot, with y tick labels on the left and x tick labels below.

    Raises:
        ValueError: A non-positive or empty range, or a plot smaller than 2 x 2 cells.
    """
    if not (0 < lo < hi) or y_max <= 0 or width < 2 or height < 2:
        raise ValueError("log_x_plot needs 0 < lo < hi, y_max > 0 and at least 2 x 2 cells")
    cols, rows = 2 * width, 4 * height
    span = math.log(hi / lo)

    def dot_row(y: float) -> int:  # 0 is the top row of dots
        return rows - 1 - round(min(max(y, 0.0), y_max) / y_max * (rows - 1))

    cells = [[0] * width for _ in range(height)]
    prev: int | None = None
    for i in range(cols):
        y = f(lo * math.exp(span * i / (cols - 1)))
        if not math.isfinite(y) or y > y_max:
            prev = None
            continue
        r = dot_row(y)
        # Join to the previous column's dot so that steep stretches stay continuous.
        for rr in range(min(r, prev if prev is not None else r),
                        max(r, prev if prev is not None else r) + 1):
            cells[rr // 4][i // 2] |= _DOT_BITS[rr % 4][i % 2]
        prev = r

    glyphs: dict[tuple[int, int], Mark] = {}
    for m in marks:
        if lo <= m.x <= hi:
            col = round(math.log(m.x / lo) / span * (width - 1))
            y = f(m.x)
            row = dot_row(y if math.isfinite(y) else y_max) // 4
            glyphs[(row, col)] = m

    labels = {0: fmt_y(y_max), height // 2: fmt_y(y_max / 2), height - 1: fmt_y(0.0)}
    pad = max(len(s) for s in labels.values())
    out = Text()
    for row in range(height):
        out.append(labels.get(row, "").rjust(pad) + (" ┤" if row in labels else " │"),
                   style="dim")
        for col in range(width):
            mark = glyphs.get((row, col))
            if mark is not None:
                out.append(mark.glyph, style=mark.style)
            else:
                bits = cells[row][col]
                out.append(chr(_BRAILLE + bits) if bits else " ", style=style)
        out.append("\n")
    out.append(" " * pad + " └" + "─" * width + "\n", style="dim")
    left, mid, right = fmt_x(lo), fmt_x(math.sqrt(lo * hi)), fmt_x(hi)
    axis = [" "] * (width + 2)
    start = (width + 2 - len(mid)) // 2
    axis[start:start + len(mid)] = mid
    axis[:len(left)] = left
    axis[len(axis) - len(right):] = right
    out.append(" " * (pad + 1) + "".join(axis).rstrip(), style="dim")
    return out
