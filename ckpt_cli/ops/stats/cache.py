"""The figures ``ckpt stats`` computed, kept per checkpoint in the user's cache directory.

A nightly ``ckpt stats RUN`` must read only the checkpoints saved since the last one. Figures
are kept per checkpoint, keyed by its identity: where it is, its format, and the name, size and
modification time (nanoseconds) of every file it is made of, through symbolic links (the file
a link names, and that file's size and time). A checkpoint rewritten in place
gets a new key, so stale figures are never used. An entry holds each tensor's
:class:`~ckpt_cli.tensors.moments.Moments` and, per predecessor key, the squared norm of each
tensor's update since that checkpoint.

Entries live under the cache directory (``$CKPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckpt``, else
``~/.cache/ckpt``), in ``stats-v1/``, never inside the run (which may be read-only, shared or a
bucket). Each is written to a temporary name and renamed into place, under an exclusive lock
that serializes the read-merge-write of processes adding to one entry (``--part``). An entry
that cannot be read (damaged, a later version) is recomputed, never trusted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ckpt_cli import storage
from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.model import CheckpointIndex
from ckpt_cli.tensors.moments import Moments

VERSION = 1
"""Bumped when the figures' meaning changes: entries of another version are not read."""


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


def identity(index: CheckpointIndex) -> list[Any]:
    """What identifies a checkpoint's bytes: location, format and each file's name, the file
    it resolves to, its size and modification time.

    Raises:
        CkptError: When a file of the checkpoint cannot be examined.
    """
    root = index.root
    where = os.path.realpath(root) if storage.has_file_system(root) else str(root)
    files = []
    for f in sorted(index.files, key=lambda f: f.path):
        p = index.path_of(f.path)
        try:
            if storage.has_file_system(p):
                # Through symbolic links: the bytes read are the target's (a link's own
                # time and size stay put while its target is rewritten).
                st, target = os.stat(p), os.path.realpath(p)
            else:
                st, target = storage.lstat(p), str(p)
        except OSError as e:
            raise CkptError(f"cannot examine: {e.strerror or e}", path=p) from None
        files.append([f.path, target, st.st_size, st.st_mtime_ns])
    return [VERSION, where, index.format, files]


def key_of(ident: list[Any]) -> str:
    """The cache key of an :func:`identity`."""
    return hashlib.sha256(orjson.dumps(ident)).hexdigest()[:40]


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


def _parse(key: str, data: Any) -> Entry | None:
    if not isinstance(data, dict) or data.get("version") != VERSION or data.get("key") != key:
        return None
    entry = Entry(key)
    tensors, updates = data.get("tensors"), data.get("updates")
    if not isinstance(tensors, dict) or not isinstance(updates, dict):
        return None
    try:
        entry.tensors = {str(n): Moments.from_list(v) for n, v in tensors.items()}
    except (ValueError, TypeError):  # TypeError: a figure of another JSON type (a list)
        return None
    if not all(_sane(m) for m in entry.tensors.values()):
        return None
    for prev, per in updates.items():
        if not isinstance(per, dict):
            return None
        got: dict[str, float | None] = {}
        for n, v in per.items():
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v) and v >= 0):
                return None
            got[str(n)] = None if v is None else float(v)
        entry.updates[str(prev)] = got
    return entry


def _sane(m: Moments) -> bool:
    """Whether figures read back are ones a computation can give (finite moments, counts
    that add up): a damaged entry that still parses is not trusted either."""
    counted = m.count + m.nan + m.posinf + m.neginf
    return (counted == m.numel and m.zeros <= m.count and sum(m.hist) <= m.count
            and all(math.isfinite(v) for v in (m.mean, m.m2, m.sumsq))
            and m.m2 >= 0 and m.sumsq >= 0
            and (not m.count or (math.isfinite(m.min) and m.min <= m.max)))


class FigureCache:
    """The cache directory's entries (``enabled=False``: a cache that keeps nothing).

    Args:
        root: The cache directory (:func:`cache_root`).
        enabled: Read and write entries.
    """

    def __init__(self, root: Path | None, *, enabled: bool = True):
        self.enabled = enabled and root is not None
        self.dir = (root / f"stats-v{VERSION}") if root is not None else None

    def _path(self, key: str) -> Path:
        assert self.dir is not None
        return self.dir / key[:2] / f"{key}.json"

    def load(self, key: str) -> Entry:
        """The entry of ``key`` (empty when there is none, or it cannot be read)."""
        if not self.enabled:
            return Entry(key)
        try:
            raw = storage.read_side(self._path(key), "stats-cache")
            data = orjson.loads(raw) if raw is not None else None
        except (OSError, CkptError, orjson.JSONDecodeError):
            data = None
        return _parse(key, data) or Entry(key)

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def save(self, entry: Entry) -> None:
        """Add ``entry``'s figures to what the cache holds for its key (kept figures win
        nothing: the newer replace them); a cache that cannot be written is skipped
        silently, it only costs a re-read next time."""
        if not self.enabled:
            return
        try:
            with self._locked(entry.key):
                have = self.load(entry.key)
                have.tensors.update(entry.tensors)
                for prev, per in entry.updates.items():
                    have.updates.setdefault(prev, {}).update(per)
                self._write(self._path(entry.key), have.to_json())
        except OSError:
            return

    @staticmethod
    def _write(path: Path, doc: dict[str, Any]) -> None:
        tmp = path.with_name(f".{path.name}.ckpt-tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(orjson.dumps(doc))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
