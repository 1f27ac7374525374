"""Where a write's bytes go, and how they become the output: the :class:`Sink`.

The writer (:func:`ckpt_cli.writers.write_checkpoint`) has one path for every destination: it
opens each shard it writes through the sink (:meth:`Sink.open`), then hands the sink the rest
of the output, the index and the side files (:class:`Tail`), and :meth:`Sink.commit`; on any
failure (Ctrl-C included) the sink's :meth:`Sink.abort` undoes what it made. Each sink keeps
its destination's atomicity:

- :class:`FileSink`, a local file: a temporary sibling, fsynced and renamed into place
  (:func:`ckpt_cli.storage.atomic.atomic_file`, the one door out: its rule for links, FIFOs,
  devices and missing parents); the caller's check runs on it first.
- :class:`DirSink`, a local directory: a temporary sibling directory holding the shards, the
  index and the side files, checked, re-checked as replaceable, fsynced and renamed
  (:func:`ckpt_cli.storage.atomic.atomic_dir`).
- :class:`ObjectSink`, a prefix (or one object) on a store, where nothing can be renamed:
  each upload completes as it is written, so the commit marker (the index, or the lone
  weights file) goes last, with the caller's check before it; on failure what this run wrote
  is deleted; keys of an earlier output it did not rewrite go after the commit.
- :class:`ckpt_cli.writers.parts.PartSink`, one part of a split job: staged shards (each
  fsynced and renamed), a receipt, and the last part finalizes.

The sinks live in ``writers/``, not ``storage/``: beyond where bytes go they know what a
checkpoint is (which names ckpt may replace, the manifest beside a file, the index as the
commit marker, receipts), which the bottom layer must not. They reach storage only through
its operations (:func:`ckpt_cli.storage.create`, the atomic helpers, the store's deletes).

Adding a destination means one more :class:`Sink` (its :meth:`Sink.begin`, :meth:`Sink.target`,
:meth:`Sink.commit`, :meth:`Sink.abort`) and one line where the writer picks it; the write
path itself does not change.
"""

from __future__ import annotations

import contextlib
import errno
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ckpt_cli import storage
from ckpt_cli.errors import DestinationExistsError
from ckpt_cli.formats.names import MANIFEST_NAME, manifest_path
from ckpt_cli.storage.atomic import atomic_dir, atomic_file
from ckpt_cli.writers.plan import NAMING

if TYPE_CHECKING:
    from ckpt_cli.parts import PartOutcome
    from ckpt_cli.writers.plan import ShardPlan


@dataclass(frozen=True, slots=True)
class Tail:
    """What follows the shards.

    Attributes:
        index: The shard index's name and how to build it from the directory the shards can
            be read back from (None when not sharded).
        sides: Side files by name (``config.json``...).
    """

    index: tuple[str, Callable[[Path], bytes]] | None = None
    sides: dict[str, bytes] = field(default_factory=dict)


class Sink:
    """One output being written: gives the writer a handle per file, then commits or aborts.

    Use as a context manager: entering runs :meth:`begin` (the destination's checks and
    staging), leaving with an exception runs :meth:`abort`; the writer calls :meth:`commit`
    itself once everything is written.

    Args:
        dest: The output file, directory or prefix.
        plan: The shard plan.
        overwrite: Replace an existing ``dest``.
        before_commit: The caller's check, given the written output's location before it
            becomes the output (an exception discards it).

    Attributes:
        root: Where the files are written (and can be read back) before the commit.
        shards: Indices into ``plan.files`` of the shards this process writes (None: none, it
            only commits).
        files: ``(name, bytes)`` of each file written, in the order written.
        index_file: The index's name, once written.
        complete: Whether :meth:`commit` made the whole output (a part may leave the rest
            to another process).
        part: What this process did of a split write, else None.
    """

    def __init__(self, dest: Path, plan: ShardPlan, *, overwrite: bool,
                 before_commit: Callable[[Path], None] | None):
        self.dest, self.plan, self.overwrite = dest, plan, overwrite
        self.before_commit = before_commit
        self.root = dest
        self.shards: list[int] | None = list(range(len(plan.files)))
        self.files: list[tuple[str, int]] = []
        self.index_file: str | None = None
        self.complete = False
        self.part: PartOutcome | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Sink:
        self.begin()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: object) -> None:
        if e is not None:
            self.abort(e)

    def begin(self) -> None:
        """Check the destination and prepare to write (nothing by default)."""

    def target(self, name: str) -> Path:
        """Where the file ``name`` is written."""
        return self.root / name

    @contextlib.contextmanager
    def open(self, name: str, *, expected: int, buffering: int) -> Iterator[Any]:
        """Open the file ``name`` (a shard) for writing; it counts as written when the block
        leaves normally (an object's upload completes), and is discarded on an exception.

        Args:
            name: The file's name in the output.
            expected: About how many bytes will be written (sizes an upload's parts).
            buffering: ``open``'s buffering for a local file (0: raw writes).

        Yields:
            The writable handle (``write``, ``tell``; ``fileno`` for a local file).
        """
        path = self.target(name)
        with storage.create(path, expected=expected, buffering=buffering) as f:
            yield f
            self.before_close()
            size: int = f.tell()
        self.wrote(name, path, size)

    def before_close(self) -> None:
        """Called once a file's bytes are all written, before it closes (nothing by default)."""

    def wrote(self, name: str, path: Path, size: int) -> None:
        """Record the file ``name``, written whole at ``path``."""
        self.files.append((name, size))

    def put(self, root: Path, name: str, data: bytes) -> None:
        """Write a small file whole (an index, a side file) under ``root``."""
        (root / name).write_bytes(data)
        self.files.append((name, len(data)))

    def write_tail(self, root: Path, tail: Tail, *, marker_last: bool = False) -> None:
        """Write the index and the side files under ``root``: the index first, or, when
        ``marker_last`` (it is the commit marker), after the side files."""
        if tail.index is not None and not marker_last:
            self._put_index(root, tail.index)
        for name, data in tail.sides.items():
            self.put(root, name, data)
        if tail.index is not None and marker_last:
            self._put_index(root, tail.index)

    def _put_index(self, root: Path, index: tuple[str, Callable[[Path], bytes]]) -> None:
        name, build = index
        self.put(root, name, build(root))
        self.index_file = name

    def commit(self, tail: Tail) -> None:
        """Write ``tail`` and make the output what is at the destination."""
        raise NotImplementedError

    def abort(self, error: BaseException) -> None:
        """Undo what this sink made, after ``error`` (nothing by default)."""
        self._stack.__exit__(type(error), error, error.__traceback__)


class FileSink(Sink):
    """A local single file: a temporary sibling, the check, fsync, rename; an integrity
    manifest beside the file described what was there before, and goes."""

    def begin(self) -> None:
        self.root = self._stack.enter_context(atomic_file(self.dest, overwrite=self.overwrite,
                                                          parents=True))

    def target(self, name: str) -> Path:
        return self.root

    def wrote(self, name: str, path: Path, size: int) -> None:
        self.files.append((self.dest.name, size))

    def commit(self, tail: Tail) -> None:
        if self.before_commit:
            self.before_commit(self.root)
        self._stack.close()  # fsync, rename into place
        self.complete = True
        drop_old_manifest(self.dest)


class DirSink(Sink):
    """A local directory: built in a temporary sibling directory, checked, fsynced, renamed."""

    def begin(self) -> None:
        self.root = self._stack.enter_context(atomic_dir(self.dest, overwrite=self.overwrite,
                                                         parents=True))

    def commit(self, tail: Tail) -> None:
        self.write_tail(self.root, tail)
        if self.before_commit:
            self.before_commit(self.root)
        if self.overwrite:
            # Again just before the swap: the directory may have changed during a long write.
            check_replaceable(self.dest)
        self._stack.close()  # fsync, rename into place
        self.complete = True


class ObjectSink(Sink):
    """An output on object storage, where nothing can be renamed: atomic by ordering.

    Each object is a multipart upload that becomes visible only when it completes (and is
    aborted on any failure). The commit marker is the last object a reader trusts: the index
    of a sharded output, else the lone weights file. Every shard goes up first; then
    ``before_commit`` runs (before the marker's upload completes, for a lone file); then
    the side files and the index. On failure, or Ctrl-C, what this run wrote is deleted and
    an upload in flight aborted. With ``overwrite``, an earlier output's index goes first
    when a new shard would replace one of its shards in place (its set is then no longer
    vouched for), and its keys the new output did not rewrite go last.

    Args:
        as_file: The output is one object, not a prefix.
        sides: The side files' names.
    """

    def __init__(self, dest: Path, plan: ShardPlan, *, overwrite: bool,
                 before_commit: Callable[[Path], None] | None, as_file: bool,
                 sides: list[str]):
        super().__init__(dest, plan, overwrite=overwrite, before_commit=before_commit)
        self.as_file, self.sides = as_file, sides
        self.obj = cast(storage.ObjectPath, dest)
        self.old: set[str] = set()
        self.written: list[str] = []

    def begin(self) -> None:
        _check_remote_dest(self.dest, self.overwrite, self.as_file)
        if self.as_file:
            return
        obj = self.obj
        old = set(obj.keys_below()) if self.overwrite else set()
        new_keys = {f"{obj.key}/{f}" for f in [*self.plan.files, *self.sides]}
        markers = sorted(k for k in old if k.endswith((".index.json", MANIFEST_NAME)))
        if markers and old & new_keys:
            obj.store.delete(markers)
            old -= set(markers)
        self.old = old

    def target(self, name: str) -> Path:
        return self.dest if self.as_file else self.dest / name

    def before_close(self) -> None:
        # The lone weights file is the commit marker: checked before its upload completes.
        if self.before_commit and not self.plan.sharded:
            self.before_commit(self.dest)

    def wrote(self, name: str, path: Path, size: int) -> None:
        if self.as_file:
            self.files.append((self.dest.name, size))
            return
        self.written.append(f"{self.obj.key}/{name}")
        super().wrote(name, path, size)

    def put(self, root: Path, name: str, data: bytes) -> None:
        super().put(root, name, data)
        self.written.append(f"{self.obj.key}/{name}")

    def commit(self, tail: Tail) -> None:
        if self.as_file:
            self.complete = True
            manifest_path(self.dest).unlink(missing_ok=True)  # it described what was there
            return
        if self.plan.sharded and self.before_commit:
            self.before_commit(self.dest)
        self.write_tail(self.dest, tail, marker_last=True)
        self.complete = True
        stale = sorted(self.old - set(self.written))
        if stale:
            self.obj.store.delete(stale)

    def abort(self, error: BaseException) -> None:
        # Nothing this run wrote may stay to look like an output (an upload in flight was
        # aborted by its own exit). A lone object is its own upload: nothing to delete.
        if self.as_file or self.complete:
            return
        with contextlib.suppress(Exception):
            self.obj.store.delete(self.written)


def drop_old_manifest(dest: Path) -> None:
    """Remove the integrity manifest beside a local single-file output just put in place: it
    described what was there before. (None can be there when its name would be longer than a
    file name can be: an output named with 240 bytes has no room for the suffix.)"""
    try:
        manifest_path(dest).unlink()
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENAMETOOLONG):
            raise


def _check_remote_dest(dest: Path, overwrite: bool, as_file: bool) -> None:
    """Refuse an output on a store that exists (without ``overwrite``) or is of the other
    kind; with ``overwrite``, a prefix must hold only what ckpt writes."""
    if as_file:
        if dest.is_dir():
            raise DestinationExistsError("is a prefix with objects below it, and this output "
                                         "is a single object; not replacing it", path=dest)
        if dest.exists() and not overwrite:
            raise DestinationExistsError("exists", path=dest,
                                         hint="use force to replace it", param="force")
        return
    if dest.is_file():
        raise DestinationExistsError("is an object, and this output is a prefix of objects; "
                                     "not replacing it", path=dest)
    if dest.is_dir():
        if not overwrite:
            raise DestinationExistsError("exists (objects lie below this prefix)", path=dest,
                                         hint="use force to replace it", param="force")
        check_replaceable(dest)



# Small JSON/text files that loaders expect next to the weights (convert copies them).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
              "added_tokens.json", "preprocessor_config.json")
# What a directory ckpt may replace (--force) can hold: what ckpt itself writes there (weight
# files and shard indexes under the names it gives them, manifests, the side files above).
# Nothing else: not notes.txt, not data/train.bin, and not a checkpoint ckpt does not write in
# a directory (a DCP checkpoint, the .pt files of a run).
_OWN_FILE = re.compile("|".join(
    rf"{re.escape(stem)}(?:-\d{{5,}}-of-\d{{5,}})?{re.escape(ext)}(?:\.index\.json)?"
    for stem, ext in NAMING.values()) + r"|.*\.ckpt-manifest\.json")
_REPLACEABLE_NAMES = {*SIDE_FILES, MANIFEST_NAME}


def check_replaceable(dest: Path) -> None:
    """Refuse to replace a directory that holds anything but what ckpt writes in one.

    ``--force`` replaces an earlier output; it must not wipe a directory that only happens to
    be named like one (photos, code, notes, a whole run), nor a regular file where the
    output is a directory.
    """
    if not dest.is_dir():
        if dest.exists() or dest.is_symlink():
            raise DestinationExistsError(
                "is a file, and this output is a directory (-o names a directory unless it "
                "ends in .safetensors, .pt, .pth, .bin or .ckpt); not replacing it", path=dest,
                hint="remove it yourself, or give -o a new name")
        return
    odd = sorted(p.name for p in dest.iterdir()
                 if p.is_dir() or p.is_symlink()
                 or not (p.name in _REPLACEABLE_NAMES or _OWN_FILE.fullmatch(p.name)))
    if odd:
        shown = ", ".join(odd[:3]) + (f" and {len(odd) - 3} more" if len(odd) > 3 else "")
        raise DestinationExistsError(
            f"holds more than checkpoint files ({shown}); not replacing it", path=dest,
            hint="remove it yourself, or write to a new directory")

