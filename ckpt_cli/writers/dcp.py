"""Where a DCP directory is written (``convert --to dcp``): a local directory or a prefix on
object storage, each with its destination's atomicity.

torch's ``FileSystemWriter`` writes each ``__<rank>_<n>.distcp`` file through its file system
object, then ``.metadata`` under a temporary name renamed into place. Locally the whole
directory is built in a temporary sibling and renamed into place
(:func:`ckpt_cli.storage.atomic.atomic_dir`). On object storage nothing can be renamed, and
``.metadata`` names its files by relative path, so they cannot be staged under another prefix
either: the writer's file system is replaced by :class:`ObjectFiles`, which uploads each file
straight to its final key (a multipart upload that becomes visible only once complete), and
``.metadata`` last, so that a DCP directory without its ``.metadata`` (not loadable, and not
taken for a checkpoint by ckpt) is all a reader can meet while it is written. A failure or
Ctrl-C deletes what this run uploaded. With ``overwrite``, the earlier ``.metadata`` is
deleted first (its files are about to be replaced in place) and its files this run did not
rewrite after the new ``.metadata`` is up.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ckpt_cli import storage
from ckpt_cli.errors import CkptError, DestinationExistsError, UsageError
from ckpt_cli.model import WrittenFile
from ckpt_cli.storage.atomic import atomic_dir, check_destination
from ckpt_cli.storage.objectpath import ObjectPath

METADATA = ".metadata"
DCP_NAME = re.compile(r"\A(?:\.metadata|__\d+_\d+\.distcp)\Z")
"""The names a DCP directory ckpt writes holds: what an output prefix may hold to be replaced."""


@dataclass
class DcpTarget:
    """Where ``dcp.save``'s writer puts the files.

    Attributes:
        root: The path the ``FileSystemWriter`` is made with.
        fs: Its file system object, where the default (local files) will not do.
        files: What was written, ``.metadata`` last (filled once the save is done).
    """

    root: str
    fs: ObjectFiles | None = None
    files: list[WrittenFile] = field(default_factory=list)

    def attach(self, writer: Any) -> None:
        """Point a ``FileSystemWriter`` at this target (its file system object)."""
        if self.fs is not None:
            writer.fs = self.fs
            writer.path = self.fs.init_path(self.root)


def check_dcp_output(out: Path, *, overwrite: bool) -> None:
    """Refuse, before any reading, a DCP output that would be refused at its end.

    Args:
        out: The output directory or prefix.
        overwrite: An existing output may be replaced.

    Raises:
        DestinationExistsError: It exists and ``overwrite`` is False, or (a prefix) holds
            more than a DCP checkpoint's files.
        DestinationError: A local destination ckpt does not write (a link, a device...).
    """
    if isinstance(out, ObjectPath):
        _old_keys(out, overwrite)
    else:
        check_destination(out, kind="dir", overwrite=overwrite, parents=True)


def _old_keys(out: ObjectPath, overwrite: bool) -> list[str]:
    """The keys of an earlier output at ``out`` that this write replaces."""
    if out.is_file():
        raise DestinationExistsError("is an object, and a DCP output is a prefix of objects; "
                                     "not replacing it", path=str(out))
    if not out.is_dir():
        return []
    if not overwrite:
        raise DestinationExistsError("exists (objects lie below this prefix)", path=str(out),
                                     hint="use force to replace it", param="force")
    keys = out.keys_below()
    odd = sorted(k[len(out.key) + 1:] for k in keys if not DCP_NAME.fullmatch(
        k[len(out.key) + 1:]))
    if odd:
        shown = ", ".join(odd[:3]) + (f" and {len(odd) - 3} more" if len(odd) > 3 else "")
        raise DestinationExistsError(f"holds more than a DCP checkpoint's files ({shown}); "
                                     "not replacing it", path=str(out),
                                     hint="remove them yourself, or write to a new prefix")
    return keys


@contextlib.contextmanager
def dcp_destination(out: Path, *, overwrite: bool, expected: int) -> Iterator[DcpTarget]:
    """Write a DCP directory at ``out``: yields the :class:`DcpTarget` to save into; leaving
    the block normally makes it the output, an exception (Ctrl-C included) leaves ``out`` as
    it was (locally) or without what this run wrote (object storage).

    Args:
        out: The directory (local) or prefix (object storage) to create.
        overwrite: Replace an existing output.
        expected: An upper bound on any one file's bytes (sizes the uploads' parts).

    Yields:
        The target; its ``files`` are filled before the block's end returns.

    Raises:
        DestinationExistsError: ``out`` exists and ``overwrite`` is False.
    """
    if isinstance(out, ObjectPath):
        with _object_destination(out, overwrite=overwrite, expected=expected) as target:
            yield target
        return
    with atomic_dir(out, overwrite=overwrite, parents=True) as tmp:
        target = DcpTarget(str(tmp))
        yield target
        found = sorted((p for p in tmp.rglob("*") if p.is_file()),
                       key=lambda p: (p.name == METADATA, p.name))
        target.files = [WrittenFile(p.relative_to(tmp).as_posix(), p.stat().st_size)
                        for p in found]


@contextlib.contextmanager
def _object_destination(out: ObjectPath, *, overwrite: bool, expected: int
                        ) -> Iterator[DcpTarget]:
    old = set(_old_keys(out, overwrite))
    marker = f"{out.key}/{METADATA}"
    if marker in old:  # its files are about to be replaced in place: it no longer vouches
        out.store.delete([marker])
        old.discard(marker)
    fs = ObjectFiles(out, expected)
    target = DcpTarget(str(out), fs)
    try:
        yield target
        if not fs.written or fs.written[-1].path != METADATA:
            raise CkptError(f"the DCP writer finished without writing {METADATA} last",
                            path=str(out))
    except BaseException:
        with contextlib.suppress(Exception):
            if fs.written:
                out.store.delete([f"{out.key}/{f.path}" for f in fs.written])
        raise
    stale = sorted(old - {f"{out.key}/{f.path}" for f in fs.written})
    if stale:
        out.store.delete(stale)
    target.files = list(fs.written)


class _UploadStream:
    """An upload as the file object DCP writes into (it closes the stream itself, then
    leaves its ``with``: the upload completes at the latter)."""

    def __init__(self, upload: Any):
        self._up = upload

    def write(self, data: Any) -> int:
        return int(self._up.write(data))

    def tell(self) -> int:
        return int(self._up.tell())

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        """Nothing: parts go out as they fill."""

    def close(self) -> None:
        """Nothing: the upload completes when the ``with`` that opened it is left."""


class ObjectFiles:
    """The file system object of a ``FileSystemWriter`` writing to a prefix on object
    storage: each file is an upload to its final key (:func:`ckpt_cli.storage.create`);
    ``.metadata``, which DCP writes under a temporary name and renames, goes up under its own
    name directly, its upload completing last.

    Args:
        root: The output prefix.
        expected: An upper bound on any one file's bytes.
    """

    def __init__(self, root: ObjectPath, expected: int):
        self.root, self.expected = root, expected
        self.written: list[WrittenFile] = []

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return str(self.root)

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{path}/{suffix}"

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Nothing: a prefix exists once a key lies below it."""

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return False  # an earlier .metadata was deleted before the save began

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        """Nothing: see :meth:`exists`."""

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """Nothing: ``.metadata`` was uploaded under its own name (:meth:`create_stream`)."""
        if self._name(new_path) != METADATA:
            raise UsageError(f"{self.root}: objects cannot be renamed ({new_path})")

    @staticmethod
    def _name(path: str | os.PathLike[str]) -> str:
        return str(path).rsplit("/", 1)[-1]

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        name = self._name(path)
        if name == f"{METADATA}.tmp":
            name = METADATA
        if mode != "wb" or not DCP_NAME.fullmatch(name):
            raise UsageError(f"{self.root}: the DCP writer asked for {name!r} ({mode}), "
                             "which ckpt does not write")
        with storage.create(cast(Path, self.root / name), expected=self.expected) as up:
            yield _UploadStream(up)
            size = int(up.tell())
        self.written.append(WrittenFile(name, size))
