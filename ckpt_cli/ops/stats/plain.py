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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any

from ckpt_cli.errors import CkptError
from ckpt_cli.ops.stats.batch import numpy_dtype_or_none
from ckpt_cli.tensors.moments import Moments, piece_moments, run_moments

if TYPE_CHECKING:
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
    """

    work: int
    file: str
    lo: int
    hi: int
    offsets: list[int]
    sizes: list[int]
    names: list[str]
    codes: list[str]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors."""
        return sum(self.sizes)


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
        files: dict[str, list[tuple[int, int, str, str]]] = {}
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
            if (nb >= small or rel is None or off is None or t.stride is not None or t.chunks
                    or (t.storage is not None and t.storage.crc is not None)):
                continue
            size = sizes.get(code)
            if size is None:
                dt = numpy_dtype_or_none(code)
                size = sizes[code] = 0 if dt is None else dt.itemsize
            if not size or nb != prod(t.shape) * size:
                continue
            if not nb:  # no values: no read, as the engine gives them
                w.got[n] = Moments()
                mine.add(n)
                continue
            items = files.get(rel)
            if items is None:
                items = files[rel] = []
            items.append((off, nb, n, code))
        for rel, items in files.items():
            try:
                end = sources.sources.get(i).file_size(rel)
            except (CkptError, OSError):
                continue  # cannot be opened: the engine says why, tensor by tensor
            items.sort()
            inside = [it for it in items if 0 <= it[0] and it[0] + it[1] <= end]
            _cut(i, rel, inside, runs)
            mine.update([it[2] for it in inside])
        taken.append(mine)
    return taken, runs


def _cut(i: int, rel: str, items: list[tuple[int, int, str, str]], runs: list[Run]) -> None:
    """Cut a file's tensors (by offset) into runs of adjacent byte ranges."""
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
        offsets, sizes, names, codes = (list(c) for c in zip(*items[start:stop], strict=True))
        runs.append(Run(i, rel, lo, hi, offsets, sizes, names, codes))
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
