"""Zip checks for ``validate``: a sane central directory, and the CRC-32 of every record.

torch.save files (and each item inside a DCP ``.distcp`` file) are zips whose records are
STORED, 64-byte aligned, and followed by data descriptors. ``torch.load`` checks none of the
zip's redundancy: a flipped bit in a tensor loads silently. Here the central directory is
parsed independently of :mod:`zipfile` (which tolerates trailing garbage and shifted offsets)
and cross-checked against the end records, every local header and data descriptor; then
every record's bytes are streamed and their CRC-32 compared with the recorded one.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from ckpt_cli import storage
from ckpt_cli.formats import zipshape
from ckpt_cli.model import Finding, Severity
from ckpt_cli.progress import Progress
from ckpt_cli.storage import Handle
from ckpt_cli.storage.reads import (
    BUFFER_SIZE,
    Meter,
    crc32,
    crc32_combine,
    read_range,
    run_parallel,
)

_EOCD, _Z64_LOCATOR, _Z64_EOCD = zipshape.EOCD, zipshape.Z64_LOCATOR, zipshape.Z64_EOCD
_CENTRAL, _LOCAL, _DESCRIPTOR = zipshape.CENTRAL, zipshape.LOCAL, zipshape.DESCRIPTOR
_FLAG_ENCRYPTED = 0x1
_FLAG_DESCRIPTOR = 0x8
_FLAG_UTF8 = 0x800
_MAX_COMMENT = 0xFFFF
_SEGMENT = 64 << 20  # records larger than this are checksummed in parallel pieces
_BATCH = 8 << 20  # small records are grouped into jobs of about this many bytes
_MAX_CENTRAL = 256 << 20  # over a million records; torch writes a few per tensor


@dataclass(frozen=True, slots=True)
class ZipRecord:
    """One record of a zip, as the central directory and its local header describe it.

    Attributes:
        name: Record name.
        header_offset: Offset of the local header from the zip's start.
        data_offset: Offset of the payload from the zip's start.
        size: Stored (compressed) size of the payload.
        crc: The CRC-32 the central directory records.
        method: Compression method (0 = STORED).
        end: End of the record (payload plus data descriptor), from the zip's start.
    """

    name: str
    header_offset: int
    data_offset: int
    size: int
    crc: int
    method: int
    end: int


@dataclass(slots=True)
class ZipReport:
    """What :func:`check_zip` found.

    Attributes:
        records: The records whose payload lies inside the zip (CRC-checkable), by offset.
        findings: Problems found.
        readable: Whether the central directory could be parsed at all.
        crc_disabled: Every non-empty record has CRC 0: written with CRC turned off.
    """

    records: list[ZipRecord] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    readable: bool = True
    crc_disabled: bool = False


_RECORD_BATCH = 128
"""Records whose local headers are fetched together from object storage."""

_GAP = 256 << 10
"""Spans of a batch closer than this are fetched as one range (of at most :data:`_SPAN`):
a batch holds at most ``_RECORD_BATCH * _GAP`` bytes it did not need (32 MiB)."""

_SPAN = 1 << 20

_WHOLE = 64 << 10
"""A zip on disk at most this long is read whole, once, for its structure checks (a short
read, at a file's end, leaves the rest to the reads that follow, as before)."""


class _Fatal(Exception):
    """The zip cannot be parsed any further."""


class _Checker:
    def __init__(self, fd: Handle, start: int, length: int, rel: str, where: str,
                 data: bytes | None = None):
        self.fd, self.start, self.length, self.rel, self.where = fd, start, length, rel, where
        self.report = ZipReport()
        self._pre: dict[int, bytes] = {}  # offset -> bytes fetched ahead (object storage)
        self._pre_at: list[int] = []
        if data is not None and len(data) == length:  # the caller read the zip already
            self._pre, self._pre_at = {0: data}, [0]

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset`` from the zip's start (fewer at the end of the window)."""
        n = max(0, min(n, self.length - offset))
        if not n:
            return b""
        got = self._held(offset, n)
        return got if got is not None else storage.pread(self.fd, n, self.start + offset)

    def _held(self, offset: int, n: int) -> bytes | None:
        i = bisect.bisect_right(self._pre_at, offset) - 1
        if i >= 0:
            at = self._pre_at[i]
            got = self._pre[at]
            if offset + n <= at + len(got):
                return got[offset - at:offset - at + n]
        return None

    def _prefetch_records(self, entries: list[tuple[str, int, int, int, int, int, int]]
                          ) -> None:
        """On object storage, fetch what :meth:`_local_headers` reads of these records in
        two concurrent batches, for :meth:`read` to serve: each record's header, name and
        (torch's) padded extra field, then the data descriptors after the payloads of the
        records that have one. One after the other, they would be a request each. Files on
        disk need nothing of the sort; only one batch of records is held at a time."""
        if isinstance(self.fd, int):
            return
        self._pre.clear()
        self._pre_at = []
        # From 24 bytes before each header: the previous record's data descriptor, if any.
        self.prefetch([(max(0, e[1] - 24), 24 + 30 + e[6] + 128) for e in entries])
        descriptors = []
        for _name, offset, csize, _crc, _method, flags, _n in entries:
            head = self.read(offset, 30) if flags & _FLAG_DESCRIPTOR else b""
            if len(head) == 30 and head[:4] == _LOCAL:
                ln, lm = struct.unpack_from("<HH", head, 26)
                descriptors.append((offset + 30 + ln + lm + csize, 24))
        self.prefetch(descriptors)

    def prefetch(self, spans: list[tuple[int, int]]) -> None:
        """Fetch ``(offset, n)`` spans in one concurrent batch, neighbours less than
        :data:`_GAP` apart merged into one ranged GET."""
        if isinstance(self.fd, int) or not spans:
            return
        fd = self.fd
        merged: list[list[int]] = []
        for off, n in sorted((o, min(n, self.length - o)) for o, n in spans
                             if 0 <= o < self.length and self._held(o, n) is None
                             and not fd.cached(self.start + o, n)):
            if merged and off <= merged[-1][1] + _GAP and off + n - merged[-1][0] <= _SPAN:
                merged[-1][1] = max(merged[-1][1], off + n)
            else:
                merged.append([off, off + n])
        if not merged:
            return
        got = fd.fetch_ranges([(self.start + a, b - a) for a, b in merged])
        self._pre.update({a: data for (a, _), data in zip(merged, got, strict=True)})
        self._pre_at = sorted(self._pre)

    def add(self, code: str, message: str, entry: str | None = None,
            severity: Severity = "error") -> None:
        loc = " ".join(x for x in (self.where, entry) if x) or None
        self.report.findings.append(Finding(severity, code, message, self.rel, loc))

    def fatal(self, code: str, message: str) -> _Fatal:
        self.add(code, message)
        self.report.readable = False
        return _Fatal()

    def run(self) -> ZipReport:
        if isinstance(self.fd, int) and 0 < self.length <= _WHOLE and not self._pre:
            # A small zip (a DCP item of a few values) in one read, not one per field: the
            # checks below read its end records, directory, headers and descriptors.
            self._pre = {0: storage.pread(self.fd, self.length, self.start)}
            self._pre_at = [0]
        try:
            cd_offset, cd_size, count = self._end_records()
            records = self._central_directory(cd_offset, cd_size, count)
            self._local_headers(records, cd_offset)
        except _Fatal:
            pass
        except (struct.error, UnicodeDecodeError, ValueError) as e:  # defensive: never crash
            self.fatal("zip-central-directory", f"malformed zip structure ({e})")
        return self.report

    def _end_records(self) -> tuple[int, int, int]:
        if self.length < 22:
            raise self.fatal("zip-no-end-record",
                             f"{self.length} bytes is too short for a zip (truncated)")
        tail_len = min(self.length, 22 + _MAX_COMMENT)
        tail = self.read(self.length - tail_len, tail_len)
        pos, exact = -1, False
        i = tail.rfind(_EOCD)
        while i >= 0:
            if i + 22 <= len(tail):
                (comment,) = struct.unpack_from("<H", tail, i + 20)
                if i + 22 + comment == len(tail):
                    pos, exact = i, True
                    break
                if pos < 0:
                    pos = i
            i = tail.rfind(_EOCD, 0, i)
        if pos < 0:
            raise self.fatal("zip-no-end-record",
                             "no end-of-central-directory record: the file is truncated or was "
                             "not fully written")
        eocd = self.length - tail_len + pos
        (_sig, disk, cd_disk, _n_disk, count, cd_size, cd_offset,
         comment) = struct.unpack_from("<4sHHHHIIH", tail, pos)
        if not exact:
            extra = len(tail) - (pos + 22 + comment)
            if extra > 0:
                self.add("zip-trailing-bytes",
                         f"{extra:,} bytes follow the end of the zip (appended data, or a "
                         "damaged end record)")
            else:
                raise self.fatal("zip-no-end-record",
                                 "the end-of-central-directory record is cut off (truncated)")
        if disk != 0 or cd_disk != 0:
            raise self.fatal("zip-central-directory",
                             "multi-disk (split) zip: not something torch writes")
        cd_end = eocd
        # torch (miniz) writes ZIP64 end records whenever ZIP64 is on, not only when needed.
        needs64 = 0xFFFFFFFF in (cd_size, cd_offset) or count == 0xFFFF
        if needs64 or (eocd >= 20 and self.read(eocd - 20, 4) == _Z64_LOCATOR):
            cd_offset, cd_size, count, cd_end = self._zip64(eocd)
        if cd_offset + cd_size != cd_end:
            raise self.fatal(
                "zip-central-directory",
                f"the end record puts the central directory at bytes {cd_offset:,}-"
                f"{cd_offset + cd_size:,} but it ends at {cd_end:,} (bytes were inserted or "
                "removed, or the zip is embedded in other data)")
        return cd_offset, cd_size, count

    def _zip64(self, eocd: int) -> tuple[int, int, int, int]:
        loc = self.read(eocd - 20, 20) if eocd >= 20 else b""
        if len(loc) < 20 or loc[:4] != _Z64_LOCATOR:
            raise self.fatal("zip-central-directory",
                             "the end record needs a ZIP64 locator, which is missing")
        (_sig, _disk, rec_off, _disks) = struct.unpack("<4sIQI", loc)
        rec = self.read(rec_off, 56)
        if len(rec) < 56 or rec[:4] != _Z64_EOCD:
            raise self.fatal("zip-central-directory",
                             f"no ZIP64 end record at byte {rec_off:,}")
        (_sig, rec_size, _made, _need, _disk, _cd_disk, _n_disk, count, cd_size,
         cd_offset) = struct.unpack("<4sQHHIIQQQQ", rec)
        if rec_off + 12 + rec_size != eocd - 20:
            raise self.fatal("zip-central-directory",
                             "the ZIP64 end record does not sit right before its locator")
        return cd_offset, cd_size, count, rec_off

    def _central_directory(self, cd_offset: int, cd_size: int,
                           count: int) -> list[tuple[str, int, int, int, int, int, int]]:
        if cd_size > _MAX_CENTRAL:  # a damaged end record must not make us read gigabytes
            raise self.fatal("zip-central-directory",
                             f"the end record claims a {cd_size:,}-byte central directory")
        data = self.read(cd_offset, cd_size)
        if len(data) != cd_size:
            raise self.fatal("zip-central-directory", "central directory runs past the end")
        out: list[tuple[str, int, int, int, int, int, int]] = []
        pos = 0
        seen: set[str] = set()
        while pos < len(data):
            if data[pos:pos + 4] != _CENTRAL or pos + 46 > len(data):
                raise self.fatal("zip-central-directory",
                                 f"central directory entry {len(out)} is malformed (byte "
                                 f"{cd_offset + pos:,})")
            (_sig, _made, _need, flags, method, _t, _d, crc, csize, usize, n, m, k, disk,
             _ia, _ea, offset) = struct.unpack_from("<4sHHHHHHIIIHHHHHII", data, pos)
            raw_name = data[pos + 46:pos + 46 + n]
            extra = data[pos + 46 + n:pos + 46 + n + m]
            pos += 46 + n + m + k
            if pos > len(data):
                raise self.fatal("zip-central-directory", "central directory entry is cut off")
            name = raw_name.decode("utf-8" if flags & _FLAG_UTF8 else "cp437")
            usize, csize, offset = _zip64_extra(extra, usize, csize, offset, disk)
            if name in seen:
                self.add("zip-duplicate-name", "the zip has two records of this name", name)
            seen.add(name)
            if flags & _FLAG_ENCRYPTED:
                self.add("zip-encrypted", "record is encrypted (torch never encrypts)", name)
            out.append((name, offset, csize, crc, method, flags, n))
        if len(out) != count:
            self.add("zip-central-directory",
                     f"the end record counts {count} records but the central directory has "
                     f"{len(out)}")
        return out

    def _local_headers(self, entries: list[tuple[str, int, int, int, int, int, int]],
                       cd_offset: int) -> None:
        entries = sorted(entries, key=lambda e: e[1])
        starts = [e[1] for e in entries[1:]] + [cd_offset]
        prev_end, prev_name = 0, ""
        non_empty = zero_crc = 0
        for i, ((name, offset, csize, crc, method, flags, _n), next_start) in enumerate(zip(
                entries, starts, strict=True)):
            if i % _RECORD_BATCH == 0:
                self._prefetch_records(entries[i:i + _RECORD_BATCH])
            head = self.read(offset, 30)
            if offset + 30 > cd_offset or len(head) < 30 or head[:4] != _LOCAL:
                self.add("zip-local-header",
                         f"no local header at byte {offset:,} where the central directory "
                         "puts it", name)
                continue
            (_sig, _v, lflags, lmethod, _t, _d, lcrc, lcsize, _lusize, ln,
             lm) = struct.unpack("<4sHHHHHIIIHH", head)
            lname = self.read(offset + 30, ln)
            want = name.encode("utf-8" if flags & _FLAG_UTF8 else "cp437")
            if lname != want or lmethod != method or (lflags & _FLAG_DESCRIPTOR) != (
                    flags & _FLAG_DESCRIPTOR):
                self.add("zip-local-header",
                         "local header disagrees with the central directory (name, method or "
                         "flags)", name)
                continue
            data = offset + 30 + ln + lm
            end = data + csize
            if end > cd_offset:
                self.add("zip-out-of-bounds",
                         f"payload ({csize:,} bytes at {data:,}) runs into the central "
                         f"directory at {cd_offset:,}", name)
                continue
            if flags & _FLAG_DESCRIPTOR:
                end = self._descriptor(name, end, crc, csize, max(next_start, end))
            elif lcrc != crc or (lcsize != csize and lcsize != 0xFFFFFFFF):
                self.add("zip-local-header",
                         "local header's CRC or size differs from the central directory's",
                         name)
            if offset < prev_end:
                self.add("zip-overlap", f"overlaps record {prev_name} by "
                                        f"{prev_end - offset:,} bytes", name)
            elif offset > prev_end and self.report.records:
                self.add("zip-gap", f"{offset - prev_end:,} bytes before this record belong to "
                                    "no record", name, severity="warning")
            prev_end, prev_name = max(prev_end, end), name
            if csize:
                non_empty += 1
                zero_crc += crc == 0
            self.report.records.append(ZipRecord(name, offset, data, csize, crc, method, end))
        if self.report.records and prev_end < cd_offset:
            self.add("zip-gap", f"{cd_offset - prev_end:,} bytes between the last record and "
                                "the central directory belong to no record", severity="warning")
        self.report.crc_disabled = non_empty > 0 and zero_crc == non_empty

    def _descriptor(self, name: str, end: int, crc: int, csize: int, limit: int) -> int:
        """Check the data descriptor after a payload; return the record's end.

        A descriptor is ``[PK\\x07\\x08] crc32 csize usize`` with 4- or 8-byte sizes (miniz
        uses 8 only for records that need ZIP64): the form that ends where the next record
        starts wins.
        """
        raw = self.read(end, 24)
        skip = 4 if raw[:4] == _DESCRIPTOR else 0
        body = raw[skip:]
        ends = []
        if len(body) >= 12 and struct.unpack_from("<II", body, 0) == (crc, csize & 0xFFFFFFFF):
            ends.append(end + skip + 12)
        if len(body) >= 20 and struct.unpack_from("<IQ", body, 0) == (crc, csize):
            ends.append(end + skip + 20)
        fits = [e for e in ends if e <= limit]
        if not fits:
            self.add("zip-data-descriptor",
                     "the data descriptor after the payload disagrees with the central "
                     "directory (CRC or size)", name)
            return end
        return limit if limit in fits else fits[0]


def _zip64_extra(extra: bytes, usize: int, csize: int, offset: int,
                 disk: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4:pos + 4 + size]
        pos += 4 + size
        if tag != 1:
            continue
        it = iter(struct.unpack_from(f"<{len(body) // 8}Q", body))
        if usize == 0xFFFFFFFF:
            usize = next(it, usize)
        if csize == 0xFFFFFFFF:
            csize = next(it, csize)
        if offset == 0xFFFFFFFF:
            offset = next(it, offset)
        break
    return usize, csize, offset


def check_zip(fd: Handle, start: int, length: int, *, rel: str, where: str = "",
              data: bytes | None = None) -> ZipReport:
    """Check a zip's structure: end records, central directory, local headers, descriptors.

    Args:
        fd: Open file descriptor of the file holding the zip.
        start: Offset of the zip in the file (0 for a whole file; a DCP item's offset).
        length: Length of the zip.
        rel: The file's path relative to the checkpoint (for findings).
        where: Prefix of findings' locations (e.g. the DCP item), or empty.
        data: The zip's bytes, if the caller has read them (else they are read from ``fd``).

    Returns:
        The :class:`ZipReport`; never raises for malformed input.
    """
    return _Checker(fd, start, length, rel, where, data).run()


@dataclass(frozen=True, slots=True)
class CrcTask:
    """One record whose CRC-32 is to be verified.

    Attributes:
        rel: File path relative to the checkpoint.
        fd: Open descriptor of that file.
        offset: Absolute offset of the payload in the file.
        size: Payload length.
        expected: Recorded CRC-32.
        location: Finding location (record name, with any prefix).
        describe: Extra words naming what the bytes hold (tensor names), or empty.
        actual: The CRC-32 of the bytes when the caller computed it already (from bytes it
            had read): then nothing is read again.
        records: How many records the task stands for: a caller that checked many records
            in memory and found them all sound sums them in one task (``actual ==
            expected``, ``size`` their bytes).
    """

    rel: str
    fd: Handle
    offset: int
    size: int
    expected: int
    location: str
    describe: str = ""
    actual: int | None = None
    records: int = 1


def crc_tasks(report: ZipReport, *, rel: str, fd: Handle, start: int, where: str = "",
              describe: Callable[[str], str] | None = None) -> list[CrcTask]:
    """The CRC tasks of a checked zip: its stored, non-empty records.

    Args:
        report: From :func:`check_zip`.
        rel: The file, relative to the checkpoint.
        fd: Its open descriptor.
        start: Offset of the zip in the file.
        where: Location prefix.
        describe: Maps a record name to the tensors it holds (for messages).

    Returns:
        Tasks; none when CRCs were disabled at write time.
    """
    if report.crc_disabled:
        return []
    return [CrcTask(rel, fd, start + r.data_offset, r.size, r.crc,
                    " ".join(x for x in (where, r.name) if x),
                    describe(r.name) if describe else "")
            for r in report.records if r.size and r.method == 0]


def verify_crcs(tasks: list[CrcTask], *, threads: int, on_progress: Progress | None = None,
                meter: Meter | None = None) -> list[Finding]:
    """Stream every task's bytes, compute CRC-32 in parallel, and report mismatches.

    Large records are split into pieces checksummed on different threads and combined; small
    ones are grouped so per-task overhead stays negligible. Memory: one buffer per thread.

    Args:
        tasks: From :func:`crc_tasks`.
        threads: Worker threads.
        on_progress: Progress callback (label ``CRC-32``).
        meter: Shared progress meter, if any.

    Returns:
        One ``crc-mismatch`` error per record whose bytes changed.

    Raises:
        CkptError: A file cannot be read or ends early.
    """
    pieces: list[tuple[int, int, int]] = []  # (task index, offset, size)
    can_split = crc32_combine(0, 0, 0) is not None
    for i, t in enumerate(tasks):
        if t.actual is not None:
            continue  # computed by the caller
        if can_split and t.size > _SEGMENT:
            pieces.extend((i, off, min(_SEGMENT, t.offset + t.size - off))
                          for off in range(t.offset, t.offset + t.size, _SEGMENT))
        else:
            pieces.append((i, t.offset, t.size))
    batches: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    size = 0
    for p in pieces:
        current.append(p)
        size += p[2]
        if size >= _BATCH:
            batches.append(current)
            current, size = [], 0
    if current:
        batches.append(current)

    def job(batch: list[tuple[int, int, int]]) -> Callable[[Meter], list[tuple[int, int, int]]]:
        def run(meter: Meter) -> list[tuple[int, int, int]]:
            buf = bytearray(BUFFER_SIZE)
            out = []
            for i, off, n in batch:
                value = 0
                for view in read_range(tasks[i].fd, off, n, buf, meter, path=tasks[i].rel):
                    value = crc32(view, value)
                out.append((i, off, value))
            return out
        return run

    results = run_parallel([job(b) for b in batches], threads=threads,
                           total=sum(t.size for t in tasks if t.actual is None), label="CRC-32",
                           on_progress=on_progress, meter=meter)
    parts: dict[int, list[tuple[int, int]]] = {}
    for batch_result in results:
        for i, off, value in batch_result:
            parts.setdefault(i, []).append((off, value))
    findings: list[Finding] = []
    for i, t in enumerate(tasks):
        value = 0 if t.actual is None else t.actual
        for off, piece in sorted(parts.get(i, [])):
            n = min(_SEGMENT, t.offset + t.size - off)
            combined = crc32_combine(value, piece, n) if off > t.offset else piece
            value = piece if combined is None else combined
        if value != t.expected:
            what = f" ({t.describe})" if t.describe else ""
            findings.append(Finding(
                "error", "crc-mismatch",
                f"CRC-32 mismatch{what}: recorded {t.expected:#010x}, the bytes give "
                f"{value:#010x}; they changed after the file was written (bit rot, a bad "
                "copy, or an overwrite)", t.rel, t.location))
    return findings
