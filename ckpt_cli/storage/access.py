"""The one interface above storage: where a path's bytes live (:func:`locate`), what the
place can do (the capability predicates commands ask instead of "is it remote?"), and how it is
opened, read and listed, the same way for a local file and an object.

Readers take a :class:`~pathlib.Path` and read through the handle :func:`open_regular`
returns. For a local path that is a file descriptor read with ``os.pread``; for a URL
(``s3://bucket/run/step_9000``, ``gs://``, ``az://``, any object store fsspec knows) the path
is an :class:`~ckpt_cli.storage.objectpath.ObjectPath` and the handle an
:class:`~ckpt_cli.storage.objectpath.ObjectFile`, which reads with ranged GETs through a small
block cache. Local paths never import fsspec.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

from ckpt_cli.errors import UsageError
from ckpt_cli.storage.config import _URL, OBJECT_STORES, is_url, redact
from ckpt_cli.storage.local import open_local
from ckpt_cli.storage.objectpath import ObjectEntry, ObjectFile, ObjectPath, _Listing, _path_class
from ckpt_cli.storage.objects import Upload


def is_remote(path: object) -> bool:
    """Whether ``path`` names an object on a store (an :class:`ObjectPath`)."""
    return isinstance(path, ObjectPath)


def locate(text: str | os.PathLike[str]) -> Path:
    """A local :class:`Path` for a path or ``file://`` URL, an :class:`ObjectPath` for others.

    The store itself is opened at the first read, with the options :func:`configure` set.

    Args:
        text: A command-line argument.

    Returns:
        Something path-like every reader takes (typed ``Path``: an :class:`ObjectPath`
        answers the subset of ``Path`` readers use).
    """
    if isinstance(text, ObjectPath):
        return cast(Path, text)
    if not isinstance(text, str) or not is_url(text):
        return Path(text)
    m = _URL.match(text)
    assert m is not None
    scheme = m.group(1).lower()
    rest = text[m.end():]
    if scheme == "file":
        return Path("/" + rest.lstrip("/")) if rest.startswith("/") else Path(rest)
    if scheme not in OBJECT_STORES:
        raise UsageError(f"{scheme}:// is not an object store ckpt reads; URLs may be "
                         f"{', '.join(s + '://' for s in sorted(OBJECT_STORES))}")
    if "@" in rest.split("/", 1)[0]:
        raise UsageError(f"{redact(text)}: credentials in a URL are not accepted; use the "
                         "standard environment variables or storage_options",
                         param="storage_options")
    rest = rest.strip("/")
    if not rest:
        raise UsageError(f"{text}: name a bucket (and a key or prefix)")
    return cast(Path, _path_class(scheme)("/" + rest))


Handle = int | ObjectFile
"""What :func:`open_regular` returns: a descriptor or an object."""


class Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes at ``start`` of an open handle.

    Args:
        fd: An open descriptor or object handle.
        start: First byte of the view.
        length: Length of the view.
        owns: Whether closing the view closes the handle.
    """

    def __init__(self, fd: Handle, start: int, length: int, *, owns: bool = False):
        super().__init__()
        self.fd, self.start, self.length, self.pos, self.owns = fd, start, length, 0, owns

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        if n == 0:
            return 0
        data = pread(self.fd, n, self.start + self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def close(self) -> None:
        if self.owns and not self.closed:
            close(self.fd)
        super().close()


def open_regular(path: Path, name: str | Path | None = None) -> Handle:
    """Open a regular file for reading, refusing FIFOs, sockets and devices without blocking.

    An object on a store (:class:`~ckpt_cli.storage.objectpath.ObjectPath`) opens as an
    :class:`~ckpt_cli.storage.objectpath.ObjectFile`; read either kind with :func:`pread`.

    The check is made before opening (a device is never opened) and again on the descriptor
    (the path may have been replaced in between); ``O_NONBLOCK`` keeps the open of a FIFO
    that appeared in that gap from waiting for a writer.

    Args:
        path: The file.
        name: How to name it in an error message (default: ``path``).

    Returns:
        A blocking, read-only descriptor (or an object handle) the caller closes with
        :func:`close`.

    Raises:
        CkptError: If it is missing or cannot be opened.
        CorruptCheckpointError: If it is not a regular file.
    """
    where = name or path
    where = name or path
    if isinstance(path, ObjectPath):
        return path.open_object()
    return open_local(path, where)


def pread(h: Handle, n: int, offset: int) -> bytes:
    """``os.pread`` for either kind of handle."""
    if isinstance(h, int):
        return os.pread(h, n, offset)
    return h.pread(n, offset)


def readinto(h: Handle, out: memoryview, offset: int) -> int:
    """One positioned read into ``out`` (``os.preadv``); may return fewer bytes locally."""
    if isinstance(h, int):
        return os.preadv(h, [out], offset)
    return h.readinto(out, offset)


_READ_CHUNK = 1 << 30  # Linux caps one read at ~2 GiB


def read_full(h: Handle, offset: int, out: memoryview) -> int:
    """Fill ``out`` with bytes of an open file from ``offset``, with positioned reads.

    Args:
        h: An open file descriptor or object handle (positioned reads need no seek, so it
            may be shared).
        offset: Absolute byte offset.
        out: A writable byte buffer.

    Returns:
        How many bytes were read: fewer than ``len(out)`` only if the file ended first.

    Raises:
        OSError: If reading fails.
    """
    if not isinstance(h, int):
        return h.readinto(out, offset)
    done, total = 0, len(out)
    while done < total:
        n = os.preadv(h, [out[done:done + _READ_CHUNK]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def size_of(h: Handle) -> int:
    """The size of the file or object behind a handle."""
    if isinstance(h, int):
        return os.fstat(h).st_size
    return h.size


def close(h: Handle) -> None:
    """Close a handle."""
    if isinstance(h, int):
        os.close(h)
    else:
        h.close()


def scandir(path: str | Path) -> Any:
    """``os.scandir`` for a local path or URL, an object store's prefix included.

    Returns:
        A context manager yielding entries with ``name``, ``path``, ``is_dir()``,
        ``is_file()``, ``is_symlink()`` and ``stat()``.

    Raises:
        OSError: If it cannot be listed (``NotADirectoryError`` for an object or nothing).
    """
    p = path if isinstance(path, ObjectPath) else locate(path) if is_url(path) else None
    if p is None:
        return os.scandir(path)
    obj = cast(ObjectPath, p)
    return _Listing([ObjectEntry(c) for c in obj.iterdir()])


def lexists(path: str | Path) -> bool:
    """``os.path.lexists`` for a local path or an object."""
    if isinstance(path, ObjectPath):
        return path.exists()
    return os.path.lexists(path)


def lstat(path: str | Path) -> os.stat_result:
    """``os.lstat`` for a local path or an object."""
    if isinstance(path, ObjectPath):
        return path.stat()
    return os.lstat(path)


Stamp = tuple[int, int, int, int]
"""A file as it is now: ``(size, mtime_ns, inode, change)``; see :func:`file_stamp`."""


def is_stamp(v: Any) -> bool:
    """Whether ``v`` is a file stamp as JSON holds it: 3 integers (size, mtime_ns, inode: ledgers
    written before the inode-change time was recorded) or 4."""
    return isinstance(v, list | tuple) and len(v) in (3, 4) and all(map(is_int64, v))


def is_int64(x: Any) -> bool:
    """Whether ``x`` is an integer (not a bool) that fits 64 signed bits."""
    return isinstance(x, int) and not isinstance(x, bool) and -(2**63) <= x < 2**63


def file_stamp(path: str | Path) -> Stamp:
    """What tells a file (or object) rewritten: ``(size, mtime_ns, inode, change)``.

    Locally ``change`` is the inode-change time (``st_ctime_ns``), which the kernel sets on
    every write, rename or ``touch`` and no user call can set back: a byte flipped in place
    with its modification time restored (``touch -r``) still shows. On object storage the
    inode is 0 and ``change`` is a 63-bit digest of the object's version id or ETag (which
    every PUT changes); 0 where the listing gives neither. Symbolic links are followed.

    Raises:
        OSError: It cannot be stat-ed (gone, permissions).
    """
    if isinstance(path, ObjectPath):
        import hashlib  # lazy: object stamps only; local reads skip hashlib

        e = path._entry()
        if e is None:
            raise FileNotFoundError(2, "No such file or directory", str(path))
        tag = int.from_bytes(hashlib.blake2b(e.tag.encode(), digest_size=8).digest(),
                             "big") >> 1 if e.tag else 0
        return (e.size, int(e.mtime * 1e9), 0, tag)
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def walk(path: Path, onerror: Callable[[OSError], None] | None = None
         ) -> Iterator[tuple[Path, list[str], list[str]]]:
    """``os.walk`` (top-down, ``dirnames`` prunable) for a local directory or a prefix.

    Yields:
        ``(directory, subdirectory names, file names)``, the directory as a path.
    """
    if not isinstance(path, ObjectPath):
        for d, dirs, files in os.walk(path, onerror=onerror):
            yield Path(d), dirs, files
        return
    stack: list[ObjectPath] = [path]
    while stack:
        d = stack.pop()
        kids = list(d.iterdir())
        dirs = [k.name for k in kids if k.is_dir()]
        files = [k.name for k in kids if not k.is_dir()]
        yield cast(Path, d), dirs, files
        stack.extend(d / n for n in reversed(dirs))


def tree_paths(path: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Every object below a prefix with its ``stat`` (from the listing), for tree totals."""
    obj = cast(ObjectPath, path)
    for k in obj.keys_below():
        child = type(obj)("/" + k)
        yield str(child), child.stat()


# What a place can do. Commands ask these, never "is it remote?": each names the capability a
# branch depends on, so a new backend answers them and the commands need no change.


def can_rename_atomically(path: object) -> bool:
    """Whether output at ``path`` is committed by a temporary sibling renamed into place.

    True on a local file system (temp + fsync + rename). False on an object store, which has
    no rename: an object appears when its upload completes, and a set of objects is
    committed by writing its marker (the index) last.
    """
    return not isinstance(path, ObjectPath)


def has_file_system(path: object) -> bool:
    """Whether ``path`` lives on a file system the operating system's own calls reach.

    Descriptors and ``O_NOFOLLOW``/``O_APPEND`` opens, inodes, symbolic links, mount points,
    fsync and file events exist there; a key on an object store has none of them.
    """
    return not isinstance(path, ObjectPath)


def reads_are_cheap(path: object) -> bool:
    """Whether reading a small file again costs no more than a local read (False over a
    network, where every read of an object is a request)."""
    return not isinstance(path, ObjectPath)


def has_multipart_uploads(path: object) -> bool:
    """Whether writes at or below ``path`` can leave unfinished multipart uploads behind
    (an object store: invisible to listings, billed until aborted)."""
    return isinstance(path, ObjectPath)


def names_local_path(text: str) -> bool:
    """Whether a command-line argument names a local path rather than a URL of any scheme
    (it holds no ``://``), before anything is located."""
    return "://" not in text


def key_url(path: Path, key: str) -> str:
    """The URL of ``key`` (``bucket/prefix/name``) on the store ``path`` lives on, for
    messages and documents; ``key`` unchanged for a local path. Opens no store."""
    if isinstance(path, ObjectPath):
        return f"{path.scheme}://{key}"
    return key


# Operations whose local and object forms differ only in how the bytes get there.


def create(path: Path, *, expected: int, buffering: int = -1) -> Any:
    """Open a new file or object for writing, as a context manager with ``write``/``tell``.

    An object is an upload (visible only once the block leaves normally; its writes are never
    short); a local file is ``open(path, "wb", buffering=buffering)``.

    Args:
        path: The file or object to create.
        expected: About how many bytes will be written (sizes an upload's parts).
        buffering: ``open``'s buffering for a local file (0: raw writes).

    Returns:
        The writable handle.
    """
    if isinstance(path, ObjectPath):
        return Upload(path, expected=expected)
    return open(path, "wb", buffering=buffering)


def write_whole(path: Path, data: bytes) -> None:
    """Write ``data`` as ``path`` so that it appears whole or not at all, replacing what is
    there: locally through a temporary sibling, fsynced and renamed into place; on a store
    with one PUT.

    Raises:
        OSError: If the local write fails.
    """
    if isinstance(path, ObjectPath):
        path.write_bytes(data)
        return
    from ckpt_cli.storage.atomic import atomic_file  # lazy: keeps writes off inspect's start-up

    with atomic_file(path, overwrite=True) as tmp:
        tmp.write_bytes(data)


def remove(path: Path) -> None:
    """Delete the file or object ``path`` durably: locally unlink it and fsync its directory;
    on a store one DELETE.

    Raises:
        OSError: If it cannot be deleted (``FileNotFoundError`` when it is missing).
    """
    if isinstance(path, ObjectPath):
        path.unlink()
        return
    from ckpt_cli.storage.atomic import fsync_path  # lazy: keeps writes off inspect's start-up

    os.unlink(path)
    fsync_path(path.parent)
