"""ckpt_cli.streaming: positioned reads and CRCs on a real file."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from ckpt_cli.streaming import crc32_combine, crc32_range, read_range


def test_crc32_range_matches_zlib(tmp_path: Path) -> None:
    data = os.urandom(100_000)
    p = tmp_path / "f"
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        assert crc32_range(fd, 0, len(data), piece=4096) == zlib.crc32(data)
        assert crc32_range(fd, 1000, 5000, piece=333) == zlib.crc32(data[1000:6000])
        assert crc32_range(fd, 99_000, 2000) is None  # the file ends first
        got = b"".join(bytes(v) for v in read_range(fd, 10, 50_000, bytearray(4096)))
        assert got == data[10:50_010]
    finally:
        os.close(fd)
    a, b = data[:777], data[777:]
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) in (zlib.crc32(data), None)
