"""``formats/zipshape.py``: which zips share a layout, on zips torch.save wrote.

A shape must match a zip of the same layout whatever its payloads, and nothing else: one
changed byte outside the payloads and CRC-32 fields, CRC copies that disagree, an extra
end-record signature, or records parse_zip would read for meaning (a second pickle) leave
the zip to the full parse.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_cli.formats import zipshape
from ckpt_cli.ops.validate.zipcheck import check_zip

pytestmark = pytest.mark.requires_torch


def _saved(value: float) -> bytes:
    buf = io.BytesIO()
    torch.save(torch.full((2,), value), buf)
    return buf.getvalue()


def _learn(data: bytes, tmp_path: Path) -> zipshape.ZipShape | None:
    f = tmp_path / "z"
    f.write_bytes(data)
    fd = os.open(f, os.O_RDONLY)
    try:
        zr = check_zip(fd, 0, len(data), rel="z")
    finally:
        os.close(fd)
    assert zr.readable and not zr.findings
    return zipshape.learn(data, [(r.name, r.header_offset, r.data_offset, r.size, r.method,
                                  r.end) for r in zr.records])


def _rename(data: bytes, old: bytes, new: bytes) -> bytes:
    assert len(old) == len(new) and data.count(old) == 2  # local header and central entry
    return data.replace(old, new)


def test_a_shape_matches_its_layout_whatever_the_payloads(tmp_path: Path) -> None:
    a, b = _saved(1.0), _saved(2.5)
    shape = _learn(a, tmp_path)
    assert shape is not None
    got = shape.crcs(b)
    with zipfile.ZipFile(io.BytesIO(b)) as z:
        assert got == tuple(i.CRC for i in z.infolist())


@pytest.mark.parametrize("where", ["name", "central-crc", "descriptor-crc", "end-record"])
def test_a_shape_refuses_a_zip_that_differs_outside_its_payloads(where: str,
                                                                 tmp_path: Path) -> None:
    a = _saved(1.0)
    shape = _learn(a, tmp_path)
    assert shape is not None
    b = bytearray(_saved(3.0))
    with zipfile.ZipFile(io.BytesIO(bytes(b))) as z:
        info = z.getinfo("archive/data/0")
    n, m = struct.unpack_from("<HH", b, info.header_offset + 26)  # the local header's
    payload = info.header_offset + 30 + n + m
    if where == "name":
        b[info.header_offset + 30 + len(info.filename) - 1] ^= 1
    elif where == "central-crc":
        at = bytes(b).index(b"PK\x01\x02")
        while bytes(b[at + 46:at + 46 + len(info.filename)]) != info.filename.encode():
            at = bytes(b).index(b"PK\x01\x02", at + 1)
        b[at + 16] ^= 1
    elif where == "descriptor-crc":
        assert b[payload + 8:payload + 12] == b"PK\x07\x08"
        b[payload + 12] ^= 1
    else:  # a second end-record signature, inside the storage's payload
        b[payload:payload + 4] = b"PK\x05\x06"
    assert shape.crcs(bytes(b)) is None


def test_no_shape_for_a_zip_with_a_record_parse_zip_reads(tmp_path: Path) -> None:
    # A second .pkl record: parse_zip scans its bytes for globals, so a shape (which masks
    # payloads) must not stand for it.
    data = _rename(_saved(1.0), b"archive/version", b"archive/ver.pkl")
    assert _learn(data, tmp_path) is None
    data = _rename(_saved(1.0), b"archive/byteorder", b"archivf/byteorder")  # another prefix
    assert _learn(data, tmp_path) is None


def test_the_pickle_cache_keeps_only_whole_pickles() -> None:
    with zipfile.ZipFile(io.BytesIO(_saved(1.0))) as z:
        raw = z.read("archive/data.pkl")
    cache = zipshape.PickleCache()
    first = cache.get(raw)
    assert first is not None and first.obj is not None
    assert cache.get(bytes(raw)) is first  # identical bytes: unpickled once
    assert cache.get(raw + b"\x80\x02N.") is None  # a second pickle after STOP: full path
    assert cache.get(raw[:-1]) is None  # no STOP: full path
