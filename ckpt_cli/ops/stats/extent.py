"""How many bytes of a checkpoint's files ``stats`` read, each byte counted once.

The engine counts the values it is given, view by view: two names viewing one storage (a
slice, a transpose: not the same view, so both are read) count its bytes twice, and a
checkpoint could report more bytes read than its files hold. Here the byte ranges of the
tensors read are merged per file and clipped to the file's size, so the figure shown beside
the files' size never exceeds it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ckpt_cli.model import CheckpointIndex, TensorInfo

if TYPE_CHECKING:
    import numpy as np


def _ranges(t: TensorInfo) -> list[tuple[str, int, int]] | None:
    """The ``(file, start, end)`` byte ranges holding ``t``'s values (None: not known)."""
    if t.chunks:
        return [(c.file, c.offset, c.offset + c.length) for c in t.chunks]
    s = t.storage
    if s is not None and s.start is not None:
        return [(s.file, s.start, s.start + s.nbytes)]
    if t.file is not None and t.offset is not None:
        return [(t.file, t.offset, t.offset + t.nbytes)]
    return None


def files_bytes(index: CheckpointIndex) -> int:
    """Bytes of the checkpoint's files."""
    return sum(f.bytes for f in index.files)


def distinct_bytes(index: CheckpointIndex, tensors: Iterable[TensorInfo]) -> int:
    """Bytes of ``index``'s files that reading ``tensors`` covers, each byte once, at most the
    files' size.

    Args:
        index: The checkpoint.
        tensors: The tensors whose values were read (FP8 scales included).

    Returns:
        The bytes, never above the size of the files.
    """
    size = {f.path: f.bytes for f in index.files}
    spans: dict[str, tuple[list[int], list[int]]] = {}
    unknown = 0
    for t in tensors:
        if not t.chunks and t.storage is None and t.file is not None and t.offset is not None:
            rs: list[tuple[str, int, int]] | None = [(t.file, t.offset, t.offset + t.nbytes)]
        else:
            rs = _ranges(t)
        if rs is None:  # gathered from elsewhere (ZeRO-3 partitions): counted as read
            unknown += t.nbytes
            continue
        for f, a, b in rs:
            have = spans.get(f)
            if have is None:
                have = spans[f] = ([], [])
            have[0].append(a)
            have[1].append(b)
    covered = sum(_union(starts, ends, size.get(f)) for f, (starts, ends) in spans.items())
    total = files_bytes(index)
    return min(covered + unknown, total) if index.files else covered + unknown


def _union(starts: list[int], ends: list[int], cap: int | None) -> int:
    """Bytes that the ranges ``[starts[k], ends[k])`` cover together, each clipped to
    ``cap``."""
    if len(starts) < 64 or max(ends) >= 1 << 62:
        covered, end = 0, -1
        for a, b in sorted(zip(starts, ends, strict=True)):
            if cap is not None:
                a, b = min(a, cap), min(b, cap)
            a = max(a, end)
            if b > a:
                covered += b - a
                end = b
        return covered
    import numpy as np  # heavy: numpy

    lo: np.ndarray = np.array(starts, dtype=np.int64)
    hi: np.ndarray = np.array(ends, dtype=np.int64)
    if cap is not None:
        np.minimum(lo, cap, out=lo)
        np.minimum(hi, cap, out=hi)
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    # Each range counts from where it starts or the furthest end before it, whichever is later.
    reach = np.empty_like(hi)
    reach[0] = -1
    np.maximum.accumulate(hi[:-1], out=reach[1:])
    return int(np.maximum(hi - np.maximum(lo, reach), 0).sum())
