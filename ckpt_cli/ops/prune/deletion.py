"""Safe deletion inside a directory held open: trash names, put-back, mount-aware removal.

Everything is relative to a directory file descriptor (``*at`` system calls) and nothing is
followed: a path swapped for a symlink mid-way cannot redirect a rename or a removal, and a
directory with another file system mounted on it (a mount point, a bind mount) is never
entered. ``ckpt prune`` renames each checkpoint aside to a trash name first and removes the
trash with :func:`remove_child` once the renames are durable.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import uuid
from collections.abc import Callable
from pathlib import Path

from ckpt_cli.formats.names import TRASH_PREFIX, fit_name

RESCUE_PREFIX = ".ckpt-rescued-"
"""Where a checkpoint goes when it changed while being moved aside and its name was taken."""


class HeldDir:
    """The run directory, held open while deleting.

    Every rename and removal is relative to this descriptor (``*at`` system calls), so
    replacing the directory's path with a symlink mid-prune cannot redirect them elsewhere.

    Args:
        path: The run directory (already resolved: no symlink in it).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.dev = os.fstat(self.fd).st_dev
        self.mount = (self.dev, mount_id(self.fd))

    def close(self) -> None:
        """Release the descriptor."""
        os.close(self.fd)

    def lstat(self, name: str) -> os.stat_result:
        """``lstat`` of a child."""
        return os.lstat(name, dir_fd=self.fd)

    def exists(self, name: str) -> bool:
        """Whether a child exists (a dangling symlink counts)."""
        try:
            self.lstat(name)
        except FileNotFoundError:
            return False
        return True

    def rename(self, src: str, dst: str) -> None:
        """Rename a child (the caller checked that ``dst`` is free)."""
        os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)


def put_back(root: HeldDir, name: str, trash: str, why: str) -> tuple[str, str]:
    """Undo a rename aside; if the name was taken meanwhile, keep the data under a rescue name."""
    if not root.exists(name):
        try:
            root.rename(trash, name)
            return "skipped", f"{why}; put back"
        except OSError:
            pass
    rescue = fit_name(f"{RESCUE_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
    try:
        root.rename(trash, rescue)
        return "failed", f"{why}, and {name} was re-created meanwhile; kept as {rescue}"
    except OSError as e:
        return "failed", f"{why}; it is left as {trash} ({e.strerror})"


def trash_name(root: HeldDir, name: str) -> str:
    """A free trash name for ``name``: ``.ckpt-trash-<name>``, made unique if taken."""
    plain = fit_name(TRASH_PREFIX + name)
    if not root.exists(plain):
        return plain
    return fit_name(f"{TRASH_PREFIX}{name}", f".{uuid.uuid4().hex[:8]}")


def remove_child(root: HeldDir, name: str) -> str | None:
    """Remove a child of the run directory, file or tree; None, or what failed.

    Walks with directory file descriptors and ``O_NOFOLLOW`` (as ``shutil.rmtree`` does on
    Linux, without its per-entry path building, which costs as much as the unlinks): a
    directory swapped for a symlink mid-walk is unlinked as a link, never entered, and a
    directory on another file system (a mount point) is never entered.
    """
    try:
        st = root.lstat(name)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot check {name}: {e.strerror}"
    errors: list[str] = []
    if stat.S_ISDIR(st.st_mode):
        _remove_dir(root.fd, name, name, errors, root.mount)
    else:
        _unlink(root.fd, name, name, errors)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return f"cannot remove {errors[0]}{more}"
    return None


def _unlink(dir_fd: int, name: str, where: str, errors: list[str],
            op: Callable[..., None] = os.unlink) -> None:
    """``op`` (unlink, or rmdir) of ``name`` in ``dir_fd``; a failure is added to ``errors``."""
    try:
        op(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as e:
        errors.append(f"{where}: {e.strerror}")


def mount_points() -> list[str]:
    """Every mount point (Linux ``/proc/self/mountinfo``; [] elsewhere)."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = os.fsdecode(f.read()).splitlines()  # as realpath decodes names
    except OSError:
        return []
    # Field 5 is the mount point, with space, tab, newline and backslash octal-escaped.
    return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            for fields in (line.split(" ") for line in lines) if len(fields) >= 5]


def mounts_inside(path: str, points: list[str] | None = None) -> list[str]:
    """Mount points at or below ``path`` (``points``: from :func:`mount_points`).

    A bind mount of a directory of the same file system looks like any directory to a walk;
    deleting through it would delete what it shows, outside the run directory.
    """
    if points is not None and not points:
        return []
    real = os.path.realpath(path)
    inside = real.rstrip("/") + "/"
    return [p for p in (mount_points() if points is None else points)
            if p == real or p.startswith(inside)]


def mount_id(fd: int) -> int | None:
    """The id of the mount an open file lies on (Linux ``/proc/self/fdinfo``), or None.

    Device numbers do not tell a bind mount of a directory of the same file system from the
    directory itself; mount ids do.
    """
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _remove_dir(parent: int, name: str, where: str, errors: list[str],
                mount: tuple[int, int | None]) -> None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # no longer a directory: remove the link
            _unlink(parent, name, where, errors)
        else:
            errors.append(f"{where}: {e.strerror}")
        return
    dev, mnt = mount
    if os.fstat(fd).st_dev != dev or (mnt is not None and mount_id(fd) != mnt):
        os.close(fd)
        errors.append(f"{where}: another file system is mounted there; not entered")
        return
    try:
        with os.scandir(fd) as it:
            children = [(c.name, c.is_dir(follow_symlinks=False)) for c in it]
        unlink = os.unlink
        # The loop body is as lean as it can be: at tens of thousands of files, interpreter
        # overhead per file would otherwise cost more than the unlink system calls.
        for child, is_dir in children:
            if is_dir:
                _remove_dir(fd, child, f"{where}/{child}", errors, mount)
                continue
            try:
                unlink(child, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                errors.append(f"{where}/{child}: {e.strerror}")
    except OSError as e:
        errors.append(f"{where}: {e.strerror}")
    finally:
        os.close(fd)
    _unlink(parent, name, where, errors, os.rmdir)
