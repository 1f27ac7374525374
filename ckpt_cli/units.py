"""The quantities users type and read: sizes, counts, durations and rates, and name order.

Sizes use decimal units like the HF hub (``5GB`` = 5e9 bytes); binary units are spelled
``GiB``. Counts take ``K M B T`` suffixes (``175B`` parameters). Durations accept ``90s``,
``30m``, ``4h``, ``7d``, ``2w``, ``5y`` and combinations such as ``1h30m``; a number without a
unit is refused (``7`` could be seven days or seven seconds), except a zero where zero is allowed.

Torch-free and humanize-free, so that the library (``ops``, the planners) and the output layer
(``render``) format sizes and order names the same way.
"""

from __future__ import annotations

import math
import re

from ckpt_cli.errors import UsageError

_SIZE_UNITS = {
    "": 1, "B": 1,
    "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9, "T": 1e12, "TB": 1e12,
    "P": 1e15, "PB": 1e15,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50,
}
_COUNT_UNITS = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
# Duration units are case-sensitive where case matters: ``m`` is minutes, while ``M`` is months
# in systemd and ISO 8601, so ``M`` and the month spellings are refused as ambiguous instead of
# being read as minutes (``--older-than 6M`` meaning six minutes deleted almost a run). Units
# that cannot be confused (``s h d w y`` and the spelled-out words) are accepted in any case.
_DURATION_UNITS = {"s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
                   "m": 60, "min": 60, "mins": 60, "minute": 60, "minutes": 60,
                   "h": 3600, "hr": 3600, "hrs": 3600, "hour": 3600, "hours": 3600,
                   "d": 86400, "day": 86400, "days": 86400,
                   "w": 7 * 86400, "week": 7 * 86400, "weeks": 7 * 86400,
                   "y": 365 * 86400, "yr": 365 * 86400, "year": 365 * 86400,
                   "years": 365 * 86400}
_MONTH_UNITS = {"mo", "mos", "mon", "month", "months"}


def _duration_factor(unit: str, what: str, text: str) -> float:
    """Seconds per ``unit``; ``M`` and months are refused (ambiguous), ``m`` is minutes."""
    if unit == "M" or unit.lower() in _MONTH_UNITS:
        raise UsageError(f"{what} {text!r}: months are not accepted ({unit!r} means months in "
                         "systemd and ISO 8601 but minutes elsewhere, and a month has no fixed "
                         "length); write minutes as m (30m) and months as days or weeks (180d, "
                         "26w)")
    factor = _DURATION_UNITS.get(unit if unit == "m" else unit.lower())
    if factor is None or (unit.lower() == "m" and unit != "m"):
        raise UsageError(f"{what} {text!r}: unknown unit {unit!r} (use s, m, h, d, w, y)")
    return factor
_NUMBER = r"(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def refuse_empty(text: str, what: str, example: str) -> None:
    """Refuse an empty value: ``--older-than ""`` must not silently drop a keep rule."""
    if not text.strip():
        raise UsageError(f"{what} {text!r} is empty; e.g. {example}")


def _number_and_unit(text: str, what: str, shown: str | None = None) -> tuple[float, str]:
    shown = text if shown is None else shown
    refuse_empty(text, what, "10K")
    m = re.fullmatch(rf"\s*{_NUMBER}\s*(?P<unit>[A-Za-z]*)\s*", text)
    if not m:
        raise UsageError(f"cannot parse {what} {shown!r}")
    value = float(m.group("num"))
    if not math.isfinite(value):
        raise UsageError(f"{what} {shown!r} is not a finite number")
    return value, m.group("unit")


def parse_size(text: str, *, what: str = "size", allow_zero: bool = False) -> int:
    """Parse a byte size such as ``5GB``, ``500MiB``, ``1.5TB`` or ``1000000``.

    Args:
        text: The size as typed.
        what: What it is, for the error message (e.g. ``--max-shard-size``).
        allow_zero: Accept 0.

    Returns:
        Bytes, rounded down.

    Raises:
        UsageError: Unparseable, unknown unit, negative or (unless allowed) zero.
    """
    return _size(text, what, allow_zero, shown=text)


def _size(text: str, what: str, allow_zero: bool, shown: str) -> int:
    refuse_empty(shown, what, "10GB")
    value, unit = _number_and_unit(text, what, shown)
    factor = _SIZE_UNITS.get(unit.upper())
    if factor is None:
        raise UsageError(f"{what} {shown!r}: unknown unit {unit!r} (use B, KB, MB, GB, TB, "
                         "or KiB, MiB, GiB, TiB)")
    out = int(value * factor)
    if out < 0 or (out == 0 and not allow_zero):
        raise UsageError(f"{what} must be positive, not {shown!r}")
    return out


def parse_count(text: str, *, what: str = "count", whole: bool = False) -> int:
    """Parse a count such as ``175B``, ``7.5M``, ``380M`` or ``1200``.

    Args:
        text: The count as typed.
        what: What it is, for the error message.
        whole: Refuse a fraction (``2.5`` ranks) instead of rounding it.

    Returns:
        The count, rounded to the nearest integer.

    Raises:
        UsageError: Unparseable, unknown suffix, zero or negative, or (with ``whole``) not a
            whole number.
    """
    value, unit = _number_and_unit(text, what)
    factor = _COUNT_UNITS.get(unit.upper())
    if factor is None:
        raise UsageError(f"{what} {text!r}: unknown suffix {unit!r} (use K, M, B or T)")
    if whole and value * factor != math.floor(value * factor):
        raise UsageError(f"{what} must be a whole number, not {text!r}")
    out = round(value * factor)
    if out <= 0:
        raise UsageError(f"{what} must be positive, not {text!r}")
    return out


def parse_duration(text: str, *, what: str = "duration", allow_zero: bool = False) -> float:
    """Parse a duration such as ``30m``, ``4h``, ``7d``, ``5y`` or ``1h30m``.

    Every number needs a unit: ``--older-than 7`` read as seconds would let a cron job delete
    almost a whole run, so a bare number is refused naming the units. A bare ``0`` is accepted
    where zero is (zero is zero in any unit).

    Args:
        text: The duration as typed.
        what: What it is, for the error message.
        allow_zero: Accept 0 (``0``, ``0s``, ``0m``...).

    Returns:
        Seconds.

    Raises:
        UsageError: Unparseable, a number without a unit, unknown unit, zero or negative.
    """
    refuse_empty(text, what, "7d")
    s = text.strip()
    if re.fullmatch(_NUMBER, s):
        if float(s) == 0 and allow_zero:
            return 0.0
        if float(s) == 0:
            raise UsageError(f"{what} must be positive, not {text!r}")
        raise UsageError(f"{what} {text!r} needs a unit: {s}d (days), {s}h (hours), {s}m "
                         f"(minutes) or {s}s (seconds); also w (weeks), y (years)")
    if s.startswith("-") and (re.fullmatch(_NUMBER, s[1:].strip())
                              or parse_duration_or_none(s[1:]) is not None):
        raise UsageError(f"{what} must be positive, not {text!r}")
    parts = re.findall(rf"{_NUMBER}\s*(?P<unit>[A-Za-z]+)", s)
    if not parts or re.sub(rf"{_NUMBER}\s*[A-Za-z]+|\s+", "", s):
        trail = re.fullmatch(rf".*[A-Za-z]\s*{_NUMBER}", s)
        if parts and trail:
            n = trail.group("num")
            raise UsageError(f"{what} {text!r}: {n} needs a unit, e.g. {s}m (every number "
                             "needs one: s, m, h, d, w, y)")
        raise UsageError(f"cannot parse {what} {text!r} (e.g. 90s, 30m, 4h, 7d, 1h30m)")
    total = 0.0
    for num, unit in parts:
        total += float(num) * _duration_factor(unit, what, text)
    if not math.isfinite(total) or total < 0 or (total == 0 and not allow_zero):
        raise UsageError(f"{what} must be positive, not {text!r}")
    return total


def parse_duration_or_none(text: str) -> float | None:
    """``parse_duration(text, allow_zero=True)``, or None where it would refuse ``text``."""
    try:
        return parse_duration(text, allow_zero=True)
    except UsageError:
        return None


def parse_rate(text: str, *, what: str = "bandwidth") -> float:
    """Parse a data rate such as ``10GB/s`` or ``800MB/s`` (``/s`` optional).

    Args:
        text: The rate as typed.
        what: What it is, for the error message.

    Returns:
        Bytes per second.

    Raises:
        UsageError: Unparseable, not positive, or in bits (``Gb/s``), which would be read as
            bytes eight times too large.
    """
    base = re.sub(r"\s*/\s*s(ec)?\s*$", "", text.strip(), flags=re.IGNORECASE)
    # Network links are quoted in bits (100 Gb/s); reading "Gb" as bytes would be 8x off, so an
    # upper-case prefix with a lower-case "b" is refused rather than guessed.
    if re.search(r"[KMGTP]b$|(bps|bits?)$", base):
        raise UsageError(f"{what} {text!r} looks like bits per second; give bytes per second "
                         "(100 Gb/s = 12.5GB/s)")
    return float(_size(base, what, False, shown=text))


_SIZE_SUFFIXES = ("kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB", "RB", "QB")


def format_size(n: float) -> str:
    """Bytes in decimal units with one decimal: ``999 Bytes``, ``1 Byte``, ``14.2 MB``.

    The project's one size formatter (tables, reasons, messages); the text is that of
    ``humanize.naturalsize(n, format="%.1f")``, which the output always used.

    Args:
        n: A number of bytes (negative is allowed: ``-1.5 kB``).

    Returns:
        The size as text.
    """
    value = float(n)
    magnitude = abs(value)
    if magnitude == 1:
        return f"{int(value)} Byte"
    if magnitude < 1000:
        return f"{int(value)} Bytes"
    # The unit comes from the unrounded value; if rounding to one decimal reaches 1000 of it
    # (999,999 bytes would read "1000.0 kB"), the next unit up is used instead.
    exp = int(min(math.log(magnitude, 1000), len(_SIZE_SUFFIXES)))
    if exp < len(_SIZE_SUFFIXES) and abs(float(f"{magnitude / 1000 ** exp:.1f}")) >= 1000:
        exp += 1
    return f"{value / 1000 ** exp:.1f} {_SIZE_SUFFIXES[exp - 1]}"


_DURATION_PARTS = (("y", 365 * 86400), ("d", 86400), ("h", 3600), ("m", 60), ("s", 1))


def format_duration(seconds: float) -> str:
    """A duration to two units, as typed on the command line: ``0.573s``, ``3m 30s``, ``1d 19h``.

    The project's one duration form for output (tables, reasons, messages), so that one
    screen never says ``3 minutes and 30 seconds`` beside ``38m 41s``.

    Args:
        seconds: The duration (not negative).

    Returns:
        The duration as text.
    """
    if seconds < 60:
        return f"{seconds:.3g}s"
    for i, (name, div) in enumerate(_DURATION_PARTS[:-1]):
        if seconds >= div:
            small_name, small = _DURATION_PARTS[i + 1]
            big, rest = divmod(round(seconds / small), div // small)
            if i and big * div >= _DURATION_PARTS[i - 1][1]:  # 59m 59.6s rounds up to 1h
                return format_duration(big * div)
            return f"{big:,}{name}" + (f" {rest}{small_name}" if rest else "")
    raise AssertionError(seconds)  # pragma: no cover - seconds >= 60 matched "m" at least


def natural_key(name: str) -> list[tuple[int, int | str]]:
    """Sort key putting ``layers.2`` before ``layers.10`` and ``rank_2`` before ``rank_10``.

    Args:
        name: A tensor, module or file name.

    Returns:
        The key: runs of digits compare as numbers, the text between them as text.
    """
    # ASCII digits only (``int("²")`` fails although ``"²".isdigit()``), and a run too long to
    # convert (a crafted name) sorts as text.
    return [(0, int(p)) if p[0] in _ASCII_DIGITS and len(p) <= _MAX_DIGITS_SORTED else (1, p)
            for p in _DIGIT_RUNS.split(name) if p]


_DIGIT_RUNS = re.compile(r"([0-9]+)")
_ASCII_DIGITS = frozenset("0123456789")
_MAX_DIGITS_SORTED = 1000


def require_positive(value: float, what: str, *, param: bool = False) -> None:
    """Refuse a quantity that is not a positive finite number.

    Args:
        value: The quantity.
        what: What it is, for the message (``params``, ``MTBF``...).
        param: ``what`` is a parameter's name (the CLI words it as its flag).

    Raises:
        UsageError: Zero, negative, NaN or infinite.
    """
    if not (value > 0 and math.isfinite(value)):
        raise UsageError(f"{what} must be positive, not {value!r}", param=what if param else None)
