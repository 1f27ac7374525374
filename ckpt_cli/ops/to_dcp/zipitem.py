"""One DCP item as ``torch.save`` writes it, without torch: a STORED zip archive of its own,
written at the current position of a ``.distcp`` file (DCP's ``FileSystemWriter`` calls
``torch.save(item, stream)`` once per item; ``dcp.load`` reads each one back with
``torch.load(weights_only=True)`` on its byte range).

The records are torch's, in torch's order, under ``archive/``: ``data.pkl`` (protocol 2),
``.format_version``, ``.storage_alignment``, ``byteorder``, ``data/0`` (a tensor's bytes),
``version``, ``.data/serialization_id``; each payload starts on a 64-byte boundary of the
archive (an ``FB`` padding extra field, as torch pads), and each record is followed by a data
descriptor (flag bit 3, as torch writes them), so that a tensor's bytes stream in pieces and
its CRC-32 is known only at its end. Offsets are relative to the archive's first byte; ZIP64
fields appear where a size or an offset needs them.
"""

from __future__ import annotations

import pickle
import struct
import uuid
import zlib
from collections.abc import Callable
from typing import Any

from ckpt_cli.writers.torchzip import tensor_pkl

ALIGN = 64
_LOCAL, _CENTRAL, _DESCRIPTOR = 0x04034B50, 0x02014B50, 0x08074B50
_END64, _LOCATOR, _END = 0x06064B50, 0x07064B50, 0x06054B50
_FULL32 = 0xFFFFFFFF  # a 32-bit field that says: see the ZIP64 field
LIMIT = _FULL32
"""Sizes and offsets from this on take ZIP64 fields (a test lowers it)."""
_DOS_DATE = 0x21  # 1980-01-01, the earliest a zip can say
_DESCRIBED = 0x08  # flag bit 3: CRC-32 and sizes in a data descriptor after the payload


class ItemZip:
    """Writes one archive through ``write``, tracking its own length.

    Args:
        write: Writes every byte it is given (the file's writer).
    """

    def __init__(self, write: Callable[[memoryview], None]):
        self._write = write
        self.length = 0
        self._entries: list[tuple[bytes, int, int, int]] = []  # name, crc, size, offset
        self._open: tuple[bytes, int, int] | None = None  # name, size, offset
        self._crc = 0
        self._got = 0

    def _out(self, data: bytes | memoryview) -> None:
        self._write(memoryview(data))
        self.length += len(data)

    def begin(self, name: str, size: int) -> None:
        """Open record ``archive/name`` of ``size`` bytes; :meth:`data` its bytes, then
        :meth:`end`."""
        raw = f"archive/{name}".encode()
        zip64 = size >= LIMIT
        extra64 = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        pad = -(self.length + 30 + len(raw) + len(extra64) + 4) % ALIGN
        extra = extra64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        s32 = _FULL32 if zip64 else size
        self._open = (raw, size, self.length)
        self._out(struct.pack("<IHHHHHIIIHH", _LOCAL, 45 if zip64 else 20, _DESCRIBED, 0, 0,
                              _DOS_DATE, 0, s32, s32, len(raw), len(extra)) + raw + extra)
        self._crc, self._got = 0, 0

    def data(self, piece: memoryview, crc: int | None = None) -> None:
        """Write a piece of the open record; ``crc``: its CRC-32 continued from the pieces
        before (computed here when None)."""
        self._crc = zlib.crc32(piece, self._crc) if crc is None else crc
        self._got += len(piece)
        self._out(piece)

    @property
    def crc(self) -> int:
        """The CRC-32 of the open record's bytes so far."""
        return self._crc

    def end(self) -> None:
        """Close the open record: its data descriptor."""
        assert self._open is not None
        raw, size, offset = self._open
        if self._got != size:
            raise ValueError(f"record {raw.decode()}: {self._got:,} bytes written, "
                             f"{size:,} declared")
        fmt = "<IIQQ" if size >= LIMIT else "<IIII"
        self._out(struct.pack(fmt, _DESCRIPTOR, self._crc, size, size))
        self._entries.append((raw, self._crc, size, offset))
        self._open = None

    def put(self, name: str, data: bytes) -> None:
        """A whole small record."""
        self.begin(name, len(data))
        self.data(memoryview(data))
        self.end()

    def header(self, pkl: bytes) -> None:
        """``data.pkl`` and the records torch writes before the storages."""
        self.put("data.pkl", pkl)
        self.put(".format_version", b"1")
        self.put(".storage_alignment", str(ALIGN).encode())
        self.put("byteorder", b"little")

    def finish(self) -> int:
        """``version``, ``.data/serialization_id`` and the central directory; returns the
        archive's length."""
        self.put("version", b"3\n")
        self.put(".data/serialization_id", str(uuid.uuid4().int).rjust(40, "0")[:40].encode())
        start = self.length
        for raw, crc, size, offset in self._entries:
            big = [v for v in (size, size, offset) if v >= LIMIT]
            extra = struct.pack("<HH", 1, 8 * len(big)) + b"".join(
                struct.pack("<Q", v) for v in big) if big else b""
            version = 45 if big else 20
            s32 = _FULL32 if size >= LIMIT else size
            self._out(struct.pack("<IHHHHHHIIIHHHHHII", _CENTRAL, version, version, _DESCRIBED,
                                  0, 0, _DOS_DATE, crc, s32, s32, len(raw), len(extra), 0, 0,
                                  0, 0, _FULL32 if offset >= LIMIT else offset) + raw + extra)
        n, size = len(self._entries), self.length - start
        if n >= 0xFFFF or size >= LIMIT or start >= LIMIT:
            where = self.length
            self._out(struct.pack("<IQHHIIQQQQ", _END64, 44, 45, 45, 0, 0, n, n, size, start))
            self._out(struct.pack("<IIQI", _LOCATOR, 0, where, 1))
            n, size, start = min(n, 0xFFFF), _FULL32, _FULL32
        self._out(struct.pack("<IHHHHIIH", _END, 0, 0, n, n, size, start, 0))
        return self.length


def object_item(obj: Any) -> bytes:
    """``torch.save(obj)`` of a value made of plain Python data (and numpy values): its
    ``data.pkl`` is what torch's pickler writes for it, protocol 2 (no storages)."""
    out = bytearray()
    z = ItemZip(out.extend)
    z.header(pickle.dumps(obj, protocol=2))
    z.finish()
    return bytes(out)


def tensor_header(z: ItemZip, code: str, shape: tuple[int, ...], nbytes: int) -> None:
    """The records of ``torch.save(tensor)`` before the tensor's bytes, and ``data/0`` opened
    for them (a contiguous tensor owning its storage, as DCP saves each one)."""
    z.header(tensor_pkl(code, shape))
    z.begin("data/0", nbytes)
