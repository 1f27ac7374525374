"""ckpt_cli.storage.reads: positioned reads and CRCs on a real file."""

from __future__ import annotations

import os
import threading
import time
import zlib
from pathlib import Path

import pytest

from ckpt_cli.errors import CkptError, CorruptCheckpointError
from ckpt_cli.storage.reads import (
    Cancelled,
    Meter,
    OpenFiles,
    crc32_combine,
    crc32_range,
    read_range,
    run_parallel,
)


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


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# --- Meter -------------------------------------------------------------------------------------

def test_meter_counts_across_threads_and_cancels() -> None:
    m = Meter()

    def work() -> None:
        for _ in range(1000):
            m.add(3)

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert m.done == 12_000
    m.stop.set()
    with pytest.raises(Cancelled):
        m.add(1)
    assert m.done == 12_000  # a cancelled add counts nothing


# --- read_range --------------------------------------------------------------------------------

def test_read_range_reuses_a_small_buffer(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    p = tmp_path / "f"
    p.write_bytes(data)
    buf = bytearray(1000)
    meter = Meter()
    fd = os.open(p, os.O_RDONLY)
    try:
        views = []
        got = bytearray()
        for v in read_range(fd, 123, 7777, buf, meter):
            assert len(v) <= len(buf)
            assert v.obj is buf  # a view of the caller's buffer, not a copy
            views.append(len(v))
            got += v
        assert bytes(got) == data[123:123 + 7777]
        assert sum(views) == 7777 and len(views) == 8
        assert meter.done == 7777
        assert list(read_range(fd, 0, 0, buf)) == []
        with pytest.raises(CorruptCheckpointError, match="file ends at byte 10,000"):
            for _ in read_range(fd, 9000, 2000, buf, path=p):
                pass
        meter.stop.set()
        with pytest.raises(Cancelled):
            next(read_range(fd, 0, 100, buf, meter))
    finally:
        os.close(fd)


def test_read_range_on_a_closed_descriptor_is_a_ckpt_error(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"x" * 10)
    fd = os.open(p, os.O_RDONLY)
    os.close(fd)
    with pytest.raises(CkptError, match="cannot read at byte 0"):
        next(read_range(fd, 0, 10, bytearray(4), path=p))


# --- run_parallel ------------------------------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 4])
def test_run_parallel_keeps_job_order_and_reports_progress(threads: int) -> None:
    def job(i: int):  # type: ignore[no-untyped-def]
        def run(m: Meter) -> int:
            time.sleep(0.01 * (5 - i))  # later jobs finish first
            m.add(10)
            return i * i
        return run

    calls: list[tuple[str, int, int]] = []
    out = run_parallel([job(i) for i in range(5)], threads=threads, total=50, label="x",
                       on_progress=lambda *a: calls.append(a))
    assert out == [0, 1, 4, 9, 16]
    assert calls[0] == ("x", 0, 50)
    assert calls[-1] == ("x", 50, 50)


@pytest.mark.parametrize("threads", [1, 3])
def test_run_parallel_propagates_a_job_exception(threads: int) -> None:
    def ok(m: Meter) -> int:
        return 1

    def bad(m: Meter) -> int:
        raise KeyError("job 2 failed")

    with pytest.raises(KeyError, match="job 2 failed"):
        run_parallel([ok, ok, bad, ok], threads=threads, total=0, label="x")


def test_run_parallel_cancels_the_other_jobs_via_the_meter() -> None:
    started = threading.Event()
    stopped: list[str] = []

    def slow(m: Meter) -> int:
        started.set()
        deadline = time.monotonic() + 10
        try:
            while time.monotonic() < deadline:
                m.add(1)
                time.sleep(0.005)
        except Cancelled:
            stopped.append("cancelled")
            raise
        return 0

    def bad(m: Meter) -> int:
        started.wait(5)
        time.sleep(0.05)
        raise RuntimeError("boom")

    meter = Meter()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="boom"):
        run_parallel([slow, bad], threads=2, total=0, label="x", meter=meter)
    assert meter.stop.is_set()
    assert stopped == ["cancelled"]  # the slow job saw Cancelled before run_parallel returned
    assert time.monotonic() - t0 < 5


def test_run_parallel_with_a_stopped_meter_raises_cancelled() -> None:
    meter = Meter()
    meter.stop.set()
    with pytest.raises(Cancelled):
        run_parallel([lambda m: m.add(1)], threads=1, total=1, label="x", meter=meter)


# --- OpenFiles ---------------------------------------------------------------------------------

def test_open_files_opens_each_path_once_and_closes_all(tmp_path: Path) -> None:
    paths = []
    for i in range(5):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes([i]) * 100)
        paths.append(p)
    with OpenFiles() as files:
        fds = [files.open(p) for p in paths]
        assert len(set(fds)) == 5
        assert [files.open(p) for p in paths] == fds  # shared, not reopened
        for i, fd in enumerate(fds):
            assert os.pread(fd, 3, 10) == bytes([i]) * 3
    assert not any(_is_open(fd) for fd in fds)
    files.close()  # closing again is harmless


def test_open_files_refuses_missing_and_special_files(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with OpenFiles() as files:
        with pytest.raises(CkptError, match="no such file"):
            files.open(tmp_path / "missing", name="shown-name")
        with pytest.raises(CorruptCheckpointError):
            files.open(fifo)
