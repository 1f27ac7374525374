"""Parsing of sizes, counts, durations and rates."""

from __future__ import annotations

import pytest

from ckpt_cli.errors import UsageError
from ckpt_cli.units import parse_count, parse_duration, parse_rate, parse_size


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
    ("90s", 90), ("30m", 1800), ("4h", 14400), ("7d", 604800), ("1h30m", 5400), ("90", 90),
    ("5y", 5 * 365 * 86400), ("2w", 14 * 86400),
])
def test_durations(text: str, expected: float) -> None:
    assert parse_duration(text) == expected


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
