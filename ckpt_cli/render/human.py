"""Human output: rich tables and bars on stdout; warnings, hints and progress on stderr.

Rich honours ``NO_COLOR`` and ``COLUMNS``; nothing here colours text that is not a terminal.
Off a terminal with ``COLUMNS`` unset nothing wraps: a line is as long as its content, so names
and dates stay whole for ``grep``, ``less -S`` and copy-paste.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any, Literal

import humanize
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from ckpt_cli.errors import visible
from ckpt_cli.model import Finding, TensorInfo
from ckpt_cli.units import format_duration, format_size

_SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


class _Console(Console):
    """A console whose closed pipe (``ckpt inspect x | head``) ends the command quietly.

    rich's default exits with status 1; ``cli.errors.handled`` turns the BrokenPipeError into
    a normal exit, as for any command piped into ``head``.
    """

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        """The text to write, without spaces at the ends of lines.

        rich pads table cells (and wrapped lines) out to their width; on a terminal that is
        invisible, but piped output then carries trailing spaces into files, ``diff`` and
        ``grep 'x$'``. Style codes between the spaces and the newline are kept.
        """
        # Text from a checkpoint (a tensor or file name) may hold escape sequences; written out
        # (``\\x1b``) they are shown, not obeyed. rich's own codes come from styles and
        # control segments, which are kept.
        shown = (s if s.control else Segment(visible(s.text), s.style) for s in buffer)
        *lines, last = super()._render_buffer(shown).split("\n")
        return "\n".join([*map(_rstrip, lines), last])


_SGR = re.compile(r"(\x1b\[[0-9;]*m)")


def _rstrip(line: str) -> str:
    """``line`` without trailing spaces, keeping the style codes among them."""
    if "\x1b" not in line:
        return line.rstrip(" ")
    parts, codes = _SGR.split(line), list[str]()
    while parts:
        if _SGR.fullmatch(parts[-1]):
            codes.insert(0, parts.pop())
        elif not parts[-1].strip(" "):
            parts.pop()
        else:
            parts[-1] = parts[-1].rstrip(" ")
            break
    return "".join(parts + codes)


# Width off a terminal with COLUMNS unset: wide enough that nothing wraps or is cut. Tables
# (expand=False) take only the width their content needs, so lines are not padded out to it.
UNWRAPPED_WIDTH = 1_000_000


def _width(stream: Any) -> int | None:
    """The width to give a console on ``stream``: None (rich decides) on a terminal or when
    ``COLUMNS`` is set, else :data:`UNWRAPPED_WIDTH`.

    rich falls back to 80 columns, or to the size of whichever of stdin/stdout/stderr is a
    terminal, so ``ckpt inspect x | grep`` would break tensor names and dates across lines.
    """
    if os.environ.get("COLUMNS", "").isdigit():
        return None
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        tty = False
    return None if tty else UNWRAPPED_WIDTH


def stdout() -> Console:
    """Console for results."""
    return _Console(highlight=False, soft_wrap=False, width=_width(sys.stdout))


def stderr() -> Console:
    """Console for diagnostics and progress (a closed pipe ends quietly here too:
    ``ckpt plan 2>&1 | head``)."""
    return _Console(stderr=True, highlight=False, width=_width(sys.stderr))


Kind = Literal["name", "value", "text", "bar"]


@dataclasses.dataclass(frozen=True)
class Col:
    """One column of a :func:`table`: what it holds decides how it gives way when space is short.

    Attributes:
        header: The heading.
        justify: ``left`` or ``right`` (numbers).
        kind: ``name``: what a row is about (a checkpoint, tensor, module or key); never
            dropped, whole on its line while it fits in half the width, else folded over
            lines (every character kept). ``value``: a number, date, dtype, shape or short
            word; never wrapped or cut: the column is dropped instead. ``text``: prose, wrapped
            at spaces. ``bar``: a drawn bar of fixed width.
        drop: Priority when the table is too wide: the lowest is dropped first, then the next;
            None: never dropped.
        style: The column's style.
    """

    header: str = ""
    justify: Literal["left", "right"] = "left"
    kind: Kind = "value"
    drop: int | None = None
    style: str = ""


TEXT_FLOOR = 12
"""Prose columns wrap down to this width before a column is dropped."""


class FitTable(Table):
    """A borderless table that fits the console by dropping its least important columns.

    rich alone shrinks every column evenly once wrapping is not enough, cutting checkpoint
    names, dates and numbers to ``step_000…`` and ``0.0…``. Here, at render time, columns are
    dropped in :attr:`Col.drop` order until what must stay whole fits; then names and prose
    wrap (never cut). The padding rich adds to each cell is stripped from line ends by the
    consoles of :func:`stdout` and :func:`stderr`.
    """

    cols: tuple[Col, ...] = ()

    def add_row(self, *renderables: Any, style: Any = None, end_section: bool = False) -> None:
        """Add a row; text cells have their control characters written out (``\\x1b``) first,
        so that columns are measured as they will be printed, and are never read as markup."""
        super().add_row(*map(_shown, renderables), style=style, end_section=end_section)

    def _fitted(self, console: Console, options: ConsoleOptions) -> Table:
        """This table without the columns that do not fit ``options.max_width``, and with
        column widths that fit it."""
        width = options.max_width
        cols = [*self.cols, *[Col(kind="text")] * (len(self.columns) - len(self.cols))]
        measured = [self._measure(console, options, i) for i in range(len(cols))]
        floors = [self._floor(c, m, width) for c, m in zip(cols, measured, strict=True)]
        keep = list(range(len(cols)))
        for _prio, _right, i in sorted((c.drop, -i, i) for i, c in enumerate(cols)
                                       if c.drop is not None):
            if _needed([floors[k] for k in keep]) <= width:
                break
            keep.remove(i)
        out = Table(box=None, show_header=self.show_header, padding=self.padding,
                    collapse_padding=self.collapse_padding, pad_edge=self.pad_edge,
                    show_edge=self.show_edge, expand=False, highlight=self.highlight)
        out.rows = list(self.rows)
        out.columns = [dataclasses.replace(self.columns[k], _index=n)
                       for n, k in enumerate(keep)]
        widths = [measured[k][1] for k in keep]
        if _needed(widths) <= width:
            return out
        # Too wide. Names and prose give up width first (widest first) down to their floor,
        # then long headers of values wrap; names and prose go below their floor only when
        # what must stay whole is wider than the console by itself.
        passes = ((("name", "text"), [floors[k] for k in keep]),
                  (("value",), [floors[k] for k in keep]),
                  (("name", "text"), [min(floors[k], 8) for k in keep]))
        for kinds, floor in passes:
            while (excess := _needed(widths) - width) > 0:
                shrinkable = [n for n, k in enumerate(keep)
                              if cols[k].kind in kinds and widths[n] > floor[n]]
                if not shrinkable:
                    break
                n = max(shrinkable, key=lambda n: widths[n])
                widths[n] -= min(excess, widths[n] - floor[n])
        for n, (column, w) in enumerate(zip(out.columns, widths, strict=True)):
            # Values are never narrower than their cells: only a long header wraps.
            column.width, column.no_wrap, column.overflow = w, False, "fold"
            if cols[keep[n]].kind == "name":
                # Names break where a reader expects, after a "." or "/" (module paths, file
                # paths), not mid-word: "layers.0.self_attn." / "out_proj.weight".
                out.columns[n] = dataclasses.replace(
                    column, _cells=[fold_name(c, w) for c in column._cells])
        return out

    def _measure(self, console: Console, options: ConsoleOptions,
                 i: int) -> tuple[int, int, int]:
        """Column ``i``'s (longest header word, natural width, widest cell)."""
        column = self.columns[i]
        unbounded = options.update_width(max(options.max_width, UNWRAPPED_WIDTH))
        cells = max((Measurement.get(console, unbounded, c).maximum for c in column.cells),
                    default=0)
        header = (Measurement.get(console, unbounded, column.header) if self.show_header
                  else Measurement(0, 0))
        return header.minimum, max(header.maximum, cells), cells

    @staticmethod
    def _floor(col: Col, measured: tuple[int, int, int], width: int) -> int:
        """The least width column ``col`` may have: all of every cell for values and bars."""
        header_word, natural, cells = measured
        if col.kind == "name":
            return min(natural, max(header_word, width // 2))
        if col.kind == "text":
            return min(natural, max(header_word, TEXT_FLOOR))
        return max(header_word, cells)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        fitted = self._fitted(console, options)
        yield fitted
        kept = {c.header for c in fitted.columns}
        gone = [str(c.header) for c in self.columns if c.header and c.header not in kept]
        if gone:
            # Said, so that a narrow terminal does not silently hide a column.
            yield Text(f"({', '.join(gone)} left out at {options.max_width} columns: widen "
                       "the terminal or use --json)", style="dim")


_BREAKS = frozenset("./ ")
"""Characters a name may break after when it is folded (module and file paths, words)."""


def fold_name(cell: Any, width: int) -> Any:
    """A name cell wider than ``width`` broken into lines after ``.``, ``/`` or a space
    (greedily, as many parts per line as fit); a part longer than a line is cut where the
    line ends (every character kept). Other cells come back as they are."""
    if width < 1 or not isinstance(cell, (str, Text)):
        return cell
    text = cell if isinstance(cell, Text) else Text(cell)
    plain = text.plain
    if len(plain) <= width or "\n" in plain:
        return cell
    cuts: list[int] = []
    start = last = 0
    for i, ch in enumerate(plain):
        if i - start >= width:
            # this line is full: break after the last break character, else right here
            start = last if last > start else i
            cuts.append(start)
        if ch in _BREAKS:
            last = i + 1
    lines = text.divide(cuts)
    out = Text(style=text.style, justify=text.justify)
    for k, line in enumerate(lines):
        if k:
            out.append("\n")
        line.rstrip()
        out.append_text(line)
    return out


_PATH_PIECE = re.compile(r"[^/ ]*(?:/+ *| +)|[^/ ]+")
"""A piece of a line that may end a line: up to and including a ``/`` or spaces."""


def fold_path_text(text: Text, width: int) -> Text:
    """``text`` (a path, or prose naming paths) wrapped to ``width``: lines break after a ``/``
    or at a space, never inside a file or directory name unless that name alone is wider than
    a line (then it is cut where the line ends; every character is kept)."""
    width = max(width, 1)
    out = Text(style=text.style, justify=text.justify, end=text.end)
    for n, line in enumerate(text.split("\n", allow_blank=True)):
        if n:
            out.append("\n")
        plain, cuts, used = line.plain, [], 0
        for m in _PATH_PIECE.finditer(plain):
            start, end = m.span()
            body = len(m.group().rstrip(" "))  # spaces at a line's end take no room
            if used and used + body > width:
                cuts.append(start)
                used = 0
            while body > width:  # a name wider than a line by itself: cut where lines end
                start += width
                body -= width
                cuts.append(start)
            used += end - start
        for k, part in enumerate(line.divide(cuts)):
            if k:
                out.append("\n")
            part.rstrip()
            out.append_text(part)
    return out


class Folded:
    """A line (or a table cell) holding a path, wrapped at render time to the width it is given
    by :func:`fold_path_text`: ``/checkpoints/`` then ``model.safetensors``, not
    ``model.safe`` / ``tensors``."""

    def __init__(self, text: str | Text, style: str = "") -> None:
        self.text = Text(visible(text, lines=False), style=style) if isinstance(text, str) \
            else _shown(text)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield fold_path_text(self.text, options.max_width)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        plain = self.text.plain
        piece = max((len(m.group().rstrip(" ")) for m in _PATH_PIECE.finditer(plain)), default=0)
        line = max((len(x) for x in plain.split("\n")), default=0)
        return Measurement(min(piece, options.max_width), min(line, options.max_width))


def _shown(cell: Any) -> Any:
    """``cell`` with its control characters written out (strings and plain ``Text``); a string
    becomes ``Text`` so that brackets in a name (``x[red]``) are printed, not read as markup."""
    if isinstance(cell, str):
        return Text(visible(cell, lines=False))
    if isinstance(cell, Text) and (plain := visible(cell.plain, lines=False)) != cell.plain:
        return Text(plain, style=cell.style, justify=cell.justify)
    return cell


def _needed(widths: list[int]) -> int:
    """The width of a borderless table with these column widths (2 spaces between)."""
    return sum(widths) + 2 * (len(widths) - 1)


def table(*cols: Col, show_header: bool = True) -> FitTable:
    """A borderless table of ``cols`` that fits the terminal (see :class:`FitTable`).

    Args:
        *cols: The columns, in order; add rows with ``add_row`` as to any rich table.
        show_header: Print the headers.

    Returns:
        The table.
    """
    t = FitTable(box=None, pad_edge=False, show_edge=False, show_header=show_header)
    t.cols = cols
    for c in cols:
        t.add_column(c.header, justify=c.justify, style=c.style,
                     overflow="fold", no_wrap=c.kind in ("value", "bar"))
    return t


def add_row(table: Table, *cells: str | Text | Folded, style: str | None = None) -> None:
    """Add a row; plain strings are literal text (tensor names may contain rich markup)."""
    table.add_row(*(Text(c) if isinstance(c, str) else c for c in cells), style=style)


def section(out: Console, title: str, total: int, shown: int, body: Table) -> None:
    """A titled table of ``shown`` of ``total`` rows, saying how many more ``--top 0`` shows."""
    out.print()
    out.print(Text(title, style="bold"))
    out.print(body)
    if shown < total:
        out.print(Text(f"… {total - shown:,} more (--top 0 shows all)", style="dim"))


def grid(label_style: str = "bold") -> FitTable:
    """A two-column grid of labels and facts (a summary): labels whole, facts wrapped.

    Returns:
        The grid; add rows with ``add_row(label, text)``.
    """
    return table(Col(kind="value", style=label_style), Col(kind="text"), show_header=False)


def size(n: int | float | None) -> str:
    """Bytes in decimal units (``14.2 MB``), as checkpoint tools and the HF hub use."""
    if n is None:
        return "-"
    return format_size(n)


def rate(bytes_per_second: float | None) -> str:
    """A data rate in decimal units (``10.0 GB/s``)."""
    return "-" if bytes_per_second is None else f"{size(bytes_per_second)}/s"


def duration(seconds: float | None, *, short: bool = False) -> str:
    """A duration to two units: ``40 minutes and 59 seconds``, or short ``40m 59s``.

    Args:
        seconds: The duration; None prints ``-``.
        short: Compact form for tables and axis labels (``3.5s``, ``40m 59s``, ``1d 19h``).

    Returns:
        The text.
    """
    if seconds is None:
        return "-"
    if short:
        return format_duration(seconds)
    if seconds < 60:
        return "1 second" if seconds == 1 else f"{seconds:.3g} seconds"
    # Two units at most: the smallest unit shown is the one below the largest.
    minimum = "seconds" if seconds < 3600 else "minutes" if seconds < 86400 else "hours"
    if seconds >= 30 * 86400:
        minimum = "days" if seconds < 365 * 86400 else "months"
    if seconds >= 1000 * 365 * 86400:  # beyond what dates (and humanize) can represent
        return f"{seconds / (365 * 86400):,.3g} years"
    return humanize.precisedelta(seconds, minimum_unit=minimum, format="%0.0f")


def count(n: int | None) -> str:
    """A large count, compact (``1.2M``, ``175.0B``)."""
    if n is None:
        return "-"
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def bar(fraction: float, width: int = 24) -> Text:
    """A horizontal bar of ``width`` cells filled to ``fraction`` (eighth-cell resolution)."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    text = "█" * full + (" ▏▎▍▌▋▊▉"[part] if part else "")
    return Text(text.ljust(width), style="cyan")


def shape(t: TensorInfo) -> str:
    """A tensor's shape as ``[4096, 4096]``."""
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


REPEATS_SHOWN = 10
"""Findings of one kind (severity and code) printed one per line; the rest are counted in one
line (a 300,000-entry index with one broken name each must not print 300,000 lines)."""

_GLOBAL_CODES = ("unsafe-global", "unknown-global")


def print_findings(findings: Iterable[Finding], *, console: Console | None = None,
                   min_severity: str = "warning") -> None:
    """Print findings, one line each, to stderr (or ``console``): at most
    :data:`REPEATS_SHOWN` of one kind, then one line counting the rest; after pickle globals
    outside the allowlist, one line with every ``--allow-global`` that would accept them.

    Args:
        findings: The findings.
        console: Where to print (default stderr).
        min_severity: ``info`` prints everything; ``warning`` skips notes; ``error`` only errors.
    """
    order = {"info": 0, "warning": 1, "error": 2}
    con = console or stderr()
    shown: dict[tuple[str, str], int] = {}
    hidden: dict[tuple[str, str], int] = {}
    globals_: dict[str, None] = {}
    for f in findings:
        if order[f.severity] < order[min_severity]:
            continue
        if f.code in _GLOBAL_CODES and f.location and f"--allow-global {f.location} " in (
                f.message):
            globals_[f.location] = None  # one that --allow-global would accept
        key = (f.severity, f.code)
        if shown.get(key, 0) >= REPEATS_SHOWN:
            hidden[key] = hidden.get(key, 0) + 1
            continue
        shown[key] = shown.get(key, 0) + 1
        where = ":".join(x for x in (f.file, f.location) if x)
        line = Text(f"{f.severity}: ", style=_SEVERITY_STYLE[f.severity])
        line.append(visible(f"{where}: ", lines=False) if where else "")
        line.append(visible(f.message, lines=False))  # escapes shown, not obeyed; one line
        con.print(line, soft_wrap=True)
    _print_hidden(con, hidden)
    if len(globals_) > 1:
        flags = " ".join(f"--allow-global {q}" for q in globals_)
        con.print(Text("hint: only if you trust the file, every global above is accepted by: ")
                  + Text(visible(flags, lines=False)), soft_wrap=True)


def print_messages(findings: Iterable[Finding]) -> None:
    """Print findings as ``<severity>: <message>`` on stderr: for messages that name their
    file themselves (``convert``'s hostile-source warnings, one per rank file of a ZeRO
    checkpoint); at most :data:`REPEATS_SHOWN` of one kind, then one line counting the rest."""
    con = stderr()
    shown: dict[tuple[str, str], int] = {}
    hidden: dict[tuple[str, str], int] = {}
    for f in findings:
        key = (f.severity, f.code)
        if shown.get(key, 0) >= REPEATS_SHOWN:
            hidden[key] = hidden.get(key, 0) + 1
            continue
        shown[key] = shown.get(key, 0) + 1
        line = Text(f"{f.severity}: ", style=_SEVERITY_STYLE[f.severity])
        line.append(visible(f.message, lines=False))
        con.print(line, soft_wrap=True)
    _print_hidden(con, hidden)


def _print_hidden(con: Console, hidden: dict[tuple[str, str], int]) -> None:
    for (severity, code), n in hidden.items():
        line = Text(f"{severity}: ", style=_SEVERITY_STYLE[severity])
        line.append(f"... and {n:,} more {code} finding{'s' if n != 1 else ''} "
                    "(--json lists every one)")
        con.print(line, soft_wrap=True)


def note_followed(followed: Any, side: str | None = None) -> None:
    """Say on stderr which checkpoint a run directory's pointer chose (``convert run/``).

    Args:
        followed: A :class:`ckpt_cli.runs.Followed`, or None (nothing printed).
        side: ``A``/``B`` for ``diff``.
    """
    if followed is None:
        return
    where = f"{side}: " if side else ""
    stderr().print(f"note: {where}{followed.path.parent}: {followed.pointer} names "
                   f"{followed.checkpoint}; reading that checkpoint", soft_wrap=True)


def is_tty() -> bool:
    """Whether stderr is a terminal (for progress bars)."""
    return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"


def show_written(r: Any, *, json: bool, quiet: bool, emit: Callable[[Any], None],
                 summary: Callable[[Any, bool], None]) -> None:
    """Print what a writing command (convert, consolidate) did.

    Hostile-source warnings go to stderr whatever ``--quiet`` and ``--json`` say, the run
    pointer followed unless ``quiet``; then the JSON document or the human summary on stdout.

    Args:
        r: The command's result (with ``warnings`` and ``followed``).
        json: Print the JSON document instead of the summary.
        quiet: No notes on stderr.
        emit: Prints the JSON document.
        summary: Prints the human summary (given ``quiet``).
    """
    print_messages(r.warnings)
    if not quiet:
        note_followed(r.followed)
    if json:
        emit(r)
    elif r.write.part is not None:
        stdout().print(r.write.part.describe(), soft_wrap=True)
        if r.write.part.finalized_here:
            summary(r, quiet)
        else:
            files = r.write.files
            stdout().print(f"Wrote {len(files)} file{'s' if len(files) != 1 else ''} "
                           f"({size(sum(b for _, b in files))}) into the staging directory")
    else:
        summary(r, quiet)
