"""The torch.save zip layout (torch >= 1.6), read without torch and without trusting one
directory: the records' offsets from their local headers (:func:`parse_zip`,
:class:`TorchZip`), the checks that refuse an archive two readers would read differently
(colliding names, shifted or duplicated directories), and the globals its pickle records
name, found statically (:func:`pickle_records_seen`, :func:`scan_other_pickles`).

Every record is STORED under one ``<archive>/`` prefix; each storage ``('storage', cls,
key, loc, numel)`` of ``data.pkl`` is the entry ``<archive>/data/<key>``, whose payload
offset comes from its local header. :mod:`ckpt_cli.formats.torchfile` reads the pickles.
"""

from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckpt_cli import storage
from ckpt_cli.errors import (
    CorruptCheckpointError,
    UnsupportedError,
    ZipConflictError,
)
from ckpt_cli.formats import allowlist
from ckpt_cli.formats.unpickler import (
    PickleLengthError,
    PickleResult,
    check_lengths,
    looks_like_pickle,
    scan_globals,
    scan_stream,
    static_globals,
)

if TYPE_CHECKING:
    from ckpt_cli.storage import Handle, ObjectFile

ZIP_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True, slots=True)
class ZipEntry:
    """One zip record.

    Attributes:
        name: Full entry name (with the archive prefix).
        header_offset: Offset of its local header, relative to the zip's start.
        data_offset: Offset of its payload, relative to the zip's start.
        size: Payload length (compressed size; torch never compresses).
        compressed: Whether the entry is not STORED.
        crc: The CRC-32 the central directory records.
    """

    name: str
    header_offset: int
    data_offset: int
    size: int
    compressed: bool
    crc: int


def torch_data_offset(header_offset: int, name: str, size: int) -> int:
    """Where torch's zip writer puts a record's payload, from the central directory alone.

    ``PyTorchStreamWriter`` pads each local header's extra field so the payload starts on a
    64-byte boundary (``getPadding`` in caffe2's ``inline_container.cc``): 30 header bytes,
    the name, a 4-byte ``FB`` extra-field header, the zip64 fields a large record or a late
    offset needs, then padding up to the boundary.
    """
    start = header_offset + 30 + len(name.encode()) + 4
    if size >= 0xFFFFFFFF or header_offset >= 0xFFFFFFFF:
        start += 4
        if size >= 0xFFFFFFFF:
            start += 16
        if header_offset >= 0xFFFFFFFF:
            start += 8
    return -(-start // 64) * 64


def zip_entries(fd: Handle, start: int, length: int, where: str) -> dict[str, ZipEntry]:
    """List a zip's records with their payload offsets.

    Each local header is read to find its payload. On object storage that would be a
    request per record, so there the headers already fetched with the central directory and
    ``data.pkl`` are read and checked, and the payloads of the others are placed where torch's
    writer puts them (:func:`torch_data_offset`); if any header read disagrees with that
    rule, the writer was not torch's and every header is fetched (in one concurrent batch).

    Args:
        fd: Open file descriptor (or object handle) of the file holding the zip.
        start: Offset of the zip within the file (0 for a plain file).
        length: Length of the zip.
        where: Name for messages (a path, or ``file@offset``).

    Returns:
        Entries by name, in central-directory order.

    Raises:
        CorruptCheckpointError: No or a malformed central directory, bad local headers.
    """
    try:
        raw = io.BufferedReader(storage.Window(fd, start, length))
        with zipfile.ZipFile(raw) as zf:
            infos = zf.infolist()
            end = zipfile._EndRecData(raw)  # type: ignore[attr-defined]
            # zipfile moves every offset by how far the central directory lies from where
            # its end record says (data prepended to a zip); torch's reader does not.
            shift = zf.start_dir - end[zipfile._ECD_OFFSET]  # type: ignore[attr-defined]
    except zipfile.BadZipFile as e:
        msg = str(e)
        if "central directory" in msg.lower() or "not a zip" in msg.lower():
            msg = "no zip central directory: the file is truncated or was not fully written"
        raise CorruptCheckpointError(msg, path=where) from None
    except (OSError, ValueError, EOFError, struct.error, NotImplementedError,
            zipfile.LargeZipFile) as e:
        raise CorruptCheckpointError(f"unreadable zip structure ({e})", path=where) from None
    for info in infos:
        if not 0 <= info.header_offset < length:  # zipfile shifts offsets by a bad CD offset
            raise CorruptCheckpointError(
                f"entry {info.filename!r}: local header offset {info.header_offset:,} lies "
                "outside the file (damaged central directory)", path=where)
    try:
        _refuse_ambiguous(fd, start, length, infos, shift, where)
    except ZipConflictError as e:
        # Name what each reader would have run: the globals of every pickle record.
        raise ZipConflictError(e.message + pickle_records_note(fd, start, length),
                               code=e.code, path=where) from None
    if isinstance(fd, int):
        return _entries_from_headers(fd, start, infos, where)
    predicted = _predicted_entries(fd, start, infos, where)
    if predicted is not None:
        return predicted
    heads = fd.fetch_ranges([(start + i.header_offset, 30) for i in infos])
    return _entries_from_headers(fd, start, infos, where, heads)


_EOCD = b"PK\x05\x06"
SCAN_LIMIT = 256 << 20  # bytes read to name what a refused pickle or zip would have run


def refuse_colliding_names(names: list[str], where: str) -> None:
    """Refuse a zip with two records whose names are equal or differ only in case (torch's
    lookup ignores case; zipfile keeps the last of equal names).

    Raises:
        ZipConflictError: Naming the two records.
    """
    seen: dict[str, str] = {}
    for name in names:
        key = name.lower()
        if key in seen:
            same = "the same name" if seen[key] == name else "names that differ in case"
            raise ZipConflictError(
                f"zip holds two records with {same} ({seen[key]!r}, {name!r}): readers "
                "disagree on which one is loaded", code="zip-duplicate-name", path=where)
        seen[key] = name


def _refuse_ambiguous(fd: Handle, start: int, length: int, infos: list[zipfile.ZipInfo],
                      shift: int, where: str) -> None:
    """Refuse a zip that two readers could read differently.

    Python's ``zipfile`` (which ckpt uses to list records) and torch's reader (miniz) agree
    on a zip torch wrote; a crafted one can show each a different ``data.pkl``: a second end
    of central directory, a central directory away from where its end record says (zipfile
    shifts every offset to match, miniz does not), or two records whose names differ only in
    case (torch's lookup ignores case; zipfile keeps the last of equal names).

    Raises:
        UnsafeCheckpointError: Naming the conflict.
    """
    refuse_colliding_names([i.filename for i in infos], where)
    span = min(length, 22 + 0xFFFF + 20)
    tail = storage.pread(fd, span, start + length - span)
    ends = []
    at = tail.rfind(_EOCD)
    while at >= 0:
        if at + 22 <= len(tail):
            _, _, _, _, cd_size, cd_off, _ = struct.unpack("<HHHHIIH", tail[at + 4:at + 22])
            pos = length - span + at
            if cd_off == 0xFFFFFFFF or cd_off + cd_size <= pos:
                ends.append(pos)
        at = tail.rfind(_EOCD, 0, at)
    if len(ends) > 1:
        raise ZipConflictError(
            f"zip has {len(ends)} end-of-central-directory records (at bytes "
            f"{', '.join(f'{p:,}' for p in sorted(ends))}): readers disagree on which "
            "central directory holds the records", code="zip-end-record", path=where)
    if shift:
        raise ZipConflictError(
            f"the central directory lies {shift:,} bytes away from where its end record says: "
            "one reader shifts every record by that much and another does not",
            code="zip-central-directory", path=where)


def failed_note(result: PickleResult, raw: bytes) -> str:
    """The note for a pickle the unpickler stopped in: what it saw, and every global the
    bytes name after that (read statically; the real loader may get there)."""
    named = {**static_globals(raw[:SCAN_LIMIT]), **result.globals}
    return allowlist.refused(PickleResult(None, named, calls=result.calls,
                                          builds=result.builds))


def pickle_records_seen(fd: Handle, start: int, length: int) -> PickleResult:
    """The globals of every ``.pkl`` record of a zip (any case), found by walking its local
    headers, whatever its central directories say."""
    classes: dict[str, str] = {}
    calls: set[str] = set()
    builds: set[str] = set()
    at, end = 0, min(length, SCAN_LIMIT)
    step = 1 << 20
    while at < end:
        chunk = storage.pread(fd, min(step + 64 * 1024, end - at), start + at)
        hit = chunk.find(ZIP_MAGIC)
        while 0 <= hit < step:
            head = chunk[hit:hit + 30]
            if len(head) == 30:
                size, n, m = struct.unpack("<I", head[18:22])[0], *struct.unpack("<HH",
                                                                                 head[26:30])
                name = chunk[hit + 30:hit + 30 + n]
                if name.lower().endswith(b".pkl") and 0 < size <= end - at:
                    raw = storage.pread(fd, size, start + at + hit + 30 + n + m)
                    found, _ = scan_globals(raw)
                    classes.update(found.globals)
                    calls |= found.calls
                    builds |= found.builds
            hit = chunk.find(ZIP_MAGIC, hit + 4)
        at += step
    return PickleResult(None, classes, calls=calls, builds=builds)


def pickle_records_note(fd: Handle, start: int, length: int) -> str:
    """:func:`pickle_records_seen` as a message note (``"; its pickles would call ..."``)."""
    seen = pickle_records_seen(fd, start, length)
    return allowlist.refused(seen).replace("; it ", "; its pickles ", 1)


def _entry(info: zipfile.ZipInfo, data: int) -> ZipEntry:
    return ZipEntry(info.filename, info.header_offset, data, info.compress_size,
                    info.compress_type != zipfile.ZIP_STORED, info.CRC)


def _predicted_entries(fd: ObjectFile, start: int, infos: list[zipfile.ZipInfo],
                       where: str) -> dict[str, ZipEntry] | None:
    """Entries placed by :func:`torch_data_offset`, checked against every header at hand
    (at least one); None when a header disagrees (then every header must be read)."""
    checked = 0
    out: dict[str, ZipEntry] = {}
    for info in infos:
        data = torch_data_offset(info.header_offset, info.filename, info.compress_size)
        if fd.cached(start + info.header_offset, 30):
            got = _read_header(fd, start, info, where)
            if got != data:
                return None
            checked += 1
        out[info.filename] = _entry(info, data)
    return out if checked or not infos else None


def _read_header(fd: Handle, start: int, info: zipfile.ZipInfo, where: str,
                 head: bytes | None = None) -> int:
    # The payload lies where torch's reader finds it: past the local header's own name and
    # extra field. A local header naming another record than the central directory reads
    # the same bytes in torch and here; validate reports it (zip-local-header), on disk and
    # on a store alike.
    if head is None:
        head = storage.pread(fd, 30, start + info.header_offset)
    if len(head) < 30 or head[:4] != ZIP_MAGIC:
        raise CorruptCheckpointError(
            f"entry {info.filename!r}: no local header at offset {info.header_offset:,}",
            path=where)
    n, m = struct.unpack("<HH", head[26:30])
    return int(info.header_offset + 30 + n + m)


def _entries_from_headers(fd: Handle, start: int, infos: list[zipfile.ZipInfo], where: str,
                          heads: list[bytes] | None = None) -> dict[str, ZipEntry]:
    out: dict[str, ZipEntry] = {}
    for i, info in enumerate(infos):
        head = None if heads is None else heads[i]
        out[info.filename] = _entry(info, _read_header(fd, start, info, where, head))
    return out


def archive_prefix(names: list[str]) -> str:
    """The ``<archive>/`` prefix of a torch zip (taken from ``data.pkl``'s entry, whose name
    torch matches without regard to case)."""
    for n in names:
        if n.lower().endswith("/data.pkl") and n.count("/") == 1:
            return n[: -len("data.pkl")]
    for n in names:
        if n.lower().endswith("data.pkl"):
            return n[: -len("data.pkl")]
    return names[0].split("/", 1)[0] + "/" if names and "/" in names[0] else ""


def record(entries: dict[str, ZipEntry], name: str) -> ZipEntry | None:
    """A record by name as torch finds it: exactly, else ignoring case (two records that
    differ only in case were refused when the zip was listed)."""
    hit = entries.get(name)
    if hit is None:
        low = name.lower()
        hit = next((e for n, e in entries.items() if n.lower() == low), None)
    return hit


@dataclass(slots=True)
class TorchZip:
    """A parsed torch zip (a file, or one embedded in a DCP ``.distcp``).

    Attributes:
        entries: Records by name.
        prefix: The ``<archive>/`` prefix.
        pickle: The unpickled ``data.pkl`` (with the globals of the zip's other ``.pkl``
            records merged in).
        base: Absolute offset of the zip within its file.
        unscanned: ``.pkl`` records other than ``data.pkl`` that could not be scanned, with
            why.
        after_stop: Bytes of ``data.pkl`` after its pickle's STOP (0 as torch writes it).
    """

    entries: dict[str, ZipEntry]
    prefix: str
    pickle: PickleResult
    base: int
    _crc_off: bool | None = None
    unscanned: dict[str, str] = field(default_factory=dict)
    after_stop: int = 0

    def storage_start(self, key: str) -> int | None:
        """Absolute file offset of storage ``key``'s bytes, or None if the record is missing."""
        e = record(self.entries, f"{self.prefix}data/{key}")
        return None if e is None else self.base + e.data_offset

    def storage_entry(self, key: str) -> ZipEntry | None:
        """The record of storage ``key``."""
        return record(self.entries, f"{self.prefix}data/{key}")

    def storage_crc(self, key: str) -> int | None:
        """The CRC-32 recorded for storage ``key``; None when there is none to check.

        ``torch.serialization.set_crc32_options(False)`` records 0 for every record: no
        checksums. A 0 among real checksums is a checksum (``skip_data`` saves write it for
        storages they left unwritten, and damage can too).
        """
        e = self.storage_entry(key)
        if e is None:
            return None
        if self._crc_off is None:
            self._crc_off = all(not x.crc for x in self.entries.values() if x.size)
        return None if self._crc_off else e.crc


def parse_zip(fd: Handle, start: int, length: int, where: str) -> TorchZip:
    """Parse a torch zip's structure and its ``data.pkl`` (safely).

    Args:
        fd: Open file descriptor.
        start: Offset of the zip in the file.
        length: Length of the zip.
        where: Name for messages.

    Returns:
        The :class:`TorchZip`.

    Raises:
        CorruptCheckpointError: For a broken zip or pickle.
        UnsupportedError: For TorchScript archives without ``data.pkl``.
    """
    entries = zip_entries(fd, start, length, where)
    names = list(entries)
    prefix = archive_prefix(names)
    pkl = record(entries, f"{prefix}data.pkl")
    if pkl is None:
        if any(n.endswith("constants.pkl") for n in names):
            raise UnsupportedError("a TorchScript archive without data.pkl", path=where)
        raise CorruptCheckpointError("zip has no data.pkl: not a torch.save file", path=where)
    if pkl.compressed:
        raise CorruptCheckpointError("data.pkl is compressed (torch never writes that)",
                                     path=where)
    if pkl.data_offset + pkl.size > length:
        raise CorruptCheckpointError("data.pkl runs past the end of the file (truncated)",
                                     path=where)
    raw = storage.pread(fd, pkl.size, start + pkl.data_offset)
    result, error = scan_globals(raw)
    if error is not None:
        raise CorruptCheckpointError(f"data.pkl is not a readable pickle ({short_error(error)})"
                                     + failed_note(result, raw), path=where)
    tz = TorchZip(entries, prefix, result, start)
    _scan_after_stop(tz, raw)
    scan_other_pickles(tz, fd, length)
    return tz


AFTER_STOP = "bytes after data.pkl's STOP"
"""The ``sources`` entry of a global named only by a pickle hidden after ``data.pkl``'s."""


def _scan_after_stop(tz: TorchZip, raw: bytes) -> None:
    """Note bytes after ``data.pkl``'s STOP and scan them as pickles.

    ``torch.load`` reads one pickle and ignores the rest; a second pickle hidden there is a
    known way past scanners that read only the first, for any loader that reads on. Its
    globals join the main pickle's (source :data:`AFTER_STOP`), so they are judged alike.
    """
    try:
        end = check_lengths(raw)
    except PickleLengthError:
        return  # scan_globals read it whole
    if end >= len(raw):
        return
    tz.after_stop = len(raw) - end
    _join(tz, scan_stream(raw[end:]), AFTER_STOP)


def _join(tz: TorchZip, found: PickleResult, source: str) -> None:
    """Add what another pickle of the archive names to ``data.pkl``'s findings, each global
    not seen there already with ``source`` as where it came from."""
    main = tz.pickle
    for qual, cls in found.globals.items():
        if qual not in main.globals:
            main.globals[qual] = cls
            main.sources[qual] = source
    main.calls |= found.calls
    main.inits |= found.inits
    main.builds |= found.builds


def _archive_classes(tz: TorchZip) -> None:
    """Count a ``__torch__.<module>.<Class>`` global as a TorchScript class (reported with the
    archive, not on its own) only where the archive's ``code/__torch__/<module>.py`` defines
    it; anywhere else it is a name no loader can resolve from the file: refused as unknown."""
    for qual, cls in tz.pickle.globals.items():
        if cls != "unknown" or not qual.startswith("__torch__."):
            continue
        module = qual.rpartition(".")[0].replace(".", "/")
        if any(n.startswith(tz.prefix) and n.endswith(f"code/{module}.py") for n in tz.entries):
            tz.pickle.globals[qual] = "torchscript"


# Small records torch writes beside the pickle and the storages: never unpickled.
_PLAIN_RECORDS = ("version", ".format_version", "byteorder", ".storage_alignment",
                  ".data/version", ".data/serialization_id", "serialization_id")


def scan_other_pickles(tz: TorchZip, fd: Handle, length: int) -> None:
    """Scan every pickle-like record besides ``data.pkl`` (TorchScript's ``constants.pkl``,
    a ``.pkl`` in any case, any record outside ``data/`` that parses as a pickle).

    ``torch.jit.load`` unpickles the ``.pkl`` ones; their globals join ``data.pkl``'s in
    ``tz.pickle.globals`` (with the record named in ``sources``), those of a record that does
    not parse too, up to where it stopped; the failure is noted in ``tz.unscanned``.
    """
    main_name = f"{tz.prefix}data.pkl".lower()
    for e in tz.entries.values():
        short = e.name.removeprefix(tz.prefix)
        named_pkl = short.lower().endswith(".pkl")
        # Every ``.pkl`` record is scanned, whatever its directory or prefix (a loader that
        # takes another prefix than torch's first record would unpickle it); storages and
        # TorchScript code are not pickles.
        if e.name.lower() == main_name or (not named_pkl and (
                short.startswith(("data/", "code/")) or short in _PLAIN_RECORDS)):
            continue
        if e.compressed or e.data_offset + e.size > length:
            if named_pkl:
                tz.unscanned[short] = ("compressed" if e.compressed
                                       else "runs past the end of the file")
            continue
        at = tz.base + e.data_offset
        if not named_pkl and not looks_like_pickle(storage.pread(fd, min(e.size, 4096), at)):
            continue  # read a record whole only when it starts like a pickle
        found, error = scan_globals(storage.pread(fd, min(e.size, SCAN_LIMIT), at))
        if error is not None and named_pkl:
            tz.unscanned[short] = f"not a readable pickle ({short_error(error)})"
        _join(tz, found, short)
    _archive_classes(tz)


def is_torchscript(tz: TorchZip) -> bool:
    """Whether a torch zip is shaped like a TorchScript archive (``torch.jit.save``):
    ``code/`` records or a ``constants.pkl``. ``torch.load`` hands such a file to
    ``torch.jit.load`` (torch <= 2.5.1 even with ``weights_only=True``: CVE-2025-32434)."""
    # torch tests for a constants.pkl record; a code/ directory is the other half of the shape.
    return any(n.startswith(f"{tz.prefix}code/") or n.rsplit("/", 1)[-1] == "constants.pkl"
               for n in tz.entries)


def short_error(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) < 120 else text[:117] + "..."
