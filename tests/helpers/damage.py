"""Ways to damage real checkpoint files, for validate's tests.

Every defect starts from a file the real library wrote and changes it the way a failure would
(truncation, a flipped bit, appended bytes) or the way a buggy writer would (header and
metadata edits, made with the format's own structures).
"""

from __future__ import annotations

import json
import pickle
import struct
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def truncate(path: Path, keep: int) -> None:
    """Cut a file to ``keep`` bytes (negative: drop that many from the end)."""
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def flip(path: Path, offset: int, mask: int = 0x01) -> None:
    """XOR one byte of a file with ``mask`` (a bit flip)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def append(path: Path, data: bytes) -> None:
    """Append bytes to a file."""
    with open(path, "ab") as f:
        f.write(data)


def zip_payload(path: Path, suffix: str) -> tuple[int, int]:
    """``(offset, size)`` of the payload of the zip record whose name ends with ``suffix``."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        n, m = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + n + m, info.compress_size


def edit_safetensors_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite a safetensors header through ``edit`` (keeps the data bytes)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def edit_dcp_metadata(directory: Path, edit: Callable[[Any], None]) -> None:
    """Rewrite a DCP ``.metadata`` through ``edit``, as DCP's FileSystemWriter writes it.

    The metadata is read with torch's own reader (the fixture is our own, trusted file).
    """
    from torch.distributed.checkpoint import FileSystemReader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md = FileSystemReader(str(directory)).read_metadata()
    edit(md)
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(md, f)


def replace_in_zip_pickle(path: Path, old: bytes, new: bytes) -> None:
    """Replace bytes inside a torch zip's ``data.pkl`` (same length; CRC left stale)."""
    assert len(old) == len(new)
    off, size = zip_payload(path, "data.pkl")
    data = bytearray(path.read_bytes())
    i = data.find(old, off, off + size)
    assert i >= 0, old
    data[i:i + len(old)] = new
    path.write_bytes(bytes(data))


def replace_pickle(path: Path, data: bytes) -> None:
    with zipfile.ZipFile(path) as zf:
        entries = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    entries[next(n for n in entries if n.endswith("data.pkl"))] = data
    with zipfile.ZipFile(path, "w") as zf:
        for name, payload in entries.items():
            zf.writestr(name, payload)


def flip_in_entry(path: Path, suffix: str, at: int) -> None:
    """Flip one bit of byte ``at`` of a zip record's payload."""
    with zipfile.ZipFile(path) as zf:
        e = next(i for i in zf.infolist() if i.filename.endswith(suffix))
    data = bytearray(path.read_bytes())
    # The payload follows the local header, whose extra field (torch's alignment padding)
    # need not match the central directory's.
    name_len, extra_len = struct.unpack_from("<HH", data, e.header_offset + 26)
    assert 0 <= at < e.file_size
    data[e.header_offset + 30 + name_len + extra_len + at] ^= 1
    path.write_bytes(bytes(data))


def flip_in_dcp_chunk(directory: Path, tensor: str, chunk: int, at: int = 100,
                      mask: int = 4) -> str:
    """Flip a bit ``at`` bytes into one stored chunk of a DCP tensor (found the way ckpt's
    reader finds it); returns the ``.distcp`` file that holds it."""
    from ckpt_cli.formats import read_index
    from ckpt_cli.formats.dcp import locate_chunk
    from ckpt_cli.storage.reads import OpenFiles

    index = read_index(directory)
    t = index.tensors[tensor]
    with OpenFiles() as files:
        sub = locate_chunk(index, lambda rel: files.open(index.path_of(rel)), t, t.chunks[chunk])
    assert sub.file is not None and sub.offset is not None
    flip(directory / sub.file, sub.offset + at, mask)
    return sub.file
