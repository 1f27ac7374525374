"""The hostile-pickle corpus's tools (issue 23): a small pickle assembler that writes opcodes
by hand, and torch-shaped containers (torch.save's zip records, a zip with two central
directories, a bad CRC, the legacy tar layout) written with :mod:`zipfile` or byte by byte.

Standard library only, and deterministic: every zip date is fixed. :mod:`pickle_corpus`
builds its cases with these.
"""

from __future__ import annotations

import io
import struct
import tarfile
import warnings
import zipfile
import zlib

# --- a small pickle assembler --------------------------------------------------------------
# Opcodes are written by hand (not pickle.dumps) so that the byte stream is exactly the one
# the technique needs, whatever the running Python would emit.

def proto(n: int) -> bytes:
    """PROTO n (protocol 2 and later streams start with it)."""
    return b"\x80" + bytes([n])


def glob(module: str, name: str) -> bytes:
    """GLOBAL: push ``module.name`` (text operands, every protocol)."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def sglob(module: str, name: str) -> bytes:
    """STACK_GLOBAL (protocol 4): push ``module.name`` from two strings on the stack."""
    return s(module) + s(name) + b"\x93"


def s(text: str) -> bytes:
    """BINUNICODE: push a str."""
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def s0(text: str) -> bytes:
    """STRING (protocol 0): push a str written as a quoted text line."""
    return b"S" + repr(text).encode() + b"\n"


def by(data: bytes) -> bytes:
    """BINBYTES: push bytes."""
    return b"B" + struct.pack("<I", len(data)) + data


def i(n: int) -> bytes:
    """BININT: push an int."""
    return b"J" + struct.pack("<i", n)


MARK, TUPLE, EMPTY_TUPLE, TUPLE1, TUPLE2, TUPLE3 = b"(", b"t", b")", b"\x85", b"\x86", b"\x87"
REDUCE, BUILD, OBJ, POP, STOP, NONE = b"R", b"b", b"o", b"0", b".", b"N"
EMPTY_DICT, SETITEM, EMPTY_LIST, APPEND, DICT = b"}", b"s", b"]", b"a", b"d"
TRUE, FALSE, MEMOIZE = b"\x88", b"\x89", b"\x94"


def tup(*items: bytes) -> bytes:
    """A tuple of the pushed items."""
    return MARK + b"".join(items) + TUPLE


def call(func: bytes, *args: bytes) -> bytes:
    """``func(*args)`` through REDUCE."""
    return func + tup(*args) + REDUCE


def lst(*items: bytes) -> bytes:
    """A list of the pushed items."""
    return EMPTY_LIST + b"".join(it + APPEND for it in items)


def dct(**items: bytes) -> bytes:
    """A dict of str keys to the pushed values."""
    return EMPTY_DICT + b"".join(s(k) + v + SETITEM for k, v in items.items())


def put(n: int) -> bytes:
    """BINPUT n."""
    return b"q" + bytes([n])


def get(n: int) -> bytes:
    """BINGET n."""
    return b"h" + bytes([n])


def code(marker: str) -> str:
    """Python source whose only effect is creating ``marker`` in the current directory."""
    return f"open({marker!r}, 'w').close()"


def shell(marker: str) -> str:
    """Shell command whose only effect is creating ``marker`` in the current directory."""
    return f"touch {marker}"


# The benign part every torch-shaped case carries: {'weight': tensor([1., 1.])} through
# torch's own rebuild function and a persistent id naming storage record "0".
def _tensor() -> bytes:
    storage = tup(s("storage"), glob("torch", "FloatStorage"), s("0"), s("cpu"), i(2))
    return call(glob("torch._utils", "_rebuild_tensor_v2"),
                storage + b"Q", i(0), tup(i(2)), tup(i(1)), FALSE,
                call(glob("collections", "OrderedDict")))


def state_dict(payload: bytes, protocol: int = 2) -> bytes:
    """A whole pickle: ``{'weight': <tensor>, 'extra': <payload>}``."""
    return proto(protocol) + EMPTY_DICT + s("weight") + _tensor() + SETITEM + s("extra") \
        + payload + SETITEM + STOP


def bare(payload: bytes, protocol: int = 2) -> bytes:
    """A whole pickle whose value is the payload itself."""
    return (proto(protocol) if protocol >= 2 else b"") + payload + STOP


# --- torch-shaped containers ---------------------------------------------------------------
_DATE = (1980, 1, 1, 0, 0, 0)
_STORAGE_0 = struct.pack("<2f", 1.0, 1.0)


def _records(pkl: bytes, pkl_name: str = "data.pkl") -> list[tuple[str, bytes]]:
    """torch.save's record layout (torch 2.x) under the ``archive/`` prefix."""
    return [(f"archive/{pkl_name}", pkl), ("archive/.format_version", b"1"),
            ("archive/.storage_alignment", b"64"), ("archive/byteorder", b"little"),
            ("archive/data/0", _STORAGE_0), ("archive/version", b"3\n"),
            ("archive/.data/serialization_id", b"0" * 40)]


def torch_zip(records: list[tuple[str, bytes]]) -> bytes:
    """A stored (uncompressed) zip of ``records`` written by :mod:`zipfile`, fixed dates."""
    buf = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        warnings.simplefilter("ignore")  # "Duplicate name": the duplicate is the point
        for name, data in records:
            info = zipfile.ZipInfo(name, date_time=_DATE)
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o600 << 16
            zf.writestr(info, data)
    return buf.getvalue()


def _local(name: str, data: bytes) -> bytes:
    """A zip local file header plus the stored data."""
    raw = name.encode()
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, zlib.crc32(data),
                       len(data), len(data), len(raw), 0) + raw + data


def _central(name: str, data: bytes, offset: int) -> bytes:
    """A zip central directory record for a stored entry whose local header is at offset."""
    raw = name.encode()
    return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21,
                       zlib.crc32(data), len(data), len(data), len(raw), 0, 0, 0, 0,
                       0o600 << 16, offset) + raw


def two_central_directories(benign: bytes, evil: bytes) -> bytes:
    """A torch zip with two central directories that disagree about ``archive/data.pkl``.

    Python's :mod:`zipfile` finds the central directory by walking back ``size`` bytes from
    the end record (and adjusts every offset by the difference it sees), so it reads the
    first directory, placed right before the end record: its ``data.pkl`` is ``benign``.
    torch's reader (miniz) reads the directory at the offset the end record states: the second
    one, stored in the end record's comment, whose ``data.pkl`` is ``evil`` (a local record
    the first directory does not list). Both directories have the same length.
    """
    body = bytearray()
    offsets: dict[str, int] = {}
    records = _records(benign)
    for name, data in records:
        offsets[name] = len(body)
        body += _local(name, data)
    evil_offset = len(body)
    body += _local("archive/data.pkl", evil)
    cd_python_at = len(body)

    def directory(shift: int, pkl: bytes, pkl_offset: int) -> bytes:
        out = b""
        for name, data in records:
            if name == "archive/data.pkl":
                out += _central(name, pkl, pkl_offset + shift)
            else:
                out += _central(name, data, offsets[name] + shift)
        return out

    size = len(directory(0, benign, 0))
    eocd_at = cd_python_at + size
    cd_torch_at = eocd_at + 22  # the comment starts right after the 22-byte end record
    # zipfile adds (eocd_at - size - stated_offset) = cd_python_at - cd_torch_at to every
    # offset it reads from its directory: store offsets that land on the real headers.
    shift = cd_torch_at - cd_python_at
    cd_python = directory(shift, benign, offsets["archive/data.pkl"])
    cd_torch = directory(0, evil, evil_offset)
    assert len(cd_python) == len(cd_torch) == size
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(records), len(records), size,
                       cd_torch_at, len(cd_torch))
    return bytes(body) + cd_python + eocd + cd_torch


def bad_crc(pkl: bytes) -> bytes:
    """A torch zip whose data.pkl record (local header and central directory) has the
    complement of its real CRC-32."""
    data = torch_zip(_records(pkl))
    crc = zlib.crc32(pkl)
    good, bad = struct.pack("<I", crc), struct.pack("<I", crc ^ 0xFFFFFFFF)
    assert data.count(good) == 2, "the CRC bytes must occur only in the two headers"
    return data.replace(good, bad)


def legacy_tar(evil: bytes) -> bytes:
    """torch's pre-1.0 tar format (members ``storages``, ``tensors``, ``pickle``)."""
    buf = io.BytesIO()
    members = [("sys_info", bare(dct(protocol_version=i(1000), little_endian=TRUE))),
               ("storages", bare(i(0)) + bare(EMPTY_LIST)), ("tensors", bare(i(0))),
               ("pickle", evil)]
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o600
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


