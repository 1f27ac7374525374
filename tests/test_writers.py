"""The output writers (ckpt_cli/writers)."""

from __future__ import annotations

import io

import pytest
import torch

from ckpt_cli.writers.torchzip import TorchZipWriter

pytestmark = pytest.mark.requires_torch


class _ShortRaw(io.RawIOBase):
    """A file whose every write stores at most 1000 bytes, like a >2 GiB write on Linux."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return len(self.data)

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0 and pos <= len(self.data):
            self._pos = pos
            return pos
        return len(self.data)

    def write(self, b: object) -> int:
        chunk = bytes(memoryview(b)[:1000])  # type: ignore[arg-type]
        pos = getattr(self, "_pos", len(self.data))
        self.data[pos:pos + len(chunk)] = chunk
        self._pos = pos + len(chunk)
        return len(chunk)


def test_torch_zip_survives_short_writes() -> None:
    raw = _ShortRaw()
    f = io.BufferedWriter(raw)
    t = torch.arange(5000, dtype=torch.float32)
    zw = TorchZipWriter(f, [("t", "F32", (5000,))])  # type: ignore[arg-type]
    zw.write_tensor(memoryview(t.numpy().tobytes()))
    zw.close()
    f.flush()
    got = torch.load(io.BytesIO(bytes(raw.data)), weights_only=True)
    assert torch.equal(got["t"], t)
