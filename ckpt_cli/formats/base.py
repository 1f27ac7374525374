"""The reader protocol and helpers shared by the format readers."""

from __future__ import annotations

import dataclasses
import io
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

from ckpt_cli import storage
from ckpt_cli.errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from ckpt_cli.model import CheckpointIndex, Finding


@runtime_checkable
class Reader(Protocol):
    """A format reader: recognises its format and reads its metadata without tensor data.

    Attributes:
        name: The format key (``safetensors``, ``torch``, ``dcp``, ``hf-index``...).
        is_dir_format: Whether the format is a directory layout (sniffed before files).
    """

    name: str
    is_dir_format: bool

    def sniff(self, path: Path) -> str | None:
        """Check whether ``path`` is in this format.

        Args:
            path: A file or directory that exists.

        Returns:
            None on a match, otherwise a short reason why it does not match.
        """
        ...

    def read_index(self, path: Path) -> CheckpointIndex:
        """Read the checkpoint's metadata (headers, pickles), never its tensor bytes.

        Args:
            path: A path :meth:`sniff` accepted.

        Returns:
            The :class:`CheckpointIndex`.

        Raises:
            CkptError: When the input is malformed, unsafe or unsupported.
        """
        ...


def wrong_kind(path: Path, *, directory: bool) -> str | None:
    """The opening every reader's ``sniff`` shares: why ``path`` is not the kind of path its
    format is (``"not a directory"``, ``"not a file"``), or None when it is.

    Args:
        path: The path being sniffed.
        directory: Whether the format is a directory layout.

    Returns:
        The reason detect lists for this reader, or None.
    """
    if directory:
        return None if path.is_dir() else "not a directory"
    return None if path.is_file() else "not a file"


class DirectoryLayout:
    """The shared half of a directory format's reader: :meth:`sniff` says ``"not a
    directory"`` for anything else, then asks the format's own :meth:`recognises`, and gives
    :attr:`missing` as the reason when it does not recognise the directory."""

    is_dir_format = True
    #: Why a directory is not in this format (what ``detect`` lists when nothing matches).
    missing = "not this format"

    def recognises(self, path: Path) -> bool:
        """Whether the directory ``path`` is laid out in this format."""
        raise NotImplementedError

    def sniff(self, path: Path) -> str | None:
        """See :meth:`Reader.sniff`."""
        if (why := wrong_kind(path, directory=True)) is not None:
            return why
        return None if self.recognises(path) else self.missing


def present(path: Path) -> bool:
    """Whether ``path`` (through symlinks) exists and is not a directory.

    Listings of checkpoint files use this rather than ``is_file()``: a FIFO or socket named
    ``model.safetensors`` must be reported, not skipped as if it were not there.
    """
    try:
        return not stat.S_ISDIR(path.stat().st_mode)
    except OSError:
        return False


def open_stream(path: Path) -> io.BufferedIOBase:
    """A buffered binary stream of a regular file (or object), for parsers that read
    sequentially (pickles).

    Raises:
        CkptError: If it is missing or cannot be opened.
        CorruptCheckpointError: If it is not a regular file.
    """
    h = storage.open_regular(path)  # never blocks on a FIFO, refuses devices
    if isinstance(h, int):
        return os.fdopen(h, "rb")
    raw = storage.Window(h, 0, storage.size_of(h), owns=True)
    return io.BufferedReader(raw, buffer_size=storage.BLOCK)


def read_small(path: Path, limit: int) -> bytes:
    """The whole of a small regular file (an index, a pointer, a metadata pickle).

    Args:
        path: The file.
        limit: The most bytes to read; a longer file is cut there (callers check the size
            first when that matters).

    Returns:
        Its bytes.

    Raises:
        CkptError: If it cannot be read or is not a regular file.
    """
    fd = storage.open_regular(path)
    try:
        return storage.pread(fd, limit, 0)
    except OSError as e:
        raise CkptError(f"cannot read: {e.strerror}", path=path) from None
    finally:
        storage.close(fd)


def file_size(path: Path) -> int:
    """Size of a file in bytes, as a :class:`CkptError` when it cannot be read.

    Args:
        path: The file.

    Returns:
        Its size.

    Raises:
        CkptError: If it is missing or cannot be read.
        CorruptCheckpointError: If it is not a regular file (a FIFO, socket, device...).
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        raise CheckpointNotFoundError("no such file", path=path) from None
    except OSError as e:
        raise CkptError(f"cannot read: {e.strerror}", path=path) from None
    kind = storage.special_kind(st.st_mode)
    if kind is not None:
        raise CorruptCheckpointError(f"not a regular file ({kind})", path=path)
    return st.st_size


def read_head(path: Path, n: int) -> bytes:
    """The first ``n`` bytes of a file (fewer if it is shorter).

    Args:
        path: The file.
        n: How many bytes.

    Returns:
        The bytes read.

    Raises:
        CkptError: If the file cannot be opened or is not a regular file.
    """
    return read_small(path, n)  # the same read: up to n bytes from the start


def contained_path(base: Path, rel: str, *, what: str, source: Path) -> Path:
    """Resolve a path a checkpoint names relative to its own directory, refusing escapes.

    Args:
        base: The checkpoint directory.
        rel: The relative path written in the checkpoint's metadata.
        what: What the path is (for the message), e.g. ``"shard"``.
        source: The file that named it (for the message).

    Returns:
        ``base / rel``.

    Raises:
        UnsafeCheckpointError: If ``rel`` is absolute, has ``..`` or leaves ``base``.
    """
    if not rel or rel.startswith(("/", "\\")) or os.path.isabs(rel) or "\x00" in rel:
        raise UnsafeCheckpointError(f"{what} path {rel!r} is not relative", path=source)
    parts = Path(rel).parts
    if ".." in parts or "\\" in rel:
        raise UnsafeCheckpointError(f"{what} path {rel!r} leaves the checkpoint directory",
                                    path=source)
    full = base / rel
    try:
        # The directories on the way must stay inside; the file itself may be a symlink (the
        # HF hub cache links every shard to ../../blobs/<hash>): reading through it is
        # harmless, and it is where the checkpoint's author put the data.
        real_base = base.resolve()
        if not full.parent.resolve().is_relative_to(real_base):
            raise UnsafeCheckpointError(
                f"{what} path {rel!r} resolves outside the checkpoint directory", path=source)
    except OSError:
        raise CorruptCheckpointError(f"cannot resolve {what} path {rel!r}", path=source) from None
    return full


def rel_to(path: Path, base: Path) -> str:
    """``path`` relative to ``base`` as a POSIX string (or the name if unrelated)."""
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return path.name


# Findings that do not make tensor data unreadable: pickle globals and TorchScript code (ckpt
# never runs them), and an HF index's bookkeeping (a tensor found in another shard than it
# says, or missing from its weight_map, is still read from where it really is).
_HARMLESS = {"unsafe-global", "unknown-global", "non-allowlisted-global",
             "torchscript-archive", "unscanned-pickle", "unindexed-tensor", "wrong-shard",
             "pickle-after-stop"}


SAFETY_CODES = frozenset({"unsafe-global", "unknown-global", "torchscript-archive",
                          "unscanned-pickle", "pickle-after-stop", "duplicate-key"})
"""Reader finding codes about what a file would do elsewhere: pickle globals that run code
under a full unpickler, TorchScript, a pickle ckpt could not scan or one hidden after
``data.pkl``'s STOP, a safetensors key spelt twice (readers disagree on which counts)."""


def safety_findings(findings: Iterable[Finding]) -> list[Finding]:
    """The safety findings of a read (:data:`SAFETY_CODES`), as every command reports them.

    A pickle ckpt could not scan is an error here, whatever the reader said: what cannot be
    scanned may run anything (fail closed, as ``validate`` judges it).

    Args:
        findings: A read's findings (``CheckpointIndex.findings``).

    Returns:
        Those about safety, in order.
    """
    return [dataclasses.replace(f, severity="error") if f.code == "unscanned-pickle" else f
            for f in findings if f.code in SAFETY_CODES]


def refused(findings: Iterable[Finding]) -> bool:
    """Whether safety findings fail a command that reports them (exit 1, as ``validate``):
    an error among them (a refused global, an unscannable pickle, a duplicate key)."""
    return any(f.severity == "error" for f in safety_findings(findings))


# Findings that mean tensors the checkpoint should hold are not there (a shard the index
# names is missing or unreadable, or lacks a tensor) or are ambiguous: whatever the caller
# selected, output or a comparison made from the rest would silently lack them.
_INCOMPLETE = {"missing-shard", "bad-shard", "missing-tensor", "duplicate-tensor"}


def refuse_incomplete(index: CheckpointIndex) -> None:
    """Refuse a checkpoint whose readers found that some of its tensors are missing.

    Raises:
        CorruptCheckpointError: Naming the first missing piece.
    """
    _refuse(index, [f for f in index.findings
                    if f.severity == "error" and f.code in _INCOMPLETE])


def refuse_damaged(index: CheckpointIndex, names: Iterable[str],
                   also_files: Iterable[str] = ()) -> None:
    """Refuse to write output from tensors whose files the readers found damaged.

    Only errors in files that hold the selected tensors count (a broken ``optimizer.pt``
    does not stop an inference export), plus errors about no file in particular, errors about
    a selected tensor itself, and those that say tensors are missing
    (:func:`refuse_incomplete`).

    Args:
        index: The source checkpoint.
        names: The tensors that will be read.
        also_files: More files whose errors count (relative to ``index.base``).

    Raises:
        CorruptCheckpointError: Naming the first damaged file and the problem.
    """
    files: set[str] = set(also_files)
    selected = set(names)
    for n in selected:
        t = index.tensors[n]
        files.update(x for x in (t.file, t.storage.file if t.storage else None) if x)
        files.update(c.file for c in t.chunks)
    _refuse(index, [f for f in index.findings if f.severity == "error"
                    and f.code not in _HARMLESS
                    and (f.file is None or f.file in files or f.code in _INCOMPLETE
                         or f.location in selected)])


def _refuse(index: CheckpointIndex, bad: list[Finding]) -> None:
    if bad:
        f = bad[0]
        more = f" (and {len(bad) - 1} more problem(s))" if len(bad) > 1 else ""
        raise CorruptCheckpointError(
            f"{f.message}" + (f" ({f.location})" if f.location else "") + more,
            path=index.base / f.file if f.file else index.root,
            hint=f"ckpt validate {index.root} lists every problem")
