"""torch.distributed.checkpoint (DCP) directories, read without torch.

``.metadata`` is a plain pickle of DCP's dataclasses; torch reads it with an unrestricted
``pickle.load`` and joins ``relative_path`` unchecked. ckpt reads it with the allowlisting
unpickler (DCP's classes become inert records) and refuses paths that leave the directory.
Each tensor chunk and each non-tensor item is a complete torch.save zip stored at
``(relative_path, offset, length)`` inside a ``__<rank>_<n>.distcp`` file.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import functools
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli import dtypes, storage
from ckpt_cli.errors import CkptError, CorruptCheckpointError, UnsupportedError
from ckpt_cli.formats import allowlist, containers, dcp_train, zipshape
from ckpt_cli.formats.base import (
    DirectoryLayout,
    contained_path,
    file_size,
    open_stream,
    present,
)
from ckpt_cli.formats.standins import DTypeRef, Opaque, TensorRecord
from ckpt_cli.formats.torchzip import parse_zip
from ckpt_cli.formats.unpickler import UNPICKLE_ERRORS, PickleResult, safe_load
from ckpt_cli.model import CheckpointIndex, Chunk, FileInfo, Finding, TensorInfo

if TYPE_CHECKING:
    import numpy as np

    from ckpt_cli.storage import Handle

METADATA = ".metadata"
_DISTCP = re.compile(r"^__(?:thin[0-9a-f]{8}_)?(\d+)_(\d+)\.distcp\Z")  # tagged: ckpt thinning
_MAX_BYTES_ITEM = 1 << 20
_MAX_BYTES_ITEMS = 4096


def metadata_file(path: Path) -> Path | None:
    """The DCP metadata file of a directory: ``.metadata`` or a lone ``__<rank>.metadata``."""
    p = path / METADATA
    if present(p):  # a FIFO there is reported when read, not taken for an unfinished save
        return p
    alts = sorted(path.glob("__*.metadata"))
    return alts[0] if len(alts) == 1 else None


class DCPReader(DirectoryLayout):
    """Reads a torch.distributed.checkpoint directory's ``.metadata``."""

    name = "dcp"
    missing = "no .metadata or __<rank>_<n>.distcp files"

    def recognises(self, path: Path) -> bool:
        """A ``.metadata`` file, or ``.distcp`` files without one: an unfinished save, which
        ``read_index`` reports."""
        return (metadata_file(path) is not None
                or any(_DISTCP.match(p.name) for p in path.iterdir()))

    def read_index(self, path: Path) -> CheckpointIndex:
        """See :meth:`ckpt_cli.formats.base.Reader.read_index`."""
        index = CheckpointIndex(format=self.name, root=path, base=path)
        read_into(index, path)
        return index


_KEPT: contextvars.ContextVar[dict[tuple[Any, ...], Any] | None] = contextvars.ContextVar(
    "ckpt_dcp_kept", default=None)


@contextlib.contextmanager
def keep_storage_maps() -> Iterator[None]:
    """Within it, the storage map :func:`read_into` parsed is kept for :func:`storage_of`
    (``validate`` reads the index, then checks where every item lies: one parse, not two)."""
    token = _KEPT.set({})
    try:
        yield
    finally:  # nothing outlives it
        _KEPT.reset(token)


def _identity(base: Path, meta_path: Path) -> tuple[Any, ...]:
    st = meta_path.stat()  # a .metadata replaced in between is parsed again
    return (str(base), str(meta_path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def storage_of(base: Path, meta_path: Path) -> dict[Any, Any]:
    """:func:`storage_map` of a ``.metadata``: the one :func:`read_into` kept (see
    :func:`keep_storage_maps`) if the file is unchanged, else parsed now."""
    kept = _KEPT.get()
    if kept:
        with contextlib.suppress(OSError, KeyError):
            return kept.pop(_identity(base, meta_path))  # type: ignore[no-any-return]
    fields, _ = parse_metadata(meta_path)
    return storage_map(fields.get("storage_data"), base, meta_path)


def parse_metadata(path: Path) -> tuple[dict[str, Any], PickleResult]:
    """Unpickle a ``.metadata`` file safely.

    Args:
        path: The ``.metadata`` file.

    Returns:
        ``(fields of Metadata, the pickle's result: its globals and calls)``.

    Raises:
        CorruptCheckpointError: If it is not a DCP metadata pickle.
    """
    try:
        with open_stream(path) as f:
            result = safe_load(f)
    except UNPICKLE_ERRORS as e:
        raise CorruptCheckpointError(f"not a readable DCP metadata pickle ({e})",
                                     path=path) from None
    except OSError as e:
        raise CkptError(f"cannot read: {e.strerror}", path=path) from None
    obj = result.obj
    if not (isinstance(obj, Opaque) and obj.qualname.endswith("checkpoint.metadata.Metadata")):
        raise CorruptCheckpointError("pickle is not a torch.distributed.checkpoint Metadata",
                                     path=path)
    fields = obj.fields()
    if not isinstance(fields.get("state_dict_metadata"), dict):
        raise CorruptCheckpointError("Metadata has no state_dict_metadata", path=path)
    return fields, result


def read_into(index: CheckpointIndex, path: Path) -> None:
    """Fill ``index`` from a DCP directory.

    Args:
        index: The index (its ``base`` is the DCP directory).
        path: The DCP directory.

    Raises:
        CorruptCheckpointError: No ``.metadata`` (the save did not finish) or a bad one.
        UnsafeCheckpointError: A storage path leaves the directory.
    """
    meta_path = metadata_file(path)
    distcp = sorted(p for p in path.iterdir() if _DISTCP.match(p.name))
    if meta_path is None:
        raise CorruptCheckpointError(
            f"{len(distcp)} .distcp file(s) but no .metadata: the save did not finish "
            "(DCP writes .metadata last)", path=path)
    identity = _identity(path, meta_path) if (kept := _KEPT.get()) is not None else None
    fields, globals_seen = parse_metadata(meta_path)
    for f in allowlist.pickle_findings(globals_seen, file=meta_path.name,
                                       what="metadata pickle"):
        if f.severity != "info":
            index.add(f)
    index.files.append(FileInfo(meta_path.name, file_size(meta_path), "metadata", "dcp"))
    sizes = {p.name: file_size(p) for p in distcp}
    storage = storage_map(fields.get("storage_data"), path, meta_path)
    if kept is not None and identity is not None:  # validate parses it once
        kept[identity] = storage
    raw_planner = fields.get("planner_data")
    planner: dict[str, Any] = raw_planner if isinstance(raw_planner, dict) else {}
    referenced: set[str] = set()
    bytes_items: list[tuple[str, str, int, int]] = []
    for fqn, md in fields["state_dict_metadata"].items():
        if not isinstance(md, Opaque):
            raise CorruptCheckpointError(f"entry {fqn!r} is not storage metadata", path=meta_path)
        name = str(fqn)
        if md.qualname.endswith("BytesStorageMetadata"):
            loc = storage.get((name, None))
            if loc is not None:
                referenced.add(loc[0])
                bytes_items.append((name, loc[0], loc[1], loc[2]))
            else:
                index.add(Finding("error", "missing-chunk", "no storage entry for this object",
                                  meta_path.name, name))
            continue
        info = _tensor(name, md.fields(), storage, index, meta_path.name)
        index.tensors[name] = info
        tree_path = planner.get(name)
        if isinstance(tree_path, tuple) and len(tree_path) > 1:
            index.containers.setdefault(f"{tree_path[0]}.", "model" if info.group == "buffer"
                                        else info.group)
        referenced.update(c.file for c in info.chunks)
    for rel in sorted(referenced):
        if rel not in sizes:
            full = path / rel
            if full.is_file():
                sizes[rel] = file_size(full)
            else:
                index.add(Finding("error", "missing-file",
                                  "referenced by .metadata but missing", rel))
    for rel, size in sorted(sizes.items()):
        index.files.append(FileInfo(rel, size, "shard", "dcp"))
    _check_bounds(index, sizes)
    _check_tiling(index, meta_path.name)
    _read_objects(index, path, bytes_items, sizes)
    # Ranks from the files .metadata names: a stray file (validate reports it) is not a rank.
    named = [p for p in distcp if p.name in referenced] or distcp
    ranks = {int(m.group(1)) for p in named if (m := _DISTCP.match(p.name))}
    index.layout.update({"world_size": len(ranks) if ranks else None,
                         "ranks": sorted(ranks), "files_per_rank": _per_rank(named)})
    version = fields.get("version")
    if isinstance(version, str):
        index.metadata["dcp_version"] = version
    if (path / "metadata.json").is_file():
        index.flavor = "megatron-dist"
        index.files.append(FileInfo("metadata.json", file_size(path / "metadata.json"),
                                    "metadata", "json"))
    step = dcp_train.train_step(index, locate_chunk)
    for k, v in containers.extract_metadata(_nested(index.objects) | step).items():
        index.metadata.setdefault(k, v)


def _per_rank(distcp: list[Path]) -> int | None:
    counts: dict[str, int] = {}
    for p in distcp:
        m = _DISTCP.match(p.name)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return max(counts.values()) if counts else None


def storage_map(raw: Any, base: Path,
                meta_path: Path) -> dict[tuple[str, tuple[int, ...] | None],
                                         tuple[str, int, int, tuple[str, ...]]]:
    """Where every item of a DCP checkpoint is stored (``Metadata.storage_data``).

    Args:
        raw: The unpickled ``storage_data`` field.
        base: The checkpoint directory.
        meta_path: The ``.metadata`` file (for messages).

    Returns:
        ``(fqn, chunk offsets or None for a non-tensor item)`` ->
        ``(relative path, byte offset, byte length, transforms)``.

    Raises:
        CorruptCheckpointError: A malformed entry.
        UnsafeCheckpointError: A path that leaves ``base``.
    """
    if not isinstance(raw, dict):
        raise CorruptCheckpointError("Metadata has no storage_data", path=meta_path)
    out: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int, tuple[str, ...]]] = {}
    checked: set[str] = set()  # thousands of items share a few files: resolve each path once
    for key, val in raw.items():
        if not isinstance(key, Opaque) or not isinstance(val, Opaque):
            raise CorruptCheckpointError("malformed storage_data entry", path=meta_path)
        k, v = key.fields(), val.fields()
        rel, off, length = v.get("relative_path"), v.get("offset"), v.get("length")
        if (not isinstance(rel, str) or not isinstance(off, int) or not isinstance(length, int)
                or not -dtypes.MAX_ELEMENTS <= off <= dtypes.MAX_ELEMENTS
                or not -dtypes.MAX_ELEMENTS <= length <= dtypes.MAX_ELEMENTS):
            raise CorruptCheckpointError(f"malformed storage info for {str(k.get('fqn'))[:80]!r}",
                                         path=meta_path)
        if rel not in checked:
            contained_path(base, rel, what="storage", source=meta_path)
            checked.add(rel)
        offs = k.get("offset")
        if offs is not None and _counts(offs) is None:
            raise CorruptCheckpointError(f"malformed chunk offsets for {str(k.get('fqn'))[:80]!r}",
                                         path=meta_path)
        transforms = _transforms(v.get("transform_descriptors"))
        out[(str(k.get("fqn")), tuple(offs) if offs is not None else None)] = (
            rel, off, length, transforms)
    return out


def _transforms(raw: Any) -> tuple[str, ...]:
    if not raw:
        return ()
    if isinstance(raw, (list, tuple)):
        return tuple(str(x) for x in raw)
    return (str(raw),)


def _tensor(name: str, f: dict[str, Any], storage: dict[Any, Any], index: CheckpointIndex,
            meta_rel: str) -> TensorInfo:
    props = f.get("properties")
    dtype = None
    if isinstance(props, Opaque):
        st = props.state
        first = st[0] if isinstance(st, tuple) and st else props.fields().get("dtype")
        if isinstance(first, DTypeRef):
            dtype = first.code
    if dtype is None:
        raise CorruptCheckpointError(f"tensor {name!r} has no known dtype", path=meta_rel)
    size = _counts(f.get("size") or ())
    if size is None:
        raise CorruptCheckpointError(f"tensor {name!r} has a malformed size "
                                     f"{str(f.get('size'))[:80]}", path=meta_rel)
    if (why := dtypes.shape_problem(size)) is not None:
        raise CorruptCheckpointError(f"tensor {name!r} declares {why}", path=meta_rel)
    raw_chunks = f.get("chunks") or []
    if not isinstance(raw_chunks, list):
        raise CorruptCheckpointError(f"tensor {name!r} has malformed chunks", path=meta_rel)
    chunks: list[Chunk] = []
    for c in raw_chunks:
        cf = c.fields() if isinstance(c, Opaque) else {}
        offs, sizes = _counts(cf.get("offsets")), _counts(cf.get("sizes"))
        if offs is None or sizes is None or len(offs) != len(size) or len(sizes) != len(size):
            index.add(Finding("error", "chunk-tiling", f"chunk {cf.get('offsets')!r} / "
                              f"{cf.get('sizes')!r} does not describe a piece of a "
                              f"{len(size)}-dimensional tensor", meta_rel, name))
            continue
        loc = storage.get((name, offs))
        if loc is None:
            index.add(Finding("error", "missing-chunk",
                              f"chunk at offsets {list(offs)} has no storage entry", meta_rel,
                              name))
            continue
        rel, off, length, transforms = loc
        chunks.append(Chunk(offs, sizes, rel, off, length, transforms))
    numel = math.prod(size)
    group = containers.group_of(tuple(name.split(".")), None, "model")
    if group == "model" and containers.is_buffer_name(name, dtype):
        group = "buffer"
    return TensorInfo(name, dtype, size, dtypes.nbytes_of(dtype, numel), group,
                      chunks[0].file if len(chunks) == 1 else None, None, None, None, 0,
                      tuple(chunks))


def _counts(raw: Any) -> tuple[int, ...] | None:
    """A tuple of non-negative ints (offsets, sizes) from a pickle, or None if it is not one."""
    if not isinstance(raw, (tuple, list)) or len(raw) > dtypes.MAX_DIMS or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= dtypes.MAX_ELEMENTS
            for x in raw):
        return None
    return tuple(raw)


def _check_tiling(index: CheckpointIndex, meta_rel: str) -> None:
    """Every element of every tensor in exactly one chunk: else output would hold garbage."""
    missing = {f.location for f in index.findings if f.code == "missing-chunk"}
    for t in index.tensors.values():
        if t.name in missing:
            continue  # the missing chunk is already reported
        for problem in tiling_problems(t.shape, [(c.offsets, c.sizes) for c in t.chunks]):
            index.add(Finding("error", "chunk-tiling", problem, meta_rel, t.name))


def _check_bounds(index: CheckpointIndex, sizes: dict[str, int]) -> None:
    for t in index.tensors.values():
        for c in t.chunks:
            size = sizes.get(c.file)
            if size is not None and c.offset + c.length > size:
                index.add(Finding("error", "chunk-out-of-bounds",
                                  f"chunk at byte {c.offset:,} (+{c.length:,}) runs past the end "
                                  f"of the {size:,}-byte file (truncated)", c.file, t.name))


def _read_objects(index: CheckpointIndex, base: Path, items: list[tuple[str, str, int, int]],
                  sizes: dict[str, int]) -> None:
    """Read small non-tensor items (step, lr, param groups) with the safe unpickler."""
    fds: dict[str, Handle] = {}
    try:
        for n, (name, rel, off, length) in enumerate(items):
            if n >= _MAX_BYTES_ITEMS or length > _MAX_BYTES_ITEM:
                index.objects[name] = f"<{length} bytes>"
                continue
            if rel not in sizes or off + length > sizes[rel]:
                continue
            fd = fds.get(rel)
            if fd is None:
                fd = fds[rel] = storage.open_regular(base / rel)
            try:
                tz = parse_zip(fd, off, length, f"{rel}@{off}")
            except CkptError as e:
                index.add(Finding("error", "bad-item", e.message, rel, name))
                continue
            obj = tz.pickle.obj
            if isinstance(obj, TensorRecord):
                index.objects[name] = containers.to_plain(obj)
            elif isinstance(obj, (dict, list)):
                try:
                    leaves = list(containers.walk(obj, tuple(name.split("."))))
                except ValueError as e:
                    index.add(Finding("error", "bad-item", str(e), rel, name))
                    continue
                for sub, leaf in leaves:
                    index.objects[".".join(sub)] = containers.to_plain(leaf)
            else:
                index.objects[name] = containers.to_plain(obj)
            for f in allowlist.pickle_findings(tz.pickle, file=rel,
                                               what=f"pickle of item {name}"):
                if f.severity != "info":
                    index.add(f)
    finally:
        for fd in fds.values():
            storage.close(fd)


def _nested(objects: dict[str, Any]) -> dict[str, Any]:
    """Top-level view of flattened objects, enough for :func:`extract_metadata`."""
    out = {k: v for k, v in objects.items() if "." not in k}
    lr = objects.get("optim.param_groups.0.lr", objects.get("optimizer.param_groups.0.lr"))
    if lr is not None:
        out.setdefault("lr", lr)
    return out


_MAX_CELLS = 1 << 22  # coverage grids larger than this use the pairwise check instead


def tiling_problems(shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...],
                                                                tuple[int, ...]]]) -> list[str]:
    """Why a tensor's chunks do not tile its shape exactly (empty if they do).

    Every element of the tensor must lie in exactly one chunk: no chunk may stick out of the
    shape, leave elements uncovered (a gap) or cover elements twice (an overlap).

    Args:
        shape: The tensor's global shape.
        chunks: ``(offsets, sizes)`` of each chunk.

    Returns:
        Plain-words problems.
    """
    nd = len(shape)
    if len(chunks) == 1 and chunks[0] == ((0,) * nd, tuple(shape)):
        return []  # one chunk that is the whole tensor (most tensors of a one-rank save)
    problems: list[str] = []
    good: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for offs, sizes in chunks:
        if len(offs) != nd or len(sizes) != nd:
            problems.append(f"chunk at {list(offs)} has {len(offs)} dimensions, the tensor {nd}")
        elif any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offs, sizes, shape, strict=True)):
            problems.append(f"chunk at {list(offs)} of size {list(sizes)} lies outside the "
                            f"tensor's shape {list(shape)}")
        else:
            good.append((offs, sizes))
    if problems or math.prod(shape) == 0:
        return problems
    if nd == 0:  # a scalar: exactly one chunk must hold it
        return [] if len(good) == 1 else [f"{len(good)} chunks hold this scalar, not 1"]
    numel = math.prod(shape)
    cuts = [sorted({0, d, *(o[k] for o, _ in good), *(o[k] + s[k] for o, s in good)})
            for k, d in enumerate(shape)]
    if math.prod(len(c) - 1 for c in cuts) > _MAX_CELLS:
        return _pairwise(good, numel)
    import numpy as np  # heavy: numpy

    # Cut every axis at every chunk boundary: each cell of the resulting grid is either wholly
    # inside a chunk or wholly outside, so counting chunks per cell decides the tiling.
    grid = np.zeros([len(c) - 1 for c in cuts], dtype=np.int32)
    for offs, sizes in good:
        grid[tuple(slice(bisect.bisect_left(c, o), bisect.bisect_left(c, o + s))
                   for c, o, s in zip(cuts, offs, sizes, strict=True))] += 1
    if (grid == 1).all():
        return []
    volume = functools.reduce(np.multiply.outer,
                              [np.diff(np.asarray(c, dtype=np.int64)) for c in cuts])
    gap = int(volume[grid == 0].sum())
    twice = int((volume * np.maximum(grid - 1, 0)).sum())
    if gap:
        at = [cuts[k][int(i)] for k, i in enumerate(np.argwhere(grid == 0)[0])]
        problems.append(f"{gap:,} of {numel:,} elements are in no chunk (a gap, first at "
                        f"{at}): a rank's shard is missing")
    if twice:
        at = [cuts[k][int(i)] for k, i in enumerate(np.argwhere(grid > 1)[0])]
        problems.append(f"{twice:,} elements are covered by more than one chunk (an overlap, "
                        f"first at {at})")
    return problems


def _pairwise(good: list[tuple[tuple[int, ...], tuple[int, ...]]], numel: int) -> list[str]:
    """Tiling check without a grid: no two chunks intersect, and their volumes add up."""
    boxes = sorted(b for b in good if math.prod(b[1]))
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[i + 1:]:
            if ob[0] >= oa[0] + sa[0]:
                break  # sorted by the first offset: no later box can meet this one
            if all(b < a + s and a < b + t for a, s, b, t in zip(oa, sa, ob, sb, strict=True)):
                return [f"chunks at {list(oa)} and {list(ob)} overlap"]
    covered = sum(math.prod(s) for _, s in boxes)
    if covered != numel:
        return [f"chunks cover {covered:,} of {numel:,} elements (a gap): a rank's shard is "
                "missing"]
    return []


# Reading chunks: each is a complete torch.save zip, whose small header says where its storage
# lies. The byte reading itself (positioned reads, mappings, CRC checks) is the caller's
# (ckpt_cli.tensors.source.TensorSource); these functions only know the DCP layout.


def locate_chunk(index: CheckpointIndex, fd_of: Callable[[str], Handle], t: TensorInfo,
                 c: Chunk) -> TensorInfo:
    """Where the values of one DCP chunk lie (parses the chunk's embedded torch zip).

    Args:
        index: The checkpoint's index (names files in messages).
        fd_of: An open descriptor of a file of ``index``, by relative path.
        t: The tensor.
        c: One of its chunks.

    Returns:
        A :class:`TensorInfo` of the chunk (shape ``c.sizes``) with its file and offset.

    Raises:
        CorruptCheckpointError: If the embedded zip does not describe a matching tensor.
        UnsupportedError: For compressed chunks.
    """
    if c.transforms:
        raise UnsupportedError(f"chunk of {t.name!r} uses storage transforms "
                               f"{list(c.transforms)}, which ckpt cannot decode yet",
                               path=index.path_of(c.file))
    fd = fd_of(c.file)
    where = f"{index.path_of(c.file)}@{c.offset}"
    tz = zipshape.parse_item(fd, c.offset, c.length, where)  # parse_zip, once per layout
    return zipshape.chunk_info(t, c, tz, where)


def row_chunks(t: TensorInfo, locate: Callable[[Chunk], TensorInfo]) -> list[TensorInfo] | None:
    """The chunks of ``t`` as contiguous tensors in row order, when the tensor is just their
    concatenation (split along the first dimension only: FSDP's ``Shard(0)``); else None.

    Args:
        t: A tensor stored as DCP chunks.
        locate: Where one chunk's values lie (:func:`locate_chunk`, bound to its files).

    Returns:
        One contiguous tensor per non-empty chunk, in row order, or None.
    """
    if not t.shape or any(c.transforms for c in t.chunks):
        return None
    chunks = sorted(t.chunks, key=lambda c: c.offsets[0])
    row = 0
    for c in chunks:
        if c.offsets[0] != row or any(
                o != 0 or s != d for o, s, d in
                zip(c.offsets[1:], c.sizes[1:], t.shape[1:], strict=True)):
            return None
        row += c.sizes[0]
    if row != t.shape[0]:
        return None
    subs = [locate(c) for c in chunks if c.sizes[0]]
    if any(s.stride is not None or s.file is None or s.offset is None for s in subs):
        return None
    return subs


def assemble_chunks(t: TensorInfo, locate: Callable[[Chunk], TensorInfo],
                    read_run: Callable[[TensorInfo, np.ndarray], None],
                    read: Callable[[TensorInfo], np.ndarray]) -> np.ndarray:
    """A whole tensor from its DCP chunks.

    Args:
        t: A tensor stored as DCP chunks.
        locate: Where one chunk's values lie (:func:`locate_chunk`, bound to its files).
        read_run: Fills a flat byte array with a contiguous chunk's bytes (and checks them).
        read: Reads a chunk's values (any layout) as an array.

    Returns:
        The tensor's values, shaped ``t.shape``.
    """
    import numpy as np  # heavy: numpy

    dt = dtypes.numpy_dtype(t.dtype)
    out = np.empty(t.shape, dtype=dt)
    for c in t.chunks:
        sub = locate(c)
        region = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))
        # A chunk split along the first dimension only (FSDP, Shard(0)) is one contiguous
        # run of the output: read its bytes straight into place, no intermediate copy.
        rows_only = all(o == 0 and s == d for o, s, d in
                        zip(c.offsets[1:], c.sizes[1:], t.shape[1:], strict=True))
        dest = (out[region] if out.ndim else out).reshape(-1).view(np.uint8)
        if (rows_only and sub.stride is None and sub.offset is not None and sub.file
                and np.shares_memory(dest, out)):
            if dest.nbytes:
                read_run(sub, dest)
        else:
            out[region] = read(sub)
    return out
