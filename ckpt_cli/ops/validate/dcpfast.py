"""The fast path of ``validate``'s DCP item checks: many small items, one layout.

A DCP file of many small tensors is thousands of embedded torch.save zips that share one
layout. :class:`Fast` reads a file's small items in large positioned reads (one per
:data:`_BLOCK` bytes, not a read per field of every zip), and checks an item whose layout it
has seen sound before (:mod:`ckpt_cli.formats.zipshape`) from memory: the same verdicts as
the full checks (``check_zip``, the pickle scan, the chunk's decoding and every record's
CRC-32) at a fraction of the cost. An item it does not recognise, or whose pickle is not one
it has unpickled, goes the full path, which teaches it the item's layout if the item is
sound. Items on object storage, large items and compressed items always go the full path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from ckpt_cli import storage
from ckpt_cli.formats import allowlist, zipshape
from ckpt_cli.model import Chunk, Finding, TensorInfo
from ckpt_cli.ops.validate.zipcheck import CrcTask, ZipReport
from ckpt_cli.storage.reads import crc32

if TYPE_CHECKING:
    from ckpt_cli.formats.torchzip import TorchZip
    from ckpt_cli.storage import Handle

_BLOCK = 8 << 20
"""Bytes of a file's consecutive small items read at once."""

_MAX_KEPT = 1 << 16
"""Verdicts kept by pickle bytes (beyond, each item's is worked out on its own)."""


class _Item(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def offsets(self) -> tuple[int, ...] | None: ...
    @property
    def rel(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def transforms(self) -> tuple[str, ...]: ...
    @property
    def where(self) -> str: ...


class _Report(Protocol):
    chunks: list[Finding]
    pickles: list[Finding]
    crc: list[CrcTask]


class Fast:
    """Reads and checks the small items of a DCP directory (see the module docstring).

    Args:
        items: The items, in the order they are checked (by file, then offset).
        chunk_problem: Why a decoded zip does not hold the chunk ``.metadata`` describes.
    """

    def __init__(self, items: Sequence[_Item],
                 chunk_problem: Callable[[TorchZip, tuple[TensorInfo, Chunk], int], str | None]
                 ) -> None:
        self._items = items
        self._problem = chunk_problem
        self._shapes = zipshape.Shapes()
        self._pickles = zipshape.PickleCache()
        self._clean: dict[bytes, bool] = {}  # pickle bytes -> no findings of their own
        self._problems: dict[tuple[bytes, int, str, tuple[int, ...], int], str | None] = {}
        self._block: tuple[str, int, bytes] = ("", 0, b"")
        self._sound: dict[str, tuple[Handle, int, int]] = {}  # rel -> (fd, records, bytes)

    def bytes_of(self, k: int, fd: Handle, size: int) -> bytes | None:
        """Item ``k``'s bytes, from the block read that holds it (None: a large item, or
        one on object storage: the full path reads it)."""
        it = self._items[k]
        if not isinstance(fd, int) or not 0 < it.length <= zipshape.MAX_LENGTH:
            return None
        rel, at, block = self._block
        if rel != it.rel or not at <= it.offset <= it.offset + it.length <= at + len(block):
            end, limit = it.offset + it.length, min(size, it.offset + _BLOCK)
            items, j = self._items, k + 1
            while j < len(items):  # the following small items of the file that fit
                nxt = items[j]
                stop = nxt.offset + nxt.length
                if (nxt.rel != it.rel or nxt.offset < it.offset or stop > limit
                        or not 0 < nxt.length <= zipshape.MAX_LENGTH):
                    break
                end, j = max(end, stop), j + 1
            rel, at, block = it.rel, it.offset, storage.pread(fd, end - it.offset, it.offset)
            self._block = (rel, at, block)
        data = block[it.offset - at:it.offset - at + it.length]
        return data if len(data) == it.length else None

    def learn(self, data: bytes, zr: ZipReport) -> None:
        """Remember the layout of an item the full checks found sound."""
        self._shapes.add(zipshape.learn(data, [
            (r.name, r.header_offset, r.data_offset, r.size, r.method, r.end)
            for r in zr.records]))

    def check(self, report: _Report, it: _Item, data: bytes, rel: str, fd: Handle,
              chunks: dict[tuple[str, tuple[int, ...]], tuple[TensorInfo, Chunk]]) -> bool:
        """Check an item of a known layout from memory; False: the full path must."""
        hit = self._shapes.match(data)
        if hit is None:
            return False
        shape, crcs = hit
        pkl = shape.records[shape.pickle]
        raw = data[pkl.data_offset:pkl.data_offset + pkl.size]
        result = self._pickles.get(raw)
        if result is None:
            return False
        # Verdicts that depend only on the pickle's bytes (and the layout, the chunk's
        # declared dtype and sizes), kept by those bytes: not by the result's id, which a
        # result the full pickle cache did not keep could hand on to another.
        clean = self._clean.get(raw)
        if clean is None:
            clean = not any(f.severity != "info"
                            for f in allowlist.pickle_findings(result, file=rel))
            if len(self._clean) < _MAX_KEPT:
                self._clean[raw] = clean
        if not clean:
            report.pickles.extend(
                f for f in allowlist.pickle_findings(result, file=rel,
                                                     what=f"pickle of item {it.name}")
                if f.severity != "info")
        pair = chunks.get((it.name, it.offsets)) if it.offsets is not None else None
        if pair is not None:
            key = (raw, id(shape), pair[0].dtype, pair[1].sizes, it.length)
            problem = self._problems.get(key, "")
            if problem == "":
                tz = zipshape.torch_zip(shape, crcs, data, it.offset, self._pickles)
                if tz is None:
                    return False
                problem = self._problem(tz, pair, it.length)
                if len(self._problems) < _MAX_KEPT:
                    self._problems[key] = problem
            if problem:
                report.chunks.append(Finding("error", "chunk-undecodable", problem, rel,
                                             it.where))
                return True
        records = shape.records
        if all(not crcs[i] for i, r in enumerate(records) if r.size) and any(
                r.size for r in records):
            return True  # written with CRC-32 turned off: nothing to verify (as crc_tasks)
        view = memoryview(data)
        _fd, n, nbytes = self._sound.get(rel, (fd, 0, 0))
        for i in shape.order:
            r = records[i]
            if not r.size or r.method != 0:
                continue
            got = crc32(view[r.data_offset:r.data_offset + r.size])
            if got == crcs[i]:
                n, nbytes = n + 1, nbytes + r.size
            else:
                report.crc.append(CrcTask(rel, fd, it.offset + r.data_offset, r.size, crcs[i],
                                          " ".join(x for x in (it.where, r.name) if x),
                                          actual=got))
        self._sound[rel] = (fd, n, nbytes)
        return True

    def flush(self, report: _Report) -> None:
        """Add one task per file for the records checked sound from memory (counted, not
        read again)."""
        for rel, (fd, n, nbytes) in self._sound.items():
            report.crc.append(CrcTask(rel, fd, 0, nbytes, 0, "", actual=0, records=n))
        self._sound.clear()
