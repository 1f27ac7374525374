"""``ckpt stats``' reading of many small tensors at once (see :mod:`.engine`).

A header of a million tiny tensors made a million reads and a million trips through the
window machinery of :func:`.engine._run`, each costing far more than the kernel's work on a
few values. Here a batch of small jobs is read by *runs*: the tensors of one file whose byte
ranges follow each other (or nearly: gaps up to :data:`_GAP` bytes are read and skipped) are
read with one positioned read, and each tensor's values are a slice of that buffer. Every
tensor is then one window (it is smaller than any window), so the figures are those
:func:`.engine._run` computes: the same values handed to the same kernel, in the same order.

Only plain tensors go this way: one contiguous byte range of a file, a dtype numpy reads, no
scale, no ZeRO gathering, no zip CRC-32 to check. A tensor whose bytes lie past the end of its
file (a truncated file), or whose run cannot be read, is handed back to :func:`.engine._run`,
which reports it as unreadable in its words; nothing is ever read past a file's end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpt_cli import dtypes
from ckpt_cli.errors import CkptError
from ckpt_cli.tensors.moments import Moments, diff_sumsq, piece_moments

if TYPE_CHECKING:
    import numpy as np

    from ckpt_cli.storage.reads import Meter

# engine's Target, Work and _Sources: engine imports this module (no cycle through types).
_Target = Any
_Work = Any
_Src = Any

_GAP = 4096
"""Bytes between two tensors of a run that are read and thrown away rather than start a new
read (a safetensors file pads nothing; a torch zip puts a local header between entries)."""
_RUN_BYTES = 4 << 20
"""Largest run read at once (a batch holds about 1 MiB of tensors: see :mod:`.engine`)."""

_DT: dict[str, Any] = {}


def numpy_dtype_or_none(code: str) -> Any:
    """The numpy dtype of a dtype code, or None where numpy cannot hold it (packed F4/F6)."""
    dt = _DT.get(code)
    if dt is None and code not in _DT:
        try:
            dt = dtypes.numpy_dtype(code)
        except KeyError:
            dt = None
        _DT[code] = dt
    return dt


def _plain(target: _Target, window: int) -> bool:
    """Whether a tensor can be read as a slice of a run (see the module notes)."""
    t = target.tensor
    if (target.scale is not None or target.zero is not None or t.chunks or t.file is None
            or t.offset is None or t.stride is not None or t.nbytes > window):
        return False
    s = t.storage
    if s is not None and s.crc is not None:
        return False
    dt = numpy_dtype_or_none(t.dtype)
    return dt is not None and t.nbytes == t.numel * dt.itemsize


def run_batch(works: list[_Work], names: list[str], chains: list[tuple[int, ...]],
              windows: list[int], sources: _Src, meter: Meter,
              done: list[int], first: int, end: int) -> list[int]:
    """Compute jobs ``first`` to ``end`` (of :func:`.engine.compute`) that are plain, reading
    each checkpoint's files by runs; ``done[k]`` gets job ``k``'s bytes read.

    Returns:
        The jobs left to :func:`.engine._run` (not plain, out of the file's bounds, or in a
        run whose read failed), in order.
    """
    left: list[int] = []
    chosen: list[int] = []
    # (checkpoint, file) -> [(offset, nbytes, job)], and each file's size, looked up once.
    wanted: dict[tuple[int, str], list[tuple[int, int, int]]] = {}
    sizes: dict[tuple[int, str], int] = {}
    for k in range(first, end):
        name = names[k]
        ok = True
        for i in chains[k]:
            target = works[i].targets[name]
            if not _plain(target, windows[k]):
                ok = False
                break
            t = target.tensor
            rel, offset = t.file or "", t.offset or 0  # both set: _plain
            key = (i, rel)
            size = sizes.get(key)
            if size is None:
                try:
                    size = sources.sources.get(i).file_size(rel)
                except (CkptError, OSError):
                    size = -1  # cannot be opened: _run says why
                sizes[key] = size
            if t.nbytes and (offset < 0 or offset + t.nbytes > size):
                ok = False
                break
        if not ok:
            left.append(k)
            continue
        chosen.append(k)
        for i in chains[k]:
            t = works[i].targets[name].tensor
            if t.nbytes:
                wanted.setdefault((i, t.file or ""), []).append((t.offset or 0, t.nbytes, k))
    values: dict[tuple[int, int], np.ndarray] = {}
    failed: set[int] = set()
    for (i, rel), items in wanted.items():
        _read_runs(sources, i, rel, items, names, works, values, failed)
    if failed:
        chosen = [k for k in chosen if k not in failed]
        left = sorted(left + list(failed))
    for k in chosen:
        done[k] = _figures(works, names[k], chains[k], k, values)
    meter.add(sum(done[k] for k in chosen))
    return left


def _read_runs(sources: _Src, i: int, rel: str, items: list[tuple[int, int, int]],
               names: list[str], works: list[_Work], values: dict[tuple[int, int], np.ndarray],
               failed: set[int]) -> None:
    """Read the tensors ``items`` of file ``rel`` of checkpoint ``i`` by runs, into
    ``values[(i, job)]``; the jobs of a run that cannot be read go to ``failed``."""
    import numpy as np  # heavy: numpy

    src = sources.sources.get(i)
    items.sort()
    start = 0
    while start < len(items):
        lo = items[start][0]
        hi = lo + items[start][1]
        stop = start + 1
        while stop < len(items):
            off, nb, _ = items[stop]
            if off - hi > _GAP or max(hi, off + nb) - lo > _RUN_BYTES:
                break
            hi = max(hi, off + nb)
            stop += 1
        buf = np.empty(hi - lo, dtype=np.uint8)
        try:
            src.read_into(rel, lo, buf.data)
        except (CkptError, OSError):
            failed.update(k for _, _, k in items[start:stop])
            start = stop
            continue
        for off, nb, k in items[start:stop]:
            t = works[i].targets[names[k]].tensor
            dt = numpy_dtype_or_none(t.dtype)
            part = buf[off - lo:off - lo + nb]
            if (off - lo) % dt.itemsize:
                part = part.copy()  # an aligned copy: the kernels read whole values
            values[(i, k)] = part.view(dt)
        start = stop


def _figures(works: list[_Work], name: str, chain: tuple[int, ...], k: int,
             values: dict[tuple[int, int], np.ndarray]) -> int:
    """One job's figures from its values (what :func:`.engine._run` does with a tensor that
    fits one window); returns the bytes read."""
    read = 0
    figures: dict[int, Moments | None] = {}
    sq: dict[int, float | None] = {}
    prev: tuple[int, np.ndarray] | None = None
    for i in chain:
        w = works[i]
        figures[i], sq[i] = None, 0.0
        arr = values.get((i, k))
        if arr is None:  # no values: no window (as in _run)
            prev = None
            continue
        read += arr.nbytes
        if name in w.stats:
            figures[i] = piece_moments(arr)
        if name in w.updates and prev is not None and prev[0] == i - 1:
            d = diff_sumsq(prev[1], arr)
            sq[i] = None if d != d else 0.0 + d  # NaN: a value was not finite
        prev = (i, arr)
    for i in chain:
        w = works[i]
        if name in w.stats:
            have = figures[i]
            w.got[name] = have if have is not None else Moments()
        if name in w.updates and i - 1 in chain:
            w.got_updates[name] = sq[i]
    return read
