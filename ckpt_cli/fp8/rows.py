"""The row machinery both directions of FP8 share: each thread's scratch buffers, passes of
a few rows (small enough for the L2 cache), a tensor's flat pieces regrouped into whole
rows or 128-row blocks, and jobs run on the cast threads with their time counted as a stage.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import numpy as np

from ckpt_cli.storage import stages
from ckpt_cli.tensors import cast

SUB = 1 << 16
"""Elements per pass of the encoder: its few temporaries stay in the L2 cache (the figures
are in docs/benchmarks/tuning.md)."""
JOB = 1 << 20
"""Elements per pool task for the channel and tensor layouts (the block layout's task is one
row of 128x128 blocks)."""


class _Scratch(threading.local):
    """Each thread's buffers for the encoder and the decoder (reused: no allocation per pass)."""

    def __init__(self) -> None:
        self.size = 0

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """FP32 values, two uint32 and one bool buffer of at least ``n`` elements."""
        if n > self.size:
            self.size = max(n, SUB)
            self.q = np.empty(self.size, dtype=np.float32)
            self.a = np.empty(self.size, dtype=np.uint32)
            self.h = np.empty(self.size, dtype=np.uint32)
            self.b = np.empty(self.size, dtype=np.bool_)
        return self.q[:n], self.a[:n], self.h[:n], self.b[:n]


SCRATCH = _Scratch()


def rows_per_pass(rows: int, cols: int) -> int:
    """Rows per pass of about :data:`SUB` elements, evened out (128 rows of 1536 in passes
    of 43, 43 and 42, not 42, 42, 42 and 2: each pass costs the same Python overhead)."""
    passes = max(1, -(-rows * cols // SUB))
    return max(1, -(-rows // passes))


def row_groups(pieces: Iterator[np.ndarray], rows: int, cols: int,
               unit: int, widen: bool = True) -> Iterator[tuple[int, np.ndarray]]:
    """Regroup a tensor's flat pieces (row-major, any sizes) into 2-D FP32 arrays (with
    ``widen``; else in the pieces' dtype) of whole ``unit``-row groups (the last one may be
    short): as many as each piece holds, as views of it; a group split between pieces is
    copied together.

    Yields:
        ``(first row, rows x cols array)``.
    """
    total = rows * cols
    group = unit * cols
    done = 0  # elements yielded
    held: list[np.ndarray] = []  # a group split between pieces, so far
    held_n = 0
    for piece in pieces:
        p = np.asarray(piece).reshape(-1)
        if widen and p.dtype != np.float32:
            p = p.astype(np.float32)
        if done + held_n + p.size > total:
            raise ValueError(f"produced more than {total:,} values")
        pos = 0
        if held_n:
            want = min(group, total - done) - held_n
            take = min(want, p.size)
            held.append(p[:take])
            held_n += take
            pos = take
            if take < want:
                held = [np.concatenate(held)]  # owns its data: the piece may go
                continue
            yield done // cols, np.concatenate(held).reshape(-1, cols)
            done += held_n
            held, held_n = [], 0
        left = p.size - pos
        whole = left if done + left == total else left // group * group
        if whole:
            yield done // cols, p[pos:pos + whole].reshape(-1, cols)
            done += whole
            pos += whole
        if pos < p.size:
            held, held_n = [p[pos:].copy()], p.size - pos
    if done + held_n != total:
        raise ValueError(f"produced {done + held_n:,} values, expected {total:,}")


def run_jobs(jobs: list[Callable[[], None]], nbytes: int, stage: str = "quantize") -> None:
    """Run ``jobs`` on the cast threads (inline when one thread or one job), their time
    counted as ``stage`` (see :mod:`ckpt_cli.storage.stages`)."""
    each = nbytes // max(1, len(jobs))

    def job(f: Callable[[], None]) -> None:
        with stages.stage(stage, each):
            f()

    if len(jobs) == 1 or cast.cast_threads() <= 1:
        for f in jobs:
            job(f)
        return
    for _ in cast.cast_pool().map(job, jobs):
        pass


