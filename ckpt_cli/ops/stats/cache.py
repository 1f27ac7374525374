"""The figures ``ckpt stats`` computed, kept per checkpoint in the user's cache directory.

A nightly ``ckpt stats RUN`` must read only the checkpoints saved since the last one. Figures
are kept per checkpoint, keyed by its identity: where it is, its format, and every file it is
made of, through symbolic links (the file a link names): its name, and its full stamp
(:func:`ckpt_cli.storage.file_stamp`: size, modification time, inode and inode-change time
locally, the version id or ETag on object storage). A checkpoint rewritten in place gets a new
key, even with its size and modification time put back (``cp -p``, ``touch -r``): the kernel
sets the inode-change time on every write and no user call sets it back. An entry holds each
tensor's :class:`~ckpt_cli.tensors.moments.Moments` and, per predecessor key, the squared norm
of each tensor's update since that checkpoint.

Entries live under the cache directory (``$CKPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckpt``, else
``~/.cache/ckpt``), in ``stats-v2/``, never inside the run (which may be read-only, shared or a
bucket). Each is written to a temporary name and renamed into place, under an exclusive lock
that serializes the read-merge-write of processes adding to one entry (``--part``). An entry
that cannot be read (damaged, a later version) is recomputed, never trusted.

Whoever can write an entry decides what stats reports (a checkpoint holding NaN can be made
to pass the gate), so the cache trusts only what its user alone could have written, as ssh's
``StrictModes`` trusts a key: the cache directory, ``stats-v2/`` and each subdirectory must be
real directories (not symbolic links) owned by the user or root and writable by no one else
(group or others; a POSIX ACL granting write shows in the group bits), else stats refuses the
cache with an error saying how to make it safe. Entry files must be regular, the user's or
root's and writable by no one else, else they are not trusted (recomputed and replaced). The
directories are opened one from the other (``O_NOFOLLOW``) and checked on their descriptors,
and every read and write goes through those descriptors: what the path's parents are (a
group's project directory, a sticky ``/tmp``) does not matter, a directory swapped in later is
not the one written to. An entry is also bounded by its checkpoint: at most
:func:`entry_cap` bytes, tensor names the checkpoint holds (no more of them than it has), at
most :data:`MAX_PREDECESSORS` predecessors; anything else is refused before it is parsed
further.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import stat
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ckpt_cli import storage
from ckpt_cli.errors import CkptError, DestinationError, UsageError
from ckpt_cli.model import CheckpointIndex
from ckpt_cli.storage.atomic import rename_at
from ckpt_cli.storage.sidefiles import CAPS, cap_text
from ckpt_cli.tensors.moments import HIST_BINS, Moments

VERSION = 2
"""Bumped when the figures' or the keys' meaning changes: entries of another version are not
read (2: keys bound to each file's inode and inode-change time; entries in directories only
their user can write)."""

SUBDIR = f"stats-v{VERSION}"
"""The cache directory's subdirectory holding this version's entries."""

MAX_PREDECESSORS = 64
"""The most predecessors an entry keeps updates against (one per ``--every`` step a run was
read with); the oldest go first."""

_FIGURES_BYTES = 13 * 26 + HIST_BINS * 21
"""The most bytes of JSON one tensor's figures take (:meth:`Moments.to_list`)."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def cache_root(explicit: Path | None = None) -> Path:
    """The cache directory: ``explicit``, else ``$CKPT_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/ckpt``, else ``~/.cache/ckpt``.

    Raises:
        UsageError: For a cache directory on object storage.
    """
    if explicit is not None:
        root = Path(explicit)
    elif os.environ.get("CKPT_CACHE_DIR"):
        root = Path(os.environ["CKPT_CACHE_DIR"])
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]) / "ckpt"
    else:
        root = Path.home() / ".cache" / "ckpt"
    if not storage.has_file_system(root):
        raise UsageError(f"the cache directory must be a local path, not {root}",
                         param="cache_dir")
    return root


def is_default(explicit: Path | None = None) -> bool:
    """Whether :func:`cache_root` answers the default location (no ``explicit`` directory, no
    ``$CKPT_CACHE_DIR``): ckpt's own, whose mode it may tighten."""
    return explicit is None and not os.environ.get("CKPT_CACHE_DIR")


def identity(index: CheckpointIndex) -> list[Any]:
    """What identifies a checkpoint's bytes: location, format and each file's name, the file
    it resolves to and its full stamp (:func:`ckpt_cli.storage.file_stamp`).

    Raises:
        CkptError: When a file of the checkpoint cannot be examined.
    """
    root = index.root
    where = os.path.realpath(root) if storage.has_file_system(root) else str(root)
    files = []
    for f in sorted(index.files, key=lambda f: f.path):
        p = index.path_of(f.path)
        try:
            # Through symbolic links: the bytes read are the target's (a link's own
            # time and size stay put while its target is rewritten).
            target = os.path.realpath(p) if storage.has_file_system(p) else str(p)
            stamp = storage.file_stamp(p)
        except OSError as e:
            raise CkptError(f"cannot examine: {e.strerror or e}", path=p) from None
        files.append([f.path, target, *stamp])
    return [VERSION, where, index.format, files]


def key_of(ident: list[Any]) -> str:
    """The cache key of an :func:`identity`.

    Names are hashed as the file system gives them: one that is not UTF-8 (``os.fsdecode``'s
    lone surrogates) is escaped, not refused (``ensure_ascii`` writes every character as
    itself or a distinct ``\\uXXXX``).
    """
    text = json.dumps(ident, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:40]


def entry_cap(names: Collection[str]) -> int:
    """The most bytes an entry of a checkpoint holding tensors ``names`` can take: each name
    (at most 6 bytes a byte, JSON-escaped) with its figures, and with an update against each
    of :data:`MAX_PREDECESSORS` predecessors; never over the side-file cap."""
    per = sum(6 * len(n.encode("utf-8", "surrogatepass")) + 32 for n in names)
    total = 4096 + per * (1 + MAX_PREDECESSORS) + len(names) * _FIGURES_BYTES \
        + MAX_PREDECESSORS * 64
    return min(total, CAPS["stats-cache"])


@dataclass(slots=True)
class Entry:
    """One checkpoint's cached figures.

    Attributes:
        key: Its cache key.
        tensors: Figures by tensor name.
        updates: Per predecessor key, each tensor's squared update norm (None: not finite).
        errors: Tensors whose values could not be read, with why (recomputed next time, not
            kept).
    """

    key: str
    tensors: dict[str, Moments] = field(default_factory=dict)
    updates: dict[str, dict[str, float | None]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, "key": self.key,
                "tensors": {n: m.to_list() for n, m in self.tensors.items()},
                "updates": self.updates}


def _is_key(k: Any) -> bool:
    return isinstance(k, str) and len(k) == 40 and all(c in "0123456789abcdef" for c in k)


def _bounded(data: Any, names: Collection[str]) -> str | None:
    """Why a parsed entry is out of its checkpoint's bounds (None: within them), counted
    before any figure is looked at."""
    if not isinstance(data, dict):
        return "not a JSON object"
    tensors, updates = data.get("tensors"), data.get("updates")
    if not isinstance(tensors, dict) or not isinstance(updates, dict):
        return "no tensors or updates"
    if len(tensors) > len(names):
        return f"{len(tensors):,} tensor names, more than the checkpoint's {len(names):,}"
    if len(updates) > MAX_PREDECESSORS:
        return f"updates against {len(updates):,} predecessors, over {MAX_PREDECESSORS}"
    for per in updates.values():
        if isinstance(per, dict) and len(per) > len(names):
            return f"{len(per):,} updated names, more than the checkpoint's {len(names):,}"
    return None


def _parse(key: str, data: Any, names: Collection[str]) -> Entry | None:
    if not isinstance(data, dict) or data.get("version") != VERSION or data.get("key") != key:
        return None
    if _bounded(data, names) is not None:
        return None
    entry = Entry(key)
    tensors, updates = data["tensors"], data["updates"]
    if not all(n in names for n in tensors):
        return None
    try:
        entry.tensors = {n: Moments.from_list(v) for n, v in tensors.items()}
    except (ValueError, TypeError):  # TypeError: a figure of another JSON type (a list)
        return None
    if not all(_sane(m) for m in entry.tensors.values()):
        return None
    for prev, per in updates.items():
        if not _is_key(prev) or not isinstance(per, dict):
            return None
        got: dict[str, float | None] = {}
        for n, v in per.items():
            if n not in names or (v is not None and not (
                    isinstance(v, int | float) and not isinstance(v, bool)
                    and math.isfinite(v) and v >= 0)):
                return None
            got[n] = None if v is None else float(v)
        entry.updates[prev] = got
    return entry


def _sane(m: Moments) -> bool:
    """Whether figures read back are ones a computation can give (finite moments, counts
    that add up): a damaged entry that still parses is not trusted either."""
    counted = m.count + m.nan + m.posinf + m.neginf
    return (counted == m.numel and m.zeros <= m.count and sum(m.hist_bins) <= m.count
            and all(math.isfinite(v) for v in (m.mean, m.m2, m.sumsq))
            and m.m2 >= 0 and m.sumsq >= 0
            and (not m.count or (math.isfinite(m.min) and m.min <= m.max)))


class UnsafeCacheError(UsageError):
    """A cache directory (or one of its subdirectories) someone else could write: a symbolic
    link, another user's, or writable by its group or others (``kind`` ``usage`` in
    ``--json``: the fix is the user's, as the message says)."""


def _owners() -> tuple[int, int]:
    return (os.geteuid(), 0)


def _writers(mode: int) -> str | None:
    """Who besides the owner may write (``"its group"``...), or None."""
    who = [w for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "everyone"))
           if mode & bit]
    return " and ".join(who) or None


def _refuse(st: os.stat_result, path: Path, what: str) -> None:
    """Raise :class:`UnsafeCacheError` unless ``st`` (a directory's, not followed) is one only
    its user (or root) can write."""
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise UnsafeCacheError(
            f"{what} is a symbolic link (to {target}): it could send the cache's reads and "
            f"writes anywhere; give the directory itself as cache_dir, or remove the link",
            path=path, param="cache_dir")
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(20, "Not a directory", str(path))
    if st.st_uid not in _owners():
        raise UnsafeCacheError(
            f"{what} belongs to another user (uid {st.st_uid}), who could make stats report "
            f"forged figures; use a cache_dir of your own", path=path, param="cache_dir")
    who = _writers(st.st_mode)
    if who is not None:
        raise UnsafeCacheError(
            f"{what} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}), who could "
            f"make stats report forged figures; make it one user's, mode 0700 or 0755 "
            f"(chmod go-w {path}), and run every process sharing it as that user", path=path,
            param="cache_dir")


def _open_dir(parent: int | None, name: str, path: Path, what: str, *,
              create: bool, tighten: bool = False) -> int | None:
    """A descriptor of directory ``name`` in ``parent`` (a descriptor; None: ``name`` is a
    path) once it is checked (:func:`_refuse`); None when it is missing and not ``create``d.

    Raises:
        UnsafeCacheError: It is a link, or someone else could write it.
        OSError: It cannot be made or opened (not a directory, permissions).
    """
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        if not create:
            return None
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent)
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode) or not tighten:
        _refuse(st, path, what)  # the link's message, before O_NOFOLLOW's bare ELOOP
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    try:
        now = os.fstat(fd)
        if tighten and now.st_uid == os.geteuid() and _writers(now.st_mode):
            # The default cache directory, the user's own, made group-writable by an older
            # ckpt under umask 002: its others' write bits go rather than stats refusing.
            os.fchmod(fd, stat.S_IMODE(now.st_mode) & ~0o022)
            now = os.fstat(fd)
        _refuse(now, path, what)  # what was opened: a swap since the stat shows
    except BaseException:
        os.close(fd)
        raise
    return fd


class FigureCache:
    """The cache directory's entries (``enabled=False``: a cache that keeps nothing).

    Args:
        root: The cache directory (:func:`cache_root`).
        enabled: Read and write entries.

        tighten: The cache directory is the default one (:func:`is_default`): one the user
            owns that others may write is made writable by the user alone, not refused.

    Attributes:
        rejected: Entry files found but not trusted, with why (they are recomputed).

    Raises:
        UnsafeCacheError: When the cache directory, or a subdirectory of it, is a symbolic
            link or could be written by someone else (see the module's documentation).
    """

    def __init__(self, root: Path | None, *, enabled: bool = True, tighten: bool = False):
        self.enabled = enabled and root is not None
        self.tighten = tighten
        self.root = root
        self.dir = (root / SUBDIR) if root is not None else None
        self.rejected: dict[str, str] = {}
        if self.enabled:
            self.check()

    def _path(self, key: str) -> Path:
        assert self.dir is not None
        return self.dir / key[:2] / f"{key}.json"

    def check(self) -> None:
        """Refuse a cache directory or subdirectory someone else could write, before any
        work; a directory missing, or that cannot be read, is left to the reads and writes
        (which skip it: it only costs a re-read). Nothing is created.

        Raises:
            UnsafeCacheError: As the class says.
        """
        if not self.enabled:
            return
        assert self.dir is not None
        try:
            with contextlib.ExitStack() as stack:
                fd = self._open_root(create=False)
                if fd is None:
                    return
                stack.callback(os.close, fd)
                sub = _open_dir(fd, SUBDIR, self.dir, _SUB, create=False)
                if sub is None:
                    return
                stack.callback(os.close, sub)
                for name in os.listdir(sub):
                    st = os.stat(name, dir_fd=sub, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode):
                        _refuse(st, self.dir / name, _SUB)
        except OSError:
            return

    def _open_root(self, create: bool) -> int | None:
        assert self.root is not None
        root = self.root
        if root.name in ("", ".", ".."):
            root = Path(os.path.realpath(root))  # its last component is then a name (or /)
            if not root.name:
                return _open_dir(None, str(root), self.root, _ROOT, create=False)
        # The parents are followed, links and all: they only choose the directory, which is
        # checked on its own descriptor, and everything below is reached from that.
        try:
            parent = os.open(root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                return None
            os.makedirs(root.parent, exist_ok=True)
            parent = os.open(root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return _open_dir(parent, root.name, self.root, _ROOT, create=create,
                             tighten=self.tighten)
        finally:
            os.close(parent)

    @contextlib.contextmanager
    def _dir_of(self, key: str, *, create: bool) -> Iterator[int | None]:
        """A descriptor of the directory holding ``key``'s entry (None: there is none),
        each directory on the way checked."""
        assert self.dir is not None
        with contextlib.ExitStack() as stack:
            fd = self._open_root(create)
            for name, path in ((SUBDIR, self.dir), (key[:2], self.dir / key[:2])):
                if fd is None:
                    break
                stack.callback(os.close, fd)
                fd = _open_dir(fd, name, path, _SUB, create=create)
            if fd is not None:
                stack.callback(os.close, fd)
            yield fd

    def load(self, key: str, names: Collection[str]) -> Entry:
        """The entry of ``key`` (empty when there is none, or it cannot be read or trusted).

        Args:
            key: The checkpoint's key (:func:`key_of`).
            names: The checkpoint's tensor names, which bound the entry (a set or a mapping).
        """
        if not self.enabled:
            return Entry(key)
        try:
            with self._dir_of(key, create=False) as d:
                data = self._read(d, key, names) if d is not None else None
        except (OSError, UnsafeCacheError) as e:  # changed since check(): not trusted
            self.rejected[str(self._path(key))] = str(e)
            data = None
        return _parse(key, data, names) or Entry(key)

    def _read(self, d: int, key: str, names: Collection[str]) -> Any:
        """The parsed entry of ``key`` in directory ``d``, or None (none, or not trusted)."""
        path = str(self._path(key))
        try:
            fd = os.open(f"{key}.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, dir_fd=d)
        except FileNotFoundError:
            return None
        except OSError as e:  # ELOOP: a symbolic link, never followed
            self.rejected[path] = f"cannot be opened as a file: {e.strerror or e}"
            return None
        cap = entry_cap(names)
        try:
            st = os.fstat(fd)
            why = _untrusted(st, cap)
            if why is not None:
                self.rejected[path] = why
                return None
            chunks, got = [], 0
            while got <= st.st_size:  # one byte more tells a file that grew
                chunk = os.read(fd, min(1 << 20, st.st_size + 1 - got))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
        finally:
            os.close(fd)
        if got > cap:
            self.rejected[path] = f"grew past its cap of {cap_text(cap)} while it was read"
            return None
        try:
            data = orjson.loads(b"".join(chunks))
        except orjson.JSONDecodeError:
            return None
        why = _bounded(data, names)
        if why is not None:
            self.rejected[path] = why
            return None
        return data

    def save(self, entry: Entry, names: Collection[str]) -> None:
        """Add ``entry``'s figures to what the cache holds for its key (kept figures win
        nothing: the newer replace them); a cache that cannot be written is skipped
        silently, it only costs a re-read next time.

        Args:
            entry: The figures computed.
            names: The checkpoint's tensor names (:meth:`load`'s).
        """
        if not self.enabled:
            return
        key = entry.key
        try:
            with self._dir_of(key, create=True) as d:
                assert d is not None
                lock = os.open(f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                               | os.O_CLOEXEC, 0o600, dir_fd=d)
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    have = _parse(key, self._read(d, key, names), names) or Entry(key)
                    have.tensors.update((n, m) for n, m in entry.tensors.items() if n in names)
                    for prev, per in entry.updates.items():
                        have.updates.setdefault(prev, {}).update(
                            (n, v) for n, v in per.items() if n in names)
                    while len(have.updates) > MAX_PREDECESSORS:  # the oldest go first
                        del have.updates[next(iter(have.updates))]
                    _write(d, key, orjson.dumps(have.to_json()))
                finally:
                    os.close(lock)
        except (OSError, UnsafeCacheError, DestinationError, orjson.JSONEncodeError):
            # JSONEncodeError: a tensor name that is no Unicode text (a pickle's lone
            # surrogate), which JSON cannot hold: recomputed next time.
            return


_ROOT = "the cache directory"
_SUB = "a subdirectory of the cache directory"


def _untrusted(st: os.stat_result, cap: int) -> str | None:
    """Why an entry file (its ``fstat``) is not trusted, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid not in _owners():
        return f"another user's file (uid {st.st_uid})"
    who = _writers(st.st_mode)
    if who is not None:
        return f"writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_size > cap:
        return (f"{st.st_size:,} bytes, over the {cap_text(cap)} an entry of this "
                f"checkpoint can take")
    return None


def _write(d: int, key: str, data: bytes) -> None:
    """``data`` as ``key``'s entry in directory ``d``: a temporary file only its user can
    write, renamed into place."""
    name = f"{key}.json"
    tmp = f".{name}.ckpt-tmp-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=d)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=d)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        rename_at(d, tmp, name)  # onto nothing or a regular file, never a link or FIFO
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=d)
        raise
