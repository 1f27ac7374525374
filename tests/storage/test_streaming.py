"""ckpt_cli.storage.reads: positioned reads and CRCs on a real file."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt_cli.errors import CkptError, CorruptCheckpointError
from ckpt_cli.storage.reads import (
    BUFFER_SIZE,
    Cancelled,
    Meter,
    OpenFiles,
    crc32,
    crc32_combine,
    crc32_parallel,
    crc32_range,
    read_ahead,
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


@pytest.mark.parametrize("reader", ["read_range", "read_ahead"])
def test_reading_a_closed_descriptor_is_a_ckpt_error(tmp_path: Path, reader: str) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"x" * 10_000)
    fd = os.open(p, os.O_RDONLY)
    os.close(fd)
    views = (read_range(fd, 0, 10_000, bytearray(4), path=p) if reader == "read_range" else
             read_ahead(fd, 0, 10_000, readers=2, chunk=1024, path=p))
    with pytest.raises(CkptError, match="cannot read at byte 0"):
        next(views)


# --- read_ahead --------------------------------------------------------------------------------

@pytest.mark.parametrize("readers", [1, 2, 3, 5])
@pytest.mark.parametrize(("start", "length"), [(0, 50_000), (7, 49_993), (1000, 4096),
                                               (0, 1), (333, 0), (4095, 4097)])
def test_read_ahead_yields_the_range_in_order(tmp_path: Path, readers: int, start: int,
                                              length: int) -> None:
    data = os.urandom(50_000)
    p = tmp_path / "f"
    p.write_bytes(data)
    meter = Meter()
    fd = os.open(p, os.O_RDONLY)
    try:
        got = bytearray()
        sizes = []
        for v in read_ahead(fd, start, length, readers=readers, meter=meter, chunk=4096):
            sizes.append(len(v))
            got += v
        assert bytes(got) == data[start:start + length]
        assert meter.done == length
        assert all(n <= (4096 if readers > 1 else BUFFER_SIZE) for n in sizes)
    finally:
        os.close(fd)


@pytest.mark.parametrize("readers", [2, 3])
def test_read_ahead_reads_on_several_threads_into_few_buffers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, readers: int) -> None:
    data = os.urandom(64 * 1024)
    p = tmp_path / "f"
    p.write_bytes(data)
    import ckpt_cli.storage.access as access

    names: set[str] = set()
    real = os.preadv

    def spy(fd_: int, bufs: list[memoryview], off: int) -> int:
        names.add(threading.current_thread().name)
        return real(fd_, bufs, off)

    monkeypatch.setattr(access.os, "preadv", spy)
    fd = os.open(p, os.O_RDONLY)
    try:
        buffers: list[bytearray] = []  # kept alive: their ids stay distinct
        for v in read_ahead(fd, 0, len(data), readers=readers, chunk=1024):
            if not any(v.obj is b for b in buffers):
                buffers.append(v.obj)
            time.sleep(0.002)  # a slow consumer: the readers run ahead
        # readers + 1 buffers, reused: as many reads in flight as readers while one is held.
        assert len(buffers) == readers + 1
        assert names and all(n.startswith("ckpt-readahead") for n in names)
        assert len(names) >= 2  # the reads ran on more than one thread
    finally:
        os.close(fd)


@contextlib.contextmanager
def _opened(path: Path, size: int) -> Iterator[int]:
    """A descriptor of a new file of ``size`` random bytes at ``path``."""
    path.write_bytes(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd
    finally:
        os.close(fd)


def test_read_ahead_names_a_file_that_ends_early(tmp_path: Path) -> None:
    p = tmp_path / "f"
    with _opened(p, 10_000) as fd:
        with pytest.raises(CorruptCheckpointError, match="file ends at byte 10,000") as e:
            for _ in read_ahead(fd, 0, 20_000, readers=2, chunk=1024, path=p):
                pass
        assert str(p) in str(e.value)


def test_read_ahead_cancels_with_the_meter_and_stops_its_threads(tmp_path: Path) -> None:
    with _opened(tmp_path / "f", 100_000) as fd:
        meter = Meter()
        gen = read_ahead(fd, 0, 100_000, readers=2, meter=meter, chunk=1024)
        next(gen)
        meter.stop.set()
        with pytest.raises(Cancelled):
            for _ in gen:
                pass
        # A consumer that stops early: the generator's close waits for its readers.
        gen = read_ahead(fd, 0, 100_000, readers=2, chunk=1024)
        next(gen)
        gen.close()  # shuts its pool down, joining the reader threads
        assert not [t for t in threading.enumerate() if t.name.startswith("ckpt-readahead")]


# --- crc32_parallel ----------------------------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("size", [0, 1, (4 << 20) - 1, 8 << 20, (13 << 20) + 7])
def test_crc32_parallel_equals_one_pass(threads: int, size: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    data = memoryview(os.urandom(size))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for start in (0, 0x1234ABCD):
            assert crc32_parallel(data, start, pool, threads) == zlib.crc32(data, start)
            assert crc32_parallel(data, start, None, threads) == crc32(data, start)
    # Continued over pieces, as a tensor's running CRC is.
    with ThreadPoolExecutor(max_workers=threads) as pool:
        value = 0
        for i in range(0, size, 5 << 20):
            value = crc32_parallel(data[i:i + (5 << 20)], value, pool, threads)
        assert value == zlib.crc32(data)


def test_crc32_parallel_splits_large_data_over_the_pool() -> None:
    from concurrent.futures import ThreadPoolExecutor

    seen: list[int] = []

    class Spy(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def, override]
            seen.append(len(args[0]))
            return super().submit(fn, *args, **kwargs)

    data = memoryview(os.urandom(16 << 20))
    with Spy(max_workers=4) as pool:
        assert crc32_parallel(data, 0, pool, 4) == zlib.crc32(data)
    if crc32_combine(1, 2, 3) is None:  # pragma: no cover - zlib without ISA-L: one pass
        assert seen == []
    else:
        assert seen == [4 << 20] * 4


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
