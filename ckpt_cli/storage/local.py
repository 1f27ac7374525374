"""Local files: telling regular files from FIFOs, sockets and devices before anything opens
them, and opening them for positioned reads without ever blocking.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ckpt_cli.errors import CheckpointNotFoundError, CkptError, CorruptCheckpointError

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISDIR, "a directory"))


def special_kind(mode: int) -> str | None:
    """What a ``st_mode`` that is not a regular file's is (``"a FIFO"``), or None if it is one."""
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def not_regular(path: Path) -> str | None:
    """Why ``path`` (followed through symlinks) is no regular file, or None when it is one or is
    missing (callers report a missing file themselves).

    Reading a FIFO blocks until someone writes to it, a socket cannot be read at all, and
    reading a device may never end or have effects: none of them is a checkpoint file, so
    they are told apart before anything opens them.

    Args:
        path: The path to check.

    Returns:
        ``"not a regular file (a FIFO)"`` and the like, or None.
    """
    try:
        kind = special_kind(path.stat().st_mode)
    except OSError:
        return None
    return None if kind is None else f"not a regular file ({kind})"


def open_local(path: Path, where: str | Path) -> int:
    """Open a local regular file for reading (see :func:`ckpt_cli.storage.open_regular`).

    Args:
        path: The file.
        where: How to name it in an error message.

    Returns:
        A blocking, read-only descriptor.

    Raises:
        CkptError: If it is missing or cannot be opened.
        CorruptCheckpointError: If it is not a regular file.
    """
    why = not_regular(path)
    if why is not None:
        raise CorruptCheckpointError(why, path=where)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointNotFoundError("no such file", path=where) from None
    except OSError as e:
        raise CkptError(f"cannot open: {e.strerror}", path=where) from None
    try:
        kind = special_kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise CorruptCheckpointError(f"not a regular file ({kind})", path=where)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
