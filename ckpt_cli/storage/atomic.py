"""The one door out: every file and directory ckpt writes goes through this module.

Outputs (``-o``, ``--junit``, ``--plot``), manifests, receipts, caches and the thinning's
in-place rewrites are built under a temporary sibling name, fsynced, then renamed into place:
a crash, an exception or Ctrl-C leaves the destination as it was; the temporary sibling (named
``.<name>.ckpt-tmp-<...>``, which no reader mistakes for a checkpoint) is removed when Python
gets the chance, and reported by ``validate``/``prune`` when it did not (SIGKILL, power loss).

One rule for the destination (docs/safety.md, "Where ckpt writes"), checked by
:func:`check_destination` before any work and again at the rename: a rename lands only on an
absent path or a regular file (a directory output: an absent path, an empty directory or one
the caller may replace). A symbolic link, FIFO, device or socket there is refused, never
written through nor replaced, ``overwrite`` or not. Missing parents of a user's output are
created (``parents=True``) and removed again when the write fails. Errors name the
destination, never the temporary.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import shutil
import socket
import stat
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

from ckpt_cli.errors import CkptError, DestinationError, DestinationExistsError, UsageError
from ckpt_cli.storage.objectpath import ObjectPath

TMP_MARK = ".ckpt-tmp-"
_NAME_MAX = 255  # bytes in one file name (Linux, macOS)


def _host_tag() -> str:
    return hashlib.blake2s(socket.gethostname().encode(), digest_size=4).hexdigest()


def tmp_sibling(dest: Path) -> Path:
    """A fresh temporary name next to ``dest``: ``.<name>.ckpt-tmp-<host>-<pid>-<random>``,
    so that a sweeper on the same host can tell that its writer is gone
    (:func:`temp_writer_gone`). A name too long to take the mark is cut short (the mark and
    the tag stay whole): a 250-byte output name must not fail on its temporary's."""
    tail = f"{TMP_MARK}{_host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    raw = os.fsencode(dest.name)[:_NAME_MAX - 1 - len(tail)]
    return dest.parent / f".{os.fsdecode(raw)}{tail}"


def temp_writer_gone(name: str) -> bool:
    """Whether a temporary name made by :func:`tmp_sibling` names a writer of this host that
    is no longer running (False when it is running, of another host, or not told)."""
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


_SPECIAL = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
            (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
            (stat.S_ISSOCK, "a socket"))


def special_kind(mode: int) -> str | None:
    """``a symbolic link``, ``a FIFO (named pipe)``, ``a character device``... for the
    ``lstat`` mode of what ckpt never writes through nor replaces; None for a regular file
    or a directory."""
    return next((what for test, what in _SPECIAL if test(mode)), None)


def _refuse_special(dest: Path, mode: int) -> None:
    what = special_kind(mode)
    if what is not None:
        raise DestinationError(
            f"is {what}, not a regular file: ckpt never writes through or over one", path=dest,
            hint="name a regular file or a new path" + (
                " (the link's target itself, if that is what you mean)"
                if what == "a symbolic link" else ""))


def _lstat(dest: Path) -> os.stat_result | None:
    try:
        return os.lstat(dest)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        bad = next((p for p in reversed(dest.parents) if p.exists() and not p.is_dir()), None)
        raise DestinationError(f"cannot be written: {bad or dest.parent} is not a directory",
                               path=dest) from None
    except OSError as e:  # ENAMETOOLONG, ELOOP, EACCES on the way
        raise DestinationError(f"cannot be written: {e.strerror or e}", path=dest) from None


def _is_local(dest: object) -> bool:
    return not isinstance(dest, ObjectPath)


def check_destination(dest: Path, *, kind: Literal["file", "dir"] = "file",
                      overwrite: bool = False, parents: bool = False) -> None:
    """Refuse, before any work, a destination this module would not write.

    Local paths only (object storage keeps its sinks' own checks): ``dest`` must be absent
    or a regular file (``kind="dir"``: absent, an empty directory, or with ``overwrite`` a
    directory); a symbolic link, FIFO, device or socket is refused even with ``overwrite``.
    Its parent must be a directory that can be written (tried by creating and removing a
    temporary there), or, with ``parents``, the nearest existing ancestor must.

    Args:
        dest: The output file or directory.
        kind: What will be written there.
        overwrite: An existing ``dest`` may be replaced.
        parents: Missing parent directories will be created.

    Raises:
        DestinationExistsError: ``dest`` exists and ``overwrite`` is False, or is a directory
            where a file goes (a regular file where a directory goes).
        DestinationError: ``dest`` is special, or its directory cannot be written.
    """
    if not _is_local(dest):
        return
    dest = Path(dest)
    st = _lstat(dest)
    if st is not None:
        _refuse_special(dest, st.st_mode)
        is_dir = stat.S_ISDIR(st.st_mode)
        if kind == "file" and is_dir:
            raise DestinationExistsError("is a directory; not replacing it", path=dest)
        if kind == "dir" and not is_dir and overwrite:
            raise DestinationExistsError("is a file, and this output is a directory; not "
                                         "replacing it", path=dest,
                                         hint="remove it yourself, or give a new name")
        if not overwrite and not (is_dir and _is_empty_dir(dest)):
            raise DestinationExistsError("already exists", path=dest,
                                         hint="pass overwrite to replace it",
                                         param="overwrite")
    _check_parent(dest, parents)


def _check_parent(dest: Path, parents: bool) -> None:
    where = dest.parent
    while True:
        st = _lstat(where)
        if st is not None and where.is_dir():  # (a link to a directory is one)
            break
        if st is not None:
            raise DestinationError(f"cannot be written: {where} is not a directory", path=dest)
        if not parents:
            raise DestinationError("cannot be written: its directory does not exist",
                                   path=dest, hint="create the directory first")
        if where.parent == where:
            break
        where = where.parent
    probe = tmp_sibling(dest if where == dest.parent else where / dest.name)
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except OSError as e:  # read-only, no permission, /proc, /sys
        raise DestinationError(f"cannot be written: {e.strerror or e}", path=dest) from None
    with contextlib.suppress(OSError):
        os.unlink(probe)


def make_parents(dest: Path) -> list[Path]:
    """Create ``dest``'s missing parent directories; returns those created, outermost first
    (:func:`remove_made` takes them away again when the write fails)."""
    missing: list[Path] = []
    where = dest.parent
    while _lstat(where) is None and where.parent != where:
        missing.append(where)
        where = where.parent
    made: list[Path] = []
    try:
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
    except FileExistsError:
        pass  # made meanwhile by someone else: theirs
    except OSError as e:
        remove_made(made)
        raise DestinationError(f"cannot create its directory: {e.strerror or e}",
                               path=dest) from None
    return made


def remove_made(made: list[Path]) -> None:
    """Remove the directories :func:`make_parents` created, innermost first, where empty."""
    for d in reversed(made):
        with contextlib.suppress(OSError):
            d.rmdir()


def _named_as_dest(e: BaseException, tmp: Path, dest: Path) -> BaseException:
    """An ``OSError`` about the temporary (or a file in it) as a :class:`CkptError` naming
    what it stands for in the destination; anything else unchanged."""
    if not isinstance(e, OSError) or isinstance(e, CkptError):
        return e
    for name in (e.filename, e.filename2):
        if isinstance(name, str) and (name == str(tmp) or name.startswith(f"{tmp}/")):
            where = str(dest) + name[len(str(tmp)):]
            return CkptError(f"cannot write: {e.strerror or e}", path=where)
    return e


def rename_onto(tmp: Path, dest: Path, *, overwrite: bool = True) -> None:
    """Rename the finished file ``tmp`` to ``dest`` in one ``rename``, which lands only on an
    absent name or a regular file (checked just before; never a link, FIFO or device).

    The in-place rewrites (thinning, receipts, staged shards) keep their crash-safety: at
    every moment ``dest`` is the old file or the new one, whole.

    Raises:
        DestinationError: ``dest`` is special or a directory.
        DestinationExistsError: ``dest`` appeared and ``overwrite`` is False.
    """
    st = _lstat(dest)
    if st is not None:
        _refuse_special(dest, st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            raise DestinationExistsError("is a directory; not replacing it", path=dest)
        if not overwrite:
            raise DestinationExistsError("appeared while writing; not replaced", path=dest)
    os.replace(tmp, dest)


def rename_at(dir_fd: int, tmp: str, name: str) -> None:
    """:func:`rename_onto` within the directory held open as ``dir_fd`` (the stats cache):
    ``name`` must be absent or a regular file.

    Raises:
        DestinationError: ``name`` is anything else.
    """
    try:
        mode = os.lstat(name, dir_fd=dir_fd).st_mode
    except FileNotFoundError:
        mode = stat.S_IFREG
    if not stat.S_ISREG(mode):
        raise DestinationError(f"is {special_kind(mode) or 'a directory'}; not replaced",
                               path=name)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def open_append(path: Path) -> int:
    """Open the file ``path`` to append to it (the run ledger), created when missing: a
    descriptor, never through a symbolic link nor onto a FIFO or device.

    Raises:
        DestinationError: ``path`` is not a regular file.
        OSError: It cannot be opened.
    """
    st = _lstat(path)
    if st is not None:
        _refuse_special(path, st.st_mode)
    flags = (os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
             | getattr(os, "O_CLOEXEC", 0))
    fd = os.open(path, flags, 0o644)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise DestinationError(f"is {special_kind(mode) or 'a directory'}, not a regular file",
                               path=path)
    return fd


@contextlib.contextmanager
def atomic_dir(dest: Path, *, overwrite: bool = False, parents: bool = False
               ) -> Iterator[Path]:
    """Build a directory atomically.

    Yields a temporary sibling directory; when the block finishes it is fsynced and renamed to
    ``dest`` (an existing ``dest`` is moved aside first and removed after). Any exception,
    including ``KeyboardInterrupt``, removes the temporary directory (and the parents it
    created) and leaves ``dest`` as it was; an ``OSError`` about a file in the temporary
    directory comes out as a :class:`CkptError` naming its place in ``dest``.

    Args:
        dest: The directory to create.
        overwrite: Replace an existing ``dest``.
        parents: Create missing parent directories.

    Yields:
        The temporary directory to write into.

    Raises:
        DestinationExistsError: ``dest`` exists and ``overwrite`` is False.
        DestinationError: ``dest`` is a link, FIFO, device or socket, or cannot be written.
    """
    dest = Path(dest)
    check_destination(dest, kind="dir", overwrite=overwrite, parents=parents)
    made = make_parents(dest) if parents else []
    tmp = tmp_sibling(dest)
    try:
        tmp.mkdir()
        yield tmp
        fsync_tree(tmp)
        replace_dir(tmp, dest, overwrite)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_made(made)
        named = _named_as_dest(e, tmp, dest)
        if named is e:
            raise
        raise named from None


def replace_dir(tmp: Path, dest: Path, overwrite: bool) -> None:
    """Rename the finished directory ``tmp`` to ``dest``; an existing ``dest`` (only with
    ``overwrite``, or when empty) is moved aside first and removed after. A link, FIFO,
    device or socket at ``dest`` is refused, never replaced."""
    old: Path | None = None
    st = _lstat(dest)
    if st is not None:
        _refuse_special(dest, st.st_mode)
        if not overwrite and not _is_empty_dir(dest):  # appeared while we were writing
            raise DestinationExistsError("appeared while writing; not replaced", path=dest)
        if stat.S_ISDIR(st.st_mode):
            old = dest.parent / f".{dest.name}.ckpt-old-{uuid.uuid4().hex[:12]}"
            os.rename(dest, old)
        else:
            dest.unlink()
    os.rename(tmp, dest)
    fsync_path(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(dest: Path, *, overwrite: bool = False, parents: bool = False
                ) -> Iterator[Path]:
    """Write one file atomically: temporary sibling, fsync, rename (:func:`rename_onto`).

    Args:
        dest: The file to create.
        overwrite: Replace an existing regular file ``dest``.
        parents: Create missing parent directories (removed again if the write fails).

    Yields:
        The temporary path to write to.

    Raises:
        DestinationExistsError: ``dest`` exists and ``overwrite`` is False, or is a directory.
        DestinationError: ``dest`` is a link, FIFO, device or socket, or cannot be written.
        CkptError: Writing failed (named as ``dest``, not the temporary).
    """
    dest = Path(dest)
    check_destination(dest, kind="file", overwrite=overwrite, parents=parents)
    made = make_parents(dest) if parents else []
    tmp = tmp_sibling(dest)
    try:
        yield tmp
        fsync_path(tmp)
        rename_onto(tmp, dest, overwrite=overwrite)
        fsync_path(dest.parent)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        remove_made(made)
        named = _named_as_dest(e, tmp, dest)
        if named is e:
            raise
        raise named from None


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
        DestinationError: Either is a link, FIFO, device or socket (never swapped).
    """
    for p in (a, b):
        st = _lstat(Path(p))
        if st is not None:
            _refuse_special(Path(p), st.st_mode)

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
