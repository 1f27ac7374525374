"""DCP checks for ``validate``: storage items, chunk tiling, chunk decoding.

A torch.distributed.checkpoint directory is a ``.metadata`` pickle naming, for every tensor
chunk and every non-tensor item, a byte range ``(file, offset, length)`` holding an embedded
torch.save zip. The reader already refuses paths that leave the directory and flags missing
files and chunks that run past their file. Here: the items of each file must not overlap
(and should cover it), every ``.distcp`` file must be referenced, and every item must decode
to what the metadata says, with a sane zip whose records' CRC-32 are then verified. (That the
chunks of each tensor tile its global shape exactly is checked by the DCP reader itself, so
that consolidate refuses such input too.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_cli import dtypes, storage
from ckpt_cli.errors import CkptError, CorruptCheckpointError, ZipConflictError
from ckpt_cli.formats import allowlist, dcp
from ckpt_cli.formats.standins import TensorRecord
from ckpt_cli.formats.torchfile import after_stop_finding, view_extent
from ckpt_cli.formats.torchzip import (
    TorchZip,
    ZipEntry,
    archive_prefix,
    failed_note,
    pickle_records_note,
    record,
    refuse_colliding_names,
    scan_other_pickles,
)
from ckpt_cli.formats.unpickler import scan_globals
from ckpt_cli.model import CheckpointIndex, Chunk, Finding, TensorInfo
from ckpt_cli.ops.validate.dcpfast import Fast as _Fast
from ckpt_cli.ops.validate.zipcheck import CrcTask, ZipReport, check_zip, crc_tasks
from ckpt_cli.storage import Handle
from ckpt_cli.storage.reads import OpenFiles

_DISTCP = re.compile(r"^__(?:thin[0-9a-f]{8}_)?\d+_\d+\.distcp\Z")  # tagged: ckpt thinning


@dataclass(slots=True)
class DcpReport:
    """What :func:`check_dcp` found, by check.

    Attributes:
        storage: Item placement: bounds, overlaps, unreferenced files (``dcp-storage``).
        chunks: Items that do not decode (``dcp-chunks``).
        zips: Zip structure problems inside items (``zip-structure``).
        pickles: Pickle globals inside items (``pickle-safety``).
        crc: CRC tasks for every record of every decodable item.
        items: Items (tensor chunks and objects) decoded.
        placed: Items named by ``.metadata``.
        files: Files they are stored in.
        tensors: Tensors made of chunks (the DCP reader checks that they tile: its
            ``chunk-tiling`` findings).
        undecoded: Items skipped because of storage transforms (compression).
        decoded: Items and undecoded items by file (with the prefix), for the files decoded.
        item_files: Every file the items are stored in (with the prefix), sorted.
    """

    storage: list[Finding] = field(default_factory=list)
    chunks: list[Finding] = field(default_factory=list)
    zips: list[Finding] = field(default_factory=list)
    pickles: list[Finding] = field(default_factory=list)
    crc: list[CrcTask] = field(default_factory=list)
    items: int = 0
    placed: int = 0
    files: int = 0
    tensors: int = 0
    undecoded: int = 0
    decoded: dict[str, tuple[int, int]] = field(default_factory=dict)
    item_files: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Item:
    name: str
    offsets: tuple[int, ...] | None
    rel: str
    offset: int
    length: int
    transforms: tuple[str, ...]

    @property
    def where(self) -> str:
        return self.name if self.offsets is None else f"{self.name}@{list(self.offsets)}"


def check_dcp(index: CheckpointIndex, directory: Path, files: OpenFiles, *, prefix: str = "",
              decode: bool = True, only: Callable[[str], bool] | None = None) -> DcpReport:
    """Check a DCP directory beyond what its reader checked.

    Args:
        index: The directory's index, as the DCP reader made it (names without ``prefix``).
        directory: The DCP directory.
        files: Where to open files (kept open for the CRC pass).
        prefix: Path of ``directory`` relative to the checkpoint being validated (``""`` when
            it is the checkpoint), prepended to findings' file names.
        decode: Decode every item and collect CRC tasks (reads headers of every item).
        only: Decode only the items of the files it accepts (paths with the prefix): the
            files of this part of a split validation (``--part``).

    Returns:
        The :class:`DcpReport`.

    Raises:
        CkptError: If ``.metadata`` cannot be read (the reader would have failed first).
    """
    report = DcpReport()
    meta_path = dcp.metadata_file(directory)
    if meta_path is None:  # the reader raises before this; kept for direct callers
        return report
    storage = dcp.storage_of(directory, meta_path)  # as the reader parsed it, if unchanged
    items = [_Item(fqn, offs, rel, off, length, tr)
             for (fqn, offs), (rel, off, length, tr) in storage.items()]
    sizes = _file_sizes(directory, items)
    report.placed, report.files = len(items), len({i.rel for i in items})
    report.item_files = sorted({prefix + i.rel for i in items})
    _placement(report, items, sizes, directory, prefix)
    report.tensors = sum(1 for t in index.tensors.values() if t.chunks)
    if decode:
        _decode(report, index, items, sizes, directory, files, prefix, only)
    return report


def _file_sizes(directory: Path, items: list[_Item]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for rel in {i.rel for i in items}:
        size = _size(directory / rel)
        if size is not None:
            sizes[rel] = size
    return sizes


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


def _placement(report: DcpReport, items: list[_Item], sizes: dict[str, int], directory: Path,
               prefix: str) -> None:
    by_file: dict[str, list[_Item]] = {}
    cut: set[str] = set()  # truncated files: their tail is a partial item, not a gap
    for it in items:
        if it.offset < 0 or it.length < 0:
            report.storage.append(Finding("error", "item-out-of-bounds",
                                          f"negative offset or length ({it.offset}, "
                                          f"{it.length})", prefix + it.rel, it.where))
            continue
        size = sizes.get(it.rel)
        if size is None:
            continue  # the reader reports the missing file
        if it.offset + it.length > size:
            cut.add(it.rel)
            # Tensor chunks past the end are reported by the reader (chunk-out-of-bounds).
            if it.offsets is None:
                report.storage.append(Finding(
                    "error", "item-out-of-bounds",
                    f"item at byte {it.offset:,} (+{it.length:,}) runs past the end of the "
                    f"{size:,}-byte file (truncated)", prefix + it.rel, it.where))
            continue
        by_file.setdefault(it.rel, []).append(it)
    for rel, lst in sorted(by_file.items()):
        lst.sort(key=lambda i: (i.offset, i.length))
        pos, prev = 0, None
        for it in lst:
            if it.offset < pos and prev is not None:
                report.storage.append(Finding(
                    "error", "item-overlap",
                    f"bytes {it.offset:,}-{it.offset + it.length:,} overlap {prev.where} "
                    f"(which ends at {pos:,}): two items share bytes", prefix + rel, it.where))
            elif it.offset > pos:
                report.storage.append(Finding(
                    "warning", "item-gap",
                    f"{it.offset - pos:,} bytes before this item belong to no item",
                    prefix + rel, it.where))
            if it.offset + it.length >= pos:
                pos, prev = it.offset + it.length, it
        if pos < sizes[rel] and rel not in cut:
            report.storage.append(Finding(
                "warning", "item-gap",
                f"{sizes[rel] - pos:,} bytes after the last item belong to no item (appended "
                "data, or items missing from .metadata)", prefix + rel))
    referenced = {it.rel for it in items}
    try:
        present = sorted(p.name for p in directory.iterdir() if _DISTCP.match(p.name))
    except OSError:
        present = []
    for name in present:
        if name not in referenced:
            report.storage.append(Finding(
                "warning", "unreferenced-file",
                ".metadata does not reference this file (left over from another save?)",
                prefix + name))


def _decode(report: DcpReport, index: CheckpointIndex, items: list[_Item],
            sizes: dict[str, int], directory: Path, files: OpenFiles, prefix: str,
            only: Callable[[str], bool] | None) -> None:
    chunks: dict[tuple[str, tuple[int, ...]], tuple[TensorInfo, Chunk]] = {
        (t.name, c.offsets): (t, c) for t in index.tensors.values() for c in t.chunks}
    todo = sorted(items, key=lambda i: (i.rel, i.offset))
    fast = _Fast(todo, _chunk_problem)
    for k, it in enumerate(todo):
        size = sizes.get(it.rel)
        if size is None or it.offset < 0 or it.length < 0 or it.offset + it.length > size:
            continue  # missing or out of bounds: reported already
        rel = prefix + it.rel
        if only is not None and not only(rel):
            continue
        report.items += 1
        n, undecoded = report.decoded.get(rel, (0, 0))
        report.decoded[rel] = (n + 1, undecoded + bool(it.transforms))
        if it.transforms:
            report.undecoded += 1
            if it.offsets is None:  # a BYTE_IO item: a torch.save zip that dcp.load unpickles
                report.pickles.append(Finding(
                    "error", "unscanned-pickle",
                    f"item {it.name} is stored through {', '.join(map(str, it.transforms))}, "
                    "which ckpt does not decode: its pickle, which dcp.load unpickles with "
                    "torch.load(weights_only=False), could not be scanned", rel, it.name))
            continue
        fd = files.open(directory / it.rel, rel)
        data = fast.bytes_of(k, fd, size)
        if data is not None and fast.check(report, it, data, rel, fd, chunks):
            continue
        zr = check_zip(fd, it.offset, it.length, rel=rel, where=it.where, data=data)
        report.zips.extend(zr.findings)
        if not zr.readable:
            continue
        try:
            tz = _load(fd, it.offset, it.length, zr, f"{directory / it.rel}@{it.offset}", data)
        except CkptError as e:
            code = "bad-item" if it.offsets is None else "chunk-undecodable"
            report.chunks.append(Finding("error", code, e.message, rel, it.where))
            continue
        _pickle_findings(report, tz, it, rel)
        if data is not None and not zr.findings and not tz.unscanned and not tz.after_stop:
            fast.learn(data, zr)
        if it.offsets is not None:
            pair = chunks.get((it.name, it.offsets))
            problem = _chunk_problem(tz, pair, it.length) if pair else None
            if problem:
                report.chunks.append(Finding("error", "chunk-undecodable", problem, rel,
                                             it.where))
                continue
        report.crc.extend(crc_tasks(zr, rel=rel, fd=fd, start=it.offset, where=it.where))
    fast.flush(report)


def _pickle_findings(report: DcpReport, tz: TorchZip, it: _Item, rel: str) -> None:
    report.pickles.extend(
        f for f in allowlist.pickle_findings(tz.pickle, file=rel,
                                             what=f"pickle of item {it.name}")
        if f.severity != "info")
    # Fail closed: a pickle record of the item ckpt could not scan may run anything.
    report.pickles.extend(
        Finding("error", "unscanned-pickle", f"item {it.name}: pickle record {name} could "
                f"not be scanned for globals: {why}", rel, it.name)
        for name, why in sorted(tz.unscanned.items()))
    if tz.after_stop:
        report.pickles.append(after_stop_finding(tz, rel, f"item {it.name}: "))


def _load(fd: Handle, start: int, length: int, zr: ZipReport, where: str,
          data: bytes | None = None) -> TorchZip:
    """Unpickle an item's ``data.pkl`` from the records :func:`check_zip` already located.

    Same result as :func:`~ckpt_cli.formats.torchzip.parse_zip`, without parsing the central
    directory a second time (DCP checkpoints hold thousands of items).

    Raises:
        CorruptCheckpointError: No ``data.pkl``, or one that does not unpickle.
    """
    try:  # as parse_zip does: records two readers would choose between
        refuse_colliding_names([r.name for r in zr.records], where)
    except ZipConflictError as e:
        raise ZipConflictError(e.message + pickle_records_note(fd, start, length),
                               code=e.code, path=where) from None
    entries = {r.name: ZipEntry(r.name, r.header_offset, r.data_offset, r.size, r.method != 0,
                                r.crc) for r in zr.records}
    prefix = archive_prefix(list(entries))
    pkl = record(entries, f"{prefix}data.pkl")
    if pkl is None or pkl.compressed:
        raise CorruptCheckpointError("the item has no readable data.pkl record", path=where)
    raw = (data[pkl.data_offset:pkl.data_offset + pkl.size] if data is not None
           else storage.pread(fd, pkl.size, start + pkl.data_offset))
    result, error = scan_globals(raw)
    if error is not None:
        raise CorruptCheckpointError(f"data.pkl is not a readable pickle ({error})"[:200]
                                     + failed_note(result, raw),
                                     path=where)
    tz = TorchZip(entries, prefix, result, start)
    scan_other_pickles(tz, fd, length)
    return tz


def _chunk_problem(tz: TorchZip, pair: tuple[TensorInfo, Chunk], length: int) -> str | None:
    """Why an embedded zip does not hold the chunk the metadata describes (None if it does)."""
    t, c = pair
    rec = tz.pickle.obj
    if not isinstance(rec, TensorRecord) or rec.storage is None:
        return "the item does not hold a tensor"
    if tuple(rec.shape) != tuple(c.sizes) or rec.dtype != t.dtype:
        return (f"holds {rec.dtype}{list(rec.shape)} but .metadata says "
                f"{t.dtype}{list(c.sizes)}")
    entry = tz.storage_entry(rec.storage.key)
    if entry is None:
        return f"its storage record data/{rec.storage.key} is missing"
    if entry.data_offset + entry.size > length:
        return "its storage record runs past the end of the item (truncated)"
    if entry.size < rec.storage.nbytes:
        return (f"its storage record holds {entry.size:,} bytes, the pickle says "
                f"{rec.storage.nbytes:,}")

    extent = view_extent(rec.shape, rec.stride, rec.storage_offset) * dtypes.DTYPES[
        rec.dtype].itemsize
    if extent > rec.storage.nbytes:
        return f"its view needs {extent:,} bytes of a {rec.storage.nbytes:,}-byte storage"
    return None
