"""The write pipeline's stages around the writer: read and cast ahead within a memory budget
(:class:`Prefetch`), each tensor's bytes checked against its dtype and shape
(:func:`tensor_bytes`), and write-behind syncing (:class:`Flusher`, :class:`Syncer`).

Reading and casting run on a background thread up to
:data:`ckpt_cli.storage.reads.MEMORY_BUDGET` bytes (or ``--max-memory``) ahead of the writer; a
tensor larger than a piece (:data:`ckpt_cli.storage.reads.PIECE_BYTES`) can be produced piece
by piece, so memory stays within the budget whatever one tensor's size.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ckpt_cli import dtypes, storage
from ckpt_cli.errors import OutOfMemoryError
from ckpt_cli.storage import stages
from ckpt_cli.storage.reads import MEMORY_BUDGET, PIECE_BYTES

if TYPE_CHECKING:
    from ckpt_cli.writers.plan import OutTensor


class Syncer:
    """The background ``fdatasync`` of one write's files, one at a time.

    The atomic rename needs everything durable (fsync) first; syncing as we go overlaps that
    disk work with reading, casting and writing what comes next instead of paying it all at
    the end: every few hundred MB of a file (:class:`Flusher`), and each file once its bytes
    are all written, while the next one is written. At most one sync runs at a time, so dirty
    data stays within about two intervals; :meth:`wait` collects the last one and raises the
    first error any of them met (the write then fails: nothing unsynced becomes an output).
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: OSError | None = None

    def start(self, fd: int) -> None:
        """Wait for the sync in progress (raising its error), then sync the file open as
        ``fd`` in the background, through a duplicate descriptor that the sync closes (so
        the file itself may close meanwhile, and its number be reused, safely)."""
        self.wait()
        dup = os.dup(fd)
        try:
            self._thread = threading.Thread(target=self._fdatasync, args=(dup,),
                                            name="ckpt-fdatasync", daemon=True)
            self._thread.start()
        except BaseException:
            self._thread = None
            os.close(dup)
            raise

    def _fdatasync(self, fd: int) -> None:
        try:
            with stages.stage("fsync"):
                os.fdatasync(fd)
        except OSError as e:  # raised in the writer's thread by wait()
            self._error = e
        finally:
            os.close(fd)

    def wait(self) -> None:
        """Wait for the sync in progress; raise the error of any sync, if one failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err


class Flusher:
    """Syncs a file being written every :attr:`EVERY` bytes, and its rest once it is complete,
    in the background (:class:`Syncer`). A handle without a descriptor (an upload to a store)
    is left alone: an object is durable when its upload completes.

    Args:
        f: The open handle.
        syncer: The write's syncer (shared by its files).
    """

    EVERY = 256 << 20

    def __init__(self, f: Any, syncer: Syncer):
        self.f, self.syncer, self.pending = f, syncer, 0
        self._local = not isinstance(f, storage.Upload)

    def wrote(self, n: int) -> None:
        self.pending += n
        if self.pending >= self.EVERY:
            self.finish()

    def finish(self) -> None:
        """Sync what was written so far in the background; called by :meth:`wrote` every
        :attr:`EVERY` bytes and once the file's bytes are all written (while its handle
        closes and the next file is written)."""
        if self._local:
            self.f.flush()
            self.syncer.start(self.f.fileno())
        self.pending = 0


def tensor_bytes(source: Prefetch, i: int, t: OutTensor) -> Iterator[memoryview]:
    """The bytes of tensor ``i``, piece by piece, checked against its dtype and shape."""
    if t.pieces is None:
        for arr in source.pieces(i):
            yield _bytes_of(arr, t)
        return
    try:
        want: np.dtype[Any] = dtypes.numpy_dtype(t.dtype)
    except KeyError:  # packed sub-byte values (F4) travel as raw bytes
        want = np.dtype(np.uint8)
    total = 0
    for arr in source.pieces(i):
        if arr.dtype != want:
            raise ValueError(f"{t.name}: produced a piece of {arr.dtype}, expected {t.dtype}")
        data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data
        total += len(data)
        if total > t.nbytes:
            break
        yield data
    if total != t.nbytes:
        raise ValueError(f"{t.name}: produced {total:,} bytes, expected {t.nbytes:,}")


def out_of_memory(name: str, nbytes: int) -> OutOfMemoryError:
    """The error for an allocation that failed while tensor ``name`` was read or cast.

    Args:
        name: The tensor.
        nbytes: Its size in bytes.

    Returns:
        A one-line error naming the tensor and the memory budget.
    """
    return OutOfMemoryError(
        f"out of memory on tensor {name!r} ({_mib(nbytes)}): ckpt streams tensors in pieces "
        f"of {_mib(PIECE_BYTES)} within a budget of about {_mib(MEMORY_BUDGET)} (strided "
        "views, DCP chunks split along other dimensions and ZeRO partitions are assembled "
        "whole); nothing written",
        hint="free memory or raise the limit (ulimit -v)")


def _mib(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n:,} bytes"


def _bytes_of(arr: np.ndarray, t: OutTensor) -> memoryview:
    """The tensor's bytes as a flat memoryview, after checking dtype and shape."""
    # Sub-byte types (F4) travel as packed bytes whose shape differs from the logical one.
    if arr.nbytes != t.nbytes or (tuple(arr.shape) != t.shape and t.dtype != "F4"):
        raise ValueError(f"{t.name}: produced {arr.dtype}{list(arr.shape)}, expected "
                         f"{t.dtype}{list(t.shape)}")
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return flat.data

_END = object()  # after a tensor's last piece


class Prefetch:
    """Produces tensors (or pieces of them) in order on a background thread, up to a budget
    of bytes ahead of the writer.

    Reading and casting (numpy, torch and file reads release the GIL; casts use every core)
    run ahead of writing as far as ``budget`` allows: the pieces produced and not yet written
    (the one being written included) stay within it, so the writer has data when the disk is
    ready and the reader keeps going while the writer waits on a flush. A piece larger than
    the budget is produced alone. A tensor without :attr:`OutTensor.pieces` is one piece.

    Args:
        tensors: What to produce, in order.
        budget: Bytes of produced, unwritten pieces (default
            :data:`ckpt_cli.storage.reads.MEMORY_BUDGET`).
    """

    def __init__(self, tensors: Sequence[OutTensor], budget: int | None = None):
        self._tensors = tensors
        self._budget = budget or MEMORY_BUDGET
        self._q: queue.Queue[tuple[int, Any, BaseException | None]] = queue.Queue()
        self._room = threading.Condition()
        self._held = 0  # bytes produced and not yet released by the writer
        self.peak = 0  # the most bytes held at once (for tests)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckpt-prefetch", daemon=True)
        self._thread.start()

    def _wait_for_room(self, need: int) -> bool:
        """Block until ``need`` more bytes fit the budget (or nothing is held)."""
        with self._room:
            while self._held and self._held + need > self._budget:
                if self._stop.is_set():
                    return False
                self._room.wait(0.1)
        return not self._stop.is_set()

    def _hold(self, n: int) -> None:
        with self._room:
            self._held += n
            self.peak = max(self.peak, self._held)

    def _release(self, n: int) -> None:
        with self._room:
            self._held -= n
            self._room.notify_all()

    def _put(self, item: tuple[int, Any, BaseException | None]) -> bool:
        if self._stop.is_set():
            return False
        self._q.put(item)
        return True

    def _run(self) -> None:
        last = 0  # size of the previous piece: what the next one will likely need
        for i, t in enumerate(self._tensors):
            if self._stop.is_set():
                return
            try:
                pieces = t.pieces() if t.pieces is not None else iter((t.load(),))
                try:
                    while self._wait_for_room(last or min(t.nbytes, PIECE_BYTES)):
                        with stages.stage("read+cast"):
                            arr: Any = next(pieces, _END)
                        if arr is _END:
                            break
                        last = int(arr.nbytes)
                        self._hold(last)
                        if not self._put((i, arr, None)):
                            return
                        del arr
                    else:
                        return  # stopped
                finally:
                    close = getattr(pieces, "close", None)
                    if close is not None:
                        close()  # a generator's mappings and files go now, not at GC
                if not self._put((i, _END, None)):
                    return
            except MemoryError:
                # Not a bug: the tensor does not fit the memory there is. Say which one.
                self._put((i, None, out_of_memory(t.name, t.nbytes)))
                return
            except BaseException as e:  # handed to the writer thread, which re-raises it
                self._put((i, None, e))
                return

    def pieces(self, i: int) -> Iterator[np.ndarray]:
        """The values of tensor ``i``, piece by piece (tensors must be asked for in order).

        A piece counts against the budget until the next one is asked for."""
        while True:
            try:
                j, arr, err = self._q.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive() and self._q.empty():
                    raise RuntimeError("tensor producer stopped early") from None
                continue
            if err is not None:
                raise err
            if j != i:
                raise RuntimeError(f"tensor {j} produced while {i} was expected")
            if arr is _END:
                return
            n = int(arr.nbytes)
            try:
                yield arr
            finally:
                del arr
                self._release(n)

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the producer and drop what it prepared."""
        self._stop.set()
        with self._room:
            self._room.notify_all()
        with contextlib.suppress(queue.Empty):
            while True:
                self._q.get_nowait()
        self._thread.join(timeout=5)
