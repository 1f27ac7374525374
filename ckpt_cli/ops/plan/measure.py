"""Storage write bandwidth, measured: parallel ``pwrite`` streams into one file, then ``fsync``.

Used by ``ckpt plan --measure DIR``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli.errors import CheckpointNotFoundError, CkptError, UsageError
from ckpt_cli.progress import Progress
from ckpt_cli.storage.atomic import tmp_sibling
from ckpt_cli.units import require_positive

DEFAULT_MEASURE_SIZE = 1_000_000_000
DEFAULT_MEASURE_STREAMS = 4
MAX_MEASURE_STREAMS = 256

_CHUNK = 4 << 20
_MIN_STREAM_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class Measurement:
    """A measured write bandwidth.

    Attributes:
        path: The directory written to.
        bytes: Bytes written.
        streams: Parallel writers.
        seconds: From the first write to the end of fsync.
    """

    path: Path
    bytes: int
    streams: int
    seconds: float

    @property
    def bytes_per_second(self) -> float:
        """The measured bandwidth."""
        return self.bytes / self.seconds

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"path": str(self.path), "bytes": self.bytes, "streams": self.streams,
                "seconds": self.seconds}


def measure_bandwidth(directory: str | Path, size: int = DEFAULT_MEASURE_SIZE,
                      streams: int = DEFAULT_MEASURE_STREAMS,
                      progress: Progress | None = None) -> Measurement:
    """Measure write bandwidth: write ``size`` bytes to one file in parallel streams, fsync.

    The test file is a hidden ``.ckpt-plan-measure.ckpt-tmp-*`` sibling (which ``validate`` and
    ``prune`` report if a SIGKILL leaves it) and is removed on every exit, Ctrl-C included. Its
    bytes are random so that compressing storage cannot flatter the result.

    Args:
        directory: A directory on the storage to measure.
        size: Bytes to write.
        streams: Threads writing disjoint ranges of the file at once (fewer when ``size`` is
            too small to give each 64 KiB).
        progress: Called as ``progress("measuring", bytes_written, size)`` before, while
            and after writing (:class:`ckpt_cli.progress.Progress`).

    Returns:
        The :class:`Measurement`.

    Raises:
        CkptError: ``directory`` is missing, not a directory or not writable, or a write fails.
        UsageError: Non-positive size or streams, too many streams, not enough free space.
    """
    require_positive(size, "measure_size", param=True)
    require_positive(streams, "measure_streams", param=True)
    if streams > MAX_MEASURE_STREAMS:
        raise UsageError(f"measure_streams must be at most {MAX_MEASURE_STREAMS}",
                         param="measure_streams")
    where = Path(directory)
    if not where.is_dir():
        if where.exists():
            raise CkptError("not a directory", path=where)
        raise CheckpointNotFoundError("no such directory", path=where)
    free = shutil.disk_usage(where).free
    if size > free:
        raise UsageError(f"measure_size is {size:,} bytes but only {free:,} are free",
                         path=where, param="measure_size")
    streams = max(1, min(streams, size // _MIN_STREAM_BYTES))
    target = tmp_sibling(where / "ckpt-plan-measure")
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise CkptError(f"cannot create a test file: {e.strerror}", path=where) from None
    stop = threading.Event()
    done = [0] * streams
    failed: list[OSError] = []
    data = os.urandom(min(_CHUNK, size))
    bounds = [size * i // streams for i in range(streams + 1)]

    def write_range(i: int) -> None:
        pos, end = bounds[i], bounds[i + 1]
        view = memoryview(data)
        try:
            while pos < end and not stop.is_set():
                n = os.pwrite(fd, view[:min(len(data), end - pos)], pos)
                if n <= 0:
                    raise OSError(0, "wrote nothing")
                pos += n
                done[i] += n
        except OSError as e:
            failed.append(e)
            stop.set()

    threads = [threading.Thread(target=write_range, args=(i,), daemon=True)
               for i in range(streams)]
    try:
        if progress is not None:
            progress("measuring", 0, size)
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.05)
                if progress is not None:
                    progress("measuring", sum(done), size)
        if failed:
            raise CkptError(f"writing the test file failed: {failed[0].strerror}", path=where)
        try:
            os.fsync(fd)
        except OSError as e:
            raise CkptError(f"fsync of the test file failed: {e.strerror}", path=where) from None
        seconds = time.perf_counter() - start
        if progress is not None:
            progress("measuring", sum(done), size)
    finally:
        # Also on Ctrl-C: stop the writers before the file they write to goes away.
        stop.set()
        for t in threads:
            if t.ident is not None:
                t.join()
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
    return Measurement(path=where, bytes=size, streams=streams, seconds=max(seconds, 1e-9))
