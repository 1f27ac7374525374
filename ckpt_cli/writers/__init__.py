"""Writing checkpoints: safetensors or torch zip, single file or HF-style shards + index.

Shared by ``convert`` and ``consolidate``. The caller describes each output tensor and how to
produce its values (:class:`OutTensor`); :func:`write_checkpoint` plans shards
(:mod:`.plan`), picks the destination's :class:`~.sink.Sink` (a local file or directory, a
prefix on object storage, one part of a split job), and runs one path for all of them: each
shard streamed into the sink one tensor at a time while a background thread reads and casts
ahead within a memory budget (:mod:`.pipeline`, :mod:`.files`), then the index and side files,
then the sink's commit, which keeps the destination's atomicity.

This module is the package's front door: it re-exports what the commands use.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli import storage
from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.model import WrittenFile
from ckpt_cli.parts import PartOutcome, fingerprint
from ckpt_cli.storage.atomic import check_destination
from ckpt_cli.storage.reads import memory_budget
from ckpt_cli.writers import files
from ckpt_cli.writers.parts import PartJob, PartSink
from ckpt_cli.writers.pipeline import Prefetch, Syncer
from ckpt_cli.writers.plan import (
    FILE_SUFFIXES,
    FORMATS,
    NAMING,
    OutTensor,
    ShardPlan,
    check_dtypes,
    index_name,
    is_extension,
    names_directory,
    output_format,
    plan_shards,
)
from ckpt_cli.writers.sink import (
    SIDE_FILES,
    DirSink,
    FileSink,
    ObjectSink,
    Sink,
    Tail,
    check_replaceable,
)

__all__ = ["FILE_SUFFIXES", "FORMATS", "SIDE_FILES", "OutTensor", "PartJob", "WriteResult",
           "is_extension", "names_directory", "output_format", "write_checkpoint"]


@dataclass(slots=True)
class WriteResult:
    """What was written.

    Attributes:
        path: The output file or directory.
        files: Each file written, :class:`~ckpt_cli.model.WrittenFile` ``(path, bytes)``
            (``path`` relative to :attr:`path` for a directory).
        index_file: The index file's name, when sharded.
        tensor_bytes: Bytes of tensor data written.
        tensors: Number of tensors written.
        part: What this process did of a split write (``--part``), else None.
    """

    path: Path
    files: list[WrittenFile] = field(default_factory=list)
    index_file: str | None = None
    tensor_bytes: int = 0
    tensors: int = 0
    part: PartOutcome | None = None

    def document(self) -> dict[str, Any]:
        """What the writing commands' ``--json`` documents say of it: ``files``,
        ``index_file``, ``tensor_bytes`` and, for a split write, ``part``."""
        return {"files": [{"path": n, "bytes": b} for n, b in self.files],
                "index_file": self.index_file, "tensor_bytes": self.tensor_bytes,
                **({"part": self.part.to_dict()} if self.part else {})}


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
        raise UsageError(f"fmt must be safetensors or pt, not {fmt!r}", param="fmt")
    budget = memory_budget(max_memory)
    check_dtypes(tensors, fmt)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise UsageError("two output tensors have the same name")
    stem, ext = NAMING[fmt]
    _check_sizes(tensors, dest)
    plan = plan_shards([t.nbytes for t in tensors], max_shard_size, stem=stem, ext=ext)
    _check_shards(plan, tensors, dest)
    as_file = dest.suffix in FILE_SUFFIXES
    if as_file and plan.sharded:
        raise UsageError(f"{len(plan.files)} shards at this max_shard_size; give output a "
                         f"directory, not the file name {dest.name!r}",
                         param=("max_shard_size", "output"))
    result = WriteResult(path=dest, tensors=len(tensors))
    meta = dict(metadata or {})
    if fmt == "safetensors":
        meta.setdefault("format", "pt")  # transformers refuses safetensors files without it
        meta.update(aliases or {})
    if overwrite and not as_file:
        check_replaceable(dest)
    content_id = _content_id(fmt, tensors, plan, meta, aliases, side_files)
    ids = {f: _serialization_id(content_id, f) for f in plan.files}
    rename = storage.can_rename_atomically(dest)  # else uploads, the marker last
    if not rename and part is not None:
        raise UsageError("part needs a local (shared) output directory for its receipts; "
                         "an output on object storage is written by one process for now",
                         param="part")
    tail = Tail(None if not plan.sharded else
                (index_name(fmt),
                 lambda root: files.index_bytes(root, fmt, tensors, plan, aliases, meta)),
                {} if as_file else dict(side_files or {}))
    try:
        sink: Sink
        if part is not None:  # claims the part: checks, joins the staged plan
            sink = PartSink(dest, plan, overwrite=overwrite, before_commit=before_commit,
                            job=part, content_id=content_id, as_file=as_file)
        elif not rename:
            sink = ObjectSink(dest, plan, overwrite=overwrite, before_commit=before_commit,
                              as_file=as_file, sides=list(side_files or {}))
        else:
            sink = (FileSink if as_file else DirSink)(dest, plan, overwrite=overwrite,
                                                      before_commit=before_commit)
        result.part = sink.part
        # The tensors this process writes (a part: those of its shards), renumbered in order.
        order = [j for i in sink.shards or () for j in plan.members[i]]
        own = [tensors[j] for j in order]
        local = {j: n for n, j in enumerate(order)}
        result.tensors, result.tensor_bytes = len(own), sum(t.nbytes for t in own)
        if on_start and sink.shards is not None:
            on_start(result.tensor_bytes)
        with sink:
            if sink.shards is not None:
                _write_shards(sink, plan, fmt, own, local, meta, aliases, on_progress, ids,
                              budget)
            sink.commit(tail)
    except OSError as e:
        if isinstance(e, CkptError):  # DestinationExistsError is a FileExistsError too
            raise
        where = e.filename if isinstance(e.filename, str) else dest
        raise CkptError(f"cannot write: {e.strerror or e}", path=where) from None
    if sink.complete:
        result.tensors, result.tensor_bytes = len(tensors), sum(t.nbytes for t in tensors)
    result.files = [WrittenFile(n, b) for n, b in sink.files]
    result.index_file = sink.index_file
    return result


MAX_FILE = (1 << 63) - 1
"""Bytes a file can hold (a signed 64-bit offset): safetensors' offsets and zip64's sizes are
checked against it before any header is built, so that an impossible shape declared by a
damaged source (a DCP ``.metadata``) is an error naming it, not a writer's overflow."""


def check_output(dest: Path, *, overwrite: bool, finishing: bool = False) -> None:
    """Refuse, before any reading, an output :func:`write_checkpoint` would refuse at its
    end: a symbolic link, FIFO or device, a place that cannot be written, an existing output
    without ``overwrite`` (:func:`ckpt_cli.storage.atomic.check_destination`; missing parents
    are fine, the write creates them).

    Args:
        dest: The output file (``.safetensors``, ``.pt``...) or directory.
        overwrite: An existing output may be replaced.
        finishing: A split job's finalize or part: an existing output is its parts' work,
            said by the part sink, not here.

    Raises:
        DestinationError: ckpt does not write there.
        DestinationExistsError: It exists and ``overwrite`` is False.
    """
    check_destination(dest, kind="file" if dest.suffix in FILE_SUFFIXES else "dir",
                      overwrite=overwrite or finishing, parents=True)


def _check_sizes(tensors: Sequence[OutTensor], dest: Path) -> None:
    for t in tensors:
        if t.nbytes > MAX_FILE:
            raise CkptError(f"tensor {t.name!r} of shape {list(t.shape)} would be "
                            f"{t.nbytes:,} bytes, more than a file can hold (2^63-1): the "
                            "source declares a shape no tensor can have", path=dest)


def _check_shards(plan: ShardPlan, tensors: Sequence[OutTensor], dest: Path) -> None:
    for fname, size, members in zip(plan.files, plan.sizes, plan.members, strict=True):
        if size > MAX_FILE:
            big = max(members, key=lambda j: tensors[j].nbytes)
            raise CkptError(f"{fname} would hold {size:,} bytes, more than a file can hold "
                            f"(2^63-1; its largest tensor {tensors[big].name!r} is "
                            f"{list(tensors[big].shape)}): give max_shard_size", path=dest)


def _write_shards(sink: Sink, plan: ShardPlan, fmt: str, own: list[OutTensor],
                  local: dict[int, int], meta: dict[str, str], aliases: dict[str, str] | None,
                  on_progress: Callable[[int], None] | None, ids: dict[str, str],
                  budget: int) -> None:
    """Stream the sink's shards into it, each through :meth:`Sink.open`."""
    # safetensors: raw writes, looped by write_all. Torch zips: zipfile writes once and ignores
    # short writes (Linux caps one write at ~2 GiB), so it gets a buffered file, whose write()
    # loops until everything is written. An object is an upload, whose writes are never short.
    buffering = 0 if fmt == "safetensors" else -1
    syncer = Syncer()  # each shard syncs in the background while the next one is written
    with Prefetch(own, budget) as source:
        for i in sink.shards or ():
            fname = plan.files[i]
            members = tuple(local[j] for j in plan.members[i])
            with sink.open(fname, expected=sum(own[k].nbytes for k in members),
                           buffering=buffering) as f:
                files.write_shard(f, fmt, own, members, meta, aliases, source, on_progress,
                                  syncer, ids[fname])
    syncer.wait()  # every shard durable (or the write fails) before the commit


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
