"""safetensors: ``u64 LE header length | JSON header | data``, parsed without the library.

The header is capped, parsed with orjson, and every structural rule of the Rust reader is
checked: known dtypes, offsets sorted and contiguous from 0, byte lengths equal to
``prod(shape) * bits / 8``, and a file exactly as long as the header says. Violations that still
let ckpt list the tensors become error findings; ones that do not raise
:class:`~ckpt_cli.errors.CorruptCheckpointError`.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from ckpt_cli import dtypes, storage
from ckpt_cli.dtypes import strict_int
from ckpt_cli.errors import CorruptCheckpointError
from ckpt_cli.formats import allowlist, provenance
from ckpt_cli.formats.base import read_head, rel_to, wrong_kind
from ckpt_cli.formats.containers import group_of
from ckpt_cli.formats.unpickler import looks_like_pickle, scan_stream
from ckpt_cli.model import CheckpointIndex, FileInfo, Finding, TensorInfo

if TYPE_CHECKING:
    from ckpt_cli.storage import Handle

MAX_HEADER = 100_000_000
"""Largest header accepted, as in the Rust reader (``HeaderTooLarge``)."""


def sniff_bytes(head: bytes, size: int) -> str | None:
    """Whether a file's first bytes look like safetensors.

    Args:
        head: At least the first 9 bytes, if the file has them.
        size: The file's size.

    Returns:
        None on a match, otherwise why not.
    """
    if len(head) < 9:
        return "shorter than a safetensors header"
    (n,) = struct.unpack("<Q", head[:8])
    if n == 0 or n > MAX_HEADER:
        return "first 8 bytes are not a plausible safetensors header length"
    if head[8:9] not in (b"{", b" "):
        return "no JSON object after the header length"
    if 8 + n > size:
        return "header length field larger than the file"
    return None


class SafetensorsReader:
    """Reads one ``.safetensors`` file's header."""

    name = "safetensors"
    is_dir_format = False

    def sniff(self, path: Path) -> str | None:
        """See :meth:`ckpt_cli.formats.base.Reader.sniff`."""
        if (why := wrong_kind(path, directory=False)) is not None:
            return why
        return sniff_bytes(read_head(path, 9), path.stat().st_size)

    def read_index(self, path: Path) -> CheckpointIndex:
        """See :meth:`ckpt_cli.formats.base.Reader.read_index`."""
        index = CheckpointIndex(format=self.name, root=path, base=path.parent)
        read_into(index, path, role="weights", default_group="model")
        return index


def parse_header(path: Path, *, fd: Handle | None = None,
                 size: int | None = None) -> tuple[int, dict[str, Any], int, list[Finding]]:
    """Read and parse a safetensors header.

    Args:
        path: The file.
        fd: The file already open for reading (with ``size``): positioned reads, no second
            open (a run listing reads the headers of thousands of files).
        size: Its size, with ``fd``.

    Returns:
        ``(header_length, header_dict, file_size, findings)``; findings cover duplicate keys.

    Raises:
        CorruptCheckpointError: If there is no parseable header.
    """
    if fd is None or size is None:
        h = storage.open_regular(path)
        try:
            return parse_header(path, fd=h, size=storage.size_of(h))
        finally:
            storage.close(h)
    if size < 8:
        raise CorruptCheckpointError(
            f"{size} bytes is too short for a safetensors file (needs 8 for the header length)",
            path=path)
    (n,) = struct.unpack("<Q", storage.pread(fd, 8, 0).ljust(8, b"\0"))
    # The field's value is never shown: in a file that is not safetensors, those are its
    # first 8 bytes (a secret behind a link, a key), and no number is plausible anyway.
    if n > MAX_HEADER:
        raise CorruptCheckpointError(
            f"not a safetensors file: its header length field is implausible (over "
            f"{MAX_HEADER:,} bytes)", path=path)
    if 8 + n > size:
        raise CorruptCheckpointError(
            f"not a safetensors file, or truncated: its header length field is larger than "
            f"the {size:,}-byte file", path=path)
    raw = storage.pread(fd, n, 8)
    try:
        header = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if "recursion" in str(e).lower() or "depth limit" in str(e):
            raise CorruptCheckpointError(_TOO_DEEP, path=path) from None
        raise CorruptCheckpointError(f"header is not valid UTF-8 JSON ({e})"
                                     + _pickle_note(fd, size), path=path) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError("header is not a JSON object", path=path)
    if text_depth_over(raw, MAX_HEADER_DEPTH):
        raise CorruptCheckpointError(_TOO_DEEP, path=path)
    findings: list[Finding] = []
    entries = len(header) - (1 if "__metadata__" in header else 0)
    # Keys are compared decoded, as every JSON reader sees them: ``"data\u005foffsets"`` is
    # ``data_offsets``. The quick count of the plain spelling is trusted only when the header
    # holds no escape at all.
    if b"\\" in raw or raw.count(b'"data_offsets"') != entries:
        findings.extend(Finding("error", "duplicate-key",
                                f"header names {_short(dup)} more than once (the safetensors "
                                "library refuses a repeated field and keeps the last of a "
                                "repeated tensor: readers disagree)", path.name)
                        for dup in _duplicate_keys(raw))
    return n, header, size, findings


MAX_HEADER_DEPTH = 128
"""The deepest nesting a header may have: serde_json's own recursion limit, so the safetensors
library refuses a deeper header too."""
_TOO_DEEP = (f"header nests deeper than {MAX_HEADER_DEPTH} levels (the safetensors library "
             "refuses it too)")


_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_ONE_BRACKET = bytes.maketrans(b"{}", b"[]")  # in valid JSON only the nesting counts


def text_depth_over(raw: bytes, limit: int) -> bool:
    """Whether a valid JSON text nests deeper than ``limit``, judged from its bytes (as
    serde_json's recursion limit judges it, so a deep value that a repeated key replaces counts
    too).

    All in C over the bytes (a walk of the parsed header cost as much as parsing it, for a
    million tensors): escapes that could hide a quote are removed, then everything but quotes
    and brackets, then the strings (brackets inside them are not structure); what remains is
    the bracket skeleton, and each pass removing its innermost bracket pairs peels one level.

    Args:
        raw: A text that a JSON parser accepted.
        limit: The deepest nesting allowed.

    Returns:
        True when some value lies deeper than ``limit``.
    """
    if b"\\" in raw:
        # Left to right, as a parser reads them: an escaped backslash, then an escaped quote.
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    skeleton = raw.translate(_ONE_BRACKET, _NOT_STRUCTURE)
    quick = skeleton.replace(b'""', b"")  # strings without brackets in them
    if b'"' in quick:  # some string holds a bracket: split the strings out properly
        quick = b"".join(skeleton.split(b'"')[::2])
    skeleton = quick
    for _ in range(limit):
        if not skeleton:
            return False
        skeleton = skeleton.replace(b"[]", b"")  # one scan: pairs it makes wait a pass
    return bool(skeleton)


def _duplicate_keys(raw: bytes) -> list[str]:
    dups: list[str] = []

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                dups.append(k)
            seen.add(k)
        return dict(pairs)

    try:
        json.loads(raw, object_pairs_hook=hook)
    except (ValueError, RecursionError):  # orjson parsed it, and its depth is bounded
        return []
    return dups


def read_into(index: CheckpointIndex, path: Path, *, role: str, default_group: str,
              prefix: str = "", fmt: str = "safetensors") -> set[str]:
    """Add a safetensors file's tensors and findings to ``index``.

    Args:
        index: The index to fill; ``path`` is recorded relative to ``index.base``.
        path: The safetensors file.
        role: The file's role (``weights``, ``shard``...).
        default_group: Group of tensors whose names say nothing else.
        prefix: Prepended to every tensor name.
        fmt: The format recorded for the file.

    Returns:
        The names (with prefix) of the tensors added.

    Raises:
        CorruptCheckpointError: If the header cannot be parsed at all.
    """
    h = storage.open_regular(path)
    try:
        stamp = _stamp(h)
        n, header, size, findings = parse_header(path, fd=h, size=storage.size_of(h))
    finally:
        storage.close(h)
    rel = rel_to(path, index.base)
    index.files.append(FileInfo(rel, size, role, fmt))
    for f in findings:
        index.add(Finding(f.severity, f.code, f.message, rel, f.location))
    meta = header.pop("__metadata__", None)
    if meta is not None:
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            index.add(Finding("error", "bad-metadata",
                              "__metadata__ must map strings to strings", rel))
        elif meta:
            index.metadata.setdefault("safetensors_metadata", {}).update(meta)
            _metadata_facts(index, meta)
    data_start = 8 + n
    added: set[str] = set()
    grouper = _Grouper(default_group)
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    # Offsets are checked in sorted order (_check_spans). Writers lay tensors out in header
    # order, each starting where the one before ends: while that chain holds, no span need be
    # kept (a million tuples), and sorting would find nothing; the first break rebuilds them.
    chain: list[tuple[str, TensorInfo]] | None = []
    spans: list[tuple[int, int, str]] = []
    pos = 0
    end_all: int | None = None  # what the quick status (formats.probe) computes, remembered
    tensors = index.tensors
    for name in list(header):
        entry = header.pop(name)  # freed as it is read: the header and the index never peak
        info = _fast_info(name, entry, rel, data_start, grouper, shapes, prefix)
        if info is None:
            last = declared_end(entry)
            if last is not None:
                end_all = last if end_all is None else max(end_all, last)
            info = _tensor_info(name, entry, rel, data_start, index, default_group, prefix)
            if info is None:
                continue
        if info.name in tensors:
            info = index.add_tensor(info)  # a name taken: listed as name#N
        else:
            tensors[info.name] = info  # add_tensor's common case, without the call
        added.add(info.name)
        b, e = entry["data_offsets"]
        end_all = e if end_all is None else max(end_all, e)
        if chain is not None and b == pos and e - b == info.nbytes:
            chain.append((name, info))
            pos = e
            continue
        if chain is not None:
            spans = [(t.offset - data_start, t.offset - data_start + t.nbytes, key)
                     for key, t in chain if t.offset is not None]
            chain = None
        spans.append((b, e, name))
    index.note_duplicates(rel, added)
    if stamp is not None:
        _remember(stamp, n, end_all if end_all is not None else 0)
    if chain is not None:
        _check_end(index, rel, pos, size - data_start)
    else:
        _check_spans(index, rel, spans, size - data_start)
    return added


_INT = {int}
_ENDS: dict[tuple[int, ...], tuple[int, int]] = {}
_ENDS_LOCK = threading.Lock()
"""Header length and declared end of the files read here, by :func:`_stamp`: the quick status
that ``validate`` asks for after reading a file (:func:`known_end`) need not parse its header
a second time (seconds for a million tensors)."""


def _stamp(h: Handle) -> tuple[int, ...] | None:
    """What identifies an open local file's current contents: device, inode, size, mtime."""
    if not isinstance(h, int):
        return None
    st = os.fstat(h)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remember(stamp: tuple[int, ...], n: int, end: int) -> None:
    with _ENDS_LOCK:  # headers are read on worker threads too
        if len(_ENDS) >= 64:
            _ENDS.pop(next(iter(_ENDS)))
        _ENDS[stamp] = (n, end)


def known_end(h: Handle) -> tuple[int, int] | None:
    """For a file that :func:`read_into` read and that has not changed since: its header
    length and the largest ``data_offsets`` end its header declares (see :func:`declared_end`);
    else None."""
    stamp = _stamp(h)
    return _ENDS.get(stamp) if stamp is not None else None


def declared_end(entry: Any) -> int | None:
    """The end of an entry's ``data_offsets``, read as leniently as the quick status reads it
    (anything int-like in the second place of a pair); None when there is none."""
    if isinstance(entry, dict):
        offs = entry.get("data_offsets")
        if isinstance(offs, list) and len(offs) == 2 and isinstance(offs[1], int):
            return offs[1]
    return None


class _Grouper:
    """:func:`~ckpt_cli.formats.containers.group_of` for the names of one file, remembered by
    what decides it (the name's first part, its last two, and whether the dtype is an
    integer's): a header of a million tensors repeats a few hundred of those."""

    __slots__ = ("cache", "default")

    def __init__(self, default: str):
        self.default = default
        self.cache: dict[tuple[str, str, bool], str] = {}

    def __call__(self, full: str, kind: str) -> str:
        last = full.rfind(".")
        key = (full.partition(".")[0], full[full.rfind(".", 0, last) + 1:] if last > 0 else full,
               kind in ("int", "uint", "bool"))
        group = self.cache.get(key)
        if group is None:
            group = group_of(tuple(full.split(".")), None, self.default)
            if group == "model" and key[2]:
                group = "buffer"
            if len(self.cache) < 65536:
                self.cache[key] = group
        return group


def _fast_info(name: str, entry: Any, rel: str, data_start: int, grouper: _Grouper,
               shapes: dict[tuple[int, ...], tuple[int, ...]], prefix: str) -> TensorInfo | None:
    """:func:`_tensor_info` for an entry that breaks no rule (the common case), checked with
    few Python steps per tensor; None for any other, which :func:`_tensor_info` then reads and
    reports."""
    if type(entry) is not dict:
        return None
    dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if type(dtype) is not str:
        return None
    spec = dtypes.DTYPES.get(dtype)
    if (spec is None or spec.bits % 8 or type(shape) is not list
            or type(offs) is not list or len(offs) != 2 or len(shape) > dtypes.MAX_DIMS):
        return None
    if shape and (set(map(type, shape)) != _INT or min(shape) < 0
                  or max(shape) > dtypes.MAX_ELEMENTS):
        return None
    begin, end = offs
    if type(begin) is not int or type(end) is not int or begin < 0:
        return None
    numel = math.prod(shape)
    expected = numel * (spec.bits // 8)
    if numel > dtypes.MAX_ELEMENTS or end - begin != expected:
        return None
    key = tuple(shape)
    key = shapes.setdefault(key, key) if len(shapes) < 65536 else key
    full = prefix + name
    return TensorInfo(full, dtype, key, expected, grouper(full, spec.kind), rel,
                      data_start + begin)


def _metadata_facts(index: CheckpointIndex, meta: dict[str, str]) -> None:
    for key in ("step", "global_step", "epoch"):
        value = strict_int(meta.get(key) or "", signed=True)
        if value is not None:
            index.metadata.setdefault("step" if key != "epoch" else "epoch", value)
    # What ckpt itself wrote (convert, consolidate): ckpt.step, ckpt.epoch.
    for key, value in provenance.read_back(meta).items():
        index.metadata.setdefault(key, value)


def _tensor_info(name: str, entry: Any, rel: str, data_start: int, index: CheckpointIndex,
                 default_group: str, prefix: str) -> TensorInfo | None:
    if not isinstance(entry, dict):
        index.add(Finding("error", "bad-entry", "header entry is not an object", rel, name))
        return None
    dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in dtypes.DTYPES:
        index.add(Finding("error", "unknown-dtype", f"unknown dtype {_short(dtype)}", rel, name))
        return None
    if (not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        index.add(Finding("error", "bad-shape", f"shape {_short(shape)} is not a list of sizes",
                          rel, name))
        return None
    if (why := dtypes.shape_problem(shape)) is not None:
        # The safetensors library takes any usize; torch and every writer stop at 2^63-1.
        index.add(Finding("error", "bad-shape", f"shape declares {why} (the safetensors "
                          "library accepts it, torch cannot hold it)", rel, name))
        return None
    if (not isinstance(offs, list) or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)):
        index.add(Finding("error", "bad-offsets", f"data_offsets {_short(offs)} is not "
                          "[begin, end]", rel, name))
        return None
    begin, end = offs
    bits = dtypes.DTYPES[dtype].bits
    numel = math.prod(shape)
    if (numel * bits) % 8:
        index.add(Finding("error", "misaligned", f"{numel} elements of {dtype} do not fill whole "
                          "bytes", rel, name))
    expected = numel * bits // 8
    if end < begin:
        index.add(Finding("error", "bad-offsets", f"data_offsets end {end} < begin {begin}",
                          rel, name))
    elif end - begin != expected:
        index.add(Finding("error", "size-mismatch",
                          f"holds {end - begin:,} bytes but {dtype}{shape} needs {expected:,}",
                          rel, name))
    full = prefix + name
    group = group_of(tuple(full.split(".")), None, default_group)
    if group == "model" and dtypes.DTYPES[dtype].kind in ("int", "uint", "bool"):
        group = "buffer"
    return TensorInfo(full, dtype, tuple(shape), expected, group, rel, data_start + begin)


def _short(value: Any) -> str:
    """A header value for a message: at most 80 characters, never a deep ``repr`` (the
    header's nesting is bounded, and its lists can still be long)."""
    text = orjson.dumps(value).decode() if isinstance(value, (list, dict)) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_spans(index: CheckpointIndex, rel: str, spans: list[tuple[int, int, str]],
                 data_len: int) -> None:
    spans.sort()
    pos = 0
    for b, e, name in spans:
        if b > pos:
            index.add(Finding("error", "gap", f"{b - pos:,} unused bytes before this tensor "
                              f"(data offset {pos:,})", rel, name))
        elif b < pos:
            index.add(Finding("error", "overlap", f"data overlaps the previous tensor by "
                              f"{pos - b:,} bytes", rel, name))
        pos = max(pos, e)
    _check_end(index, rel, pos, data_len)


def _check_end(index: CheckpointIndex, rel: str, pos: int, data_len: int) -> None:
    if pos > data_len:
        index.add(Finding("error", "truncated",
                          f"tensor data needs {pos:,} bytes but the file has {data_len:,} after "
                          "the header (truncated)", rel))
    elif pos < data_len:
        index.add(Finding("error", "trailing-bytes",
                          f"{data_len - pos:,} bytes after the last tensor (trailing garbage or a "
                          "damaged header)", rel))


def _pickle_note(fd: Handle, size: int) -> str:
    """For a file that is not safetensors after all: torch.load would read it as a pickle
    (its first eight bytes can be pickle opcodes), so say what that pickle would run."""
    head = storage.pread(fd, min(size, 1 << 24), 0)
    if not looks_like_pickle(head[:4096]):
        return ""
    note = allowlist.refused(scan_stream(head))
    return note.replace("; it ", "; read as the pickle torch.load would take it for, it ", 1)
