"""What a run directory holds besides its checkpoints' data, and how recent a checkpoint is:
the one walk of a checkpoint's tree (:func:`tree_scan`: bytes, files, newest change, its own
files' times), writers' lock files (:func:`writer_lock`) and the temporaries a killed writer
left (:func:`stale_temporaries`). :mod:`ckpt_cli.runs` re-exports them.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path
from typing import NamedTuple

from ckpt_cli import storage
from ckpt_cli.formats.names import MANIFEST_NAME, TRASH_PREFIX, is_own_temporary

LOCK_SUFFIX = ".lock"

class TreeScan(NamedTuple):
    """What one walk of a file or directory tree found (symlinks never followed).

    Attributes:
        bytes: Total size of the files (a symlink counts its own size, not its target's).
        files: Number of non-directories.
        mtime: Newest modification time, the top directory included.
        changed: Newest of every modification and inode-change time. A copy that preserves
            modification times (``cp -p``, ``rsync -a``) still sets inode-change times, which
            nothing can set back, so a tree being copied in looks recent here.
        exists: Whether the path existed.
    """

    bytes: int
    files: int
    mtime: float
    changed: float
    exists: bool = True


def tree_scan(path: Path, *, own_times: bool = False) -> TreeScan:
    """Walk a file or directory tree once (symlinks are counted, never followed).

    Args:
        path: A file or directory.
        own_times: Take ``mtime`` and ``changed`` from the checkpoint's own files only: not
            from what ckpt writes at a directory's top (its manifest, its temporaries), nor
            from the top directory itself, whose times that write moves (a checkpoint verified
            long after its save is not a recent one). Their bytes and files still count
            (the contents of such a temporary directory are not walked).

    Returns:
        The :class:`TreeScan`; ``exists`` is False (and everything 0) when ``path`` is missing.
    """
    try:
        st = storage.lstat(path)
    except OSError:
        return TreeScan(0, 0, 0.0, 0.0, exists=False)
    changed = max(st.st_mtime, st.st_ctime)
    if not stat.S_ISDIR(st.st_mode):
        return TreeScan(st.st_size, 1, st.st_mtime, changed)
    if not storage.has_file_system(path):
        total, count, newest = 0, 0, st.st_mtime
        top = f"{str(path).rstrip('/')}/"
        for name, est in storage.tree_paths(path):  # objects only: no directories
            total += est.st_size
            count += 1
            if not (own_times and _ckpt_sidecar(name.removeprefix(top))):
                newest = max(newest, est.st_mtime)
        return TreeScan(total, count, newest, max(changed, newest))
    # Plain comparisons instead of max() and st_mode instead of is_dir(): this loop runs once
    # per file of every checkpoint when listing thousands of them.
    total, count, newest = 0, 0, st.st_mtime
    top_times = (st.st_mtime, changed)
    if own_times:
        newest = changed = 0.0
    stack = [os.fspath(path)]
    top_dir = stack[0]
    while stack:
        d = stack.pop()
        try:
            with storage.scandir(d) as it:
                for e in it:
                    try:
                        est = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if own_times and d == top_dir and _ckpt_sidecar(e.name):
                        total += est.st_size
                        count += not stat.S_ISDIR(est.st_mode)
                        continue
                    m, c = est.st_mtime, est.st_ctime
                    if m > newest:
                        newest = m
                    if m > changed:
                        changed = m
                    if c > changed:
                        changed = c
                    if stat.S_ISDIR(est.st_mode):
                        stack.append(e.path)
                    else:
                        total += est.st_size
                        count += 1
        except OSError:
            continue
    if own_times and not newest and not changed:  # nothing of its own yet: the directory's
        newest, changed = top_times
    return TreeScan(total, count, newest, changed)


def _ckpt_sidecar(name: str) -> bool:
    """Whether a name at a checkpoint directory's top is what ckpt itself writes there: its
    manifest, or one of its temporaries."""
    return name == MANIFEST_NAME or is_own_temporary(name)


def tree_stats(path: Path) -> tuple[int, int, float]:
    """``(bytes, files, newest mtime)`` of a file or a directory tree (symlinks not followed)."""
    scan = tree_scan(path)
    return scan.bytes, scan.files, scan.mtime


STALE_TEMP_AGE = 3600.0
"""Seconds a temporary whose writer cannot be told (another host's, or a name without one)
must be unchanged before the sweeper removes it."""


def stale_temporaries(root: Path, now: float) -> list[Path]:
    """ckpt's own temporaries a killed write left in a run, at its top and at the top of each
    directory there, a checkpoint's (``formats.names.is_own_temporary``: ``.ckpt-tmp-``,
    ``.ckpt-old-`` and trash names): the one list the sweeper (prune, watch's passes) removes.

    Trash (made only by a prune, under its lock) is stale whenever the caller holds that lock;
    a temporary whose writer of this host is gone (``storage.atomic.temp_writer_gone``) is
    stale at once; any other once nothing in it changed for :data:`STALE_TEMP_AGE` seconds.

    Args:
        root: The run directory (local), its prune lock held by the caller.
        now: The current time.

    Returns:
        The paths to remove.
    """
    from ckpt_cli.storage.atomic import temp_writer_gone  # lazy: keeps writes off start-up

    out: list[Path] = []
    try:
        with storage.scandir(root) as it:
            dirs = [root, *sorted(Path(e.path) for e in it if not e.name.startswith(".")
                                  and e.is_dir(follow_symlinks=False))]
    except OSError:
        return out
    for d in dirs:
        try:
            with storage.scandir(d) as it:
                names = sorted(e.name for e in it if is_own_temporary(e.name))
        except OSError:
            continue
        for name in names:
            path = Path(d) / name
            if (name.startswith(TRASH_PREFIX) or temp_writer_gone(name)
                    or now - tree_scan(path).changed >= STALE_TEMP_AGE):
                out.append(path)
    return out


PRUNE_LOCK = ".ckpt-prune.lock"
"""The file ``ckpt prune`` locks (``flock``) in a run directory while it works."""


def _stale_prune_lock(path: Path) -> bool:
    """Whether ``path`` is a ``.ckpt-prune.lock`` nobody holds: then it is removed (a prune
    once aimed inside a checkpoint left it; it is no writer's). Held, or not ours to tell: kept.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a prune holds it
        try:
            os.unlink(path)
        except OSError:
            return True  # unheld all the same: not a writer's lock
        return True
    finally:
        os.close(fd)


def writer_lock(path: Path) -> str | None:
    """A lock file a writer may hold on a checkpoint, if there is one.

    Looks for ``<name>.lock`` and ``.<name>.lock`` beside it and for ``*.lock`` files (``.lock``
    too) at the top of a checkpoint directory. Presence is enough: some writers lock by creating
    the file rather than with ``flock``, and a stale lock is cheaper than a lost checkpoint.
    The one exception is prune's own ``.ckpt-prune.lock`` inside a checkpoint (left by a prune
    aimed one level too deep): when no process holds its ``flock`` it is removed, not obeyed.

    Args:
        path: The checkpoint file or directory.

    Returns:
        The lock file's path relative to the parent directory, or None.
    """
    for cand in (f"{path.name}{LOCK_SUFFIX}", f".{path.name}{LOCK_SUFFIX}"):
        if storage.lexists(path.parent / cand):
            return cand
    try:
        if path.is_dir() and not path.is_symlink():
            with storage.scandir(path) as it:
                for e in it:
                    if e.name.endswith(LOCK_SUFFIX):
                        if (e.name == PRUNE_LOCK and storage.has_file_system(path)
                                and _stale_prune_lock(Path(e.path))):
                            continue
                        return f"{path.name}/{e.name}"
    except OSError:
        return None
    return None


# The pointers a training job writes to say which checkpoint to resume from, in the order
# they are trusted. Lightning's last.ckpt is a copy (or link) of a ranked checkpoint, not a
# choice among them, so it is not followed here.
