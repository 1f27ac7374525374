"""The zip checker on zips written by Python's zipfile (ZIP64, descriptors, comments)."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_cli.ops.validate.zipcheck import check_zip, crc_tasks, verify_crcs
from tests.helpers import damage

pytestmark = pytest.mark.requires_torch


class _Unseekable(io.RawIOBase):
    """A write-only stream: zipfile then writes data descriptors after each record."""

    def __init__(self, f: io.BufferedWriter):
        self.f = f

    def writable(self) -> bool:
        return True

    def write(self, b: bytes) -> int:  # type: ignore[override]
        return self.f.write(b)


def _check(path: Path) -> tuple[list[str], int, list[str]]:
    fd = os.open(path, os.O_RDONLY)
    try:
        zr = check_zip(fd, 0, os.fstat(fd).st_size, rel=path.name)
        tasks = crc_tasks(zr, rel=path.name, fd=fd, start=0)
        crc = verify_crcs(tasks, threads=2)
    finally:
        os.close(fd)
    return [f.code for f in zr.findings], len(tasks), [f.code for f in crc]


@pytest.mark.parametrize("zip64", [False, True])
def test_streamed_zip_with_descriptors(tmp_path: Path, zip64: bool) -> None:
    p = tmp_path / "s.zip"
    with open(p, "wb") as raw, zipfile.ZipFile(_Unseekable(raw), "w") as zf:
        for i in range(3):
            with zf.open(f"r/{i}", "w", force_zip64=zip64) as e:
                e.write(os.urandom(1000 + i))
    assert _check(p) == ([], 3, [])


def test_zip_with_comment_and_compressed_record(tmp_path: Path) -> None:
    p = tmp_path / "c.zip"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("stored", b"x" * 100)
        zf.writestr("deflated", b"y" * 100, compress_type=zipfile.ZIP_DEFLATED)
        zf.comment = b"a comment is not trailing garbage"
    codes, tasks, crc = _check(p)
    assert codes == [] and crc == []
    assert tasks == 1  # the compressed record's CRC covers its inflated bytes: not streamed


def test_crc_of_a_large_record_split_across_threads(tmp_path: Path) -> None:
    """Records over 64 MiB are checksummed in pieces and the CRCs combined."""
    p = tmp_path / "big.pt"
    torch.save({"w": torch.arange(20_000_000, dtype=torch.float32)}, p)  # 80 MB
    assert _check(p) == ([], 7, [])  # 7 records, one of them 80 MB
    off, size = damage.zip_payload(p, "data/0")
    damage.flip(p, off + size - 5)  # in the last piece
    codes, _, crc = _check(p)
    assert codes == [] and crc == ["crc-mismatch"]


def test_not_a_zip_at_all(tmp_path: Path) -> None:
    p = tmp_path / "x.zip"
    p.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    codes, tasks, _ = _check(p)
    assert codes == ["zip-no-end-record"] and tasks == 0
    p.write_bytes(b"PK")
    assert _check(p)[0] == ["zip-no-end-record"]


def test_zlib_fallback_without_isal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where isal has no wheel, zlib's CRC-32 is used and large records are not split."""
    import zlib

    from ckpt_cli.storage import reads

    monkeypatch.setattr(reads, "_crc32", zlib.crc32)
    monkeypatch.setattr(reads, "_crc32_combine", None)
    assert reads.crc32_combine(1, 2, 3) is None
    p = tmp_path / "big.pt"
    torch.save({"w": torch.arange(20_000_000, dtype=torch.float32)}, p)
    assert _check(p) == ([], 7, [])
    off, size = damage.zip_payload(p, "data/0")
    damage.flip(p, off + size - 5)
    assert _check(p)[2] == ["crc-mismatch"]
