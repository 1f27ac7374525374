"""Comparing the values of two tensors, streamed in blocks, without torch.

Used by ``ckpt diff`` and by commands that verify what they wrote. Memory stays small: a tensor
stored as one contiguous byte range is read block by block with positioned reads into reused
buffers; DCP chunks split along the first dimension are streamed piece by piece
(:meth:`~ckpt_cli.tensors.source.TensorSource.iter_pieces`); other layouts (strided views,
chunks split along other dimensions) are read whole once and then walked in blocks, so the upcast
temporaries are always block-sized.

Rules:

- Floating tensors are compared after upcasting: in float32 when both sides are 32-bit or
  narrower floats (the upcast is exact), else in float64 (complex128 for complex). Sums are
  accumulated across blocks in Python floats (float64).
- An element is within tolerance when ``|a - b| <= atol + rtol * max(|a|, |b|)``. The bound is
  symmetric, so swapping the sides never changes a verdict.
- NaN on both sides at the same position, and infinities of the same sign, count as equal;
  any other non-finite pairing is a mismatch. Statistics cover the finite pairs only.
- Integer and boolean tensors are compared exactly, whatever the tolerance.
- The relative L2 change is ``||a - b|| / max(||a||, ||b||)`` (symmetric; 0 when both are 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt_cli import dtypes
from ckpt_cli.model import TensorInfo
from ckpt_cli.ops.options.diff import BLOCK_ELEMENTS as BLOCK_ELEMENTS
from ckpt_cli.storage import stages

if TYPE_CHECKING:
    import numpy as np

    from ckpt_cli.tensors.source import TensorSource



@dataclass(frozen=True, slots=True)
class Tolerance:
    """When two values count as equal.

    Attributes:
        rtol: Relative tolerance (times the larger magnitude of the two values).
        atol: Absolute tolerance.
        source: Why these values: ``exact`` (same dtype, or integers), ``dtype:<CODE>`` (the
            rounding of the coarser of two different float dtypes) or ``user``.
    """

    rtol: float
    atol: float
    source: str

    @property
    def exact(self) -> bool:
        """Whether only exactly equal values pass."""
        return self.rtol == 0 and self.atol == 0


EXACT = Tolerance(0.0, 0.0, "exact")

# A complex number is as precise as its real and imaginary parts.
_COMPONENT = {"C64": "F32", "C128": "F64"}


def _finfo(code: str) -> tuple[float, float] | None:
    """``(eps, smallest_subnormal)`` of a float dtype, or None if numpy cannot represent it."""
    import numpy as np  # heavy: numpy

    if dtypes.DTYPES[code].kind != "float":
        return None
    try:
        dt = dtypes.numpy_dtype(code)
    except KeyError:
        return None
    if dt.kind == "f":
        fi = np.finfo(dt.type)
        return float(fi.eps), float(fi.smallest_subnormal)
    import ml_dtypes  # heavy: ml_dtypes

    mfi = ml_dtypes.finfo(dt)  # type: ignore[no-untyped-call]
    return float(mfi.eps), float(mfi.smallest_subnormal)


def default_tolerance(dtype_a: str, dtype_b: str, *, rtol: float | None = None,
                      atol: float | None = None) -> Tolerance:
    """The tolerance for comparing a tensor stored as ``dtype_a`` with one stored as ``dtype_b``.

    Same dtype: exact. Two different float dtypes: one unit in the last place of the coarser
    one (``rtol`` = its machine epsilon, ``atol`` = its smallest subnormal), so FP32 against
    its FP16 or BF16 rounding is equal, whichever rounding mode made it. Integers and booleans
    are always exact. ``rtol``/``atol`` given by the user replace the defaults one by one
    (for floats only).

    Args:
        dtype_a: Canonical dtype code of side A.
        dtype_b: Canonical dtype code of side B.
        rtol: A user-given relative tolerance, or None.
        atol: A user-given absolute tolerance, or None.

    Returns:
        The :class:`Tolerance`.
    """
    kinds = {dtypes.DTYPES[dtype_a].kind, dtypes.DTYPES[dtype_b].kind}
    if not kinds & {"float", "complex"}:
        return EXACT
    base = EXACT
    if dtype_a != dtype_b:
        known = [(fi, code) for code in (dtype_a, dtype_b)
                 if dtypes.DTYPES[code].kind in ("float", "complex")
                 and (fi := _finfo(_COMPONENT.get(code, code))) is not None]
        if known:
            (eps, _), code = max(known, key=lambda k: k[0][0])
            base = Tolerance(eps, max(fi[1] for fi, _ in known), f"dtype:{code}")
    if rtol is None and atol is None:
        return base
    return Tolerance(base.rtol if rtol is None else rtol, base.atol if atol is None else atol,
                     "user")


def relative_l2(norm_diff: float, norm_a: float, norm_b: float) -> float:
    """``norm_diff / max(norm_a, norm_b)``: symmetric in A and B.

    Args:
        norm_diff: ``||a - b||``.
        norm_a: ``||a||``.
        norm_b: ``||b||``.

    Returns:
        0 when nothing differs, inf for a change from all zeros.
    """
    if norm_diff == 0:
        return 0.0
    den = max(norm_a, norm_b)
    return norm_diff / den if den > 0 else math.inf


@dataclass(slots=True)
class DiffStats:
    """How the values of two same-shaped tensors differ.

    Attributes:
        elements: Elements compared.
        max_abs: Largest ``|a - b|`` over finite pairs.
        mean_abs: Mean ``|a - b|`` over finite pairs.
        norm_a: L2 norm of A's finite values (those paired with finite values in B).
        norm_b: L2 norm of B's finite values (likewise).
        norm_diff: L2 norm of ``a - b`` over finite pairs.
        changed: Elements whose values are not exactly equal (non-finite mismatches included).
        outside: Elements outside the tolerance (non-finite mismatches included).
        nonfinite_mismatches: Positions where one side is NaN/inf and the other is not the
            same (NaN with NaN and equal infinities match).
        nonfinite_matched: Positions where both sides hold the same NaN/inf.
        raw_only: True when the dtype has no numeric decoding (F4, F6) and only bytes were
            compared; the float statistics are then 0 and ``changed`` counts differing bytes.
    """

    elements: int = 0
    max_abs: float = 0.0
    mean_abs: float = 0.0
    norm_a: float = 0.0
    norm_b: float = 0.0
    norm_diff: float = 0.0
    changed: int = 0
    outside: int = 0
    nonfinite_mismatches: int = 0
    nonfinite_matched: int = 0
    raw_only: bool = False

    @property
    def rel_l2(self) -> float:
        """``||a - b|| / max(||a||, ||b||)``; 0 when nothing differs, inf for a change from 0."""
        if self.nonfinite_mismatches:
            return math.inf
        return relative_l2(self.norm_diff, self.norm_a, self.norm_b)

    @property
    def identical(self) -> bool:
        """Every value exactly equal (NaN matching NaN)."""
        return self.changed == 0

    @property
    def within_tolerance(self) -> bool:
        """Every value equal within the tolerance."""
        return self.outside == 0


class _Acc:
    """Running sums over blocks (float64 in Python, so block sums never lose the total)."""

    __slots__ = ("changed", "matched", "max_abs", "mismatched", "n", "outside", "ss_a", "ss_b",
                 "ss_d", "sum_abs")

    def __init__(self) -> None:
        self.n = 0
        self.max_abs = 0.0
        self.sum_abs = 0.0
        self.ss_a = self.ss_b = self.ss_d = 0.0
        self.changed = self.outside = self.mismatched = self.matched = 0

    def stats(self, elements: int) -> DiffStats:
        return DiffStats(elements, self.max_abs, self.sum_abs / self.n if self.n else 0.0,
                          math.sqrt(self.ss_a), math.sqrt(self.ss_b), math.sqrt(self.ss_d),
                          self.changed, self.outside, self.mismatched, self.matched)


class _Flat:
    """Flat, block-wise access to one tensor's elements.

    A tensor stored as one contiguous byte range is read block by block; other decodable
    layouts come piece by piece from :meth:`TensorSource.iter_pieces` (bounded for DCP chunks
    split along the first dimension, one whole buffer for strided views), asked for in order;
    packed sub-byte dtypes are read whole.
    """

    def __init__(self, src: TensorSource, t: TensorInfo, block: int):
        import numpy as np  # heavy: numpy

        self.src, self.t = src, t
        self.whole: np.ndarray | None = None
        self._pieces: Iterator[np.ndarray] | None = None
        try:
            self.dt: np.dtype[Any] | None = dtypes.numpy_dtype(t.dtype)
        except KeyError:
            self.dt = None
        if self.dt is None:
            self.whole = src.read(t).reshape(-1)
            return
        self.buf = np.empty(min(block, max(t.numel, 1)) * self.dt.itemsize, dtype=np.uint8)
        if t.chunks or t.stride is not None or t.file is None or t.offset is None:
            self._pieces = src.iter_pieces(t)
            self._cur = np.empty(0, dtype=self.dt)  # the rest of the current piece
            self._pos = 0  # index of self._cur's first element

    def get(self, i: int, j: int) -> np.ndarray:
        """Elements ``[i, j)`` (a view valid until the next call; blocks asked for in order)."""
        if self.whole is not None:
            return self.whole[i:j]
        assert self.dt is not None
        if self._pieces is not None:
            return self._next(i, j)
        assert self.t.file is not None and self.t.offset is not None
        size = self.dt.itemsize
        out = self.buf[: (j - i) * size]
        self.src.read_into(self.t.file, self.t.offset + i * size, out.data)
        return out.view(self.dt)

    def _next(self, i: int, j: int) -> np.ndarray:
        """The next block from the pieces: a view of one piece, or pieces copied together."""
        assert self._pieces is not None and self.dt is not None
        if i != self._pos:
            raise ValueError(f"blocks asked for out of order ({i} after {self._pos})")
        n = j - i
        if self._cur.size >= n:  # the common case: the block lies inside one piece
            out, self._cur = self._cur[:n], self._cur[n:]
            self._pos = j
            return out
        out = self.buf[: n * self.dt.itemsize].view(self.dt)
        got = 0
        while got < n:
            if not self._cur.size:
                piece = next(self._pieces, None)
                if piece is None:
                    raise ValueError(f"{self.t.name}: its pieces end at element {i + got}")
                self._cur = piece.reshape(-1)
                continue
            k = min(n - got, self._cur.size)
            out[got:got + k] = self._cur[:k]
            self._cur = self._cur[k:]
            got += k
        self._pos = j
        return out


def work_dtype(dtype_a: str, dtype_b: str) -> str:
    """The dtype values are compared in: ``F32``, ``F64`` or ``C128``.

    Args:
        dtype_a: Canonical dtype code of side A.
        dtype_b: Canonical dtype code of side B.

    Returns:
        ``F32`` when both are floats of at most 32 bits, ``C128`` if either is complex, else
        ``F64``.
    """
    da, db = dtypes.DTYPES[dtype_a], dtypes.DTYPES[dtype_b]
    if "complex" in (da.kind, db.kind):
        return "C128"
    if da.kind == db.kind == "float" and da.bits <= 32 and db.bits <= 32:
        return "F32"
    return "F64"


def compare_values(src_a: TensorSource, ta: TensorInfo, src_b: TensorSource, tb: TensorInfo,
                   tol: Tolerance, *, block: int = BLOCK_ELEMENTS,
                   on_block: Callable[[int], None] | None = None) -> DiffStats:
    """Compare the values of two tensors of the same shape.

    Args:
        src_a: Reader of side A's checkpoint.
        ta: The tensor in A.
        src_b: Reader of side B's checkpoint.
        tb: The tensor in B (same number of elements as ``ta``).
        tol: The tolerance deciding ``outside``; ignored for integers and booleans.
        block: Elements per block.
        on_block: Called with the number of bytes (both sides) done after each block.

    Returns:
        The :class:`DiffStats`.

    Raises:
        ValueError: If the tensors have different element counts.
        CkptError: If either tensor cannot be read (the message names its file).
    """
    import numpy as np  # heavy: numpy

    n = ta.numel
    if tb.numel != n:
        raise ValueError(f"{ta.name}: {n} elements vs {tb.numel}")
    fa, fb = _Flat(src_a, ta, block), _Flat(src_b, tb, block)
    if fa.dt is None or fb.dt is None:
        return _compare_raw(fa, fb, n, on_block)
    kinds = {dtypes.DTYPES[ta.dtype].kind, dtypes.DTYPES[tb.dtype].kind}
    exact = not kinds & {"float", "complex"}
    work = np.dtype({"F32": np.float32, "F64": np.float64, "C128": np.complex128}[
        work_dtype(ta.dtype, tb.dtype)])
    if exact:
        tol = EXACT
    bufs = None if exact else _Buffers(work, min(block, max(n, 1)))
    acc = _Acc()
    nbytes, reported = ta.nbytes + tb.nbytes, 0
    with np.errstate(all="ignore"):
        for i in range(0, n, block):
            j = min(n, i + block)
            x, y = fa.get(i, j), fb.get(i, j)
            with stages.stage("compare", x.nbytes + y.nbytes):
                if bufs is None:
                    _exact_block(x, y, acc)
                else:
                    _float_block(x, y, bufs, tol, acc)
            if on_block is not None:
                done = j * nbytes // n  # integer arithmetic: the last call reaches nbytes
                on_block(done - reported)
                reported = done
    return acc.stats(n)


def compare_arrays(x: np.ndarray, y: np.ndarray, tol: Tolerance, *,
                   block: int = BLOCK_ELEMENTS) -> DiffStats:
    """Compare two float32 arrays of the same size already in memory, block by block, with
    the statistics :func:`compare_values` computes (``diff`` of dequantized FP8 weights).

    Args:
        x: Side A's values (float32).
        y: Side B's values (float32, as many elements).
        tol: The tolerance deciding ``outside``.
        block: Elements per block.

    Returns:
        The :class:`DiffStats`.
    """
    import numpy as np  # heavy: numpy

    xf, yf = x.reshape(-1), y.reshape(-1)
    n = xf.shape[0]
    if yf.shape[0] != n:
        raise ValueError(f"{n} elements vs {yf.shape[0]}")
    bufs = _Buffers(np.dtype(np.float32), min(block, max(n, 1)))
    acc = _Acc()
    with np.errstate(all="ignore"):
        for i in range(0, n, block):
            j = min(n, i + block)
            _float_block(xf[i:j], yf[i:j], bufs, tol, acc)
    return acc.stats(n)


class _Buffers:
    """Reused work arrays of one block (upcast A, upcast B, difference, scratch)."""

    def __init__(self, work: np.dtype[Any], size: int):
        import numpy as np  # heavy: numpy

        self.work = work
        self.x = np.empty(size, dtype=work)
        self.y = np.empty(size, dtype=work)
        self.d = np.empty(size, dtype=work)
        self.real = np.empty(size, dtype=np.float64 if work.kind == "c" else work)


def _upcast(v: np.ndarray, buf: np.ndarray) -> np.ndarray:
    import numpy as np  # heavy: numpy

    if v.dtype == buf.dtype:
        return v
    out = buf[: v.shape[0]]
    np.copyto(out, v, casting="unsafe")
    return out


def _float_block(x: np.ndarray, y: np.ndarray, bufs: _Buffers, tol: Tolerance,
                 acc: _Acc) -> None:
    import numpy as np  # heavy: numpy

    m = x.shape[0]
    xa, ya = _upcast(x, bufs.x), _upcast(y, bufs.y)
    d = bufs.d[:m]
    np.subtract(xa, ya, out=d)
    ss_d = float(np.vdot(d, d).real)
    ss_a = float(np.vdot(xa, xa).real)
    ss_b = float(np.vdot(ya, ya).real)
    if not (math.isfinite(ss_d) and math.isfinite(ss_a) and math.isfinite(ss_b)):
        # Some value is NaN or inf (or the squares overflowed): redo this block the careful way.
        _careful_block(xa, ya, tol, acc)
        return
    acc.n += m
    acc.ss_a += _unless_underflow(ss_a, xa)
    acc.ss_b += _unless_underflow(ss_b, ya)
    ad = bufs.real[:m]
    np.abs(d, out=ad)
    big = float(ad.max()) if m else 0.0
    if big == 0.0:
        return  # every difference is exactly zero: nothing else to count
    acc.ss_d += _unless_underflow(ss_d, ad)
    acc.max_abs = max(acc.max_abs, big)
    acc.sum_abs += float(ad.sum(dtype=np.float64))
    changed = int(np.count_nonzero(ad))
    acc.changed += changed
    acc.outside += changed if tol.exact else _count_outside(ad, xa, ya, big, tol)


def _unless_underflow(ss: float, v: np.ndarray) -> float:
    """A float32 sum of squares, redone in float64 if it underflowed to 0 (|v| < ~1e-23)."""
    return _sumsq(v) if ss == 0.0 and v.any() else ss


def _count_outside(ad: np.ndarray, xa: np.ndarray, ya: np.ndarray, big: float,
                   tol: Tolerance) -> int:
    """Elements with ``|a-b| > atol + rtol * max(|a|, |b|)`` (``ad`` holds ``|a-b|``)."""
    import numpy as np  # heavy: numpy

    if big <= tol.atol:
        return 0
    if tol.rtol == 0:
        return int(np.count_nonzero(ad > tol.atol))
    bound = np.maximum(np.abs(xa), np.abs(ya))
    bound *= tol.rtol
    bound += tol.atol
    return int(np.count_nonzero(ad > bound))


def _careful_block(xa: np.ndarray, ya: np.ndarray, tol: Tolerance, acc: _Acc) -> None:
    """One block holding NaN/inf (or huge values): non-finite values matched by position.

    Differences are taken in the work dtype, as in the fast path, so a value's statistics do
    not depend on which block it fell in; only a difference that overflows the work dtype is
    redone in float64. Sums are float64.
    """
    import numpy as np  # heavy: numpy

    fin = np.isfinite(xa) & np.isfinite(ya)
    x, y = xa, ya
    if not fin.all():
        nf = ~fin
        xn, yn = xa[nf], ya[nf]
        same = (xn == yn) | (np.isnan(xn) & np.isnan(yn))
        bad = int(np.count_nonzero(~same))
        acc.mismatched += bad
        acc.matched += int(xn.shape[0]) - bad
        acc.changed += bad
        acc.outside += bad
        x, y = xa[fin], ya[fin]
    d = x - y
    if not np.isfinite(d).all():
        wide = np.complex128 if d.dtype.kind == "c" else np.float64
        x, y = x.astype(wide), y.astype(wide)
        d = x - y
    ad = np.abs(d).astype(np.float64)
    acc.n += int(x.shape[0])
    acc.ss_d += float(np.dot(ad, ad))
    acc.ss_a += _sumsq(x)
    acc.ss_b += _sumsq(y)
    if x.shape[0]:
        big = float(ad.max())
        acc.max_abs = max(acc.max_abs, big)
        acc.sum_abs += float(ad.sum())
        acc.changed += int(np.count_nonzero(ad))
        acc.outside += _count_outside(ad, x, y, big, tol)


def _sumsq(v: np.ndarray) -> float:
    """Sum of squared magnitudes, in float64 (no overflow for any float32 input)."""
    import numpy as np  # heavy: numpy

    m = np.abs(v).astype(np.float64)
    return float(np.dot(m, m))


def _exact_block(x: np.ndarray, y: np.ndarray, acc: _Acc) -> None:
    """Integers and booleans: equality decided on the stored values, statistics in float64."""
    import numpy as np  # heavy: numpy

    ne = int(np.count_nonzero(x != y))
    acc.changed += ne
    acc.outside += ne
    acc.n += int(x.shape[0])
    xf, yf = x.astype(np.float64), y.astype(np.float64)
    acc.ss_a += float(np.dot(xf, xf))
    acc.ss_b += float(np.dot(yf, yf))
    if ne:
        d = np.abs(xf - yf)
        acc.ss_d += float(np.dot(d, d))
        acc.max_abs = max(acc.max_abs, float(d.max()))
        acc.sum_abs += float(d.sum())


def _compare_raw(fa: _Flat, fb: _Flat, n: int,
                 on_block: Callable[[int], None] | None) -> DiffStats:
    """Dtypes numpy cannot decode (F4, F6): equal only if the packed bytes are."""
    import numpy as np  # heavy: numpy

    if fa.whole is None or fb.whole is None or fa.t.dtype != fb.t.dtype:
        raise ValueError("raw comparison needs the same packed dtype on both sides")
    diff = int(np.count_nonzero(fa.whole.view(np.uint8) != fb.whole.view(np.uint8)))
    if on_block is not None:
        on_block(fa.t.nbytes + fb.t.nbytes)
    return DiffStats(n, changed=diff, outside=diff, raw_only=True)
