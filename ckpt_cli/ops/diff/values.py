"""``diff``'s value comparison: each common pair streamed block by block over the worker threads
within the memory budget (:mod:`ckpt_cli.ops.diff.compare` holds the statistics), FP8 pairs
dequantized, errors naming the side they come from, and tied copies found by value."""

from __future__ import annotations

import copy
import dataclasses
import re
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ckpt_cli import dtypes, fp8
from ckpt_cli.errors import (
    CkptError,
    OutOfMemoryError,
)
from ckpt_cli.fp8 import scheme as fp8_scheme
from ckpt_cli.model import CheckpointIndex, TensorInfo
from ckpt_cli.ops.diff.compare import (
    EXACT,
    DiffStats,
    Tolerance,
    compare_arrays,
    compare_values,
    default_tolerance,
)
from ckpt_cli.ops.diff.names import WEIGHT_GROUPS
from ckpt_cli.ops.diff.result import (
    DiffResult,
    OnlyIn,
    TensorDiff,
)
from ckpt_cli.progress import Progress
from ckpt_cli.storage.reads import PIECE_BYTES, Meter, default_jobs, run_bounded
from ckpt_cli.tensors.source import TensorSource

if TYPE_CHECKING:
    import numpy as np

def on_side(e: CkptError, label: str) -> CkptError:
    """The same error with its message prefixed by the side it concerns (``A:``/``B:``).

    Args:
        e: The error.
        label: ``A`` or ``B``.

    Returns:
        A copy of ``e`` (same class, path and exit code) with ``side`` set, so that its text
        starts with ``label``.
    """
    if e.side is not None:
        return e  # already labelled (a read inside a read)
    err = copy.copy(e)
    err.side = label
    err.args = (str(err),)
    return err


class _SideSource(TensorSource):
    """A tensor source whose errors say which side they come from."""

    def __init__(self, index: CheckpointIndex, label: str):
        super().__init__(index)
        self.label = label

    def read(self, t: TensorInfo, *, mapped: bool = False) -> np.ndarray:
        try:
            return super().read(t, mapped=mapped)
        except CkptError as e:
            raise on_side(e, self.label) from None

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        try:
            super().read_into(rel, offset, out)
        except CkptError as e:
            raise on_side(e, self.label) from None

    def iter_pieces(self, t: TensorInfo, *, piece_bytes: int | None = None,
                    mapped: bool = False) -> Iterator[np.ndarray]:
        try:
            yield from super().iter_pieces(t, piece_bytes=piece_bytes, mapped=mapped)
        except CkptError as e:
            raise on_side(e, self.label) from None


def _dequantized_values(src: TensorSource, t: TensorInfo,
                        scale: TensorInfo | None) -> tuple[np.ndarray, float]:
    """A tensor's values in float32 (``weight * scale`` for an FP8 weight with its scale),
    and its largest scale (0 when not quantized)."""
    import numpy as np  # heavy: numpy

    if scale is None:
        return np.asarray(src.read(t), dtype=np.float32), 0.0
    s = src.read(scale)
    values = fp8.dequantize(src.read(t), s, "F32")
    return values, float(np.asarray(s, dtype=np.float32).max(initial=0.0))


def fp8_tolerance(ta: TensorInfo, tb: TensorInfo, max_scale: float, *,
                  rtol: float | None = None, atol: float | None = None) -> Tolerance:
    """The tolerance of a comparison of dequantized FP8 values: one unit in the last place
    of the FP8 dtype (E4M3: ``rtol`` 2**-3) relative to the larger value, and its smallest
    subnormal times the largest scale as ``atol`` (values below it round to 0 or a
    subnormal); ``rtol``/``atol`` given by the user replace them one by one.

    Args:
        ta: The tensor in A.
        tb: The tensor in B.
        max_scale: The largest scale of the quantized side(s).
        rtol: A user-given relative tolerance, or None.
        atol: A user-given absolute tolerance, or None.

    Returns:
        The :class:`Tolerance` (source ``fp8:<CODE>``, or ``user``).
    """
    import ml_dtypes  # heavy: ml_dtypes

    codes = [t.dtype for t in (ta, tb) if t.dtype in fp8_scheme.FP8_DTYPES]
    infos = [(ml_dtypes.finfo(dtypes.numpy_dtype(c)), c)  # type: ignore[no-untyped-call]
             for c in codes]
    fi, code = max(infos, key=lambda x: float(x[0].eps))
    base = Tolerance(float(fi.eps), float(fi.smallest_subnormal) * max_scale, f"fp8:{code}")
    if rtol is None and atol is None:
        return base
    return Tolerance(base.rtol if rtol is None else rtol, base.atol if atol is None else atol,
                     "user")


# --- values ----------------------------------------------------------------------------------

def _why_not(t: TensorInfo, label: str) -> str | None:
    if t.kind != "dense":
        return f"{label} holds a {t.kind} tensor"
    if not t.chunks and (t.file is None or t.offset is None):
        return f"{label} has no data for it"
    return None


def comparable(ta: TensorInfo, tb: TensorInfo) -> str | None:
    """Why the values of two same-shaped tensors cannot be compared, or None if they can.

    Args:
        ta: The tensor in A.
        tb: The tensor in B.

    Returns:
        A short reason, or None.
    """
    why = _why_not(ta, "A") or _why_not(tb, "B")
    if why:
        return why
    decodable = [dtypes.DTYPES[t.dtype].numpy_name is not None for t in (ta, tb)]
    if not all(decodable) and (any(decodable) or ta.dtype != tb.dtype):
        return f"{ta.dtype} and {tb.dtype} cannot be compared (no numeric decoding)"
    return None


def _compare_all(result: DiffResult, progress: Progress | None, budget: int) -> None:
    """Compare the values of every comparable pair, several pairs at once (as many as the
    cores and the memory budget allow), each on a thread with its own readers."""
    opts = result.options
    todo: list[tuple[TensorDiff, TensorInfo, TensorInfo]] = []
    for td in result.tensors:
        if td.status == "shape_changed":
            continue
        ta, tb = result.index_a.tensors[td.name_a], result.index_b.tensors[td.name_b]
        why = comparable(ta, tb)
        if why:
            td.status, td.reason = "skipped", why
            continue
        todo.append((td, ta, tb))
    total = sum(ta.nbytes + tb.nbytes for _, ta, tb in todo)
    sides: list[tuple[_SideSource, _SideSource]] = []
    local = threading.local()
    lock = threading.Lock()

    def sources() -> tuple[_SideSource, _SideSource]:
        pair: tuple[_SideSource, _SideSource] | None = getattr(local, "pair", None)
        if pair is None:
            pair = local.pair = (_SideSource(result.index_a, "A"),
                                 _SideSource(result.index_b, "B"))
            with lock:
                sides.append(pair)
        return pair

    def dequantized_job(td: TensorDiff, ta: TensorInfo, tb: TensorInfo,
                        ) -> Callable[[Meter], tuple[DiffStats, Tolerance]]:
        dq = result.dequantized[td.name]
        sa = result.index_a.tensors[dq.scale_a] if dq.scale_a else None
        sb = result.index_b.tensors[dq.scale_b] if dq.scale_b else None

        def run(meter: Meter) -> tuple[DiffStats, Tolerance]:
            src_a, src_b = sources()
            try:
                xa, ma = _dequantized_values(src_a, ta, sa)
                xb, mb = _dequantized_values(src_b, tb, sb)
            except MemoryError:
                raise OutOfMemoryError(
                    f"out of memory dequantizing tensor {td.name!r} ({ta.numel:,} elements): "
                    "an FP8 weight is compared whole, in FP32 on both sides",
                    hint="free memory or raise the limit (ulimit -v)") from None
            except CkptError as e:
                raise CkptError(f"{td.name}: {e}") from None
            tol = fp8_tolerance(ta, tb, max(ma, mb), rtol=opts.rtol, atol=opts.atol)
            stats = compare_arrays(xa, xb, tol, block=opts.block)
            meter.add(ta.nbytes + tb.nbytes)
            return stats, tol
        return run

    def job(td: TensorDiff, ta: TensorInfo, tb: TensorInfo,
            ) -> Callable[[Meter], tuple[DiffStats, Tolerance]]:
        if td.name in result.dequantized:
            return dequantized_job(td, ta, tb)

        def run(meter: Meter) -> tuple[DiffStats, Tolerance]:
            src_a, src_b = sources()
            tol = default_tolerance(ta.dtype, tb.dtype, rtol=opts.rtol, atol=opts.atol)
            try:
                stats = compare_values(src_a, ta, src_b, tb, tol, block=opts.block,
                                       on_block=meter.add)
            except MemoryError:
                raise OutOfMemoryError(
                    f"out of memory comparing tensor {td.name!r} ({ta.nbytes:,} + "
                    f"{tb.nbytes:,} bytes): ckpt compares in blocks of "
                    f"{opts.block:,} elements from pieces of at most {PIECE_BYTES >> 20} "
                    "MiB, but reads strided views and DCP chunks split along other "
                    "dimensions whole",
                    hint="free memory or raise the limit (ulimit -v)") from None
            return stats, tol
        return run

    def comparing(_label: str, done: int, all_bytes: int) -> None:
        if progress is not None:
            progress("comparing", min(done, all_bytes), all_bytes)

    try:
        outcomes = run_bounded([job(*x) for x in todo],
                               [_held(ta, opts.block) + _held(tb, opts.block)
                                + 7 * 8 * opts.block if td.name not in result.dequantized
                                else ta.nbytes + tb.nbytes + 20 * ta.numel
                                for td, ta, tb in todo],
                               budget=budget, threads=default_jobs(), total=total,
                               label="values", on_progress=comparing)
    finally:
        for a, b in sides:
            a.close()
            b.close()
    for (td, ta, tb), (stats, tol) in zip(todo, outcomes, strict=True):
        kinds = {dtypes.DTYPES[ta.dtype].kind, dtypes.DTYPES[tb.dtype].kind}
        if not kinds & {"float", "complex"}:
            tol = EXACT
        td.stats, td.tolerance = stats, tol
        td.status = ("identical" if stats.identical else
                     "within_tolerance" if stats.within_tolerance else "changed")
    with _SideSource(result.index_a, "A") as src_a, _SideSource(result.index_b, "B") as src_b:
        result.only_a = _value_ties(result.only_a, result, src_a, "a")
        result.only_b = _value_ties(result.only_b, result, src_b, "b")


def _held(t: TensorInfo, block: int) -> int:
    """Bytes a comparison holds of one side: a block of a tensor stored as one byte range;
    the whole tensor for other layouts (an upper bound: DCP chunks split along the first
    dimension stream in pieces)."""
    if t.chunks or t.stride is not None or t.file is None:
        return t.nbytes
    return min(t.nbytes, block * dtypes.DTYPES[t.dtype].itemsize)


_MAX_TIE_CANDIDATES = 8
# Names of the tensors models tie (output heads and embeddings): only these are taken for tied
# copies on equal values alone, so a missing bias that happens to equal another (all zeros)
# still counts as missing.
_TIEABLE = re.compile(r"(^|\.)(lm_head|embed_out|output|head|decoder|proj_out|wte|"
                      r"word_embeddings|embed_tokens|tok_embeddings|embedding|embeddings|"
                      r"shared)(\.|$)")


def _value_ties(only: list[OnlyIn], result: DiffResult, src: TensorSource,
                side: str) -> list[OnlyIn]:
    """Mark one-sided weights that hold exactly the values of a common tensor of their side.

    A DCP or plain torch save keeps a tied ``lm_head.weight`` as its own entry, so storage
    sharing cannot reveal the tie; identical values can. Only model weights and buffers are
    checked, against at most a few common tensors of the same dtype and shape.
    """
    ix = result.index_a if side == "a" else result.index_b
    by_sig: dict[tuple[str, tuple[int, ...]], list[tuple[str, TensorInfo]]] = {}
    for td in result.tensors:
        if td.status in ("identical", "within_tolerance"):
            t = ix.tensors[td.name_a if side == "a" else td.name_b]
            by_sig.setdefault((t.dtype, t.shape), []).append((td.name, t))
    out: list[OnlyIn] = []
    for o in only:
        if o.tied_to is None and o.group in WEIGHT_GROUPS and _TIEABLE.search(o.name):
            t = ix.tensors[o.original]
            for name, u in by_sig.get((t.dtype, t.shape), [])[:_MAX_TIE_CANDIDATES]:
                if comparable(t, u) is None and compare_values(
                        src, t, src, u, EXACT, block=result.options.block).identical:
                    o = dataclasses.replace(o, tied_to=name, tie="values")
                    break
        out.append(o)
    return out
