"""Reading every byte of large files: bounded memory, parallel threads, progress; the pools
that run such work and the memory budget tensor pipelines keep to.

``validate``'s CRC-32 pass and the integrity manifest read whole checkpoints. Both stream byte
ranges through reusable buffers with positioned reads (``os.preadv``), so memory is a few
buffers per thread whatever the file size, and a file that shrinks while it is read gives a
clean "file ends early" error (and a failing disk an I/O error) instead of the SIGBUS an mmap
would die of. The checksums applied to the buffers (ISA-L's CRC-32, xxh3, BLAKE3, OpenSSL's
SHA-256) release the GIL, so threads overlap on several cores. Buffers are small enough to
stay in L2 while they are checksummed right after the copy. A digest of one large file is
sequential; there :func:`read_ahead` copies the file on several threads ahead of the hasher,
and :func:`crc32_parallel` checksums a large piece in blocks on a pool and combines them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import (
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    Executor,
    Future,
    ThreadPoolExecutor,
    wait,
)
from pathlib import Path
from typing import Generic, TypeVar

from ckpt_cli.errors import CkptError, CorruptCheckpointError, UsageError
from ckpt_cli.progress import Progress
from ckpt_cli.storage import access, stages
from ckpt_cli.storage.access import Handle
from ckpt_cli.storage.threads import default_jobs as default_jobs
from ckpt_cli.storage.threads import usable_cpus as usable_cpus
from ckpt_cli.storage.threads import worker_threads as worker_threads

_crc32_combine: Callable[[int, int, int], int] | None
try:  # ISA-L's CRC-32 (x86 PCLMUL / ARM PMULL) is ~20x zlib's; zlib is the fallback.
    from isal.isal_zlib import crc32 as _crc32
    from isal.isal_zlib import crc32_combine as _crc32_combine
except ImportError:  # pragma: no cover - isal has wheels for the platforms ckpt supports
    from zlib import crc32 as _crc32

    _crc32_combine = None

BUFFER_SIZE = 512 << 10
"""Bytes per positioned read where one thread reads and checksums: the copy and the checksum
both run on L2-resident bytes. For one large file, several readers ahead of one hasher
(:func:`read_ahead`, 8 MiB reads) are faster (docs/benchmarks/tuning.md has the figures)."""

PIECE_BYTES = 64 << 20
"""Bytes of one piece of a tensor streamed through ``convert``/``consolidate``/``diff``: tensors
larger than this are read, cast, checked and written piece by piece, so memory stays bounded
whatever the size of one tensor (a large model's embedding is several GB)."""

MEMORY_BUDGET = 4 * PIECE_BYTES
"""The default memory budget (``--max-memory``): tensor data read ahead and not yet written
(or checked, or compared). 256 MiB holds the piece being written, two read and cast ahead, and
one being read: enough for reading and casting to run on while the writer waits for a flush
(every 256 MB, see :class:`ckpt_cli.writers.pipeline.Flusher`) or the disk, and small beside what
loading a checkpoint costs (a 4.7 GB training checkpoint: a 1.6 GB model). A tensor that must
be read whole (strided views, DCP chunks split along other dimensions) may add its size."""

MIN_MEMORY = PIECE_BYTES
"""The smallest ``--max-memory``: one piece."""


def memory_budget(max_memory: int | None) -> int:
    """The memory budget to use: ``max_memory``, or :data:`MEMORY_BUDGET` when None.

    Args:
        max_memory: Bytes, as given by ``--max-memory``.

    Returns:
        The budget in bytes.

    Raises:
        UsageError: If ``max_memory`` is below one piece (:data:`MIN_MEMORY`): tensors stream
            in pieces of that size, so a smaller budget could not be kept.
    """
    if max_memory is None:
        return MEMORY_BUDGET
    if max_memory < MIN_MEMORY:
        raise UsageError(f"max_memory must be at least {MIN_MEMORY >> 20}MiB (one piece of a "
                         f"tensor), not {max_memory:,} bytes", param="max_memory")
    return max_memory

T = TypeVar("T")
K = TypeVar("K")
C = TypeVar("C")


def crc32(data: memoryview | bytes, value: int = 0) -> int:
    """CRC-32 (the zip polynomial) of ``data``, continuing from ``value``."""
    if stages.enabled():
        with stages.stage("hash", len(data)):
            return _crc32(data, value)
    return _crc32(data, value)


CRC_BLOCK = 4 << 20
"""Fewest bytes per thread of :func:`crc32_parallel` (ISA-L checksums 4 MiB in ~0.3 ms; a pool
task costs ~10-50 us)."""


def crc32_parallel(data: memoryview, value: int, pool: Executor | None, threads: int) -> int:
    """CRC-32 of ``data`` continuing from ``value``, its blocks checksummed on ``pool``'s
    threads at once and combined (``crc32_combine``): the same value as :func:`crc32`.

    A mapped piece of a file is faulted in by its first pass, so this also spreads the reading
    of the page cache over the threads. Falls back to one thread for small data, one thread, no
    pool, or no ``crc32_combine`` (zlib without ISA-L).

    Args:
        data: The bytes.
        value: The CRC-32 of the bytes before them (0 to start).
        pool: Threads to run the blocks on; the caller must not be one of them (it waits).
        threads: Blocks to split ``data`` into, at most.

    Returns:
        The CRC-32 of everything so far.
    """
    n = len(data)
    parts = min(threads, n // CRC_BLOCK)
    if pool is None or parts < 2 or _crc32_combine is None:
        return crc32(data, value)
    size = -(-n // parts)
    bounds = [(i, min(n, i + size)) for i in range(0, n, size)]
    futures = [pool.submit(crc32, data[a:b]) for a, b in bounds]
    for (a, b), f in zip(bounds, futures, strict=True):
        value = int(_crc32_combine(value, f.result(), b - a))
    return value


def crc32_range(fd: Handle, offset: int, length: int, piece: int = 16 << 20) -> int | None:
    """CRC-32 of ``length`` bytes of an open file from ``offset``, read in bounded pieces;
    None if the file ends first."""
    buf = memoryview(bytearray(min(length, piece)))
    value, done = 0, 0
    while done < length:
        n = access.readinto(fd, buf[:min(len(buf), length - done)], offset + done)
        if n <= 0:
            return None
        value = crc32(buf[:n], value)
        done += n
    return value


def crc32_combine(crc1: int, crc2: int, len2: int) -> int | None:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``; None if unavailable."""
    if _crc32_combine is None:  # pragma: no cover - see the import above
        return None
    return int(_crc32_combine(crc1, crc2, len2))


class Meter:
    """Bytes processed so far by worker threads, and a flag that asks them to stop.

    Attributes:
        done: Bytes processed.
        stop: Set when the caller gives up (an error elsewhere, Ctrl-C): workers raise
            :class:`Cancelled` at their next buffer.
    """

    def __init__(self) -> None:
        self.done = 0
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        """Count ``n`` more bytes; raise :class:`Cancelled` if the work was called off."""
        if self.stop.is_set():
            raise Cancelled
        with self._lock:
            self.done += n


class Cancelled(Exception):
    """Raised inside worker threads after :attr:`Meter.stop` is set."""


def read_range(fd: Handle, start: int, length: int, buf: bytearray, meter: Meter | None = None,
               *, path: str | Path = "") -> Iterator[memoryview]:
    """Yield successive views of bytes ``[start, start + length)`` of an open file.

    Each view is only valid until the next one is requested (the buffer is reused).

    Args:
        fd: An open file descriptor (shared between threads: positioned reads need no seek).
        start: First byte.
        length: Number of bytes.
        buf: The buffer to read into.
        meter: Counts the bytes read, and cancels.
        path: The file's name, for the error message.

    Yields:
        Views of at most ``len(buf)`` bytes.

    Raises:
        CorruptCheckpointError: If the file ends before ``start + length``.
        CkptError: If reading fails.
        Cancelled: If ``meter.stop`` is set.
    """
    mv = memoryview(buf)
    off, end = start, start + length
    while off < end:
        try:
            with stages.stage("read"):
                n = access.readinto(fd, mv[:min(len(mv), end - off)], off)
        except OSError as e:
            raise _cannot_read(e, off, path) from None
        if n <= 0:
            raise _ends_early(off, end, path)
        if meter is not None:
            meter.add(n)
        yield mv[:n]
        off += n


def _cannot_read(e: OSError, offset: int, path: str | Path) -> CkptError:
    return CkptError(f"cannot read at byte {offset:,}: {e.strerror}", path=path)


def _ends_early(at: int, end: int, path: str | Path) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"file ends at byte {at:,} but {end - at:,} more bytes were expected (it shrank while "
        "being read, or is truncated)", path=path)


READ_AHEAD_MIN = 64 << 20
"""Files from this size up are worth reading ahead on several threads (:func:`read_ahead`)."""

READ_AHEAD_CHUNK = 8 << 20
"""Bytes per read of :func:`read_ahead` (big enough that one pool task per chunk costs ~0.5% of
copying it)."""


def read_ahead(fd: Handle, start: int, length: int, *, readers: int,
               meter: Meter | None = None, path: str | Path = "",
               chunk: int | None = None) -> Generator[memoryview, None, None]:
    """Yield successive views of bytes ``[start, start + length)`` of a file, in order, read
    ahead by ``readers`` threads at once.

    For a consumer that must see the bytes in order on one thread (a file's checksum: xxh3
    digests page-cache bytes ~5x faster than one thread copies them out): the copies run on
    ``readers`` threads, so the consumer, not one thread's copy, sets the pace. Memory is
    ``readers + 1`` buffers of ``chunk`` bytes. Each view is only valid until the next one is
    requested. Falls back to :func:`read_range` for one reader, a short range, or an object on
    a store (its handle reads one request at a time).

    Args:
        fd: An open file descriptor (or object handle).
        start: First byte.
        length: Number of bytes.
        readers: Threads copying ahead of the consumer.
        meter: Counts the bytes handed out, and cancels.
        path: The file's name, for the error message.
        chunk: Bytes per read (default :data:`READ_AHEAD_CHUNK`).

    Yields:
        Views of at most ``chunk`` bytes (:data:`BUFFER_SIZE` where one thread reads).

    Raises:
        CorruptCheckpointError: If the file ends before ``start + length``.
        CkptError: If reading fails.
        Cancelled: If ``meter.stop`` is set.
    """
    chunk = chunk or READ_AHEAD_CHUNK
    if readers <= 1 or length <= chunk or not isinstance(fd, int):
        yield from read_range(fd, start, length, bytearray(min(max(length, 1), BUFFER_SIZE)),
                              meter, path=path)
        return
    done_with = threading.Event()  # the consumer left: reads still queued are not wanted

    def fill(buf: bytearray, off: int, n: int) -> int:
        """Read ``n`` bytes at ``off`` into ``buf``; fewer only where the file ends."""
        if done_with.is_set() or (meter is not None and meter.stop.is_set()):
            raise Cancelled
        try:
            with stages.stage("read"):
                return access.read_full(fd, off, memoryview(buf)[:n])
        except OSError as e:
            raise _cannot_read(e, off, path) from None

    end, nxt = start + length, start
    free: deque[bytearray] = deque()
    pending: deque[tuple[Future[int], bytearray, int, int]] = deque()
    ex = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="ckpt-readahead")

    def top_up() -> None:
        """Keep ``readers`` reads in flight, in buffers the consumer does not hold."""
        nonlocal nxt
        while nxt < end and len(pending) < readers:
            # At most readers + 1 buffers: those in flight and the one the consumer holds.
            buf = free.popleft() if free else bytearray(chunk)
            n = min(chunk, end - nxt)
            pending.append((ex.submit(fill, buf, nxt, n), buf, nxt, n))
            nxt += n

    try:
        top_up()
        while pending:
            future, buf, off, n = pending.popleft()
            top_up()  # the next read starts before this one is waited for
            got = future.result()
            if got < n:
                raise _ends_early(off + got, end, path)
            if meter is not None:
                meter.add(n)
            yield memoryview(buf)[:n]
            free.append(buf)
    finally:
        done_with.set()
        for future, *_ in pending:
            future.cancel()
        ex.shutdown(wait=True, cancel_futures=True)


def run_parallel(jobs: Sequence[Callable[[Meter], T]], *, threads: int, total: int,
                 label: str, on_progress: Progress | None = None,
                 meter: Meter | None = None) -> list[T]:
    """Run ``jobs`` on a thread pool, reporting progress from the calling thread.

    Args:
        jobs: Callables taking the shared :class:`Meter` (they call ``meter.add`` as they go).
        threads: Worker threads.
        total: Bytes all jobs will process, for progress.
        label: What is being done, for progress.
        on_progress: Progress callback (about 10 calls per second, plus one at the end).
        meter: The meter to use (a fresh one by default).

    Returns:
        The jobs' results, in order.

    Raises:
        Exception: The first exception a job raised; the other jobs are cancelled.
        KeyboardInterrupt: Propagated after asking the workers to stop.
    """
    meter = meter or Meter()
    if on_progress:
        on_progress(label, 0, total)
    if threads <= 1 or len(jobs) <= 1:
        out = []
        last = time.monotonic()
        for j in jobs:
            out.append(j(meter))
            if on_progress and time.monotonic() - last > 0.1:
                on_progress(label, meter.done, total)
                last = time.monotonic()
        if on_progress:
            on_progress(label, meter.done, total)
        return out
    ex = ThreadPoolExecutor(max_workers=min(threads, len(jobs)), thread_name_prefix="ckpt-read")
    futures: list[Future[T]] = [ex.submit(j, meter) for j in jobs]
    try:
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.1, return_when=FIRST_EXCEPTION)
            if on_progress:
                on_progress(label, meter.done, total)
            for f in done:
                if f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]
    except BaseException:
        meter.stop.set()
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def run_bounded(jobs: Sequence[Callable[[Meter], T]], costs: Sequence[int], *, budget: int,
                threads: int, total: int, label: str, on_progress: Progress | None = None,
                ) -> list[T]:
    """Run ``jobs`` on a thread pool, in order, with at most ``budget`` bytes of them at once.

    Job ``i`` starts once the jobs running leave room for ``costs[i]`` (its memory); a job
    larger than the budget runs alone. So memory stays within the budget plus the largest job,
    and cores are used as far as it allows.

    Args:
        jobs: Callables taking the shared :class:`Meter` (they call ``meter.add`` as they go).
        costs: Bytes of memory each job holds while it runs.
        budget: Bytes of memory the jobs may hold together.
        threads: Worker threads.
        total: Bytes all jobs will process, for progress.
        label: What is being done, for progress.
        on_progress: Progress callback, from the calling thread.

    Returns:
        The jobs' results, in order.

    Raises:
        Exception: The exception of the first job (in order) that raised one; no job starts
            after a failure.
        KeyboardInterrupt: Propagated after asking the workers to stop.
    """
    meter = Meter()
    if threads <= 1 or len(jobs) <= 1:
        return run_parallel(jobs, threads=1, total=total, label=label, on_progress=on_progress,
                            meter=meter)
    if on_progress:
        on_progress(label, 0, total)
    results: list[T | None] = [None] * len(jobs)
    running: dict[Future[T], int] = {}
    failed: dict[int, BaseException] = {}
    held = started = 0
    ex = ThreadPoolExecutor(max_workers=min(threads, len(jobs)), thread_name_prefix="ckpt-work")
    try:
        while (started < len(jobs) and not failed) or running:
            while not failed and started < len(jobs) and len(running) < threads and (
                    not running or held + costs[started] <= budget):
                running[ex.submit(jobs[started], meter)] = started
                held += costs[started]
                started += 1
            done, _ = wait(running, timeout=0.1, return_when=FIRST_COMPLETED)
            if on_progress:
                on_progress(label, meter.done, total)
            for f in done:
                i = running.pop(f)
                held -= costs[i]
                err = f.exception()
                if err is not None:
                    failed[i] = err
                else:
                    results[i] = f.result()
        if failed:
            # The jobs before the first failure all ran: this is the error running them one
            # after another would have raised.
            raise failed[min(failed)]
        return results  # type: ignore[return-value]
    except BaseException:
        meter.stop.set()
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


class PerThread(Generic[K, C]):
    """One object per key per worker thread, made on first use and all closed together: what
    threads reading at once need of things that must not be shared between them (a tensor
    source's open files and record checks).

    Args:
        make: Makes the object of a key (called on the thread that first asks for it).
    """

    def __init__(self, make: Callable[[K], C]):
        self._make = make
        self._local = threading.local()
        self._all: list[C] = []
        self._lock = threading.Lock()

    def get(self, key: K) -> C:
        """This thread's object for ``key``."""
        mine: dict[K, C] | None = getattr(self._local, "objects", None)
        if mine is None:
            mine = self._local.objects = {}
        obj = mine.get(key)
        if obj is None:
            obj = mine[key] = self._make(key)
            with self._lock:
                self._all.append(obj)
        return obj

    def close(self) -> None:
        """Close every object made, on every thread."""
        with self._lock:
            for obj in self._all:
                obj.close()  # type: ignore[attr-defined]
            self._all.clear()


class OpenFiles:
    """Read-only descriptors of the files being checked, opened once and shared by threads.

    Use as a context manager; everything opened is closed on exit.
    """

    def __init__(self) -> None:
        self._fds: dict[Path, Handle] = {}

    def open(self, path: Path, name: str | Path | None = None) -> Handle:
        """A descriptor for ``path`` (opened on first use).

        Args:
            path: The file.
            name: How to name it in an error message (default: ``path``).

        Returns:
            The descriptor.

        Raises:
            CkptError: If it cannot be opened.
        """
        fd = self._fds.get(path)
        if fd is None:
            fd = access.open_regular(path, name)
            self._fds[path] = fd
        return fd

    def close(self) -> None:
        """Close every descriptor."""
        while self._fds:
            access.close(self._fds.popitem()[1])

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
