"""Streaming safetensors writer: the header is computed from shapes and dtypes up front, then
tensor bytes are appended one tensor at a time, so memory holds one tensor, not the file.

The layout matches the Rust writer: header JSON padded with spaces to a multiple of 8, tensors
contiguous from offset 0 in the order given.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, BinaryIO

import orjson

from ckpt_cli import dtypes
from ckpt_cli.storage import Upload


def header_bytes(entries: Sequence[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None) -> tuple[bytes, list[int]]:
    """Build a safetensors header.

    Args:
        entries: ``(name, dtype code, shape)`` in file order.
        metadata: ``__metadata__`` (strings only), or None.

    Returns:
        ``(8-byte length + padded JSON, per-tensor byte sizes)``.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    sizes: list[int] = []
    pos = 0
    for name, code, shape in entries:
        n = 1
        for d in shape:
            n *= d
        size = dtypes.nbytes_of(code, n)
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [pos, pos + size]}
        sizes.append(size)
        pos += size
    raw = orjson.dumps(header)
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, sizes


def write_all(f: BinaryIO, data: memoryview) -> None:
    """Write every byte of ``data`` (``os.write`` may write less than asked)."""
    if not hasattr(f, "fileno") or isinstance(f, Upload):
        f.write(data)  # an object's upload: never short
        return
    fd = f.fileno()
    while data:
        n = os.write(fd, data[: 1 << 30])
        data = data[n:]
