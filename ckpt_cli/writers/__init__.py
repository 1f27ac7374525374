"""Writing checkpoints: safetensors or torch zip, single file or HF-style shards + index.

Shared by ``convert`` and ``consolidate``. The caller describes each output tensor and how to
produce its values (:class:`OutTensor`); the writer plans shards (:func:`plan_shards`), builds
everything under a temporary sibling (:mod:`ckpt_cli.storage.atomic`), streams one tensor at a
time while a background thread reads and casts ahead within a memory budget, and renames the
result into place only when it is complete and fsynced. A tensor larger than a piece
(:data:`ckpt_cli.storage.reads.PIECE_BYTES`) can be produced piece by piece
(:attr:`OutTensor.pieces`), so memory stays within
:data:`ckpt_cli.storage.reads.MEMORY_BUDGET` whatever one tensor's size.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import re
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import orjson

from ckpt_cli import dtypes, stages, storage
from ckpt_cli.errors import (
    CkptError,
    DestinationExistsError,
    OutOfMemoryError,
    UnsupportedError,
    UsageError,
)
from ckpt_cli.manifest import MANIFEST_NAME, manifest_path
from ckpt_cli.parts import PartOutcome, fingerprint
from ckpt_cli.writers.plan import ShardPlan, plan_shards
from ckpt_cli.storage.atomic import TMP_MARK, atomic_dir, atomic_file, fsync_path
from ckpt_cli.storage.reads import MEMORY_BUDGET, PIECE_BYTES, memory_budget
from ckpt_cli.writers.parts import PartJob, write_parted
from ckpt_cli.writers.safetensors import header_bytes, write_all
from ckpt_cli.writers.torchzip import TorchZipWriter

if TYPE_CHECKING:
    import numpy as np

FORMATS = ("safetensors", "pt")
FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
_NAMING = {"safetensors": ("model", ".safetensors"), "pt": ("pytorch_model", ".bin")}


def output_format(dest: Path, fmt: str | None, *, directory: bool = False) -> str:
    """The format to write: ``fmt``, or what ``dest``'s suffix says (a directory: safetensors).

    This is also where the output's kind is decided: a name ending in ``.safetensors``,
    ``.pt``, ``.pth``, ``.bin`` or ``.ckpt`` (Lightning's name for a torch file) is a file;
    any other name is a directory, unless it has an extension ckpt does not write
    (``model.safetenors``, ``x.txt``), which is refused rather than silently made a
    directory. An extension is a suffix of letters and digits starting with a letter
    (:func:`is_extension`): ``checkpoint-1.5`` and ``step_0001.00`` are directory names. An
    existing directory, or a name given with a trailing slash (``directory``), is a
    directory whatever its suffix.

    Args:
        dest: The output path.
        fmt: ``safetensors``, ``pt``, or None to infer it.
        directory: The name was given with a trailing slash: the user means a directory.

    Returns:
        ``safetensors`` or ``pt``.

    Raises:
        UsageError: An unknown format, one that contradicts the file name (``x.pt`` as
            safetensors would mislead every later reader), or an output name with an
            extension ckpt does not write.
    """
    by_suffix = {".safetensors": "safetensors", ".pt": "pt", ".pth": "pt", ".bin": "pt",
                 ".ckpt": "pt"}
    implied = by_suffix.get(dest.suffix)
    accepted = ", ".join(FILE_SUFFIXES[:-1]) + f" or {FILE_SUFFIXES[-1]}"
    if implied and directory:
        raise UsageError(f"{dest}/: ends in '/' (a directory) but names a {dest.suffix} file; "
                         f"drop the '/' for a file, or name the directory without {dest.suffix}")
    if implied and dest.is_dir():
        raise UsageError(f"{dest}: an existing directory, but a {dest.suffix} output is one "
                         "file; name another file, or remove the directory first")
    if not implied and dest.suffix.lower() in by_suffix:
        raise UsageError(f"{dest}: write the extension in lower case "
                         f"({dest.suffix.lower()!r}); ckpt and the loaders match it exactly")
    if (not implied and not directory and is_extension(dest.suffix)
            and not dest.is_dir()):
        raise UsageError(f"{dest}: unknown output extension {dest.suffix!r}; a file must end "
                         f"in {accepted}; a directory has no extension (or give it with a "
                         "trailing '/')")
    if fmt is None:
        return implied or "safetensors"
    if fmt not in FORMATS:
        raise UsageError(f"--format must be safetensors or pt, not {fmt!r}")
    if implied and implied != fmt:
        raise UsageError(f"--format {fmt} does not match the file name {dest.name!r}",
                         hint=f"name it *.{'safetensors' if fmt == 'safetensors' else 'pt'}")
    return fmt


def names_directory(output: str | os.PathLike[str]) -> bool:
    """Whether an output argument ends in a slash: the user means a directory.

    Args:
        output: The output as given (a ``str`` keeps its trailing slash, a ``Path`` has none).

    Returns:
        True for ``out/`` or ``s3://bucket/out/``.
    """
    return isinstance(output, str) and len(output) > 1 and output.endswith(("/", os.sep))


_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,15}")


def is_extension(suffix: str) -> bool:
    """Whether a name's suffix is a file extension (``.txt``, ``.h5``, ``.safetenors``) rather
    than part of a directory name (``.5`` in ``checkpoint-1.5``, ``.00``, ``.my_run``).

    Args:
        suffix: ``Path.suffix`` of the name (``""`` for none).

    Returns:
        True for a dot, a letter and up to 15 more letters or digits.
    """
    return _EXTENSION.fullmatch(suffix) is not None


@dataclass(frozen=True, slots=True)
class OutTensor:
    """One tensor to write.

    Attributes:
        name: Its name in the output.
        dtype: Output dtype code.
        shape: Output shape.
        load: Returns the values: a C-contiguous numpy array of ``dtype`` and ``shape``.
        pieces: Optionally, returns an iterator over the values in row-major order as
            flat arrays of ``dtype`` (together ``nbytes``); used instead of ``load`` when
            given, so that a large tensor never sits in memory whole.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]
    pieces: Callable[[], Iterator[np.ndarray]] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        n = 1
        for d in self.shape:
            n *= d
        return dtypes.nbytes_of(self.dtype, n)

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(slots=True)
class WriteResult:
    """What was written.

    Attributes:
        path: The output file or directory.
        files: ``(name, bytes)`` of each file written (relative to ``path`` for a directory).
        index_file: The index file's name, when sharded.
        tensor_bytes: Bytes of tensor data written.
        tensors: Number of tensors written.
        part: What this process did of a split write (``--part``), else None.
    """

    path: Path
    files: list[tuple[str, int]] = field(default_factory=list)
    index_file: str | None = None
    tensor_bytes: int = 0
    tensors: int = 0
    part: PartOutcome | None = None


def write_checkpoint(dest: Path, tensors: Sequence[OutTensor], *, fmt: str = "safetensors",
                     max_shard_size: int | None = None, metadata: dict[str, str] | None = None,
                     aliases: dict[str, str] | None = None, overwrite: bool = False,
                     side_files: dict[str, bytes] | None = None,
                     on_progress: Callable[[int], None] | None = None,
                     before_commit: Callable[[Path], None] | None = None,
                     on_start: Callable[[int], None] | None = None,
                     part: PartJob | None = None,
                     max_memory: int | None = None) -> WriteResult:
    """Write tensors as one file or as HF-style shards with an index, atomically.

    ``dest`` is a file when it ends in a :data:`FILE_SUFFIXES` extension (then the
    output must fit one shard), otherwise a directory holding ``model.safetensors`` (or
    ``pytorch_model.bin``) or shards ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json``.

    Args:
        dest: Output file or directory.
        tensors: The tensors, in output order.
        fmt: ``safetensors`` or ``pt``.
        max_shard_size: Largest shard in bytes (None: one file).
        metadata: String metadata (safetensors ``__metadata__``; recorded in the index too).
        aliases: ``{alias: name}`` for tied tensors written once. safetensors records them in
            ``__metadata__`` (as ``safetensors.torch.save_model`` does); pt writes the alias
            as a second key sharing the storage (as ``torch.save`` does).
        overwrite: Replace an existing ``dest``.
        side_files: Extra small files to put next to the weights (directory output only),
            e.g. ``config.json``.
        on_progress: Called with the number of bytes just written.
        before_commit: Called with the temporary path when everything is written but not yet
            renamed into place (to check or verify it); an exception discards the output.
            With ``part``: called with the staged directory once this part's shards are in.
        on_start: Called once with the bytes of tensor data this process will write.
        part: Write only this process's share of the shards, and finalize when every part
            is done (:mod:`ckpt_cli.writers.parts`).
        max_memory: Bytes of tensor data read and cast ahead of the writer (``--max-memory``;
            default :data:`ckpt_cli.storage.reads.MEMORY_BUDGET`).

    Returns:
        The :class:`WriteResult`.

    Raises:
        UsageError: Bad format, a single-file ``dest`` that the shard size would split, or
            ``max_memory`` below one piece.
        DestinationExistsError: ``dest`` exists and ``overwrite`` is False.
    """
    if fmt not in FORMATS:
        raise UsageError(f"--format must be safetensors or pt, not {fmt!r}")
    budget = memory_budget(max_memory)
    _check_dtypes(tensors, fmt)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise UsageError("two output tensors have the same name")
    stem, ext = _NAMING[fmt]
    plan = plan_shards([t.nbytes for t in tensors], max_shard_size, stem=stem, ext=ext)
    as_file = dest.suffix in FILE_SUFFIXES
    if as_file and plan.sharded:
        raise UsageError(f"{len(plan.files)} shards at this --max-shard-size; give -o a "
                         f"directory, not the file name {dest.name!r}")
    result = WriteResult(path=dest, tensors=len(tensors))
    meta = dict(metadata or {})
    if fmt == "safetensors":
        meta.setdefault("format", "pt")  # transformers refuses safetensors files without it
        meta.update(aliases or {})
    if overwrite and not as_file:
        _check_replaceable(dest)
    content_id = _content_id(fmt, tensors, plan, meta, aliases, side_files)
    ids = {f: _serialization_id(content_id, f) for f in plan.files}
    remote = not storage.can_rename_atomically(dest)  # then uploads, the marker last
    if remote and part is not None:
        raise UsageError("--part needs a local (shared) output directory for its receipts; "
                         "an output on object storage is written by one process for now")
    try:
        if remote:
            if on_start:
                on_start(sum(t.nbytes for t in tensors))
            _write_remote(dest, fmt, tensors, plan, meta, aliases, overwrite, side_files,
                          result, on_progress, before_commit, ids, as_file, budget)
        elif part is not None:
            _write_part(dest, fmt, tensors, plan, meta, aliases, overwrite, side_files, result,
                        on_progress, before_commit, on_start, part, content_id, ids, as_file,
                        budget)
            return result
        else:
            if on_start:
                on_start(sum(t.nbytes for t in tensors))
            if as_file:
                _write_file(dest, fmt, tensors, plan, meta, aliases, overwrite, result,
                            on_progress, before_commit, ids, budget=budget)
            else:
                _write_dir(dest, fmt, tensors, plan, meta, aliases, overwrite, side_files,
                           result, on_progress, before_commit, ids, budget=budget)
    except OSError as e:
        where = e.filename if isinstance(e.filename, str) else dest
        raise CkptError(f"cannot write: {e.strerror or e}", path=where) from None
    result.tensor_bytes = sum(t.nbytes for t in tensors)
    return result


def _write_file(dest: Path, fmt: str, tensors: Sequence[OutTensor], plan: ShardPlan,
                meta: dict[str, str], aliases: dict[str, str] | None, overwrite: bool,
                result: WriteResult, on_progress: Callable[[int], None] | None,
                before_commit: Callable[[Path], None] | None, ids: dict[str, str], *,
                budget: int) -> None:
    with atomic_file(dest, overwrite=overwrite) as tmp, _Prefetch(tensors, budget) as source:
        _write_shard(tmp, fmt, tensors, plan.members[0], meta, aliases, source, on_progress,
                     ids[plan.files[0]])
        result.files.append((dest.name, tmp.stat().st_size))
        if before_commit:
            before_commit(tmp)
    # An integrity manifest beside the file described what was there before.
    with contextlib.suppress(FileNotFoundError):
        manifest_path(dest).unlink()


def _write_dir(dest: Path, fmt: str, tensors: Sequence[OutTensor], plan: ShardPlan,
               meta: dict[str, str], aliases: dict[str, str] | None, overwrite: bool,
               side_files: dict[str, bytes] | None, result: WriteResult,
               on_progress: Callable[[int], None] | None,
               before_commit: Callable[[Path], None] | None, ids: dict[str, str], *,
               budget: int) -> None:
    with atomic_dir(dest, overwrite=overwrite) as tmp, _Prefetch(tensors, budget) as source:
        for fname, members in zip(plan.files, plan.members, strict=True):
            _write_shard(tmp / fname, fmt, tensors, members, meta, aliases, source,
                         on_progress, ids[fname])
            result.files.append((fname, (tmp / fname).stat().st_size))
        result.files += _finish_dir(tmp, fmt, tensors, plan, aliases, meta, side_files, result)
        if before_commit:
            before_commit(tmp)
        if overwrite:
            # Again just before the swap: the directory may have changed during a long write.
            _check_replaceable(dest)


def _finish_dir(tmp: Path, fmt: str, tensors: Sequence[OutTensor], plan: ShardPlan,
                aliases: dict[str, str] | None, meta: dict[str, str],
                side_files: dict[str, bytes] | None, result: WriteResult) -> list[tuple[str, int]]:
    """Write the index (when sharded) and the side files; ``(name, bytes)`` of each."""
    files: list[tuple[str, int]] = []
    if plan.sharded:
        result.index_file, size = _write_index(tmp, fmt, tensors, plan, aliases, meta)
        files.append((result.index_file, size))
    for name, data in (side_files or {}).items():
        (tmp / name).write_bytes(data)
        files.append((name, len(data)))
    return files


def _write_remote(dest: Path, fmt: str, tensors: Sequence[OutTensor], plan: ShardPlan,
                  meta: dict[str, str], aliases: dict[str, str] | None, overwrite: bool,
                  side_files: dict[str, bytes] | None, result: WriteResult,
                  on_progress: Callable[[int], None] | None,
                  before_commit: Callable[[Path], None] | None, ids: dict[str, str],
                  as_file: bool, budget: int) -> None:
    """Write to object storage, where nothing can be renamed: atomic by ordering.

    Each object is a multipart upload that becomes visible only when it completes (and is
    aborted on any failure). The commit marker is the last object a reader trusts: the index
    of a sharded output, else the lone weights file. Every shard goes up first; then
    ``before_commit`` runs (before the marker's upload completes, for a lone file); then
    the side files and the index. On failure, or Ctrl-C, what this run wrote is deleted and
    an upload in flight aborted. With ``overwrite``, an earlier output's index goes first
    when a new shard would replace one of its shards in place (its set is then no longer
    vouched for), and its keys the new output did not rewrite go last.
    """
    obj = cast(storage.ObjectPath, dest)
    _check_remote_dest(dest, overwrite, as_file)
    check = (lambda: before_commit(dest)) if before_commit else None
    if as_file:
        with _Prefetch(tensors, budget) as source:
            size = _write_shard(dest, fmt, tensors, plan.members[0], meta, aliases, source,
                                on_progress, ids[plan.files[0]], before_close=check)
        result.files.append((dest.name, size))
        manifest_path(dest).unlink(missing_ok=True)  # it described what was there before
        return
    old = set(obj.keys_below()) if overwrite else set()
    new_keys = {f"{obj.key}/{f}" for f in [*plan.files, *(side_files or {})]}
    markers = sorted(k for k in old if k.endswith((".index.json", MANIFEST_NAME)))
    if markers and old & new_keys:
        obj.store.delete(markers)
        old -= set(markers)
    written: list[str] = []
    try:
        with _Prefetch(tensors, budget) as source:
            for n, (fname, members) in enumerate(zip(plan.files, plan.members, strict=True)):
                last = n == len(plan.files) - 1
                size = _write_shard(dest / fname, fmt, tensors, members, meta, aliases, source,
                                    on_progress, ids[fname],
                                    before_close=check if last and not plan.sharded else None)
                written.append(f"{obj.key}/{fname}")
                result.files.append((fname, size))
        if plan.sharded and before_commit:
            before_commit(dest)
        for name, data in (side_files or {}).items():
            (dest / name).write_bytes(data)
            written.append(f"{obj.key}/{name}")
            result.files.append((name, len(data)))
        if plan.sharded:
            result.index_file, size = _write_index(dest, fmt, tensors, plan, aliases, meta)
            written.append(f"{obj.key}/{result.index_file}")
            result.files.append((result.index_file, size))
    except BaseException:
        # Nothing this run wrote may stay to look like an output (an upload in flight was
        # aborted by its own exit).
        with contextlib.suppress(Exception):
            obj.store.delete(written)
        raise
    stale = sorted(old - set(written))
    if stale:
        obj.store.delete(stale)


def _check_remote_dest(dest: Path, overwrite: bool, as_file: bool) -> None:
    """Refuse an output on a store that exists (without ``overwrite``) or is of the other
    kind; with ``overwrite``, a prefix must hold only what ckpt writes."""
    if as_file:
        if dest.is_dir():
            raise DestinationExistsError("is a prefix with objects below it, and this output "
                                         "is a single object; not replacing it", path=dest)
        if dest.exists() and not overwrite:
            raise DestinationExistsError("exists", path=dest,
                                         hint="use --force to replace it")
        return
    if dest.is_file():
        raise DestinationExistsError("is an object, and this output is a prefix of objects; "
                                     "not replacing it", path=dest)
    if dest.is_dir():
        if not overwrite:
            raise DestinationExistsError("exists (objects lie below this prefix)", path=dest,
                                         hint="use --force to replace it")
        _check_replaceable(dest)


def _write_part(dest: Path, fmt: str, tensors: Sequence[OutTensor], plan: ShardPlan,
                meta: dict[str, str], aliases: dict[str, str] | None, overwrite: bool,
                side_files: dict[str, bytes] | None, result: WriteResult,
                on_progress: Callable[[int], None] | None,
                before_commit: Callable[[Path], None] | None,
                on_start: Callable[[int], None] | None, job: PartJob, content_id: str,
                ids: dict[str, str], as_file: bool, budget: int) -> None:
    """This process's share of a split write (see :mod:`ckpt_cli.writers.parts`)."""

    def write_mine(mine: list[int], out_dir: Path) -> Generator[tuple[int, Path], None, None]:
        order = [j for i in mine for j in plan.members[i]]
        own = [tensors[j] for j in order]
        local = {j: n for n, j in enumerate(order)}
        result.tensors, result.tensor_bytes = len(own), sum(t.nbytes for t in own)
        if on_start:
            on_start(result.tensor_bytes)
        with _Prefetch(own, budget) as source:
            for i in mine:
                fname = plan.files[i]
                tmp = out_dir / f".{fname}{TMP_MARK}{os.getpid()}"
                try:
                    _write_shard(tmp, fmt, own, tuple(local[j] for j in plan.members[i]), meta,
                                 aliases, source, on_progress, ids[fname])
                    # Durable before its receipt vouches for it (a power loss must not leave
                    # a receipt for a shard of the right size and the wrong bytes).
                    fsync_path(tmp)
                    os.replace(tmp, out_dir / fname)
                except BaseException:
                    tmp.unlink(missing_ok=True)
                    raise
                yield i, out_dir / fname

    def finish(out_dir: Path) -> list[tuple[str, int]]:
        result.tensors = len(tensors)
        result.tensor_bytes = sum(t.nbytes for t in tensors)
        return _finish_dir(out_dir, fmt, tensors, plan, aliases, meta, side_files, result)

    result.tensors, result.tensor_bytes = 0, 0
    write_parted(dest, job, plan, content_id, as_file, overwrite, result, write_mine, finish,
                 before_commit)


def _content_id(fmt: str, tensors: Sequence[OutTensor], plan: ShardPlan, meta: dict[str, str],
                aliases: dict[str, str] | None, side_files: dict[str, bytes] | None) -> str:
    """Fingerprint of everything an output holds (not the tensor values: their source)."""
    return fingerprint({
        "fmt": fmt, "files": plan.files, "members": plan.members,
        "tensors": [(t.name, t.dtype, t.shape) for t in tensors], "meta": meta,
        "aliases": aliases or {},
        "side": {n: hashlib.sha256(d).hexdigest() for n, d in (side_files or {}).items()}})


def _serialization_id(content_id: str, fname: str) -> str:
    """A torch zip's ``.data/serialization_id``: torch draws it at random and only logs it on
    load; derived from the content here, so that the same conversion gives the same bytes
    (whether one process writes it or many parts do)."""
    digest = hashlib.sha256(f"{content_id}/{fname}".encode()).digest()
    return str(int.from_bytes(digest[:17], "big")).rjust(40, "0")[:40]


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
    for stem, ext in _NAMING.values()) + r"|.*\.ckpt-manifest\.json")
_REPLACEABLE_NAMES = {*SIDE_FILES, MANIFEST_NAME}


def _check_replaceable(dest: Path) -> None:
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


# Dtypes each output format cannot hold: safetensors has no complex128 and no 6-bit floats;
# torch has no 6-bit floats, and its float4 packs pairs with a shape ckpt does not write yet.
# Neither gets torch's own complex32 and raw bit types (no numpy dtype to write them from).
_TORCH_ONLY = {d.code for d in dtypes.DTYPES.values()
               if d.kind in ("complex", "bits") and d.numpy_name is None}
_UNWRITABLE = {"safetensors": {"C128", "F6_E2M3", "F6_E3M2", *_TORCH_ONLY},
               "pt": {"F4", "F6_E2M3", "F6_E3M2", *_TORCH_ONLY}}


def _check_dtypes(tensors: Sequence[OutTensor], fmt: str) -> None:
    bad = [t for t in tensors if t.dtype in _UNWRITABLE[fmt]]
    if bad:
        other = "pt" if fmt == "safetensors" else "safetensors"
        hint = (f"--format {other} can hold {bad[0].dtype}"
                if bad[0].dtype not in _UNWRITABLE[other] else None)
        raise UnsupportedError(f"{fmt} cannot hold {bad[0].dtype} ({bad[0].name}"
                               + (f" and {len(bad) - 1} more" if len(bad) > 1 else "") + ")",
                               hint=hint)


def _write_shard(path: Path, fmt: str, tensors: Sequence[OutTensor], members: tuple[int, ...],
                 meta: dict[str, str], aliases: dict[str, str] | None, source: _Prefetch,
                 on_progress: Callable[[int], None] | None, sid: str | None = None, *,
                 before_close: Callable[[], None] | None = None) -> int:
    """Write one shard file (or object); returns its size. ``before_close`` runs once every
    byte is written and before the file closes (an object's upload completes)."""
    entries = [(tensors[i].name, tensors[i].dtype, tensors[i].shape) for i in members]
    # safetensors: raw writes, looped by write_all. Torch zips: zipfile writes once and ignores
    # short writes (Linux caps one write at ~2 GiB), so it gets a buffered file, whose write()
    # loops until everything is written. An object is an upload, whose writes are never short.
    expected = sum(tensors[i].nbytes for i in members)
    out: Any = storage.create(path, expected=expected,
                              buffering=0 if fmt == "safetensors" else -1)
    with out as f:
        flusher = _Flusher(f)
        if fmt == "safetensors":
            head, _ = header_bytes(entries, meta)
            write_all(f, memoryview(head))
            for i in members:
                for data in _tensor_bytes(source, i, tensors[i]):
                    with stages.stage("write", len(data)):
                        write_all(f, data)
                    flusher.wrote(len(data))
                    if on_progress:
                        on_progress(len(data))
                    del data
        else:
            here = {e[0] for e in entries}
            local = {a: n for a, n in (aliases or {}).items() if n in here}
            zw = TorchZipWriter(f, entries, local, serialization_id=sid)
            try:
                for i in members:
                    with zw.tensor_record(tensors[i].nbytes) as record:
                        for data in _tensor_bytes(source, i, tensors[i]):
                            with stages.stage("write", len(data)):
                                record.write(data)
                            flusher.wrote(len(data))
                            if on_progress:
                                on_progress(len(data))
                            del data
                zw.close()
            except BaseException:
                zw.abandon()
                raise
        # Before the file closes. (On an error, closing while a flush runs is harmless: the
        # kernel holds the file until fdatasync returns, and the error raised says more.)
        flusher.wait()
        if before_close is not None:
            before_close()
        size: int = f.tell()
    return size


class _Flusher:
    """Flushes written data to disk every few hundred MB while writing continues.

    The atomic rename needs everything durable (fsync) first; flushing as we go overlaps that
    disk work with reading, casting and writing the next tensors instead of paying it all at
    the end. Each ``fdatasync`` runs on a thread of its own (write-behind), at most one at a
    time, so dirty data stays within about two intervals; :meth:`wait` collects the last one.
    """

    EVERY = 256 << 20

    def __init__(self, f: Any):
        self.f, self.pending = f, 0
        self._sync: threading.Thread | None = None
        self._error: OSError | None = None

    def wrote(self, n: int) -> None:
        self.pending += n
        if self.pending >= self.EVERY and not isinstance(self.f, storage.Upload):
            self.f.flush()
            self.wait()
            self._sync = threading.Thread(target=self._fdatasync, args=(self.f.fileno(),),
                                          name="ckpt-fdatasync", daemon=True)
            self._sync.start()
            self.pending = 0

    def _fdatasync(self, fd: int) -> None:
        try:
            with stages.stage("fsync"):
                os.fdatasync(fd)
        except OSError as e:  # raised in the writer's thread by wait()
            self._error = e

    def wait(self) -> None:
        """Wait for the flush in progress; raise its error, if any."""
        if self._sync is not None:
            self._sync.join()
            self._sync = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err


def _tensor_bytes(source: _Prefetch, i: int, t: OutTensor) -> Iterator[memoryview]:
    """The bytes of tensor ``i``, piece by piece, checked against its dtype and shape."""
    import numpy as np

    if t.pieces is None:
        for arr in source.pieces(i):
            yield _bytes_of(arr, t)
        return
    try:
        want: np.dtype[Any] = dtypes.numpy_dtype(t.dtype)
    except KeyError:  # packed sub-byte values (F4) travel as raw bytes
        want = np.dtype(np.uint8)
    total = 0
    for arr in source.pieces(i):
        if arr.dtype != want:
            raise ValueError(f"{t.name}: produced a piece of {arr.dtype}, expected {t.dtype}")
        data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data
        total += len(data)
        if total > t.nbytes:
            break
        yield data
    if total != t.nbytes:
        raise ValueError(f"{t.name}: produced {total:,} bytes, expected {t.nbytes:,}")


def out_of_memory(name: str, nbytes: int) -> OutOfMemoryError:
    """The error for an allocation that failed while tensor ``name`` was read or cast.

    Args:
        name: The tensor.
        nbytes: Its size in bytes.

    Returns:
        A one-line error naming the tensor and the memory budget.
    """
    return OutOfMemoryError(
        f"out of memory on tensor {name!r} ({_mib(nbytes)}): ckpt streams tensors in pieces "
        f"of {_mib(PIECE_BYTES)} within a budget of about {_mib(MEMORY_BUDGET)} (strided "
        "views, DCP chunks split along other dimensions and ZeRO partitions are assembled "
        "whole); nothing written",
        hint="free memory or raise the limit (ulimit -v)")


def _mib(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n:,} bytes"


def _bytes_of(arr: np.ndarray, t: OutTensor) -> memoryview:
    """The tensor's bytes as a flat memoryview, after checking dtype and shape."""
    import numpy as np

    # Sub-byte types (F4) travel as packed bytes whose shape differs from the logical one.
    if arr.nbytes != t.nbytes or (tuple(arr.shape) != t.shape and t.dtype != "F4"):
        raise ValueError(f"{t.name}: produced {arr.dtype}{list(arr.shape)}, expected "
                         f"{t.dtype}{list(t.shape)}")
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return flat.data


def _write_index(tmp: Path, fmt: str, tensors: Sequence[OutTensor], plan: ShardPlan,
                 aliases: dict[str, str] | None, meta: dict[str, str]) -> tuple[str, int]:
    from ckpt_cli.formats.hf_index import count_parameters

    stem, ext = _NAMING[fmt]
    weight_map: dict[str, str] = {}
    for fname, members in zip(plan.files, plan.members, strict=True):
        for i in members:
            weight_map[tensors[i].name] = fname
    if fmt == "pt":  # a tied alias is a real key of the shard holding its target
        for alias, target in (aliases or {}).items():
            weight_map[alias] = weight_map[target]
    # Counted as inspect counts the output (model weights only, tied copies once): read back
    # from the shards just written, which the index, written last, commits.
    index: dict[str, Any] = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors),
                     "total_parameters": count_parameters(tmp, list(plan.files)),
                     **{k: v for k, v in meta.items() if k.startswith("ckpt.")}},
        "weight_map": dict(sorted(weight_map.items())),
    }
    name = f"{stem}{ext}.index.json"
    data = orjson.dumps(index, option=orjson.OPT_INDENT_2) + b"\n"
    (tmp / name).write_bytes(data)
    return name, len(data)


_END = object()  # after a tensor's last piece


class _Prefetch:
    """Produces tensors (or pieces of them) in order on a background thread, up to a budget
    of bytes ahead of the writer.

    Reading and casting (numpy, torch and file reads release the GIL; casts use every core)
    run ahead of writing as far as ``budget`` allows: the pieces produced and not yet written
    (the one being written included) stay within it, so the writer has data when the disk is
    ready and the reader keeps going while the writer waits on a flush. A piece larger than
    the budget is produced alone. A tensor without :attr:`OutTensor.pieces` is one piece.

    Args:
        tensors: What to produce, in order.
        budget: Bytes of produced, unwritten pieces (default
            :data:`ckpt_cli.storage.reads.MEMORY_BUDGET`).
    """

    def __init__(self, tensors: Sequence[OutTensor], budget: int | None = None):
        self._tensors = tensors
        self._budget = budget or MEMORY_BUDGET
        self._q: queue.Queue[tuple[int, Any, BaseException | None]] = queue.Queue()
        self._room = threading.Condition()
        self._held = 0  # bytes produced and not yet released by the writer
        self.peak = 0  # the most bytes held at once (for tests)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckpt-prefetch", daemon=True)
        self._thread.start()

    def _wait_for_room(self, need: int) -> bool:
        """Block until ``need`` more bytes fit the budget (or nothing is held)."""
        with self._room:
            while self._held and self._held + need > self._budget:
                if self._stop.is_set():
                    return False
                self._room.wait(0.1)
        return not self._stop.is_set()

    def _hold(self, n: int) -> None:
        with self._room:
            self._held += n
            self.peak = max(self.peak, self._held)

    def _release(self, n: int) -> None:
        with self._room:
            self._held -= n
            self._room.notify_all()

    def _put(self, item: tuple[int, Any, BaseException | None]) -> bool:
        if self._stop.is_set():
            return False
        self._q.put(item)
        return True

    def _run(self) -> None:
        last = 0  # size of the previous piece: what the next one will likely need
        for i, t in enumerate(self._tensors):
            if self._stop.is_set():
                return
            try:
                pieces = t.pieces() if t.pieces is not None else iter((t.load(),))
                try:
                    while self._wait_for_room(last or min(t.nbytes, PIECE_BYTES)):
                        with stages.stage("read+cast"):
                            arr: Any = next(pieces, _END)
                        if arr is _END:
                            break
                        last = int(arr.nbytes)
                        self._hold(last)
                        if not self._put((i, arr, None)):
                            return
                        del arr
                    else:
                        return  # stopped
                finally:
                    close = getattr(pieces, "close", None)
                    if close is not None:
                        close()  # a generator's mappings and files go now, not at GC
                if not self._put((i, _END, None)):
                    return
            except MemoryError:
                # Not a bug: the tensor does not fit the memory there is. Say which one.
                self._put((i, None, out_of_memory(t.name, t.nbytes)))
                return
            except BaseException as e:  # handed to the writer thread, which re-raises it
                self._put((i, None, e))
                return

    def pieces(self, i: int) -> Iterator[np.ndarray]:
        """The values of tensor ``i``, piece by piece (tensors must be asked for in order).

        A piece counts against the budget until the next one is asked for."""
        while True:
            try:
                j, arr, err = self._q.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive() and self._q.empty():
                    raise RuntimeError("tensor producer stopped early") from None
                continue
            if err is not None:
                raise err
            if j != i:
                raise RuntimeError(f"tensor {j} produced while {i} was expected")
            if arr is _END:
                return
            n = int(arr.nbytes)
            try:
                yield arr
            finally:
                del arr
                self._release(n)

    def __enter__(self) -> _Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the producer and drop what it prepared."""
        self._stop.set()
        with self._room:
            self._room.notify_all()
        with contextlib.suppress(queue.Empty):
            while True:
                self._q.get_nowait()
        self._thread.join(timeout=5)
