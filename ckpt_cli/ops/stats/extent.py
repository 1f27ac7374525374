"""How many bytes of a checkpoint's files ``stats`` read, each byte counted once.

The engine counts the values it is given, view by view: two names viewing one storage (a
slice, a transpose: not the same view, so both are read) count its bytes twice, and a
checkpoint could report more bytes read than its files hold. Here the byte ranges of the
tensors read are merged per file and clipped to the file's size, so the figure shown beside
the files' size never exceeds it.
"""

from __future__ import annotations

from collections.abc import Iterable

from ckpt_cli.model import CheckpointIndex, TensorInfo


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
    spans: dict[str, list[tuple[int, int]]] = {}
    unknown = 0
    for t in tensors:
        rs = _ranges(t)
        if rs is None:  # gathered from elsewhere (ZeRO-3 partitions): counted as read
            unknown += t.nbytes
            continue
        for f, a, b in rs:
            spans.setdefault(f, []).append((a, b))
    covered = 0
    for f, pairs in spans.items():
        cap = size.get(f)
        end = -1
        for a, b in sorted(pairs):
            if cap is not None:
                a, b = min(a, cap), min(b, cap)
            a = max(a, end)
            if b > a:
                covered += b - a
                end = b
    total = files_bytes(index)
    return min(covered + unknown, total) if index.files else covered + unknown
