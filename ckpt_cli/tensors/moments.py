"""Streaming statistics of tensor values: counts, moments, extremes and a histogram of |x|.

``ckpt stats`` reads a tensor once, piece by piece (row-major, any layout), and needs figures
that equal torch's ``float64`` computations on the whole tensor. Each piece is summarised by
:func:`piece_moments` into a :class:`Moments`; pieces, tensors and modules are combined with
:meth:`Moments.merge`. Accuracy, and why it is done this way:

* Every value is widened to float64 (exact for FP8/FP16/BF16/FP32).
* Within a piece, values are taken in blocks of :data:`BLOCK` elements (small enough for the
  CPU cache): each block's mean is its float64 sum over its count, and its spread ``M2`` is the
  sum of squared deviations from *that* mean (a second pass over the cached block). Summing
  deviations from the block's own mean avoids the cancellation of ``sum(x**2) - n * mean**2``
  (catastrophic for a LayerNorm weight whose values are all near 1).
* Blocks, pieces, tensors and modules are merged with Chan et al.'s pairwise update of
  ``(n, mean, M2)`` (exact up to rounding whatever the counts), so the error grows with the
  number of merges, not the number of elements: about ``1e-15`` relative for a
  billion-element tensor in 16M-element pieces. Kahan summation was not needed: each
  block's sum has ~``BLOCK`` terms, and merges are few.
* ``sumsq`` (for the L2 norm) is a sum of non-negative terms, so plain float64 accumulation is
  already accurate to ``~n_blocks * eps`` relative.
* Squares overflow float64 past ``1e154`` and underflow below ``1e-154``: a float64 piece
  whose ``|x|`` reaches past ``2**480`` (or stays below ``2**-480``) is summed again divided
  by a power of two near its largest ``|x|`` (exact), and its ``m2`` and ``sumsq`` are kept
  with that ``scale`` (as BLAS ``nrm2`` keeps its scaled sum of squares): ``[1e200, 3e200]``
  has an L2 norm, ``[1e-200]`` one above zero. Merges bring both to the larger scale.

Moments (mean, std, min, max, L2) are over the finite values; NaN, +Inf and -Inf are counted
apart. Complex values are taken as their modulus ``|z|`` (an update between two checkpoints
as ``|a - b|``). ``std`` is torch's default (Bessel-corrected, ``correction=1``). The histogram
counts the non-zero finite values per binade: bin ``i`` holds
``2**(HIST_LO+i) <= |x| < 2**(HIST_LO+i+1)``, values below ``2**HIST_LO`` in bin 0 and at or
above ``2**HIST_HI`` in the last.

A compiled kernel (``ckpt_cli/tensors/_moments.c``, ``setup.py``'s optional extension) does a
piece the same way, in one read of the values and several times faster, with the GIL released;
its blocks (2048 values) are merged through a binary counter, pairwise, so its rounding grows
with ``log2`` of their number. The numpy kernel here gives the same figures (within rounding)
where it was not built or ``CKPT_NO_COMPILED_MOMENTS`` is set.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ckpt_cli.tensors.extensions import load

if TYPE_CHECKING:
    from collections.abc import Callable


BLOCK = 1 << 16
"""Elements per block of the numpy kernel (its float64 copy stays in the L2 cache)."""
HIST_LO = -150
"""Binade of the first histogram bin (FP32's smallest subnormal is ``2**-149``)."""
HIST_HI = 128
"""Binade of the last histogram bin (FP32's largest value is below ``2**128``)."""
HIST_BINS = HIST_HI - HIST_LO + 1
TINY_BINADE = -53
"""Values below ``2**-53`` (about 1.1e-16, Adam's default ``eps`` squared) count as ``tiny``:
an ``exp_avg_sq`` that small no longer changes the step, which ``eps`` then sets alone."""


def _empty_hist() -> list[int]:
    return [0] * HIST_BINS


def _trimmed(lo: int, bins: list[int]) -> tuple[int, list[int]]:
    """``bins`` (counts from bin ``lo`` on) without zero bins at either end; ``(0, [])``
    when all are zero."""
    first = next((i for i, c in enumerate(bins) if c), None)
    if first is None:
        return 0, []
    last = len(bins)
    while not bins[last - 1]:
        last -= 1
    return lo + first, bins[first:last]


@dataclass(slots=True)
class Moments:
    """Figures of a set of values (a piece, a tensor, a module), mergeable.

    Attributes:
        numel: Values, finite or not.
        count: Finite values (the moments are over these).
        mean: Their mean.
        m2: Sum of their squared deviations from ``mean``.
        sumsq: Sum of their squares.
        min: Smallest finite value (``inf`` when there is none).
        max: Largest finite value (``-inf`` when there is none).
        zeros: Values equal to zero (either sign).
        nan: NaN values.
        posinf: +Inf values.
        neginf: -Inf values.
        hist_lo: The first bin of ``hist_bins``.
        hist_bins: Non-zero finite values per binade of ``|x|`` (see the module notes), from
            bin ``hist_lo`` to the last bin that counts any (a tensor's values span a few
            binades: a million tensors' figures hold a few bins each, not 279); :attr:`hist`
            is the full histogram.
        scale: ``m2`` and ``sumsq`` are in units of ``4**scale`` (0 but for values whose
            squares float64 cannot hold: see the module notes).
    """

    numel: int = 0
    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    sumsq: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    zeros: int = 0
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    hist_lo: int = 0
    hist_bins: list[int] = field(default_factory=list)
    scale: int = 0

    @property
    def hist(self) -> list[int]:
        """The full histogram: :data:`HIST_BINS` counts (set from one, or from a shorter list
        of the first bins)."""
        full = _empty_hist()
        full[self.hist_lo:self.hist_lo + len(self.hist_bins)] = self.hist_bins
        return full

    @hist.setter
    def hist(self, counts: list[int]) -> None:
        if len(counts) > HIST_BINS:
            raise ValueError(f"{len(counts)} histogram bins, more than {HIST_BINS}")
        self.hist_lo, self.hist_bins = _trimmed(0, list(counts))

    def merge(self, other: Moments) -> None:
        """Add ``other``'s values to these figures (Chan et al.'s pairwise update)."""
        m2, sumsq = other.m2, other.sumsq
        if not (other.scale or self.scale):
            # The common case, written out (a module of a million tiny tensors merges each):
            # what add_spread, the extremes and _add_hist below do, in the same order.
            count = other.count
            n = self.count + count
            if count:
                if self.count:
                    delta = other.mean - self.mean
                    self.m2 += m2 + delta * delta * (self.count * count / n)
                    self.mean += delta * (count / n)
                else:
                    self.m2, self.mean = m2, other.mean
            self.count = n
            self.sumsq += sumsq
            self.numel += other.numel
            if other.min < self.min:
                self.min = other.min
            if other.max > self.max:
                self.max = other.max
            self.zeros += other.zeros
            self.nan += other.nan
            self.posinf += other.posinf
            self.neginf += other.neginf
            bins = other.hist_bins
            if bins:
                mine = self.hist_bins
                if mine and other.hist_lo == self.hist_lo and len(bins) == len(mine):
                    self.hist_bins = list(map(operator.add, mine, bins))
                else:
                    self._add_hist(other.hist_lo, bins)
            return
        if other.scale != self.scale:
            if not (other.sumsq or other.m2):
                pass  # nothing of other's to scale
            elif not (self.sumsq or self.m2) or other.scale > self.scale:
                self._rescale(other.scale)
            if other.scale != self.scale:
                m2, sumsq = (math.ldexp(m2, 2 * (other.scale - self.scale)),
                             math.ldexp(sumsq, 2 * (other.scale - self.scale)))
        self.add_spread(other.count, other.mean, m2, sumsq)
        self.numel += other.numel
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        self.zeros += other.zeros
        self.nan += other.nan
        self.posinf += other.posinf
        self.neginf += other.neginf
        self._add_hist(other.hist_lo, other.hist_bins)

    def _add_hist(self, lo: int, bins: list[int]) -> None:
        if not bins:
            return
        mine = self.hist_bins
        if not mine:
            self.hist_lo, self.hist_bins = lo, list(bins)
            return
        start = min(self.hist_lo, lo)
        out = [0] * (max(self.hist_lo + len(mine), lo + len(bins)) - start)
        a = self.hist_lo - start
        out[a:a + len(mine)] = mine
        b = lo - start
        out[b:b + len(bins)] = map(operator.add, out[b:b + len(bins)], bins)
        self.hist_lo, self.hist_bins = start, out

    def add_spread(self, count: int, mean: float, m2: float, sumsq: float) -> None:
        """Add the count and moments of ``count`` more finite values (Chan et al.'s update):
        the part of :meth:`merge` the numpy kernel does per block, without extremes, counts
        of specials or histogram."""
        n = self.count + count
        if count:
            delta = mean - self.mean
            if self.count:
                d = math.ldexp(delta, -self.scale) if self.scale else delta
                self.m2 += m2 + d * d * (self.count * count / n)
                self.mean += delta * (count / n)
            else:
                self.m2, self.mean = m2, mean
        self.count = n
        self.sumsq += sumsq

    def _rescale(self, scale: int) -> None:
        """Express ``m2`` and ``sumsq`` in units of ``4**scale``."""
        shift = 2 * (self.scale - scale)
        self.m2, self.sumsq = math.ldexp(self.m2, shift), math.ldexp(self.sumsq, shift)
        self.scale = scale

    @property
    def std(self) -> float | None:
        """Standard deviation (``correction=1``, torch's default); None below 2 values."""
        if self.count < 2:
            return None
        return _scaled(math.sqrt(max(self.m2, 0.0) / (self.count - 1)), self.scale)

    @property
    def l2(self) -> float:
        """L2 norm of the finite values (``inf`` only past float64's largest value)."""
        return _scaled(math.sqrt(self.sumsq), self.scale)

    @property
    def sumsq_value(self) -> float:
        """Sum of the squares of the finite values, unscaled (``inf`` past float64's range)."""
        return _scaled(self.sumsq, 2 * self.scale)

    @property
    def absmax(self) -> float | None:
        """Largest ``|x|`` of the finite values; None when there is none."""
        return max(abs(self.min), abs(self.max)) if self.count else None

    @property
    def inf(self) -> int:
        """Infinite values, either sign."""
        return self.posinf + self.neginf

    @property
    def tiny(self) -> int:
        """Non-zero finite values below ``2**TINY_BINADE`` (see :data:`TINY_BINADE`)."""
        return sum(self.hist_bins[:max(0, TINY_BINADE - HIST_LO - self.hist_lo)])

    def to_list(self) -> list[Any]:
        """A compact JSON-able form (the cache's), read back by :meth:`from_list`."""
        out = [self.numel, self.count, _num(self.mean), _num(self.m2), _num(self.sumsq),
               _num(self.min), _num(self.max), self.zeros, self.nan, self.posinf,
               self.neginf, self.hist_lo, list(self.hist_bins)]
        return [*out, self.scale] if self.scale else out

    @classmethod
    def from_list(cls, data: Any) -> Moments:
        """The figures of :meth:`to_list`'s output.

        Raises:
            ValueError: For data that is not such a list.
        """
        if not isinstance(data, list) or len(data) not in (13, 14):
            raise ValueError("not a list of 13 or 14 figures")
        numel, count, mean, m2, sumsq, mn, mx, zeros, nan, posinf, neginf, lo, hist = data[:13]
        scale = data[13] if len(data) == 14 else 0
        if not isinstance(scale, int) or isinstance(scale, bool) or abs(scale) > 2048:
            raise ValueError("bad scale")
        ints = (numel, count, zeros, nan, posinf, neginf, lo)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            raise ValueError("counts must be whole numbers")
        if not isinstance(hist, list) or lo + len(hist) > HIST_BINS or not all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in hist):
            raise ValueError("bad histogram")
        out = cls(numel, count, _float(mean), _float(m2), _float(sumsq), _float(mn), _float(mx),
                  zeros, nan, posinf, neginf, *_trimmed(lo, hist), scale)
        if not (math.isfinite(out.m2) and math.isfinite(out.sumsq)) or (
                out.sumsq == 0 and out.hist_bins):
            # written before sums were scaled: an overflowed or underflowed sum, recomputed
            raise ValueError("sums out of float64's range")
        return out


def _scaled(v: float, k: int) -> float:
    """``v * 2**k``, ``inf`` past float64's range."""
    try:
        return math.ldexp(v, k)
    except OverflowError:
        return math.inf


def _num(v: float) -> float | str:
    """``v`` for JSON: infinities and NaN (a float64 overflow) as strings, not JSON's extension."""
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _float(v: Any) -> float:
    if isinstance(v, str) and v in ("inf", "-inf", "nan"):
        return float(v)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    raise ValueError(f"not a number: {v!r}")


# -- kernels ------------------------------------------------------------------------------

_KERNEL_DTYPES = ("float32", "float64", "float16", "bfloat16")


@functools.cache
def _compiled() -> Any:
    """The compiled module (``ckpt_cli.tensors._moments``), or None where it was not built or
    ``CKPT_NO_COMPILED_MOMENTS`` is set."""
    return load("_moments", "CKPT_NO_COMPILED_MOMENTS")


@functools.lru_cache(maxsize=64)
def _name(dtype: Any) -> str:
    """``dtype.name``, remembered: numpy computes it in Python each time, which cost more than
    the compiled kernel's work on a tensor of a few values."""
    return str(dtype.name)


def moments_kernel() -> str:
    """Which kernel :func:`piece_moments` uses: ``"compiled"`` or ``"numpy"``."""
    return "numpy" if _compiled() is None else "compiled"


def _as_kernel_input(arr: np.ndarray) -> np.ndarray:
    """``arr`` as a flat array of a dtype the kernels take (others widened exactly: FP8 and
    integers up to 2**24 to float32, larger integers to float64)."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    if _name(flat.dtype) in _KERNEL_DTYPES:
        return flat
    if flat.dtype.kind == "c":
        modulus: np.ndarray = np.abs(flat)  # hypot: no overflow; float32 or float64
        return modulus
    if flat.dtype.kind in "iub" and flat.dtype.itemsize >= 4:
        return flat.astype(np.float64)
    return flat.astype(np.float32)


def piece_moments(arr: np.ndarray) -> Moments:
    """The figures of one piece of values.

    Args:
        arr: Values of any numeric dtype (BF16/FP8 as ml_dtypes), any shape.

    Returns:
        Their :class:`Moments`.
    """
    flat = _as_kernel_input(arr)
    out = _kernel(flat)
    big = max(abs(out.min), abs(out.max)) if out.count else 0.0
    if flat.dtype.itemsize == 8 and big and not _SAFE_LO <= big <= _SAFE_HI:
        # Squares past float64's range: sum again divided by 2**k (exact), keep k.
        k = math.frexp(big)[1]
        again = _kernel(np.ldexp(flat, -k))
        out.mean, out.m2, out.sumsq = math.ldexp(again.mean, k), again.m2, again.sumsq
        out.scale = k
    return out


def run_moments(buf: np.ndarray, dtype: np.dtype[Any], spans: np.ndarray) -> list[Moments]:
    """The figures of many pieces of one buffer: :func:`piece_moments` of each, in one call of
    the compiled kernel (a run of a million tiny tensors read at once: the kernel's work on each
    is a few values, and a call per piece cost more than it).

    Args:
        buf: The bytes (a C-contiguous uint8 array).
        dtype: The values' dtype, one the kernels take (float32/64/16, bfloat16).
        spans: int64 ``(byte offset, count)`` pairs, shape ``(n, 2)``: each piece is ``count``
            values from that offset of ``buf`` (a multiple of the dtype's size).

    Returns:
        The pieces' :class:`Moments`, in order.

    Raises:
        ValueError: For a dtype the kernels do not take, or a piece outside ``buf``.
    """
    name = _name(dtype)
    if name not in _KERNEL_DTYPES:
        raise ValueError(f"{name} is not a kernel dtype")
    compiled = _compiled()
    size = dtype.itemsize
    if compiled is not None and spans.size:
        out: list[Moments] = compiled.pieces(buf, name, spans, Moments)
    else:
        out = []
        for off, n in spans.tolist():
            if off < 0 or n < 0 or off % size or off + n * size > buf.size:
                raise ValueError(f"span ({off}, {n}) is not whole aligned {name} items")
            out.append(_kernel(buf[off:off + n * size].view(dtype)))
    if size == 8:  # squares past float64's range: as piece_moments does them
        for k, m in enumerate(out):
            big = max(abs(m.min), abs(m.max)) if m.count else 0.0
            if big and not _SAFE_LO <= big <= _SAFE_HI:
                off, n = (int(v) for v in spans[k])
                out[k] = piece_moments(buf[off:off + n * size].view(dtype))
    return out


_SAFE_LO, _SAFE_HI = 2.0 ** -480, 2.0 ** 480
"""Largest ``|x|`` of a piece within which squares and their sums stay in float64's range."""


def _kernel(flat: np.ndarray) -> Moments:
    compiled = _compiled()
    if compiled is not None:
        hist = _hist_array()
        count, mean, m2, sumsq, lo, hi, zeros, nan, posinf, neginf = compiled.piece(
            _buffer(flat), _name(flat.dtype), hist)
        out = Moments(flat.size, count, mean, m2, sumsq, lo, hi, zeros, nan, posinf, neginf)
        _set_hist(out, hist)
        return out
    return numpy_piece_moments(flat)


def _buffer(flat: np.ndarray) -> np.ndarray:
    """``flat`` as the compiled kernel reads it: 16-bit floats as their bits (numpy exports no
    buffer of an ml_dtypes bfloat16 array)."""
    return flat.view(np.uint16) if flat.dtype.itemsize == 2 else flat


def _hist_array() -> np.ndarray:
    return np.zeros(HIST_BINS, dtype=np.int64)


def numpy_piece_moments(arr: np.ndarray) -> Moments:
    """:func:`piece_moments` with numpy alone (the kernel where the compiled one is missing).

    Args:
        arr: Flat values of one of the kernel dtypes (float32/64/16, bfloat16).

    Returns:
        Their :class:`Moments`.
    """
    out = Moments(numel=arr.size)
    if arr.size == 0:
        return out
    x = arr if arr.dtype.itemsize >= 4 else arr.astype(np.float32)
    with np.errstate(all="ignore"):
        if not math.isfinite(float(np.add.reduce(x, dtype=np.float64))):
            out.nan = int(np.isnan(x).sum())
            out.posinf = int(np.isposinf(x).sum())
            out.neginf = int(np.isneginf(x).sum())
            x = x[np.isfinite(x)]
            if x.size == 0:
                return out
    out.min, out.max = float(x.min()), float(x.max())
    out.zeros = x.size - int(np.count_nonzero(x))
    hist = _hist_array()
    buf = np.empty(min(BLOCK, x.size), dtype=np.float64)
    with np.errstate(all="ignore"):  # float64 overflow (values past 1e154) gives inf, silently
        for i in range(0, x.size, BLOCK):
            blk = x[i:i + BLOCK]
            d = buf[:blk.size]
            np.copyto(d, blk)
            mean = float(np.add.reduce(d)) / blk.size
            # einsum, not np.dot: BLAS's threads, woken for every block, made this kernel
            # 5-15x slower on a busy machine (and oversubscribe the stats threads).
            sumsq = float(np.einsum("i,i->", d, d))
            d -= mean
            out.add_spread(blk.size, mean, float(np.einsum("i,i->", d, d)), sumsq)
            _binades(blk, hist)
    _set_hist(out, hist)
    return out


def _set_hist(out: Moments, hist: np.ndarray) -> None:
    """A kernel's full histogram into ``out``'s compact one."""
    used = hist.nonzero()[0]  # np.flatnonzero's work, without its Python around it
    if used.size:
        lo, hi = int(used[0]), int(used[-1]) + 1
        out.hist_lo, out.hist_bins = lo, hist[lo:hi].tolist()


def _binades(x: np.ndarray, hist: np.ndarray) -> None:
    """Add the binades of ``|x|`` (finite float32 or float64 values) to ``hist``."""
    if x.dtype == np.float32:
        field_ = (x.view(np.uint32) >> 23) & 0xFF
        bias, width = 127, 256
    else:
        field_ = ((x.view(np.uint64) >> 52) & 0x7FF).astype(np.uint32)
        bias, width = 1023, 2048
    counts = np.bincount(field_, minlength=width)
    below = int(counts[0]) - (x.size - int(np.count_nonzero(x)))  # subnormals
    counts[0] = 0
    # Exponent field f holds binade f - bias; clamp into [HIST_LO, HIST_HI].
    binade = np.arange(width) - bias
    idx = np.clip(binade - HIST_LO, 0, HIST_BINS - 1)
    np.add.at(hist, idx, counts)
    if below:
        sub = x[(field_ == 0) & (x != 0)]
        _, e = np.frexp(np.abs(sub).astype(np.float64))
        np.add.at(hist, np.clip(e.astype(np.int64) - 1 - HIST_LO, 0, HIST_BINS - 1), 1)


def diff_sumsq(a: np.ndarray, b: np.ndarray) -> float:
    """``sum((a - b) ** 2)`` in float64 over two equally long sets of values (the squared L2
    norm of an update between two checkpoints).

    Args:
        a: Values (any numeric dtype, flat or not).
        b: As many values, in the same order.

    Returns:
        The sum; NaN when a value on either side is not finite.

    Raises:
        ValueError: When the sizes differ.
    """
    if np.iscomplexobj(a) or np.iscomplexobj(b):  # |a - b|, not |a| - |b|
        ca, cb = (np.asarray(v, dtype=np.complex128).reshape(-1) for v in (a, b))
        if ca.size != cb.size:
            raise ValueError(f"{ca.size:,} values against {cb.size:,}")
        with np.errstate(all="ignore"):
            total = float(np.sum(np.square(np.abs(ca - cb))))
        return total if math.isfinite(total) else math.nan
    fa, fb = _as_kernel_input(a), _as_kernel_input(b)
    if fa.size != fb.size:
        raise ValueError(f"{fa.size:,} values against {fb.size:,}")
    compiled = _compiled()
    if compiled is not None and fa.dtype == fb.dtype:
        return float(compiled.diff_sumsq(_buffer(fa), _buffer(fb), _name(fa.dtype)))
    total = 0.0
    buf = np.empty(min(BLOCK, fa.size), dtype=np.float64)
    with np.errstate(all="ignore"):
        for i in range(0, fa.size, BLOCK):
            d = buf[:min(BLOCK, fa.size - i)]
            np.copyto(d, fa[i:i + BLOCK])
            d -= fb[i:i + BLOCK]
            total += float(np.einsum("i,i->", d, d))
    return total if math.isfinite(total) else math.nan


def tensor_moments(pieces: Callable[[], Any]) -> Moments:
    """The figures of a tensor given as an iterable of pieces (a convenience for tests and
    small callers; ``ckpt stats`` merges pieces as it reads them).

    Args:
        pieces: Returns an iterable of arrays, together the tensor's values.

    Returns:
        Their :class:`Moments`.
    """
    total = Moments()
    for p in pieces():
        total.merge(piece_moments(p))
    return total
