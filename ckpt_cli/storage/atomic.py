"""Atomic output: build under a temporary sibling name, fsync, then rename into place.

A crash, an exception or Ctrl-C leaves the destination as it was; the temporary sibling (named
``.<name>.ckpt-tmp-<uuid>``, which no reader mistakes for a checkpoint) is removed when Python
gets the chance, and reported by ``validate``/``prune`` when it did not (SIGKILL, power loss).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from ckpt_cli.errors import CkptError, DestinationExistsError, UsageError

TMP_MARK = ".ckpt-tmp-"


def _host_tag() -> str:
    import hashlib
    import socket

    return hashlib.blake2s(socket.gethostname().encode(), digest_size=4).hexdigest()


def tmp_sibling(dest: Path) -> Path:
    """A fresh temporary name next to ``dest``: ``.<name>.ckpt-tmp-<host>-<pid>-<random>``,
    so that a sweeper on the same host can tell that its writer is gone
    (:func:`temp_writer_gone`)."""
    return dest.parent / (f".{dest.name}{TMP_MARK}{_host_tag()}-{os.getpid()}-"
                          f"{uuid.uuid4().hex[:8]}")


def temp_writer_gone(name: str) -> bool:
    """Whether a temporary name made by :func:`tmp_sibling` names a writer of this host that
    is no longer running (False when it is running, of another host, or not told)."""
    import re

    m = re.search(r"\.ckpt-tmp-([0-9a-f]{8})-(\d+)-[0-9a-f]{8}\Z", name)
    if m is None or m.group(1) != _host_tag():
        return False
    pid = int(m.group(2))
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, someone else's
    return False


def fsync_path(path: Path) -> None:
    """fsync a file or directory (directories: so renames and new entries are durable)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (files first, then their directories)."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for f in files:
            p = Path(dirpath) / f
            if not p.is_symlink():
                fsync_path(p)
        fsync_path(Path(dirpath))


def umask() -> int:
    """The process's umask, read without changing it where the kernel shows it."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    # Elsewhere the only way to read it is to set it; put it straight back.
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def honour_umask(path: Path) -> None:
    """Give a file a library wrote the mode ``open()`` would have (``0o666`` minus the umask).

    safetensors' ``save_file`` writes through a private temporary file and keeps its 0600
    mode; every other file ckpt writes gets the usual permissions, so these should too.

    Args:
        path: A regular file ckpt created.
    """
    os.chmod(path, 0o666 & ~umask())


def _is_empty_dir(p: Path) -> bool:
    return p.is_dir() and not p.is_symlink() and not any(p.iterdir())


def _check_dest(dest: Path, overwrite: bool) -> None:
    if (dest.exists() or dest.is_symlink()) and not _is_empty_dir(dest):
        if not overwrite:
            raise DestinationExistsError("already exists", path=dest,
                                         hint="pass overwrite (or force) to replace it",
                                         param=("overwrite", "force"))
    if not dest.parent.is_dir():
        raise CkptError("parent directory does not exist", path=dest.parent)


@contextlib.contextmanager
def atomic_dir(dest: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Build a directory atomically.

    Yields a temporary sibling directory; when the block finishes it is fsynced and renamed to
    ``dest`` (an existing ``dest`` is moved aside first and removed after). Any exception,
    including ``KeyboardInterrupt``, removes the temporary directory and leaves ``dest`` as it
    was.

    Args:
        dest: The directory to create.
        overwrite: Replace an existing ``dest``.

    Yields:
        The temporary directory to write into.

    Raises:
        DestinationExistsError: ``dest`` exists and ``overwrite`` is False.
    """
    dest = Path(dest)
    _check_dest(dest, overwrite)
    tmp = tmp_sibling(dest)
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        replace_dir(tmp, dest, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(tmp: Path, dest: Path, overwrite: bool) -> None:
    """Rename the finished directory ``tmp`` to ``dest``; an existing ``dest`` (only with
    ``overwrite``, or when empty) is moved aside first and removed after."""
    old: Path | None = None
    if dest.exists() or dest.is_symlink():
        if not overwrite and not _is_empty_dir(dest):  # appeared while we were writing
            raise DestinationExistsError("appeared while writing; not replaced", path=dest)
        if dest.is_dir() and not dest.is_symlink():
            old = dest.parent / f".{dest.name}.ckpt-old-{uuid.uuid4().hex[:12]}"
            os.rename(dest, old)
        else:
            dest.unlink()
    os.rename(tmp, dest)
    fsync_path(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(dest: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Write one file atomically: temporary sibling, fsync, ``os.replace``.

    Args:
        dest: The file to create.
        overwrite: Replace an existing ``dest``.

    Yields:
        The temporary path to write to.

    Raises:
        DestinationExistsError: ``dest`` exists and ``overwrite`` is False.
    """
    dest = Path(dest)
    _check_dest(dest, overwrite)
    if dest.is_dir():
        raise DestinationExistsError("is a directory", path=dest)
    tmp = tmp_sibling(dest)
    try:
        yield tmp
        fsync_path(tmp)
        if not overwrite and dest.exists():
            raise DestinationExistsError("appeared while writing; not replaced", path=dest)
        os.replace(tmp, dest)
        fsync_path(dest.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def check_not_input(out: Path, source: Path, inputs: Iterable[Path] = ()) -> None:
    """Refuse an output that would overwrite, contain or sit inside what is being read.

    Args:
        out: The output file or directory.
        source: The path the user gave as input.
        inputs: Every file the input consists of (an index's shards live beside it, not
            below it).

    Raises:
        UsageError: If writing ``out`` (or replacing it) could touch an input.
    """
    o = out.resolve()
    s = source.resolve()
    if s == o or s.is_relative_to(o) or (source.is_dir() and o.is_relative_to(s)):
        raise UsageError(f"the output {out} would overwrite or sit inside the input {source}")
    for f in inputs:
        r = f.resolve()
        if r == o or r.is_relative_to(o):
            raise UsageError(f"the output {out} would overwrite the input file {f}")


RENAME_EXCHANGE = 2
"""``renameat2`` flag: swap two paths atomically (Linux 3.15+, most local file systems)."""


def exchange(a: Path, b: Path) -> None:
    """Swap two paths (files or directories) in one atomic step: ``renameat2(RENAME_EXCHANGE)``.

    A directory cannot be renamed over a non-empty one; swapping instead means no moment exists
    at which either name is missing, so a crash leaves one of the two complete at each name.

    Args:
        a: One path.
        b: The other, in the same file system.

    Raises:
        OSError: The kernel, C library or file system cannot swap (``ENOSYS``, ``EINVAL``,
            ``EOPNOTSUPP``), or either path is missing.
    """
    import ctypes
    import errno

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        raise OSError(errno.ENOSYS, "renameat2 is not available") from None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))
