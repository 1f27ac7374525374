"""Parsing of sizes, counts, durations and rates; the size formatter and the natural sort."""

from __future__ import annotations

import humanize
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_cli.errors import UsageError
from ckpt_cli.units import (
    format_size,
    natural_key,
    parse_count,
    parse_duration,
    parse_rate,
    parse_size,
    require_positive,
)


@pytest.mark.parametrize("text,expected", [
    ("5GB", 5_000_000_000), ("5gb", 5_000_000_000), ("1.5TB", 1_500_000_000_000),
    ("500MiB", 500 * 2**20), ("100", 100), ("2 KB", 2000), ("1e9", 1_000_000_000),
])
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("175B", 175_000_000_000), ("7.5M", 7_500_000), ("380M", 380_000_000), ("1200", 1200),
    ("1.2T", 1_200_000_000_000),
])
def test_counts(text: str, expected: int) -> None:
    assert parse_count(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("90s", 90), ("30m", 1800), ("4h", 14400), ("7d", 604800), ("1h30m", 5400), ("90s", 90),
    ("5y", 5 * 365 * 86400), ("2w", 14 * 86400),
])
def test_durations(text: str, expected: float) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["7", "90", " 12 ", "1.5", "1e3"])
def test_a_duration_without_a_unit_is_refused_naming_the_units(text: str) -> None:
    # "--older-than 7" used to mean 7 seconds: a cron job pruning with it deleted almost a run.
    n = text.strip()
    with pytest.raises(UsageError) as e:
        parse_duration(text, what="--older-than")
    assert e.value.message == (f"--older-than {text!r} needs a unit: {n}d (days), {n}h (hours), "
                               f"{n}m (minutes) or {n}s (seconds); also w (weeks), y (years)")
    assert e.value.exit_code == 2


@pytest.mark.parametrize("text", ["0", "0.0", "0s", "0m"])
def test_zero_needs_no_unit_where_zero_is_allowed(text: str) -> None:
    assert parse_duration(text, what="--grace", allow_zero=True) == 0
    with pytest.raises(UsageError, match="must be positive"):
        parse_duration(text, what="--mtbf")


def test_rates() -> None:
    assert parse_rate("10GB/s") == 10e9
    assert parse_rate("800 MB/s") == 800e6
    assert parse_rate("1GiB") == 2**30


@pytest.mark.parametrize("func,text", [
    (parse_size, "-5GB"), (parse_size, "0"), (parse_size, "5XB"), (parse_size, "lots"),
    (parse_count, "0"), (parse_count, "3Q"), (parse_duration, "0s"), (parse_duration, "5 parsecs"),
    (parse_duration, "1h junk"), (parse_rate, "fast"), (parse_size, "nan"),
])
def test_bad_input(func, text: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError):
        func(text)


def test_whole_counts() -> None:
    assert parse_count("1K", what="--gpus", whole=True) == 1000
    assert parse_count("2.5K", whole=True) == 2500
    assert parse_count("2.5") == 2  # rounded when a fraction is acceptable
    with pytest.raises(UsageError, match=r"--keep must be a whole number, not '2\.5'"):
        parse_count("2.5", what="--keep", whole=True)


@pytest.mark.parametrize("text", ["100Gb/s", "100Gbps", "10 Gbit/s", "400Mb/s", "8 bits/s"])
def test_rates_in_bits_are_refused(text: str) -> None:
    with pytest.raises(UsageError, match="looks like bits per second"):
        parse_rate(text, what="--bandwidth")


def test_rate_errors_quote_what_was_typed() -> None:
    with pytest.raises(UsageError, match=r"--bandwidth must be positive, not '0GB/s'"):
        parse_rate("0GB/s", what="--bandwidth")
    with pytest.raises(UsageError, match=r"--bandwidth '5XB/s': unknown unit 'XB'"):
        parse_rate("5XB/s", what="--bandwidth")


# -- formatting and ordering ------------------------------------------------------------------

@pytest.mark.parametrize("n,text", [
    (0, "0 Bytes"), (1, "1 Byte"), (999, "999 Bytes"), (1000, "1.0 kB"), (14_200_000, "14.2 MB"),
    (999_949, "999.9 kB"), (999_950, "1.0 MB"), (10**9, "1.0 GB"), (2.5e12, "2.5 TB"),
    (-1500, "-1.5 kB"), (10**33, "1000.0 QB"),
])
def test_format_size(n: float, text: str) -> None:
    assert format_size(n) == text


@settings(max_examples=300)
@given(st.one_of(st.integers(min_value=-10**33, max_value=10**33),
                 st.floats(min_value=0, max_value=1e33)))
def test_format_size_reads_as_the_output_always_did(n: float) -> None:
    # Reports and --json messages were written with humanize; the text must not change.
    assert format_size(n) == humanize.naturalsize(n, binary=False, format="%.1f")


def test_natural_key_orders_numbers_as_numbers() -> None:
    names = ["layers.10.w", "layers.2.w", "layers.2", "rank_10", "rank_2", "a", "1a", ""]
    assert sorted(names, key=natural_key) == [
        "", "1a", "a", "layers.2", "layers.2.w", "layers.10.w", "rank_2", "rank_10"]
    assert natural_key("zero_pp_rank_3_mp_rank_00") == natural_key("zero_pp_rank_3_mp_rank_0")


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf")])
def test_require_positive(value: float) -> None:
    with pytest.raises(UsageError, match="--x must be positive"):
        require_positive(value, "--x")
    require_positive(0.5, "--x")


@pytest.mark.parametrize("text,expected", [
    ("2H", 7200), ("3D", 3 * 86400), ("1W", 7 * 86400), ("1Y", 365 * 86400), ("90S", 90),
    ("5min", 300), ("2hours", 7200), ("3days", 3 * 86400),
])
def test_unambiguous_units_in_any_case(text: str, expected: float) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["6M", "10M", "1mo", "2months", "1month", "3MO"])
def test_capital_m_and_months_are_refused_not_read_as_minutes(text: str) -> None:
    # "--older-than 6M" used to mean six minutes: M is months in systemd and ISO 8601.
    with pytest.raises(UsageError) as e:
        parse_duration(text, what="--older-than")
    assert e.value.exit_code == 2
    assert "months are not accepted" in e.value.message and "30m" in e.value.message
    assert parse_duration("6m") == 360  # lower-case m stays minutes


@pytest.mark.parametrize("text", ["-1d", "-5", "-1h30m"])
def test_a_negative_duration_says_it_must_be_positive(text: str) -> None:
    with pytest.raises(UsageError, match="must be positive"):
        parse_duration(text, what="--older-than")


def test_a_trailing_number_without_a_unit_is_named() -> None:
    with pytest.raises(UsageError) as e:
        parse_duration("1h30", what="--grace")
    assert e.value.message.startswith("--grace '1h30': 30 needs a unit, e.g. 1h30m")
