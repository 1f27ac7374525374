"""Reading tensor values, one tensor at a time, as numpy arrays (no torch).

Every reader describes where a tensor's bytes live (:class:`~ckpt_cli.model.TensorInfo`): one
byte range, a strided view of a storage, or DCP chunks that are embedded torch zips. This module
turns that into a numpy array with the right dtype (ml_dtypes for BF16 and FP8) and shape,
reading with positioned reads into a fresh buffer, so memory holds one tensor at a time.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import replace
from types import TracebackType
from typing import Any

import numpy as np

from ckpt_cli import dtypes, storage
from ckpt_cli.errors import CorruptCheckpointError, UnsupportedError
from ckpt_cli.formats import dcp
from ckpt_cli.model import CheckpointIndex, Chunk, TensorInfo
from ckpt_cli.storage import Handle, open_regular, read_full, reads
from ckpt_cli.storage.reads import crc32_parallel, crc32_range
from ckpt_cli.tensors import cast

_MAX_OPEN = 64
_MAP_MIN = 1 << 20  # below this a copy is as cheap as setting up a mapping


class TensorSource:
    """Reads tensors of one checkpoint; keeps a small cache of open files.

    Use as a context manager, or call :meth:`close`.

    Args:
        index: The checkpoint's index.
    """

    def __init__(self, index: CheckpointIndex):
        self.index = index
        self._fds: OrderedDict[str, Handle] = OrderedDict()
        # Zip records whose CRC-32 was computed: (file, start) -> the CRC their bytes give.
        self._crc_got: dict[tuple[str, int], int] = {}

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close every open file."""
        while self._fds:
            _, fd = self._fds.popitem()
            storage.close(fd)

    def _fd(self, rel: str) -> Handle:
        fd = self._fds.get(rel)
        if fd is not None:
            self._fds.move_to_end(rel)
            return fd
        path = self.index.path_of(rel)
        fd = open_regular(path)
        self._fds[rel] = fd
        if len(self._fds) > _MAX_OPEN:
            _, old = self._fds.popitem(last=False)
            storage.close(old)
        return fd

    def fd_of(self, rel: str) -> Handle:
        """File ``rel`` (relative to the index's base), open for positioned reads (kept open
        by this source: not to be closed by the caller)."""
        return self._fd(rel)

    def file_size(self, rel: str) -> int:
        """Size of file ``rel`` (relative to the index's base), opening it if need be."""
        return storage.size_of(self._fd(rel))

    def read_rows(self, t: TensorInfo, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of ``t`` (its first dimension; ``0 <= start <= stop <= rows``),
        reading only their bytes when ``t`` is one contiguous range of a numpy dtype, else
        read whole and sliced.

        Raises:
            CorruptCheckpointError: The file ends before the rows do.
        """
        row = math.prod(t.shape[1:])
        try:
            dt = dtypes.numpy_dtype(t.dtype)
        except KeyError:  # sub-byte types: packed bytes, no rows to address
            dt = None
        if (dt is None or t.chunks or t.stride is not None or t.file is None
                or t.offset is None or row == 0):
            return np.ascontiguousarray(self.read(t)[start:stop])
        out = np.empty((stop - start, *t.shape[1:]), dtype=dt)
        if out.nbytes:
            first = t.offset + start * row * dt.itemsize
            end = first + out.nbytes
            size = self.file_size(t.file)
            if end > size:
                raise CorruptCheckpointError(
                    f"tensor {t.name!r} needs bytes up to {end:,} but the file has {size:,}",
                    path=self.index.path_of(t.file))
            self.read_into(t.file, first, out.reshape(-1).view(np.uint8).data)
        return out

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes of file ``rel`` from ``offset``; a short read is an error.

        Args:
            rel: File path relative to the index's base.
            offset: Absolute byte offset.
            out: A writable byte buffer.

        Raises:
            CorruptCheckpointError: If the file ends first.
        """
        done, total = read_full(self._fd(rel), offset, out), len(out)
        if done < total:
            raise CorruptCheckpointError(
                f"file ends at byte {offset + done:,}; {total - done:,} more bytes expected "
                "(truncated)", path=self.index.path_of(rel))

    def read(self, t: TensorInfo, *, mapped: bool = False) -> np.ndarray:
        """Read one tensor's values.

        Args:
            t: A tensor of this source's index.
            mapped: For a tensor stored as one contiguous byte range, return a read-only view
                of the file mapped into memory instead of a copy (saves a copy of every byte
                when the caller only reads, e.g. to cast). The mapping lives as long as the
                array. Other tensors are read as usual.

        Returns:
            A C-contiguous numpy array of the tensor's shape. BF16/FP8 use ml_dtypes dtypes;
            sub-byte types (F4, F6) come back as raw ``uint8`` packed bytes.

        Raises:
            CorruptCheckpointError: Truncated files or chunks that do not decode.
            UnsupportedError: Compressed DCP chunks, tensors without data.
        """
        if t.chunks:
            return self._read_chunks(t)
        if t.file is None or t.offset is None:
            raise UnsupportedError(f"tensor {t.name!r} ({t.kind}) has no readable data",
                                   path=self.index.root)
        first, end = self._extent(t)
        size = storage.size_of(self._fd(t.file))
        if end > size or first < 0:
            # Checked before allocating: a damaged header can claim exabytes.
            raise CorruptCheckpointError(
                f"tensor {t.name!r} needs bytes up to {end:,} but the file has {size:,}",
                path=self.index.path_of(t.file))
        try:
            dt = dtypes.numpy_dtype(t.dtype)
        except KeyError:
            if t.stride is not None:
                raise UnsupportedError(f"tensor {t.name!r} is a strided view of packed "
                                       f"{t.dtype} values, which ckpt cannot read",
                                       path=self.index.root) from None
            buf = np.empty(t.nbytes, dtype=np.uint8)
            self.read_into(t.file, t.offset, buf.data)
            self._check_crc(t, buf)
            return buf
        if t.stride is None:
            if mapped and t.nbytes >= _MAP_MIN:
                arr = self._map(t, dt)
            else:
                arr = np.empty(t.shape, dtype=dt)
                if arr.nbytes:
                    self.read_into(t.file, t.offset, arr.reshape(-1).view(np.uint8).data)
            self._check_crc(t, arr)
            return arr
        return self._read_strided(t, dt)

    def iter_pieces(self, t: TensorInfo, *, piece_bytes: int | None = None,
                    mapped: bool = False) -> Iterator[np.ndarray]:
        """Yield one tensor's values in row-major order, as flat arrays of bounded size.

        A tensor stored as one contiguous byte range, or as DCP chunks split along the first
        dimension only (FSDP's ``Shard(0)``), is read ``piece_bytes`` at a time, so memory holds
        a piece, not the tensor; its CRC-32 (torch zips) is computed over the pieces as they are
        read and checked before the last one is handed out. Other layouts (strided views,
        chunks split along other dimensions, packed sub-byte dtypes) are read whole into one
        buffer and yielded in slices of it, so a cast of the pieces makes no second copy of the
        whole tensor.

        Args:
            t: A tensor of this source's index.
            piece_bytes: Largest piece (default :data:`ckpt_cli.storage.reads.PIECE_BYTES`).
            mapped: Pieces may be read-only views of the file mapped into memory (see
                :meth:`read`); each mapping covers one piece.

        Yields:
            1-D arrays of the tensor's dtype, together holding every element once, in order.

        Raises:
            CorruptCheckpointError: Truncated files, chunks that do not decode, CRC mismatch.
            UnsupportedError: Compressed DCP chunks, tensors without data.
        """
        piece = piece_bytes or reads.PIECE_BYTES
        if t.chunks:
            subs = dcp.row_chunks(t, functools.partial(self._locate, t))
            if subs is None:
                yield from split_pieces(self.read(t), piece)
                return
            for sub in subs:
                yield from self._contiguous_pieces(sub, piece, mapped)
            return
        if t.stride is None and t.file is not None and t.offset is not None:
            yield from self._contiguous_pieces(t, piece, mapped)
            return
        yield from split_pieces(self.read(t, mapped=mapped), piece)

    def _contiguous_pieces(self, t: TensorInfo, piece: int,
                           mapped: bool) -> Iterator[np.ndarray]:
        """Pieces of a tensor stored as one contiguous byte range (see :meth:`iter_pieces`)."""
        assert t.file is not None and t.offset is not None
        if t.nbytes <= piece or t.dtype not in dtypes.DTYPES or (
                dtypes.DTYPES[t.dtype].numpy_name is None):
            yield self.read(t, mapped=mapped).reshape(-1)
            return
        dt = dtypes.numpy_dtype(t.dtype)
        size = storage.size_of(self._fd(t.file))
        if t.offset < 0 or t.offset + t.nbytes > size:
            raise CorruptCheckpointError(
                f"tensor {t.name!r} needs bytes up to {t.offset + t.nbytes:,} but the file has "
                f"{size:,}", path=self.index.path_of(t.file))
        s = t.storage
        # The running CRC covers the zip entry when the tensor is exactly its bytes; otherwise
        # (a view of part of a storage) _check_crc reads the entry itself, in pieces.
        whole_entry = (s is not None and s.crc is not None and t.offset == s.start
                       and t.nbytes == s.crc_len and (s.file, s.start) not in self._crc_got)
        running = 0
        step = max(1, piece // dt.itemsize)
        numel = t.nbytes // dt.itemsize
        for start in range(0, numel, step):
            count = min(step, numel - start)
            off = t.offset + start * dt.itemsize
            if mapped and count * dt.itemsize >= _MAP_MIN:
                arr = self._map_range(t.file, off, count, dt)
            else:
                arr = np.empty(count, dtype=dt)
                self.read_into(t.file, off, arr.view(np.uint8).data)
            if whole_entry:
                running = _crc32(arr.view(np.uint8).data, running)
            if start + count >= numel:  # checked before the last piece leaves
                if whole_entry:
                    assert s is not None
                    self._crc_got[(s.file, s.start or 0)] = running
                self._check_crc(t)
            yield arr

    def _check_crc(self, t: TensorInfo, arr: np.ndarray | None = None) -> None:
        """Compare the bytes of the zip entry that holds ``t`` with the entry's CRC-32.

        Writing output from damaged bytes would launder the damage into a file that then
        validates clean; torch zips record a CRC-32 per storage. When ``arr`` holds exactly
        the entry's bytes (the usual case: a tensor owns its storage), checking costs one fast
        pass (ISA-L) over bytes that were read anyway; for a view of part of a storage, or a
        strided one, the whole entry is read once more, in pieces. Each entry is checked once
        per source. A zip written with checksums off
        (``torch.serialization.set_crc32_options(False)``) has none to compare with
        (``crc`` None).
        """
        s = t.storage
        if s is None or s.crc is None or s.start is None or not s.crc_len:
            return
        key = (s.file, s.start)
        got = self._crc_got.get(key)  # many views of one storage: read it once
        if got is None:
            if arr is not None and t.offset == s.start and arr.nbytes == s.crc_len:
                got = _crc32(arr.reshape(-1).view(np.uint8).data)
            else:
                got = self._crc_of(s.file, s.start, s.crc_len)
            self._crc_got[key] = got
        if got != s.crc:
            raise CorruptCheckpointError(
                f"tensor {t.name!r}: its bytes fail the CRC-32 check (recorded {s.crc:#010x}, "
                f"read {got:#010x}): the file is damaged", path=self.index.path_of(s.file))

    def _crc_of(self, rel: str, offset: int, length: int) -> int:
        """CRC-32 of a byte range of file ``rel``, read in bounded pieces."""
        value = crc32_range(self._fd(rel), offset, length)
        if value is None:
            raise CorruptCheckpointError(f"file ends before byte {offset + length:,} "
                                         "(truncated)", path=self.index.path_of(rel))
        return value

    def _map(self, t: TensorInfo, dt: np.dtype[Any]) -> np.ndarray:
        assert t.file is not None and t.offset is not None
        return self._map_range(t.file, t.offset, t.nbytes // dt.itemsize, dt).reshape(t.shape)

    def _map_range(self, rel: str, offset: int, count: int, dt: np.dtype[Any]) -> np.ndarray:
        """``count`` values of file ``rel`` from ``offset``, as a read-only mapped array."""
        fd = self._fd(rel)
        if not isinstance(fd, int):  # an object on a store: read, there is nothing to map
            arr = np.empty(count, dtype=dt)
            self.read_into(rel, offset, arr.view(np.uint8).data)
            return arr
        # The callers checked that the range lies within the file: touching a mapping past
        # the end of a file is a SIGBUS, not an exception.
        end = offset + count * dt.itemsize
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        m = mmap.mmap(fd, end - start, offset=start, prot=mmap.PROT_READ)
        with contextlib.suppress(AttributeError, OSError):
            m.madvise(mmap.MADV_SEQUENTIAL)
        return np.frombuffer(m, dtype=dt, count=count, offset=offset - start)

    @staticmethod
    def _extent(t: TensorInfo) -> tuple[int, int]:
        """The byte range ``[first, end)`` of the file that a tensor's values occupy.

        A strided view can cover less than its logical size (an expanded tensor, stride 0:
        HF's ``position_ids``) or more (a transposed slice of a larger storage).
        """
        assert t.offset is not None
        if t.stride is None:
            return t.offset, t.offset + t.nbytes
        if any(d == 0 for d in t.shape):
            return t.offset, t.offset
        item = dtypes.DTYPES[t.dtype].itemsize
        pairs = list(zip(t.shape, t.stride, strict=False))
        lo = sum((d - 1) * s for d, s in pairs if s < 0)
        hi = sum((d - 1) * s for d, s in pairs if s > 0)
        return t.offset + lo * item, t.offset + (hi + 1) * item

    def _read_strided(self, t: TensorInfo, dt: np.dtype[Any]) -> np.ndarray:
        assert t.stride is not None and t.file is not None and t.offset is not None
        if any(d == 0 for d in t.shape):
            return np.empty(t.shape, dtype=dt)
        item = dt.itemsize
        first, end = self._extent(t)
        lo = (first - t.offset) // item
        raw = np.empty(end - first, dtype=np.uint8)
        self.read_into(t.file, first, raw.data)
        self._check_crc(replace(t, offset=first), raw)
        base = raw.view(dt)
        view = np.lib.stride_tricks.as_strided(
            base[-lo:], shape=t.shape, strides=tuple(s * item for s in t.stride), writeable=False)
        return np.ascontiguousarray(view)

    def _read_chunks(self, t: TensorInfo) -> np.ndarray:
        return dcp.assemble_chunks(t, functools.partial(self._locate, t), self._read_run,
                                   self.read)

    def _read_run(self, t: TensorInfo, dest: np.ndarray) -> None:
        """Fill the flat byte array ``dest`` with the bytes of contiguous tensor ``t``."""
        assert t.file is not None and t.offset is not None
        self.read_into(t.file, t.offset, dest.data)
        self._check_crc(t, dest)

    def _locate(self, t: TensorInfo, c: Chunk) -> TensorInfo:
        return dcp.locate_chunk(self.index, self._fd, t, c)

    def read_chunk(self, t: TensorInfo, c: Chunk) -> np.ndarray:
        """Read one DCP chunk of tensor ``t`` (an embedded torch.save zip).

        Args:
            t: The tensor.
            c: One of its chunks.

        Returns:
            The chunk's values, shaped ``c.sizes``.

        Raises:
            CorruptCheckpointError: If the embedded zip does not describe a matching tensor.
            UnsupportedError: For compressed chunks.
        """
        return self.read(self._locate(t, c))


def _crc32(data: memoryview, value: int = 0) -> int:
    """CRC-32 of a piece being read, on the cast threads at once (it is a stage of its own
    beside the cast: on many cores one thread's checksum would pace the reading); on one
    thread when called from a cast thread (which must not wait on its own pool)."""
    if threading.current_thread().name.startswith(cast.CAST_THREAD):
        return crc32_parallel(data, value, None, 1)
    return crc32_parallel(data, value, cast.cast_pool(), cast.cast_threads())


def split_pieces(arr: np.ndarray, piece_bytes: int | None = None) -> Iterator[np.ndarray]:
    """Flat views of ``arr`` of at most ``piece_bytes`` each (no copies), in order.

    Args:
        arr: A C-contiguous array.
        piece_bytes: Largest piece (default :data:`ckpt_cli.storage.reads.PIECE_BYTES`).

    Yields:
        1-D views that together cover ``arr`` (one empty view for an empty array).
    """
    flat = arr.reshape(-1)
    step = max(1, (piece_bytes or reads.PIECE_BYTES) // max(flat.itemsize, 1))
    if flat.size <= step:
        yield flat
        return
    for i in range(0, flat.size, step):
        yield flat[i:i + step]


def iter_tensors(index: CheckpointIndex, names: Iterable[str] | None = None,
                 ) -> Iterator[tuple[TensorInfo, np.ndarray]]:
    """Yield ``(info, values)`` for the tensors of ``index``, one at a time.

    Args:
        index: The checkpoint's index.
        names: Which tensors (default: all, in index order).

    Yields:
        Each tensor's info and a fresh numpy array of its values.
    """
    with TensorSource(index) as src:
        for name in (names if names is not None else list(index.tensors)):
            t = index.tensors[name]
            yield t, src.read(t)
