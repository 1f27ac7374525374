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


def test_small_records_share_their_crc_jobs(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Small records are checksummed in jobs of about 8 MiB, not one job per 128 bytes (a
    second ``_BATCH``, the records fetched together from object storage, shadowed it)."""
    from ckpt_cli.ops.validate import zipcheck

    p = tmp_path / "many.pt"
    torch.save({f"t{i}": torch.full((8,), float(i)) for i in range(300)}, p)
    jobs: list[int] = []
    real = zipcheck.run_parallel

    def counting(js: list[object], **kw: object) -> object:
        jobs.append(len(js))
        return real(js, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(zipcheck, "run_parallel", counting)
    codes, tasks, crc = _check(p)
    assert (codes, crc) == ([], []) and tasks > 300
    assert jobs == [1]
    off, _ = damage.zip_payload(p, "data/150")
    damage.flip(p, off + 3)
    assert _check(p)[2] == ["crc-mismatch"]


@pytest.mark.parametrize("hurt", ["none", "truncate", "central", "local", "descriptor"])
def test_a_small_zip_is_read_once_with_the_findings_of_many_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hurt: str) -> None:
    """A zip of at most 64 KiB (a DCP item) is read whole for its structure checks; damage
    anywhere gives the findings the field-by-field reads gave."""
    from ckpt_cli import storage
    from ckpt_cli.ops.validate import zipcheck

    p = tmp_path / "small.pt"
    torch.save({"a": torch.arange(6.0), "b": torch.ones(3)}, p)
    data = p.read_bytes()
    if hurt == "truncate":
        damage.truncate(p, len(data) - 7)
    elif hurt == "central":
        damage.flip(p, data.rindex(b"PK\x01\x02") + 20, 0x40)  # a recorded size
    elif hurt == "local":
        damage.flip(p, data.index(b"PK\x03\x04", 10) + 26)  # a name length
    elif hurt == "descriptor":
        damage.flip(p, data.index(b"PK\x07\x08") + 9)
    reads: list[int] = []
    real = storage.pread

    def counted(h: object, n: int, offset: int) -> bytes:
        reads.append(n)
        return real(h, n, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(storage, "pread", counted)
    whole = _check(p)
    if hurt == "none":
        assert whole == ([], 8, []) and reads == [p.stat().st_size]
    else:
        assert whole[0] or whole[2]  # the damage is found
    monkeypatch.setattr(zipcheck, "_WHOLE", 0)
    reads.clear()
    assert _check(p) == whole
    assert len(reads) >= (1 if hurt == "truncate" else 6)  # field by field, as before
