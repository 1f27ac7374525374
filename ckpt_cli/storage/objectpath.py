"""Keys on an object store as paths (:class:`ObjectPath`), opened objects read with ranged GETs
(:class:`ObjectFile`), and the entries a listing yields (:class:`ObjectEntry`).

Small reads go through the store's shared block cache; large ones (tensor data) straight to
concurrent ranged GETs; a sequential pass is served from chunks read ahead of it.
"""

from __future__ import annotations

import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterator
from fnmatch import fnmatchcase
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from ckpt_cli.errors import CkptError, StorageError, UsageError
from ckpt_cli.storage.config import _lock, concurrency
from ckpt_cli.storage.objects import (
    _READER_STALE,
    BLOCK,
    LARGE_READ,
    RANGE_BYTES,
    STREAM_AFTER,
    Entry,
    ObjectStore,
    Upload,
    store_for,
)

if TYPE_CHECKING:
    from concurrent.futures import Future

_classes: dict[str, type[ObjectPath]] = {}


def _path_class(scheme: str) -> type[ObjectPath]:
    with _lock:
        cls = _classes.get(scheme)
        if cls is None:
            # One subclass per scheme: pathlib builds children with type(self), so a child
            # of s3://b/run knows it lives on s3 without carrying a reference.
            cls = _classes[scheme] = type(f"ObjectPath_{scheme}", (ObjectPath,),
                                          {"scheme": scheme})
        return cls


class ObjectFile:
    """An object opened for positioned reads: ranged GETs through the store's block cache.

    Small reads (headers, central directories, pickles) fetch whole :data:`BLOCK`-aligned
    blocks, coalescing neighbouring missing blocks into one GET, and keep them in a cache the
    store shares between every open of the object (a sniff, then a parse, read the same
    header once). Reads of :data:`LARGE_READ` or more (tensor data) go straight to
    concurrent ranged GETs of :data:`RANGE_BYTES`.

    Args:
        store: The store.
        key: The object's key.
        size: Its size (from the listing).
    """

    def __init__(self, store: ObjectStore, key: str, size: int):
        self.store, self.key, self.size = store, key, size
        self._local = threading.local()  # where each thread reading it is
        self._chunks: OrderedDict[int, Future[bytes]] = OrderedDict()
        self._readers: dict[int, tuple[int, int]] = {}  # thread -> (its chunk, when)
        self._tick = 0
        self._chunk_lock = threading.Lock()

    @property
    def url(self) -> str:
        """The object's URL."""
        return self.store.url(self.key)

    def cached(self, offset: int, n: int) -> bool:
        """Whether ``[offset, offset + n)`` is already in the cache (no request needed)."""
        first, last = offset // BLOCK, max(offset, offset + n - 1) // BLOCK
        return self.store.has_blocks(self.key, range(first, last + 1))

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer only at the end of the object)."""
        end = min(self.size, offset + max(0, n))
        if end <= offset:
            return b""
        if end - offset >= LARGE_READ:
            return b"".join(self.store.fetch(self.key, _ranges(offset, end)))
        st = self._stream()
        if offset == st.next:
            st.run += end - offset
        else:
            st.run = end - offset
        st.next = end
        if st.run > STREAM_AFTER or self._chunk_at(offset):
            return self._streamed(offset, end)
        first, last = offset // BLOCK, (end - 1) // BLOCK
        data = b"".join(self.store.blocks(self.key, self.size, range(first, last + 1)))
        lo = offset - first * BLOCK
        return data[lo:lo + (end - offset)]

    def _stream(self) -> _Stream:
        st: _Stream | None = getattr(self._local, "stream", None)
        if st is None:
            st = self._local.stream = _Stream()
        return st

    def _chunk_at(self, offset: int) -> bool:
        """Whether the chunk holding ``offset`` was read ahead already (another thread's
        pass reached it): then it serves this read too, however short."""
        with self._chunk_lock:
            return offset // RANGE_BYTES in self._chunks

    def _streamed(self, offset: int, end: int) -> bytes:
        """Serve sequential readers from :data:`RANGE_BYTES` chunks fetched ahead of them.

        The chunks are shared by every thread reading the object (validate checks the
        records of one file on several threads, each reading its own stretch, and a chunk
        may straddle two stretches). Each reader's position is known; a chunk stays while a
        reader is in it or within its read-ahead window; others are kept, least recently used
        first out, up to ``2 x concurrency + readers`` chunks (a dropped chunk's fetch, if
        still running, is left to finish: another reader may wait on it). The readers share
        :func:`concurrency` chunks of read-ahead between them, so memory stays bounded
        whatever the number of threads.
        """
        me = threading.get_ident()
        first, last = offset // RANGE_BYTES, (end - 1) // RANGE_BYTES
        n_chunks = -(-self.size // RANGE_BYTES)
        with self._chunk_lock:
            self._tick += 1
            self._readers[me] = (first, self._tick)
            # A reader not heard from in a while has moved on to other work.
            for tid, (_, seen) in list(self._readers.items()):
                if self._tick - seen > _READER_STALE:
                    del self._readers[tid]
            ahead = max(1, concurrency() // len(self._readers))
            windows = [(pos, pos + max(ahead, 1)) for pos, _ in self._readers.values()]
            windows.append((first, last + 1))
            for c in range(first, min(max(last + 1, first + ahead), n_chunks)):
                if c not in self._chunks:
                    lo, hi = c * RANGE_BYTES, min(self.size, (c + 1) * RANGE_BYTES)
                    self._chunks[c] = self.store.submit(self.key, lo, hi)
            for c in range(first, last + 1):
                self._chunks.move_to_end(c)
            futures = [self._chunks[c] for c in range(first, last + 1)]
            # Past the cap, the least recently used chunks no reader's window covers go (a
            # chunk that straddles two stretches often waits there for the second reader).
            cap = 2 * concurrency() + len(self._readers)
            for c in [c for c in self._chunks if not any(lo <= c < hi for lo, hi in windows)]:
                if len(self._chunks) <= cap:
                    break
                del self._chunks[c]
        parts = [f.result() for f in futures]
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        lo = offset - first * RANGE_BYTES
        return data[lo:lo + (end - offset)]

    def fetch_ranges(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Many small ``(offset, n)`` ranges at once, concurrently, past the cache (a zip's
        scattered local headers)."""
        return self.store.fetch(self.key, [(o, min(self.size, o + n)) for o, n in ranges])

    def readinto(self, out: memoryview, offset: int) -> int:
        """Fill ``out`` from ``offset``; returns how many bytes (fewer only at the end)."""
        end = min(self.size, offset + len(out))
        if end - offset >= LARGE_READ:  # each range straight into place: no joined copy
            got = 0
            ranges = _ranges(offset, end)
            for (s, _), data in zip(ranges, self.store.fetch(self.key, ranges), strict=True):
                out[s - offset:s - offset + len(data)] = data
                got += len(data)
            return got
        data = self.pread(len(out), offset)
        out[:len(data)] = data
        return len(data)

    def close(self) -> None:
        """Drop the chunks read ahead (the block cache is the store's)."""
        with self._chunk_lock:
            self._chunks.clear()
            self._readers.clear()


def _ranges(offset: int, end: int) -> list[tuple[int, int]]:
    """``[offset, end)`` as the :data:`RANGE_BYTES` ranges of concurrent GETs."""
    return [(s, min(end, s + RANGE_BYTES)) for s in range(offset, end, RANGE_BYTES)]


class _Stream:
    """One thread's pass over an object: where it will read next, and how far it has read
    contiguously (a long run is served from chunks read ahead)."""

    def __init__(self) -> None:
        self.next, self.run = -1, 0


class ObjectPath(PurePosixPath):
    """A key or prefix on an object store, answering the part of ``Path`` readers use.

    ``str()`` gives the URL. There are no symlinks; a prefix with keys below it is a
    directory. Anything that would need a local file (``os.open``, ``os.fspath``) raises
    :class:`~ckpt_cli.errors.UsageError` naming the URL instead of touching the local disk.
    """

    scheme = ""

    @property
    def store(self) -> ObjectStore:
        """The store this path lives on."""
        return store_for(self.scheme)

    @property
    def key(self) -> str:
        """The key (``bucket/prefix/name``) as fsspec names it."""
        return PurePosixPath.__str__(self).strip("/")

    def __str__(self) -> str:
        # Held as /bucket/key: relative_to() gives relative paths, which print plainly.
        if not self.is_absolute():
            return PurePosixPath.__str__(self)
        return f"{self.scheme}://{self.key}"

    def as_posix(self) -> str:
        """The URL, or a relative path as is."""
        return str(self)

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        # pathlib compares parts only: s3://b/x would equal gs://b/x and the local /b/x.
        if not isinstance(other, ObjectPath):
            return False
        return self.scheme == other.scheme and PurePosixPath.__eq__(self, other)

    def __hash__(self) -> int:
        return hash((self.scheme, PurePosixPath.__str__(self)))

    def __fspath__(self) -> str:
        raise UsageError(f"{self}: this needs a local file (object storage is not supported "
                         "here yet)")

    def _entry(self) -> Entry | None:
        return self.store.lookup(self.key)

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        """A ``stat`` result from the listing (mode, size, modification time).

        Raises:
            FileNotFoundError: When nothing is stored at or below this key.
        """
        e = self._entry()
        if e is None:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        mode = (stat.S_IFDIR | 0o755) if e.is_dir else (stat.S_IFREG | 0o644)
        ns = int(e.mtime * 1e9)
        return os.stat_result((mode, 0, 0, 1, 0, 0, e.size, int(e.mtime), int(e.mtime),
                               int(e.mtime), e.mtime, e.mtime, e.mtime, ns, ns, ns))

    def lstat(self) -> os.stat_result:
        """The same as :meth:`stat`: objects are never links."""
        return self.stat()

    def exists(self, *, follow_symlinks: bool = True) -> bool:
        """Whether a key, or keys below this prefix, exist."""
        return self._entry() is not None

    def is_file(self) -> bool:
        """Whether this is a key holding an object."""
        e = self._entry()
        return e is not None and not e.is_dir

    def is_dir(self) -> bool:
        """Whether keys exist below this prefix."""
        e = self._entry()
        return e is not None and e.is_dir

    def is_symlink(self) -> bool:
        """Never: object stores have no links."""
        return False

    def iterdir(self) -> Iterator[ObjectPath]:
        """The keys and prefixes directly below this one."""
        if not self.is_dir():
            raise NotADirectoryError(20, "Not a directory", str(self))
        for name in self.store.children(self.key):
            yield self / name

    def glob(self, pattern: str) -> Iterator[ObjectPath]:
        """Children matching a one-level ``pattern`` (``*.safetensors``)."""
        if "/" in pattern or "**" in pattern:
            raise UsageError(f"{self}: glob {pattern!r} across levels is not supported")
        for child in self.iterdir():
            if fnmatchcase(child.name, pattern):
                yield child

    def resolve(self, strict: bool = False) -> ObjectPath:
        """Itself: keys have no links to resolve."""
        return self

    def absolute(self) -> ObjectPath:
        """Itself."""
        return self

    def readlink(self) -> ObjectPath:
        """Always fails: objects are never links."""
        raise OSError(22, "Invalid argument (not a link)", str(self))

    def open_object(self) -> ObjectFile:
        """Open the object for positioned reads.

        Raises:
            StorageError: If there is no such key.
            CkptError: If it is a prefix, not an object.
        """
        e = self._entry()
        if e is None:
            raise StorageError("no such key", path=str(self))
        if e.is_dir:
            raise CkptError("a directory (prefix), not a file", path=str(self))
        return ObjectFile(self.store, self.key, e.size)

    def read_bytes(self) -> bytes:
        """The whole object (used for small files only)."""
        f = self.open_object()
        return f.pread(f.size, 0)

    def read_text(self, encoding: str | None = None, errors: str | None = None) -> str:
        """The whole object as text."""
        return self.read_bytes().decode(encoding or "utf-8", errors or "strict")

    def write_bytes(self, data: bytes) -> int:
        """Store ``data`` as this object (one PUT: it appears whole or not at all)."""
        with Upload(self) as up:
            up.write(data)
        return len(data)

    def unlink(self, missing_ok: bool = False) -> None:
        """Delete the object.

        Raises:
            FileNotFoundError: If there is none and ``missing_ok`` is False.
        """
        if not self.is_file():
            if missing_ok:
                return
            raise FileNotFoundError(2, "No such file or directory", str(self))
        self.store.delete([self.key])

    def keys_below(self) -> list[str]:
        """Every object key at or below this prefix."""
        e = self._entry()
        if e is None:
            return []
        if not e.is_dir:
            return [self.key]
        self.store.children(self.key)
        with self.store._lock:
            return sorted(k for k, v in self.store._entries.items()
                          if not v.is_dir and k.startswith(self.key + "/"))


class ObjectEntry:
    """What :func:`scandir` yields for an object store: the ``os.DirEntry`` subset the run
    listing uses (never a link; ``path`` is the URL, which :func:`locate` turns back)."""

    __slots__ = ("_p", "name", "path")

    def __init__(self, p: ObjectPath):
        self._p, self.name, self.path = p, p.name, str(p)

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        return self._p.is_dir()

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        return self._p.is_file()

    def is_symlink(self) -> bool:
        return False

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        return self._p.stat()


class _Listing:
    def __init__(self, entries: list[ObjectEntry]):
        self._entries = entries

    def __enter__(self) -> Iterator[ObjectEntry]:
        return iter(self._entries)

    def __exit__(self, *exc: object) -> None:
        return None

