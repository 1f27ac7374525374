"""``ckpt stats``' reading of small plain tensors by runs, their figures in one kernel call per
run (see :mod:`.engine`).

A header of a million tiny tensors cost, per tensor, a trip through the engine's jobs
(names, chains, windows, memory costs), a read, and a kernel call that took longer than the
kernel's work on a few values. Here, before the engine plans its jobs, each checkpoint's
*plain* tensors whose figures alone are wanted (no update against a neighbour) are taken
apart: one contiguous byte range of a file, smaller than :data:`SMALL` bytes, a dtype numpy
reads, no scale, no ZeRO gathering, no zip CRC-32 to check, within the file's size. They are
laid out per file by offset, cut into runs of adjacent byte ranges (gaps up to
:data:`GAP` bytes read and skipped), and each run is one job: one positioned read, and one
call of :func:`~ckpt_cli.tensors.moments.run_moments` per dtype in it. The figures are those
:func:`.engine._run` computes: every such tensor fits one window, and the same values go to
the same kernel. A run whose read fails hands its tensors to :func:`.engine._run` one by
one, which reports each in its own words; nothing is read past a file's end.

A DCP tensor of one small chunk holding all of it is one embedded torch.save zip (an item):
items are cut into runs the same way, by their byte ranges, and each item of a run is
recognised from memory (:class:`~ckpt_cli.formats.zipshape.ItemValues`: a layout and a
pickle seen sound before, the chunk's checks passed once for them, its storage's CRC-32
checked); its values are gathered aligned, and the run's figures come from one kernel call
per dtype. An item not recognised (the first of a layout, a damaged one) goes to
:func:`.engine._run` as before: a locate that parses it in full, and its errors in its words.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING, Any

from ckpt_cli.errors import CkptError
from ckpt_cli.formats import zipshape
from ckpt_cli.ops.stats.batch import numpy_dtype_or_none
from ckpt_cli.tensors.moments import Moments, piece_moments, run_moments

if TYPE_CHECKING:
    import numpy as np

    from ckpt_cli.storage.reads import Meter

_Work = Any  # engine's Work and _Sources: engine imports this module
_Src = Any

SMALL = 64 << 10
"""Bytes below which a tensor is read as part of a run (the engine's small jobs)."""
GAP = 4096
"""Bytes between two tensors of a run that are read and thrown away rather than start a new
read (a safetensors file pads nothing; a torch zip puts a local header between entries)."""
RUN_BYTES = 1 << 20
"""Largest run read at once (one job's memory: its buffer)."""
RUN_TENSORS = 1 << 16
"""Most tensors in one run (the jobs of a header of a million tiny ones spread over threads)."""

_KERNEL = frozenset(("float32", "float64", "float16", "bfloat16"))


@dataclass(slots=True)
class Run:
    """One job: adjacent tensors of one file of one checkpoint.

    Attributes:
        work: The checkpoint's index in the list given to the engine.
        file: The file, relative to the checkpoint's base.
        lo: Where the read starts (the first tensor's offset).
        hi: Where it ends (the largest end of a tensor).
        offsets: Each tensor's absolute byte offset, in increasing order.
        sizes: Each tensor's bytes (none zero).
        names: Each tensor's name.
        codes: Each tensor's dtype code.
        values: Each tensor's bytes, for a run of DCP items (``offsets`` and ``sizes`` are
            then the items'); None for a run of byte ranges (``sizes`` are the tensors').
        rest: Names of a run of DCP items left to the engine (an item not recognised).
    """

    work: int
    file: str
    lo: int
    hi: int
    offsets: list[int]
    sizes: list[int]
    names: list[str]
    codes: list[str]
    values: list[int] | None = None
    rest: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors."""
        return sum(self.sizes if self.values is None else self.values)


def take_plain(works: list[_Work], sources: _Src, select: Callable[[str], bool] | None,
               window: int) -> tuple[list[set[str]], list[Run]]:
    """Take apart each checkpoint's plain small tensors whose figures alone are wanted (see the
    module notes): tensors of no bytes get their (empty) figures here, the others are cut into
    runs. Each fits a window of ``window`` bytes (the engine's smallest for one checkpoint).

    Returns:
        Per checkpoint, the names taken (the engine leaves them out of its jobs), and the runs.
    """
    taken: list[set[str]] = []
    runs: list[Run] = []
    sizes: dict[str, int] = {}  # dtype code -> bytes per value (0: not read this way)
    small = min(SMALL, window + 1)
    for i, w in enumerate(works):
        upd = w.updates | works[i + 1].updates if i + 1 < len(works) else w.updates
        targets = w.targets
        mine: set[str] = set()
        files: dict[str, list[tuple[int, int, str, str, int]]] = {}
        items: dict[str, list[tuple[int, int, str, str, int]]] = {}  # DCP items, by file
        stats = w.stats
        every = len(stats) == len(targets)  # (stats are names of targets)
        # In the targets' order (the header's), not the set's: a million records are visited
        # where they lie in memory, one after the next, not at random.
        for n, tg in targets.items():
            if (not every and n not in stats) or (upd and n in upd) or (
                    select is not None and not select(n)):
                continue
            if tg.scale is not None or tg.zero is not None:
                continue
            t = tg.tensor
            nb, rel, off, code = t.nbytes, t.file, t.offset, t.dtype
            chunk = _whole_item(t) if t.chunks else None
            if chunk is not None:
                rel, off = chunk.file, chunk.offset
            elif (rel is None or off is None or t.stride is not None or t.chunks
                    or (t.storage is not None and t.storage.crc is not None)):
                continue
            if nb >= small:
                continue
            size = sizes.get(code)
            if size is None:
                dt = numpy_dtype_or_none(code)
                size = sizes[code] = 0 if dt is None else dt.itemsize
            if not size or nb != prod(t.shape) * size:
                continue
            if chunk is not None:  # an item of its own: read with its neighbours'
                if nb:
                    items.setdefault(rel, []).append((off, chunk.length, n, code, nb))
                continue
            if not nb:  # no values: no read, as the engine gives them
                w.got[n] = Moments()
                mine.add(n)
                continue
            here = files.get(rel)
            if here is None:
                here = files[rel] = []
            here.append((off, nb, n, code, nb))
        for dcp, by_file in ((False, files), (True, items)):
            for rel, here in by_file.items():
                try:
                    end = sources.sources.get(i).file_size(rel)
                except (CkptError, OSError):
                    continue  # cannot be opened: the engine says why, tensor by tensor
                here.sort()
                inside = [it for it in here if 0 <= it[0] and it[0] + it[1] <= end]
                _cut(i, rel, inside, runs, dcp)
                mine.update([it[2] for it in inside])
        taken.append(mine)
    return taken, runs


def _whole_item(t: Any) -> Any:
    """The DCP chunk that holds all of ``t`` in one small plain item, or None."""
    if len(t.chunks) != 1:
        return None
    c = t.chunks[0]
    if (c.transforms or not 0 < c.length <= zipshape.MAX_LENGTH or any(c.offsets)
            or tuple(c.sizes) != tuple(t.shape)):
        return None
    return c


def _cut(i: int, rel: str, items: list[tuple[int, int, str, str, int]], runs: list[Run],
         dcp: bool) -> None:
    """Cut a file's tensors (or DCP items, ``dcp``) by offset into runs of adjacent byte
    ranges."""
    start = 0
    while start < len(items):
        lo = items[start][0]
        hi = lo + items[start][1]
        stop = start + 1
        cap = min(len(items), start + RUN_TENSORS)
        while stop < cap:
            off, nb = items[stop][0], items[stop][1]
            end = off + nb
            if off - hi > GAP or end - lo > RUN_BYTES:
                break
            if end > hi:
                hi = end
            stop += 1
        offsets, sizes, names, codes, values = (list(c) for c in zip(*items[start:stop],
                                                                     strict=True))
        runs.append(Run(i, rel, lo, hi, offsets, sizes, names, codes, values if dcp else None))
        start = stop


def run_plain(works: list[_Work], sources: _Src, run: Run, meter: Meter) -> int | None:
    """Compute the figures of a run's tensors into its checkpoint's ``got``.

    Returns:
        Bytes read, or None when the run could not be read (nothing was computed).
    """
    import numpy as np  # heavy: numpy

    lo, hi = run.lo, run.hi
    buf = np.empty(hi - lo, dtype=np.uint8)
    try:
        sources.sources.get(run.work).read_into(run.file, lo, buf.data)
    except (CkptError, OSError):
        return None
    if run.values is not None:
        return _run_items(works, sources, run, meter, buf)
    got = works[run.work].got
    codes = run.codes
    first = codes[0]
    if codes.count(first) == len(codes):
        groups = {first: None}
    else:
        groups = dict.fromkeys(codes)
    offs = np.array(run.offsets, dtype=np.int64) - lo
    sizes = np.array(run.sizes, dtype=np.int64)
    for code in groups:
        dt = numpy_dtype_or_none(code)
        if len(groups) == 1:
            pick: list[int] | None = None
            o, s = offs, sizes
        else:
            pick = [k for k, c in enumerate(codes) if c == code]
            o, s = offs[pick], sizes[pick]
        names = run.names if pick is None else [run.names[k] for k in pick]
        if dt.name in _KERNEL and not (o % dt.itemsize).any():
            spans = np.empty((len(names), 2), dtype=np.int64)
            spans[:, 0] = o
            spans[:, 1] = s // dt.itemsize
            got.update(zip(names, run_moments(buf, dt, spans), strict=True))
            continue
        for name, a, b in zip(names, o.tolist(), s.tolist(), strict=True):
            part = buf[a:a + b]
            if a % dt.itemsize:
                part = part.copy()  # an aligned copy: the kernels read whole values
            got[name] = piece_moments(part.view(dt))
    read = int(sizes.sum())
    meter.add(read)
    return read


_LEARN = 4
"""Items of a run not recognised that are parsed in full here, to learn their layout (one
layout serves thousands of items; beyond a few misses the run's items are the engine's)."""


def _run_items(works: list[_Work], sources: _Src, run: Run, meter: Meter,
               buf: np.ndarray) -> int:
    """:func:`run_plain` of a run of DCP items, in ``buf``: each item recognised from memory
    (:func:`~ckpt_cli.formats.zipshape.known_item`: a layout and a pickle seen sound before,
    :func:`~ckpt_cli.formats.zipshape.chunk_info`'s checks, its storage's CRC-32), the figures
    of all in one kernel call per dtype. Anything else (an item not recognised, a strided or
    compressed storage, a CRC-32 that does not match) goes to ``run.rest``: the engine reads
    it as before, and says what is wrong in its words.
    """
    import numpy as np  # heavy: numpy

    w = works[run.work]
    targets, got = w.targets, w.got
    blob = buf.tobytes()
    lo = run.lo
    misses = 0
    spans: dict[str, tuple[list[str], list[int], list[int]]] = {}
    assert run.values is not None
    find = _ITEMS.find
    for off, length, name, code in zip(run.offsets, run.sizes, run.names, run.codes,
                                       strict=True):
        t = targets[name].tensor
        at = off - lo
        hit = find(blob[at:at + length], t, t.chunks[0])
        if hit is None:
            run.rest.append(name)
            if misses < _LEARN:  # parsed in full (and its layout learnt, if sound)
                misses += 1
                with contextlib.suppress(CkptError, OSError):
                    zipshape.parse_item(sources.sources.get(run.work).fd_of(run.file), off,
                                        length, "")
            continue
        names, starts, sizes = spans.setdefault(code, ([], [], []))
        names.append(name)
        starts.append(at + hit[0])
        sizes.append(hit[1])
    read = 0
    for code, (names, starts, sizes) in spans.items():
        dt = numpy_dtype_or_none(code)
        assert dt is not None
        size = np.array(sizes, dtype=np.int64)
        read += int(size.sum())
        # The values, packed (items put them anywhere: the kernels read whole values).
        ends = np.cumsum(size)
        pick = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(
            np.array(starts, dtype=np.int64) - (ends - size), size)
        packed = buf[pick]
        if dt.name in _KERNEL:
            pairs = np.empty((len(names), 2), dtype=np.int64)
            pairs[:, 0] = ends - size
            pairs[:, 1] = size // dt.itemsize
            got.update(zip(names, run_moments(packed, dt, pairs), strict=True))
            continue
        for name, a, b in zip(names, (ends - size).tolist(), sizes, strict=True):
            got[name] = piece_moments(packed[a:a + b].view(dt))
    meter.add(read)
    return read


_ITEMS = zipshape.ItemValues()
