"""Recognising the zips of a DCP file that share one layout, without parsing each again.

A DCP checkpoint of many small tensors holds thousands of embedded torch.save zips that
differ only in their payloads (the tensor's bytes, its pickle) and the CRC-32 fields that
describe them: the same records, names, offsets, sizes, local headers, data descriptors,
central directory and end records, byte for byte. Once one zip of a given length has been
parsed in full and found sound (by whatever the caller requires: ``validate``'s structure
checks, ``parse_zip``), a :class:`ZipShape` remembers its bytes with the payloads and CRC-32
fields masked out. Another zip whose unmasked bytes are identical has the same structure, so
every structural verdict carries over; its own CRC-32 fields are read and each copy (central
directory, data descriptor or local header) must agree, as the full parse requires.

Fail closed: anything the shape does not match exactly (another length, one differing byte
outside the payloads, CRC copies that disagree, an extra end-of-central-directory signature
anywhere, which some parsers react to) takes the caller's full path. Pickle payloads are
not judged here: :class:`PickleCache` memoises the safe unpickling of identical bytes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt_cli import dtypes, storage
from ckpt_cli.errors import CorruptCheckpointError
from ckpt_cli.formats.standins import TensorRecord
from ckpt_cli.formats.torchfile import contiguous_strides
from ckpt_cli.formats.torchzip import TorchZip, ZipEntry, archive_prefix, parse_zip
from ckpt_cli.formats.unpickler import (
    PickleLengthError,
    PickleResult,
    check_lengths,
    scan_globals,
)
from ckpt_cli.model import Chunk, StorageRef, TensorInfo
from ckpt_cli.storage.reads import crc32

if TYPE_CHECKING:
    from ckpt_cli.storage import Handle

EOCD = _EOCD = b"PK\x05\x06"
Z64_LOCATOR = _Z64_LOCATOR = b"PK\x06\x07"
Z64_EOCD = _Z64_EOCD = b"PK\x06\x06"
CENTRAL = _CENTRAL = b"PK\x01\x02"
LOCAL = _LOCAL = b"PK\x03\x04"
DESCRIPTOR = _DESCRIPTOR = b"PK\x07\x08"
"""The zip record signatures (validate's structure checks use these too)."""
_FLAG_DESCRIPTOR = 0x8
_U32 = struct.Struct("<I")

MAX_LENGTH = 64 << 10
"""Zips longer than this are not worth a shape: their per-zip parse is small beside their
bytes (and a shape holds a copy of the zip's fixed bytes)."""

_MAX_SHAPES = 256
_MAX_PICKLES = 4096
_MAX_PICKLE = 4096


@dataclass(frozen=True, slots=True)
class ShapeRecord:
    """One record of a :class:`ZipShape` (offsets from the zip's start).

    Attributes:
        name: Record name.
        header_offset: Local header offset.
        data_offset: Payload offset.
        size: Payload length.
        method: Compression method (0 = STORED).
        end: End of the record (payload and data descriptor).
    """

    name: str
    header_offset: int
    data_offset: int
    size: int
    method: int
    end: int


class ZipShape:
    """The layout of one sound zip: its fixed bytes, and where each record's CRC-32 lies.

    Args:
        data: The zip's bytes.
        records: Its records, by offset, as the full parse found them.
        crc_at: For each record, the offsets of its CRC-32 copies: the central directory's
            first, then the data descriptor's or the local header's.
    """

    __slots__ = ("_fixed", "_slices", "crc_at", "eocds", "length", "order", "pickle", "prefix",
                 "records", "sound")

    def __init__(self, data: bytes, records: tuple[ShapeRecord, ...],
                 crc_at: tuple[tuple[int, ...], ...]):
        self.length = len(data)
        self.records = records  # in central-directory order
        self.crc_at = crc_at
        self.order = tuple(sorted(range(len(records)), key=lambda i: records[i].header_offset))
        names = [r.name for r in records]
        self.prefix = archive_prefix(names)
        self.pickle = next((i for i, r in enumerate(records)
                            if r.name == f"{self.prefix}data.pkl" and r.method == 0), -1)
        masked = sorted([(r.data_offset, r.data_offset + r.size) for r in records]
                        + [(p, p + 4) for ps in crc_at for p in ps])
        slices, pos = [], 0
        for a, b in masked:
            if a > pos:
                slices.append(slice(pos, a))
            pos = max(pos, b)
        if pos < self.length:
            slices.append(slice(pos, self.length))
        self._slices = tuple(slices)
        self._fixed = b"".join(map(data.__getitem__, self._slices))
        self.eocds = data.count(_EOCD)
        # Sound only if every end-record signature lies in the fixed bytes: then a zip with
        # as many has them all at the same places (a parser that looks for a second one sees
        # the same).
        fixed_eocds = sum(s.count(_EOCD) for s in map(data.__getitem__, self._slices))
        self.sound = (fixed_eocds == self.eocds and self.pickle >= 0
                      and len(set(names)) == len(names)
                      and all(n.startswith(self.prefix) and _plain(n[len(self.prefix):])
                              for i, n in enumerate(names) if i != self.pickle))

    def crcs(self, data: bytes) -> tuple[int, ...] | None:
        """Each record's CRC-32 if ``data`` is a zip of this shape, else None."""
        if (len(data) != self.length
                or b"".join(map(data.__getitem__, self._slices)) != self._fixed
                or data.count(_EOCD) != self.eocds):
            return None
        out = []
        unpack = _U32.unpack_from
        for ps in self.crc_at:
            (crc,) = unpack(data, ps[0])
            for p in ps[1:]:
                if unpack(data, p)[0] != crc:
                    return None
            out.append(crc)
        return tuple(out)


def learn(data: bytes, records: list[tuple[str, int, int, int, int, int]]) -> ZipShape | None:
    """The shape of a zip the caller parsed in full and found sound, or None if it is not
    one this module knows how to mask (not torch's plain layout: ZIP64 fields in a central
    directory entry, a comment, records other than torch's, a directory out of place).

    Args:
        data: The zip's bytes.
        records: ``(name, header_offset, data_offset, size, method, end)`` of every record.
    """
    n = len(data)
    if not 22 <= n <= MAX_LENGTH or data[n - 22:n - 18] != _EOCD:
        return None
    count, cd_size, cd_offset, comment = struct.unpack_from("<HIIH", data, n - 12)
    if comment:
        return None
    if n >= 42 and data[n - 42:n - 38] == _Z64_LOCATOR:
        (rec_off,) = struct.unpack_from("<Q", data, n - 34)
        if data[rec_off:rec_off + 4] != _Z64_EOCD:
            return None
        count, cd_size, cd_offset = struct.unpack_from("<QQQ", data, rec_off + 32)
    by_offset = {r[1]: r for r in records}
    if len(by_offset) != len(records) or count != len(records):
        return None
    out: list[ShapeRecord] = []
    crc_at: list[tuple[int, ...]] = []
    pos, end = cd_offset, cd_offset + cd_size
    while pos < end:
        if data[pos:pos + 4] != _CENTRAL:
            return None
        flags, = struct.unpack_from("<H", data, pos + 8)
        csize, usize = struct.unpack_from("<II", data, pos + 20)
        ln, lm, lk = struct.unpack_from("<HHH", data, pos + 28)
        (offset,) = struct.unpack_from("<I", data, pos + 42)
        r = by_offset.pop(offset, None)
        if r is None or 0xFFFFFFFF in (csize, usize, offset) or r[3] != csize:
            return None
        name, header, payload, size, method, rec_end = r
        if flags & _FLAG_DESCRIPTOR:
            at = payload + size
            copy = at + 4 if data[at:at + 4] == _DESCRIPTOR else at
        else:
            if data[header:header + 4] != _LOCAL:
                return None
            copy = header + 14
        crc_at.append((pos + 16, copy))
        out.append(ShapeRecord(name, header, payload, size, method, rec_end))
        pos += 46 + ln + lm + lk
    if by_offset or pos != end:
        return None
    shape = ZipShape(data, tuple(out), tuple(crc_at))
    return shape if shape.sound else None


def torch_zip(shape: ZipShape, crcs: tuple[int, ...], data: bytes, base: int,
              pickles: PickleCache) -> TorchZip | None:
    """What :func:`~ckpt_cli.formats.torchzip.parse_zip` returns for ``data``, a zip of
    ``shape`` at ``base`` whose records carry ``crcs``; None when its pickle needs the full
    path (see :class:`PickleCache`)."""
    pkl = shape.records[shape.pickle]
    result = pickles.get(data[pkl.data_offset:pkl.data_offset + pkl.size])
    if result is None:
        return None
    entries = {r.name: ZipEntry(r.name, r.header_offset, r.data_offset, r.size, r.method != 0,
                                crc) for r, crc in zip(shape.records, crcs, strict=True)}
    return TorchZip(entries, shape.prefix, result, base)


# torch's records beside data.pkl and the storages (names under the archive prefix): never
# pickles, never read for meaning. A zip with any other record (a second .pkl, TorchScript
# code, a record under another prefix) has no shape: parse_zip scans such records' bytes.
_PLAIN = ("version", ".format_version", "byteorder", ".storage_alignment", ".data/version",
          ".data/serialization_id", "serialization_id")


def _plain(short: str) -> bool:
    return short in _PLAIN or (short.startswith("data/") and short[5:].isascii()
                               and short[5:].isdigit())


class Shapes:
    """Learned shapes, by length (a bounded number; a later one of the same length replaces
    none: the first stands)."""

    __slots__ = ("_by_length",)

    def __init__(self) -> None:
        self._by_length: dict[int, ZipShape] = {}

    def match(self, data: bytes) -> tuple[ZipShape, tuple[int, ...]] | None:
        """The shape ``data`` has, with its records' CRC-32, or None."""
        shape = self._by_length.get(len(data))
        if shape is None:
            return None
        crcs = shape.crcs(data)
        return None if crcs is None else (shape, crcs)

    def add(self, shape: ZipShape | None) -> None:
        """Remember ``shape`` (None: nothing)."""
        if shape is not None and len(self._by_length) < _MAX_SHAPES:
            self._by_length.setdefault(shape.length, shape)


class PickleCache:
    """:func:`~ckpt_cli.formats.unpickler.scan_globals` of identical pickle bytes, once.

    Only pickles that parse, end at their STOP and are at most a few KiB are kept: anything
    else is the caller's full path. The results are shared: callers must not change them.
    """

    __slots__ = ("_done",)

    def __init__(self) -> None:
        self._done: dict[bytes, PickleResult | None] = {}

    def get(self, raw: bytes) -> PickleResult | None:
        """The unpickled result of ``raw``, or None when it needs the full path."""
        hit = self._done.get(raw, _MISSING)
        if hit is not _MISSING:
            return hit  # type: ignore[no-any-return]
        result: PickleResult | None = None
        if len(raw) <= _MAX_PICKLE:
            try:
                whole = check_lengths(raw) == len(raw)
            except PickleLengthError:
                whole = False
            if whole:
                found, error = scan_globals(raw)
                result = found if error is None else None
        if len(self._done) < _MAX_PICKLES:
            self._done[raw] = result
        return result


_MISSING: Any = object()


_SHAPES = Shapes()
_PICKLES = PickleCache()


def parse_item(fd: Handle, start: int, length: int, where: str) -> TorchZip:
    """:func:`~ckpt_cli.formats.torchzip.parse_zip` of a DCP item, read in one positioned
    read when it is small and recognised by the shape of an item ``parse_zip`` parsed before
    (process-wide: a shape is a fact about bytes, not about a file).

    Raises:
        CorruptCheckpointError: As ``parse_zip``.
        UnsupportedError: As ``parse_zip``.
    """
    if not (isinstance(fd, int) and 0 < length <= MAX_LENGTH):
        return parse_zip(fd, start, length, where)
    data = storage.pread(fd, length, start)
    hit = _SHAPES.match(data) if len(data) == length else None
    if hit is not None:
        tz = torch_zip(hit[0], hit[1], data, start, _PICKLES)
        if tz is not None:
            return tz
    tz = parse_zip(fd, start, length, where)
    # Learn only from the bytes parse_zip read (its reads of the file came after ours).
    if (hit is None and len(data) == length and not tz.unscanned and not tz.after_stop
            and storage.pread(fd, length, start) == data):
        _SHAPES.add(learn(data, [(e.name, e.header_offset, e.data_offset, e.size,
                                  1 if e.compressed else 0, e.data_offset + e.size)
                                 for e in tz.entries.values()]))
    return tz


def known_item(data: bytes, base: int) -> TorchZip | None:
    """:func:`parse_item`'s quick path on an item's bytes already read (``base``: where it
    starts in its file): its :class:`TorchZip` when it has the shape of an item parsed before
    and a pickle unpickled before, else None (then :func:`parse_item` must read it)."""
    hit = _SHAPES.match(data)
    return None if hit is None else torch_zip(hit[0], hit[1], data, base, _PICKLES)


class ItemValues:
    """Where the values of DCP items lie, from their bytes: an item of a layout and pickle
    seen sound before (:func:`known_item`) whose chunk checks (:func:`chunk_info`) passed
    once for the same layout, pickle, dtype and sizes passes them again, at the same place
    (they depend on nothing else); only its storage's CRC-32 is its own, and checked here.
    """

    __slots__ = ("_known",)

    def __init__(self) -> None:
        self._known: dict[tuple[object, ...], tuple[int, int, int] | None] = {}

    def find(self, data: bytes, t: TensorInfo, c: Chunk) -> tuple[int, int] | None:
        """``(offset in data, bytes)`` of the values of ``t``'s one chunk ``c``, an item that
        holds them contiguous and uncompressed, its storage's CRC-32 checked; None for any
        other item (the caller's full path then reads it, and says what is wrong)."""
        hit = _SHAPES.match(data)
        if hit is None:
            return None
        shape, crcs = hit
        pkl = shape.records[shape.pickle]
        raw = data[pkl.data_offset:pkl.data_offset + pkl.size]
        key = (shape, raw, t.dtype, c.sizes)
        known = self._known.get(key, _MISSING)
        if known is _MISSING:
            known = self._learn(shape, crcs, data, t, c)
            if len(self._known) < _MAX_PICKLES:
                self._known[key] = known
        if known is None:
            return None
        start, nbytes, i = known
        r = shape.records[i]
        if r.size and any(crcs[k] for k, x in enumerate(shape.records) if x.size):
            # (a zip written with checksums off records 0 for every record: none to check)
            if crc32(memoryview(data)[r.data_offset:r.data_offset + r.size]) != crcs[i]:
                return None
        return start, nbytes

    @staticmethod
    def _learn(shape: ZipShape, crcs: tuple[int, ...], data: bytes, t: TensorInfo,
               c: Chunk) -> tuple[int, int, int] | None:
        tz = torch_zip(shape, crcs, data, 0, _PICKLES)
        if tz is None:
            return None
        try:
            info = chunk_info(t, c, tz, "")
        except CorruptCheckpointError:
            return None
        s = info.storage
        entry = tz.storage_entry(s.key) if s is not None else None
        if (s is None or entry is None or entry.compressed or info.stride is not None
                or info.offset is None or info.offset + info.nbytes > len(data)):
            return None
        i = next(k for k, r in enumerate(shape.records) if r.name == entry.name)
        return info.offset, info.nbytes, i


def chunk_info(t: TensorInfo, c: Chunk, tz: TorchZip, where: str) -> TensorInfo:
    """Where the values of DCP chunk ``c`` of ``t`` lie, from its parsed item ``tz``
    (:func:`ckpt_cli.formats.dcp.locate_chunk`'s checks, without reading).

    Raises:
        CorruptCheckpointError: If the item does not describe a matching tensor.
    """
    rec = tz.pickle.obj
    if not isinstance(rec, TensorRecord) or rec.storage is None:
        raise CorruptCheckpointError(f"chunk of {t.name!r} does not hold a tensor",
                                     path=where)
    if tuple(rec.shape) != tuple(c.sizes) or rec.dtype != t.dtype:
        raise CorruptCheckpointError(
            f"chunk of {t.name!r} holds {rec.dtype}{list(rec.shape)}, metadata says "
            f"{t.dtype}{list(c.sizes)}", path=where)
    entry = tz.storage_entry(rec.storage.key)
    start = tz.storage_start(rec.storage.key)
    if entry is None or start is None:
        raise CorruptCheckpointError(f"chunk of {t.name!r} lacks its storage record",
                                     path=where)
    if entry.data_offset + entry.size > c.length:
        raise CorruptCheckpointError(f"chunk of {t.name!r} is truncated", path=where)
    item = dtypes.DTYPES[rec.dtype].itemsize
    stride = None if rec.stride == contiguous_strides(rec.shape) else rec.stride
    return TensorInfo(t.name, rec.dtype, rec.shape, dtypes.nbytes_of(rec.dtype, math.prod(
        rec.shape)), t.group, c.file, start + rec.storage_offset * item, stride,
        StorageRef(c.file, rec.storage.key, start, rec.storage.nbytes, rec.storage.dtype,
                   tz.storage_crc(rec.storage.key), entry.size), rec.storage_offset)
