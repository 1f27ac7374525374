"""``validate --values``: stream every floating tensor and look for NaN, Inf and all-zero.

Tensors are read piece by piece through :meth:`~ckpt_cli.tensors.source.TensorSource.iter_pieces`
(a tensor stored as one byte range in pieces of :data:`~ckpt_cli.storage.reads.PIECE_BYTES`; DCP
tensors a chunk at a time; strided views whole) and examined in slices. Several
tensors are scanned at once, on as many threads as ``--jobs`` and the memory budget
(``--max-memory``) allow, so memory stays within the budget plus the largest tensor that must
be read whole, whatever the checkpoint's size. Views of one storage (tied weights) are read
once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckpt_cli import dtypes
from ckpt_cli.errors import CkptError
from ckpt_cli.model import CheckpointIndex, Finding, TensorInfo
from ckpt_cli.progress import Progress
from ckpt_cli.storage.reads import (
    MEMORY_BUDGET,
    PIECE_BYTES,
    Meter,
    PerThread,
    run_bounded,
)
from ckpt_cli.tensors.source import TensorSource

if TYPE_CHECKING:
    import numpy as np

_SLICE = 1 << 24  # elements examined at once (bounds the temporary masks)


@dataclass(frozen=True, slots=True)
class ValueScan:
    """What ``--values`` read.

    Attributes:
        tensors: Floating tensors examined.
        bytes: Bytes of them read.
        skipped: Floating tensors whose values could not be examined (packed sub-byte types,
            compressed chunks, tensors without data).
        seconds: Wall time.
    """

    tensors: int
    bytes: int
    skipped: int
    seconds: float


@dataclass(slots=True)
class _Counts:
    numel: int = 0
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    nonzero: bool = False

    def add(self, arr: np.ndarray) -> None:
        import numpy as np  # heavy: numpy

        flat = arr.reshape(-1)
        self.numel += flat.size
        # Damaged data holds signalling NaNs and the like: counting them must stay silent.
        with np.errstate(all="ignore"):
            for i in range(0, flat.size, _SLICE):
                part = flat[i:i + _SLICE]
                finite = np.isfinite(part)
                if not finite.all():
                    self.nan += int(np.isnan(part).sum())
                    self.posinf += int(np.isposinf(part).sum())
                    self.neginf += int(np.isneginf(part).sum())
                if not self.nonzero and part.any():
                    self.nonzero = True


def _pieces(src: TensorSource, t: TensorInfo) -> Iterator[np.ndarray]:
    """A tensor's values in pieces; DCP tensors a chunk at a time (the order of the values
    does not matter here, so chunks split along any dimension need no assembling)."""
    if t.chunks:
        for c in t.chunks:
            yield src.read_chunk(t, c)
    else:
        yield from src.iter_pieces(t)


def _cost(t: TensorInfo) -> int:
    """Memory a scan of ``t`` holds: a piece, its largest chunk, or the whole tensor when its
    layout is read whole; plus the masks of one slice."""
    if t.chunks:
        item = dtypes.DTYPES[t.dtype].itemsize
        held = max(math.prod(c.sizes) * item for c in t.chunks)
    elif t.stride is None and t.file is not None:
        held = min(t.nbytes, PIECE_BYTES)
    else:
        held = t.nbytes
    return held + 3 * _SLICE


TensorValues = tuple[list[Finding], bool]
"""What examining one tensor found: its findings, and whether it could not be read."""


def value_file(t: TensorInfo) -> str | None:
    """The file a tensor's values scan is charged to (its first chunk's, for DCP)."""
    return _file(t)


def scan_values(index: CheckpointIndex, *, on_progress: Progress | None = None,
                select: Callable[[TensorInfo], bool] | None = None,
                done_elsewhere: Mapping[str, TensorValues] | None = None,
                collect: dict[str, TensorValues] | None = None,
                max_memory: int = MEMORY_BUDGET, threads: int = 1,
                ) -> tuple[list[Finding], ValueScan]:
    """Examine every floating tensor's values.

    Args:
        index: The checkpoint.
        on_progress: Progress callback (label ``values``), in bytes.
        select: Read only the tensors it accepts (this part's, with ``--part``); the others
            are taken from ``done_elsewhere`` when there, else left out.
        done_elsewhere: Results of tensors other parts examined, by name.
        collect: Receives the result of each tensor examined here, by name.
        max_memory: Memory budget in bytes for the tensors being scanned, as resolved once
            by :func:`~ckpt_cli.ops.validate.validate` (default 256 MiB; a tensor whose layout
            is read whole may add its size).
        threads: Tensors scanned at once (at most; the budget may allow fewer).

    Returns:
        ``(findings, stats)``. NaN is an error in weights, optimizer state and buffers (a
        warning in other state); Inf is an error in weights and optimizer state, a note for
        -inf in buffers (attention masks hold it on purpose) and a warning otherwise; a
        tensor of zeros is a warning in weights and a note elsewhere. Tensors that cannot be
        read are warnings (their structural problem is reported by the other checks).
    """
    t0 = time.perf_counter()
    elsewhere = done_elsewhere or {}
    budget = max_memory
    todo: list[TensorInfo] = []
    seen: set[tuple[object, ...]] = set()
    skipped = 0
    for t in index.tensors.values():
        if not t.is_floating or t.numel == 0:
            continue
        if t.kind != "dense" or dtypes.DTYPES[t.dtype].numpy_name is None:
            skipped += 1
            continue
        key = t.view_key
        if key is not None:
            if key in seen:
                continue  # another name for the same bytes (tied weights)
            seen.add(key)
        if select is None or select(t) or t.name in elsewhere:
            todo.append(t)
    total = sum(t.nbytes for t in todo)
    mine = [t for t in todo if select is None or select(t)]
    sources: PerThread[int, TensorSource] = PerThread(lambda _: TensorSource(index))

    def job(t: TensorInfo) -> Callable[[Meter], _Counts | CkptError]:
        def run(meter: Meter) -> _Counts | CkptError:
            counts = _Counts()
            try:
                for arr in _pieces(sources.get(0), t):
                    counts.add(arr)
                    meter.add(arr.nbytes)
                    del arr  # before the next read: memory holds one piece, not two
            except CkptError as e:
                return e
            return counts
        return run

    try:
        outcomes = run_bounded([job(t) for t in mine], [_cost(t) for t in mine], budget=budget,
                               threads=max(1, threads), total=sum(t.nbytes for t in mine),
                               label="values",
                               on_progress=on_progress)
    finally:
        sources.close()
    if on_progress:
        on_progress("values", total, total)
    scanned = {t.name: got for t, got in zip(mine, outcomes, strict=True)}
    findings: list[Finding] = []
    examined = 0
    for t in todo:
        if t.name not in scanned:  # another part's tensor (--part): its receipt's result
            found, unreadable = elsewhere[t.name]
            findings.extend(found)
            skipped += unreadable
            examined += not unreadable
            continue
        got = scanned[t.name]
        if isinstance(got, CkptError):
            skipped += 1
            bad = Finding("warning", "values-unreadable",
                          f"values not examined: {got.message}", _file(t), t.name)
            findings.append(bad)
            if collect is not None:
                collect[t.name] = ([bad], True)
            continue
        examined += 1
        judged = _judge(t, got)
        findings.extend(judged)
        if collect is not None:
            collect[t.name] = (judged, False)
    return findings, ValueScan(examined, total, skipped, time.perf_counter() - t0)


def _file(t: TensorInfo) -> str | None:
    return t.file or (t.chunks[0].file if t.chunks else None)


def _judge(t: TensorInfo, c: _Counts) -> list[Finding]:
    out: list[Finding] = []
    where = _file(t)
    state = t.group in ("model", "optimizer", "buffer")  # what a resumed run computes with
    if c.nan:
        out.append(Finding("error" if state else "warning", "nan",
                           f"{c.nan:,} of {c.numel:,} values are NaN", where, t.name))
    inf = c.posinf + c.neginf
    if inf and t.group in ("model", "optimizer"):
        out.append(Finding("error", "inf", f"{inf:,} of {c.numel:,} values are infinite",
                           where, t.name))
    elif c.posinf or (c.neginf and t.group != "buffer"):
        out.append(Finding("warning" if state else "info", "inf",
                           f"{inf:,} of {c.numel:,} values are infinite", where, t.name))
    elif c.neginf:
        out.append(Finding("info", "inf", f"{c.neginf:,} of {c.numel:,} values are -inf (as "
                           "in an attention mask)", where, t.name))
    if not c.nonzero and not c.nan:
        out.append(Finding("warning" if t.group == "model" else "info", "all-zero",
                           f"all {c.numel:,} values are zero (never trained, or wiped?)",
                           where, t.name))
    return out
