"""torch.save files: the zip format (torch >= 1.6) and the legacy pickle stream, read without torch.

Zip: the layout (records, their offsets, the refusals) is :mod:`ckpt_cli.formats.torchzip`'s.
``data.pkl`` is unpickled by :mod:`ckpt_cli.formats.unpickler`; each storage ``('storage', cls,
key, loc, numel)`` is the entry ``<archive>/data/<key>``, whose payload offset comes from its
local header. Tensor bytes are therefore addressed as (file, offset) and never loaded here.

Legacy: ``magic | 1001 | sys_info | main pickle | sorted key list | [i64 numel + bytes] per key``.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli import dtypes, storage
from ckpt_cli.errors import (
    CorruptCheckpointError,
    UnsupportedError,
)
from ckpt_cli.formats import allowlist, containers
from ckpt_cli.formats.base import file_size, open_stream, read_head, rel_to, wrong_kind
from ckpt_cli.formats.standins import StorageRecord, StorageType, TensorRecord
from ckpt_cli.formats.torchzip import (
    SCAN_LIMIT,
    TorchZip,
    is_torchscript,
    parse_zip,
    record,
    short_error,
)

# Re-exported: sniffers and validate's stray-file check ask them here.
from ckpt_cli.formats.torchzip import ZIP_MAGIC as ZIP_MAGIC
from ckpt_cli.formats.torchzip import pickle_records_seen as pickle_records_seen
from ckpt_cli.formats.unpickler import (
    UNPICKLE_ERRORS,
    PickleResult,
    looks_like_pickle,
    scan_globals,
    scan_stream,
    unpickler_for,
)
from ckpt_cli.model import CheckpointIndex, FileInfo, Finding, StorageRef, TensorInfo

if TYPE_CHECKING:
    from ckpt_cli.storage import Handle

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_HEAD = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


def sniff_torch(path: Path) -> str | None:
    """Whether ``path`` is a torch.save file (zip or legacy).

    Args:
        path: A file.

    Returns:
        None on a match, else why not.
    """
    if (why := wrong_kind(path, directory=False)) is not None:
        return why
    head = read_head(path, 16)
    if head.startswith(ZIP_MAGIC):
        return None
    if head.startswith(_LEGACY_HEAD):
        return None
    (n,) = struct.unpack_from("<Q", head.ljust(8, b"\0"))
    if head[8:9] == b"{" and 8 + n <= path.stat().st_size:
        # A safetensors file whose header is 640, 896, 1152 or 1408 bytes long starts like
        # a protocol 2-5 pickle (its length, little-endian); its header JSON follows.
        return "a safetensors header, not a pickle"
    if _tar_members(path) is not None:
        return None  # torch.load reads a tar too (the oldest torch.save format)
    if looks_like_pickle(read_head(path, 4096)):
        return None  # a pickle of any protocol (0-5); read_index says what it is
    return "no zip magic (PK\\x03\\x04), tar header or pickle opcodes"


# The members of the oldest torch.save format (a tar) that torch.load unpickles.
_TAR_PICKLES = ("sys_info", "pickle", "storages", "tensors")
_TAR_MAX_MEMBERS = 4096


def _tar_members(path: Path) -> dict[str, tuple[int, int]] | None:
    """The members of a tar file (``name -> (data offset, size)``), or None if it is not
    one: what ``torch.load`` tries first (``tarfile.open(mode="r:")``) on a non-zip file."""
    import tarfile  # lazy: legacy tar format only

    try:
        with open_stream(path) as f, tarfile.open(fileobj=f, mode="r:") as tar:
            out: dict[str, tuple[int, int]] = {}
            for i, m in enumerate(tar):
                if i >= _TAR_MAX_MEMBERS:
                    break
                if m.isfile():
                    out[m.name] = (m.offset_data, m.size)
            return out
    except (tarfile.TarError, OSError, EOFError, ValueError, UnicodeDecodeError):
        return None


def _read_tar(path: Path, members: dict[str, tuple[int, int]]) -> PickleResult:
    """Scan the pickles of a legacy tar checkpoint (torch < 0.1.10) for globals.

    ``torch.load`` unpickles its ``sys_info``, ``pickle``, ``storages`` and ``tensors``
    members; ckpt scans each (and any other member that parses as a pickle) but does not
    decode this format's tensors.
    """
    result = PickleResult({})
    fd = storage.open_regular(path)
    try:
        for name, (offset, size) in members.items():
            raw = storage.pread(fd, min(size, SCAN_LIMIT), offset)
            if name not in _TAR_PICKLES and not looks_like_pickle(raw[:4096]):
                continue
            found, _ = scan_globals(raw)
            for qual, cls in found.globals.items():
                result.globals.setdefault(qual, cls)
                result.sources.setdefault(qual, f"tar member {name}")
            result.calls |= found.calls
            result.inits |= found.inits
            result.builds |= found.builds
    finally:
        storage.close(fd)
    return result


class TorchReader:
    """Reads torch.save zip files and legacy torch pickles."""

    name = "torch"
    is_dir_format = False

    def sniff(self, path: Path) -> str | None:
        """See :meth:`ckpt_cli.formats.base.Reader.sniff`."""
        return sniff_torch(path)

    def read_index(self, path: Path) -> CheckpointIndex:
        """See :meth:`ckpt_cli.formats.base.Reader.read_index`."""
        index = CheckpointIndex(format=self.name, root=path, base=path.parent)
        read_into(index, path, role=role_of(path.name), prefix="")
        return index


def role_of(filename: str) -> str:
    """A checkpoint file's role, guessed from its name.

    Args:
        filename: The file's name.

    Returns:
        ``optimizer``, ``scheduler``, ``rng``, ``args``, ``other`` or ``weights``.
    """
    low = filename.lower()
    if "optim" in low:
        return "optimizer"
    if "scheduler" in low or low.startswith("lr_"):
        return "scheduler"
    if low.startswith(("rng_state", "random_states")):
        return "rng"
    if low.startswith("training_args"):
        return "args"
    if low.startswith(("scaler", "sampler", "dl_state")):
        return "other"
    return "weights"


_ROLE_GROUP = {"optimizer": "optimizer", "scheduler": "other", "rng": "other", "args": "other",
               "other": "other", "weights": "model", "shard": "model"}


def read_into(index: CheckpointIndex, path: Path, *, role: str, prefix: str) -> set[str]:
    """Add a torch.save file's tensors, objects, metadata and findings to ``index``.

    Args:
        index: The index to fill.
        path: The file.
        role: The file's role (see :func:`role_of`).
        prefix: Prepended to tensor and object names (``""`` for a lone file).

    Returns:
        The names of the tensors added.

    Raises:
        CorruptCheckpointError: If the file cannot be parsed.
    """
    size = file_size(path)
    rel = rel_to(path, index.base)
    head = read_head(path, 16)
    if head.startswith(ZIP_MAGIC):
        fmt = "torch"
        fd = storage.open_regular(path)
        try:
            tz = parse_zip(fd, 0, size, str(path))
            _zip_findings(index, tz, rel, fd)
        finally:
            storage.close(fd)
        result = tz.pickle
        storages = {k: (tz.storage_start(k), tz.storage_entry(k), tz.storage_crc(k))
                    for k in result.storages}
    elif (members := _tar_members(path)) is not None:
        fmt = "torch-tar"
        result = _read_tar(path, members)
        storages = {}
        index.add(Finding("error", "unsupported-format",
                          "a legacy tar checkpoint (torch < 0.1.10): its pickles were scanned, "
                          "its tensors are not read"
                          + allowlist.refused(result),
                          rel_to(path, index.base)))
    else:
        result = _read_plain_pickle(path)
        storages = {}
        fmt = "pickle"
        if result.obj == LEGACY_MAGIC:  # a legacy stream, whatever protocol its magic used
            fmt = "torch-legacy"
            result, starts = _read_legacy(path, size)
            storages = {k: (starts.get(k), None, None) for k in result.storages}
    index.files.append(FileInfo(rel, size, role, fmt))
    return add_tree(index, result, storages, rel=rel, role=role, prefix=prefix)


def add_tree(index: CheckpointIndex, result: PickleResult,
             storages: dict[str, tuple[int | None, Any, int | None]], *, rel: str, role: str,
             prefix: str) -> set[str]:
    """Flatten an unpickled torch tree into ``index``: tensors, objects, metadata, findings.

    Args:
        index: The index to fill.
        result: The safe unpickler's result.
        storages: Storage key -> (absolute start or None, zip entry or None).
        rel: The file's path relative to ``index.base``.
        role: The file's role.
        prefix: Prepended to names.

    Returns:
        The names of the tensors added.
    """
    tree = result.obj
    default = containers.file_default_group(tree)
    if default == "model":
        default = _ROLE_GROUP.get(role, "model")
    flavor = _flavor(tree)
    if flavor and index.flavor is None:
        index.flavor = flavor
    added: set[str] = set()
    used: set[str] = set()
    try:
        leaves = list(containers.walk(tree))
    except ValueError as e:
        raise CorruptCheckpointError(str(e), path=index.base / rel) from None
    for path, leaf in leaves:
        name = prefix + ".".join(path)
        if isinstance(leaf, TensorRecord):
            problem = _malformed(leaf)
            if problem:
                index.add(Finding("error", "bad-tensor", problem, rel, name))
                continue
            info = _tensor_info(index, name, path, leaf, storages, rel, default)
            if len(path) > 1:
                index.containers.setdefault(prefix + path[0] + ".", info.group if info.group
                                            != "buffer" else "model")
            info = index.add_tensor(info)
            added.add(info.name)
            for part in (leaf, *leaf.parts):
                if part.storage is not None:
                    used.add(part.storage.key)
        elif path:
            index.objects[name] = containers.to_plain(leaf)
    index.note_duplicates(rel, added)
    meta = containers.extract_metadata(tree)
    for k, v in meta.items():
        index.metadata.setdefault(k, v)
    _global_findings(index, result, rel)
    unused = [k for k in storages if k not in used]
    if unused:
        index.add(Finding("warning", "unreferenced-storage",
                          f"{len(unused)} storage record(s) no tensor refers to", rel,
                          ", ".join(unused[:5])))
    return added


def _flavor(tree: Any) -> str | None:
    if not isinstance(tree, dict):
        return None
    if "pytorch-lightning_version" in tree:
        return "lightning"
    if "ds_version" in tree or "ds_config" in tree:
        return "deepspeed"
    if "checkpoint_version" in tree and ("iteration" in tree or "args" in tree):
        return "megatron"
    return None


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= dtypes.MAX_ELEMENTS


def _malformed(rec: TensorRecord) -> str | None:
    """Why a pickled tensor's geometry cannot be trusted, if it cannot (crafted or damaged)."""
    if not isinstance(rec.shape, tuple) or not all(_is_count(d) for d in rec.shape):
        return f"shape {str(rec.shape)[:80]} is not a tuple of sizes below 2^63"
    if (why := dtypes.shape_problem(rec.shape)) is not None:
        return f"shape declares {why}"
    if rec.kind in ("dense",) and rec.storage is not None:
        if not isinstance(rec.stride, tuple) or len(rec.stride) != len(rec.shape) or not all(
                _is_count(s) for s in rec.stride):
            return f"strides {str(rec.stride)[:80]} do not fit shape {list(rec.shape)}"
        if not _is_count(rec.storage_offset):
            return (f"storage offset {str(rec.storage_offset)[:80]} is not a count below "
                    "2^63")
    if rec.dtype not in dtypes.DTYPES:
        return f"unknown dtype {rec.dtype!r}"
    return None


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-order strides (in elements) for ``shape``."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


def view_extent(shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> int:
    """One past the largest element index a strided view touches (0 for an empty view)."""
    if any(d == 0 for d in shape):
        return 0
    return offset + sum((d - 1) * s for d, s in zip(shape, stride, strict=False)) + 1


def _tensor_info(index: CheckpointIndex, name: str, path: tuple[str, ...], rec: TensorRecord,
                 storages: dict[str, tuple[int | None, Any, int | None]], rel: str,
                 default: str) -> TensorInfo:
    group = containers.group_of(path, rec, default)
    code = rec.dtype
    shape = rec.shape
    if code == "F4":  # torch's float4_e2m1fn_x2 packs two values per element
        shape = (*shape[:-1], shape[-1] * 2) if shape else shape
    numel = 1
    for d in shape:
        numel *= d
    nbytes = dtypes.nbytes_of(code, numel)
    st = rec.storage
    if st is None:
        if rec.kind == "meta":
            message = "meta tensor: saved without data (shape and dtype only)"
            nbytes = 0
        elif rec.kind == "sparse":
            message = "sparse tensor: described, its values not decoded"
            nbytes = sum(p.storage.nbytes for p in rec.parts if p.storage is not None)
        else:
            message = f"{rec.kind} tensor: data not described"
        index.add(Finding("warning", "tensor-kind", message, rel, name))
        return TensorInfo(name, code, shape, nbytes, group, None, None, None, None, 0, (),
                          rec.kind)
    start, entry, crc = storages.get(st.key, (None, None, None))
    itemsize = dtypes.DTYPES[code].itemsize
    stride = rec.stride if rec.stride != contiguous_strides(rec.shape) else None
    ref = StorageRef(rel, st.key, start, st.nbytes, st.dtype, crc,
                     entry.size if entry is not None else 0)
    offset = None if start is None else start + rec.storage_offset * itemsize
    if start is None:
        index.add(Finding("error", "missing-storage",
                          f"storage {st.key!r} is not in the file", rel, name))
    else:
        if entry is not None and entry.size < st.nbytes:
            index.add(Finding("error", "short-storage",
                              f"storage {st.key!r} holds {entry.size:,} bytes, the pickle says "
                              f"{st.nbytes:,}", rel, name))
        extent = view_extent(rec.shape, rec.stride, rec.storage_offset) * itemsize
        if extent > st.nbytes:
            index.add(Finding("error", "view-out-of-bounds",
                              f"view needs {extent:,} bytes of a {st.nbytes:,}-byte storage",
                              rel, name))
    if rec.kind != "dense":
        index.add(Finding("warning", "tensor-kind", f"{rec.kind} tensor: values not decoded",
                          rel, name))
    return TensorInfo(name, code, shape, nbytes, group, rel, offset, stride, ref,
                      rec.storage_offset, (), rec.kind)


def _global_findings(index: CheckpointIndex, result: PickleResult, rel: str) -> None:
    for f in allowlist.pickle_findings(result, file=rel, sources=result.sources):
        index.add(f)


def _zip_findings(index: CheckpointIndex, tz: TorchZip, rel: str, fd: Handle) -> None:
    if is_torchscript(tz):
        index.add(Finding("error", "torchscript-archive",
                          "a TorchScript archive (code/, constants.pkl): torch.load hands it to "
                          "torch.jit.load, which runs its code (torch <= 2.5.1 even with "
                          "weights_only=True: CVE-2025-32434); ckpt reads its tensors as data",
                          rel))
    if tz.after_stop:
        index.add(after_stop_finding(tz, rel))
    for name, why in sorted(tz.unscanned.items()):
        index.add(Finding("warning", "unscanned-pickle",
                          f"pickle record {name} could not be scanned for globals: {why}", rel,
                          name))
    bo = record(tz.entries, f"{tz.prefix}byteorder")
    if bo is not None and bo.size <= 8 and not bo.compressed:
        order = storage.pread(fd, bo.size, tz.base + bo.data_offset).strip()
        if order == b"big":
            index.add(Finding("error", "big-endian",
                              "tensors are stored big-endian; ckpt reads little-endian data only",
                              rel))
    for e in tz.entries.values():
        if e.compressed:
            index.add(Finding("error", "compressed-entry",
                              "entry is compressed; torch writes every record STORED", rel,
                              e.name))


def after_stop_finding(tz: TorchZip, rel: str, what: str = "") -> Finding:
    """The warning for bytes after ``data.pkl``'s STOP (see ``torchzip._scan_after_stop``)."""
    return Finding("warning", PICKLE_AFTER_STOP,
                   f"{what}data.pkl holds {tz.after_stop:,} bytes after its pickle's STOP: "
                   "torch.load reads one pickle and ignores them, but a second pickle hidden "
                   "there is a known way past scanners; its globals were scanned too", rel)


PICKLE_AFTER_STOP = "pickle-after-stop"


def _read_plain_pickle(path: Path) -> PickleResult:
    """A pickle that is not a torch.save stream (Accelerate's ``random_states_0.pkl``...),
    with the globals of every pickle after it merged in (see :func:`scan_stream`)."""
    try:
        with open_stream(path) as f:
            up = unpickler_for(f)
            result = PickleResult(up.load(), up.globals, up.storages, calls=up.calls,
                                  builds=up.builds, inits=up.inits)
            rest = f.read(SCAN_LIMIT)
    except UNPICKLE_ERRORS as e:
        # What came before the failure ran under pickle.load, and the real loader may go on
        # where ckpt's stand-ins cannot: every global the bytes name is listed.
        with open_stream(path) as f:
            found = scan_stream(f.read(SCAN_LIMIT))
        raise CorruptCheckpointError(
            f"not a readable pickle ({short_error(e)})"
            + allowlist.refused(found), path=path) from None
    later = scan_stream(rest)
    for qual, cls in later.globals.items():
        if qual not in result.globals:
            result.globals[qual] = cls
            result.sources[qual] = "a later pickle in the file"
    result.calls |= later.calls
    result.inits |= later.inits
    result.builds |= later.builds
    return result


def _read_legacy(path: Path, size: int) -> tuple[PickleResult, dict[str, int]]:
    """Parse a legacy (pre-zip) torch.save stream and locate each storage's bytes."""
    storages: dict[str, StorageRecord] = {}
    views: dict[str, tuple[str, int]] = {}

    def persistent(pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {str(pid)[:80]!r}")
        stype, key, location, numel = pid[1], str(pid[2]), str(pid[3]), pid[4]
        if not isinstance(stype, StorageType) or not isinstance(numel, int):
            raise pickle.UnpicklingError("malformed storage id")
        view = pid[5] if len(pid) > 5 else None
        rec = storages.setdefault(key, StorageRecord(key, stype.dtype, location, numel))
        if view:  # (view_key, offset, size): a view into the root storage
            vkey, voff, vsize = str(view[0]), int(view[1]), int(view[2])
            views[vkey] = (key, voff)
            return StorageRecord(vkey, stype.dtype, location, vsize)
        return rec

    # torch.load unpickles all five pickles of the stream with the same unpickler: a global
    # in the magic number's, the protocol version's, sys_info's or the key list's pickle
    # runs as surely as one in the main pickle's. Every one is scanned and reported.
    seen: dict[str, tuple[str, str]] = {}  # qualname -> (classification, which pickle)
    calls: set[str] = set()
    builds: set[str] = set()
    inits: set[str] = set()

    def note() -> str:
        # The stream stopped: the real loader may read on where ckpt cannot (a stand-in
        # that is not the number torch checks), so every pickle of the file is named.
        with open_stream(path) as whole:
            found = scan_stream(whole.read(SCAN_LIMIT))
        named = {**found.globals, **{q: c for q, (c, _) in seen.items()}}
        return allowlist.refused(PickleResult(None, named, calls=calls | found.calls,
                                              builds=builds | found.builds))

    def load(f: Any, what: str, use: Callable[[Any], Any] | None = None) -> PickleResult:
        up = None
        try:
            up = unpickler_for(f, persistent=use)
            obj = up.load()
        except UNPICKLE_ERRORS as e:
            for qual, cls in (up.globals if up is not None else {}).items():
                seen.setdefault(qual, (cls, what))
            calls.update(up.calls if up is not None else ())
            builds.update(up.builds if up is not None else ())
            raise CorruptCheckpointError(
                f"legacy torch pickle is unreadable ({what}: {short_error(e)})" + note(),
                path=path) from None
        for qual, cls in up.globals.items():
            seen.setdefault(qual, (cls, what))
        calls.update(up.calls)
        builds.update(up.builds)
        inits.update(up.inits)
        return PickleResult(obj, up.globals, up.storages, calls=up.calls, builds=up.builds,
                            inits=up.inits)

    with open_stream(path) as f:
        magic = load(f, "magic number").obj
        if magic != LEGACY_MAGIC:
            raise CorruptCheckpointError(
                "a pickle, but not a torch.save file (no torch magic number)" + note(),
                path=path)
        proto = load(f, "protocol version").obj
        if proto != 1001:
            raise CorruptCheckpointError(f"unknown legacy protocol version {proto!r}"
                                         + note(), path=path)
        sys_info = load(f, "sys_info").obj
        if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
            raise UnsupportedError("big-endian legacy checkpoint", path=path)
        main = load(f, "main", persistent)
        keys = load(f, "storage keys").obj
        pos = f.tell()
    for qual, (cls, what) in seen.items():
        if qual not in main.globals:
            main.globals[qual] = cls
            main.sources[qual] = f"the {what} pickle"
    main.calls |= calls
    main.inits |= inits
    main.builds |= builds
    if not isinstance(keys, list):
        raise CorruptCheckpointError("legacy storage key list is missing", path=path)
    starts: dict[str, int] = {}
    fd = storage.open_regular(path)
    try:
        for key in keys:
            hdr = storage.pread(fd, 8, pos)
            if len(hdr) < 8:
                break  # truncated: the storages past here have no start
            (count,) = struct.unpack("<q", hdr)
            rec = storages.get(str(key))
            itemsize = dtypes.DTYPES[rec.dtype].itemsize if rec else 1
            end = pos + 8 + count * itemsize
            if count < 0 or end > size:
                break  # truncated inside this storage's bytes: it and the rest are missing
            starts[str(key)] = pos + 8
            pos = end
    finally:
        storage.close(fd)
    for vkey, (root, voff) in views.items():
        if root in starts:
            rec = storages[root]
            starts[vkey] = starts[root] + voff * dtypes.DTYPES[rec.dtype].itemsize
    main.storages.update({k: storages[k] for k in storages})
    for vkey, (root, _) in views.items():
        main.storages.setdefault(vkey, storages[root])
    return main, starts
