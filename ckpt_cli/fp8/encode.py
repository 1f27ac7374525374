"""FP8 (E4M3) weight quantization for deployment.

Layouts (what inference engines load from an HF directory):

* ``block``: DeepSeek-V3 / transformers ``"fp8"`` method. ``weight`` is ``float8_e4m3fn``;
  ``weight_scale_inv`` is FP32 ``[ceil(out/128), ceil(in/128)]``, one value per 128x128 block
  (a partial block at the edge has its own scale, which is how the engines pad); despite its
  name it is the *multiplier* that dequantizes: ``w = q * weight_scale_inv``.
* ``channel`` / ``tensor``: compressed-tensors ``float-quantized``. ``weight`` FP8,
  ``weight_scale`` FP32 ``[out, 1]`` (channel) or ``[1]`` (tensor); ``w = q * weight_scale``.

Scales are ``amax / 448`` (448: E4M3's largest finite value) over the block, row or tensor,
never below FP32's smallest normal value 2**-126 (an all-zero or subnormal group); values are
divided by their scale, clamped to ±448 (saturating) and rounded to nearest even: bit for bit
torch's ``.to(float8_e4m3fn)``, computed with numpy integer passes over row blocks on the cast
threads, streamed piece by piece (:func:`quantize_pieces`, :class:`Quantized`). Dequantizing,
in :mod:`ckpt_cli.fp8.decode`, streams the same way; which tensors are quantized, and the
scales' names and shapes, are :mod:`ckpt_cli.fp8.scheme`'s and :mod:`ckpt_cli.fp8.groups`'
rules.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator

import numpy as np

from ckpt_cli.errors import CkptError
from ckpt_cli.fp8.rows import JOB, SCRATCH, row_groups, rows_per_pass, run_jobs
from ckpt_cli.fp8.scheme import BLOCK, FP8_MAX, scale_shape
from ckpt_cli.tensors import cast

# FP32 bit patterns and constants of the E4M3 encoder (see :func:`_encode`).
_ABS = 0x7FFFFFFF
_F32_MIN_NORMAL_E4M3 = 0x3C800000  # 2**-6, E4M3's smallest normal value
_REBIAS = (0x7FFFF - (120 << 23)) & 0xFFFFFFFF  # half an E4M3 ulp less one, exponent 127 -> 7
_F32_2_14 = 0x46800000  # 16384.0: its FP32 ulp is 2**-9, E4M3's subnormal step
_TINY = 2.0 ** -126  # FP32's smallest normal value


def _encode(q: np.ndarray, out: np.ndarray, careful: bool) -> None:
    """E4M3 codes of scaled FP32 values, rounded to nearest even, saturating at ±448: bit for
    bit torch's ``q.clamp(-448, 448).to(torch.float8_e4m3fn)``.

    Integer passes over the FP32 bits (numpy has no FP8 kernel; ml_dtypes' cast runs ~0.2 G
    elements/s per core here): for normal results, add half an E4M3 ulp less one plus the
    kept mantissa's lowest bit (ties to even), rebias the exponent and shift; a value below
    2**-6 is rounded by adding 16384.0 in FP32 (whose ulp is E4M3's subnormal step, so the
    FPU rounds to nearest even); the sign bit goes on last.

    Args:
        q: 1-D FP32 values divided by their scale (overwritten when ``careful``).
        out: 1-D uint8 of the same size: the codes.
        careful: Values may lie beyond ±464 or be NaN (a scale below FP32's normal range, from
            an amax under about 5e-36). Otherwise every value is within ±448 by a few ulps
            (``|x| <= amax`` and ``scale = amax / 448`` rounded once), which rounds to ±448
            without clamping.
    """
    u32 = np.uint32
    if careful:
        np.clip(q, np.float32(-FP8_MAX), np.float32(FP8_MAX), out=q)
    _, a, h, flags = SCRATCH.get(q.size)
    u = q.view(u32)
    np.bitwise_and(u, u32(_ABS), out=a)
    np.right_shift(a, u32(20), out=h)
    h &= u32(1)
    h += a
    h += u32(_REBIAS)
    if a.size and int(a.min()) < _F32_MIN_NORMAL_E4M3:
        small = np.flatnonzero(np.less(a, u32(_F32_MIN_NORMAL_E4M3), out=flags))
        f = a[small].view(np.float32) + np.float32(16384.0)
        h[small] = (f.view(u32) - u32(_F32_2_14)) << u32(20)
    h >>= u32(20)
    np.copyto(out, h, casting="unsafe")
    sign = np.signbit(q, out=flags).view(np.uint8)
    sign *= np.uint8(0x80)
    out |= sign
    if careful:
        nan = np.isnan(q)
        if nan.any():  # torch: 0x7F with the NaN's sign (0/0 gives x86's negative NaN)
            out[nan] = np.where(np.signbit(q[nan]), np.uint8(0xFF), np.uint8(0x7F))


def _non_finite() -> CkptError:
    return CkptError("non-finite values cannot be quantized to FP8")


def _scales(amax_bits: np.ndarray) -> np.ndarray:
    """``amax / 448`` in FP32, at least FP32's smallest normal value (2**-126), from the
    amax's FP32 bits.

    The floor: an all-zero group, or one whose largest magnitude is below about 5.3e-36
    (``448 * 2**-126``), would otherwise get a zero or subnormal scale, which loaders and
    ``ckpt validate`` refuse (a zero scale dequantizes everything to 0 and cannot be
    inverted). With the floor every code stays within ±448 and the group dequantizes to
    its values rounded to E4M3 steps of 2**-126 (to 0 for the tiny or zero values).
    """
    if amax_bits.size and int(amax_bits.max()) >= 0x7F800000:
        raise _non_finite()
    amax = amax_bits.view(np.float32)
    s = amax / np.float32(FP8_MAX)
    np.maximum(s, np.float32(_TINY), out=s)
    return s


def _careful(s: np.ndarray) -> bool:
    return bool(s.size) and bool(float(np.min(s)) < _TINY)


def _divide_encode(x: np.ndarray, s: np.ndarray, out: np.ndarray, careful: bool) -> None:
    """Encode rows ``x`` (2-D FP32) divided by ``s`` (broadcast to ``x``) into ``out``
    (uint8, ``x``'s shape), a few rows per pass."""
    rows, cols = x.shape
    step = rows_per_pass(rows, cols)
    buf = SCRATCH.get(min(rows, step) * cols)[0]
    per_row = s.ndim == 2 and s.shape[0] == rows and rows > 1
    # careful: a scale of 0 (an amax below ~3e-43) divides to inf and NaN, as torch's did
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for i in range(0, rows, step):
            n = min(step, rows - i)
            q = buf[: n * cols].reshape(n, cols)
            np.divide(x[i:i + n], s[i:i + n] if per_row else s, out=q)
            _encode(q.reshape(-1), out[i:i + n].reshape(-1), careful)


def _abs_max_bits(x: np.ndarray, axis: int | None) -> np.ndarray:
    """The largest ``|x|`` as FP32 bits (uint32), over ``axis`` of 2-D FP32 ``x`` (None: all),
    a few rows per pass. A NaN's bits exceed every finite value's (and inf's)."""
    u32 = np.uint32
    rows, cols = x.shape
    step = rows_per_pass(rows, cols)
    parts = []
    acc: np.ndarray | None = None
    scratch = SCRATCH.get(min(rows, step) * cols)[1]
    for i in range(0, rows, step):
        xs = x[i:i + step]
        a = np.bitwise_and(xs.view(u32), u32(_ABS), out=scratch[:xs.size].reshape(xs.shape))
        if axis == 1:
            parts.append(a.max(axis=1))
            continue
        m = a.max(axis=0) if axis == 0 else np.asarray(a.max()).reshape(1)
        acc = m if acc is None else np.maximum(acc, m, out=acc)
    if axis == 1:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=u32)
    return acc if acc is not None else np.zeros(cols if axis == 0 else 1, dtype=u32)


def _block_row(x: np.ndarray, out: np.ndarray, scale_row: np.ndarray) -> None:
    """One row of 128x128 blocks (``x``: up to 128 rows of FP32): scales into ``scale_row``,
    codes into ``out``."""
    cols = x.shape[1]
    nb = scale_row.size
    colmax = np.zeros(nb * BLOCK, dtype=np.uint32)
    colmax[:cols] = _abs_max_bits(x, 0)
    s = _scales(colmax.reshape(nb, BLOCK).max(axis=1))
    scale_row[...] = s
    _divide_encode(x, np.repeat(s, BLOCK)[:cols], out, _careful(s))


def _channel_rows(x: np.ndarray, out: np.ndarray, scale_rows: np.ndarray) -> None:
    """Rows quantized per row (channel layout): scales into ``scale_rows`` (``[n, 1]``)."""
    s = _scales(_abs_max_bits(x, 1)).reshape(-1, 1)
    scale_rows[...] = s
    _divide_encode(x, s, out, _careful(s))


def _amax_into(chunk: np.ndarray, found: np.ndarray) -> None:
    found[...] = _abs_max_bits(chunk.reshape(1, -1), None)


def _tensor_amax(pieces: Iterator[np.ndarray]) -> np.ndarray:
    """The per-tensor layout's first pass: the largest ``|x|`` over all pieces, as bits."""
    best = np.zeros(1, dtype=np.uint32)
    for p in pieces:
        flat = np.asarray(p).reshape(-1)
        if flat.dtype != np.float32:
            flat = flat.astype(np.float32)
        if not flat.size:
            continue
        n = max(JOB, -(-flat.size // max(1, 2 * cast.cast_threads())))
        found = [np.zeros(1, dtype=np.uint32) for _ in range(0, flat.size, n)]
        run_jobs([functools.partial(_amax_into, flat[i:i + n], found[k])
                  for k, i in enumerate(range(0, flat.size, n))], flat.nbytes)
        for m in found:
            np.maximum(best, m, out=best)
    return best


def quantize_pieces(pieces: Callable[[], Iterator[np.ndarray]], shape: tuple[int, ...],
                    layout: str, scale_out: np.ndarray) -> Iterator[np.ndarray]:
    """Quantize a 2-D tensor streamed as flat pieces (row-major), piece by piece.

    Memory holds the source piece, its FP8 codes (a quarter of it) and one row of 128x128
    blocks (or one row, with the channel/tensor layouts) copied when it straddles two pieces;
    never the whole tensor. Rows are spread over the cast threads (``CKPT_THREADS``).

    Args:
        pieces: Returns an iterator over the values as flat arrays (FP32, or any float dtype,
            widened to FP32 first); called twice with the per-tensor layout (its scale needs
            the amax over the whole tensor before the first value is encoded).
        shape: ``(rows, cols)``.
        layout: ``block``, ``channel`` or ``tensor``.
        scale_out: The FP32 scale array (:func:`scale_shape`), filled as rows are done; it is
            complete once the iterator is exhausted.

    Yields:
        Flat ``float8_e4m3fn`` arrays, together the tensor's codes in row-major order.

    Raises:
        CkptError: A NaN or an infinity in the values (nothing sensible to scale).
    """
    import ml_dtypes  # heavy: ml_dtypes

    rows, cols = shape
    tensor_scale: np.ndarray | None = None
    if layout == "tensor":
        tensor_scale = _scales(_tensor_amax(pieces()))
        scale_out[...] = tensor_scale.reshape(scale_out.shape)
    # Rows go in groups of whole block rows (of one row, per channel or tensor); a job is a
    # block row, or about JOB elements of rows.
    unit = BLOCK if layout == "block" else 1
    per_job = BLOCK if layout == "block" else max(1, JOB // max(1, cols))
    for r0, x in row_groups(pieces(), rows, cols, unit):
        out = np.empty(x.shape, dtype=np.uint8)
        jobs: list[Callable[[], None]] = []
        for i in range(0, x.shape[0], per_job):
            xs, os = x[i:i + per_job], out[i:i + per_job]
            if layout == "block":
                b = (r0 + i) // BLOCK
                jobs.append(functools.partial(_block_row, xs, os, scale_out[b]))
            elif layout == "channel":
                jobs.append(functools.partial(_channel_rows, xs, os,
                                              scale_out[r0 + i:r0 + i + xs.shape[0]]))
            else:
                assert tensor_scale is not None
                jobs.append(functools.partial(_divide_encode, xs, tensor_scale, os,
                                              _careful(tensor_scale)))
        run_jobs(jobs, x.nbytes)
        yield out.reshape(-1).view(ml_dtypes.float8_e4m3fn)
        del out, x


def scales_only(pieces: Iterator[np.ndarray], shape: tuple[int, ...],
                layout: str) -> np.ndarray:
    """The scales :func:`quantize_pieces` gives, without encoding (one pass of amax)."""
    rows, cols = shape
    scale = np.empty(scale_shape(shape, layout), dtype=np.float32)
    if layout == "tensor":
        scale[...] = _scales(_tensor_amax(pieces)).reshape(scale.shape)
        return scale
    unit = BLOCK if layout == "block" else 1
    per_job = BLOCK if layout == "block" else max(1, JOB // max(1, cols))
    for r0, x in row_groups(pieces, rows, cols, unit):
        for i in range(0, x.shape[0], per_job):
            xs = x[i:i + per_job]
            if layout == "block":
                nb = scale.shape[1]
                colmax = np.zeros(nb * BLOCK, dtype=np.uint32)
                colmax[:cols] = _abs_max_bits(xs, 0)
                scale[(r0 + i) // BLOCK] = _scales(colmax.reshape(nb, BLOCK).max(axis=1))
            else:
                scale[r0 + i:r0 + i + xs.shape[0]] = _scales(_abs_max_bits(xs, 1)).reshape(-1, 1)
    return scale


def quantize(arr: np.ndarray, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a 2-D array to E4M3 in ``layout``.

    Scales are ``amax / 448`` over each 128x128 block (a partial block at the edge has its
    own), row or the whole tensor, at least 2**-126 (an all-zero or subnormal group); values
    are divided by their scale, clamped to ±448 and rounded to nearest even: bit for bit
    what torch gives for ``(w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``, computed
    with numpy in row blocks on the cast threads (see :func:`quantize_pieces`).

    Returns:
        ``(weight, scale)``: the FP8 values (numpy ``float8_e4m3fn``) and the FP32 scales.

    Raises:
        CkptError: NaN or infinite values.
    """
    import ml_dtypes  # heavy: ml_dtypes

    if arr.ndim != 2:
        raise CkptError(f"only 2-D weights are quantized, not shape {list(arr.shape)}")
    shape = (int(arr.shape[0]), int(arr.shape[1]))
    scale = np.empty(scale_shape(shape, layout), dtype=np.float32)
    flat = np.ascontiguousarray(arr).reshape(-1)
    out = np.empty(flat.size, dtype=np.uint8)
    if flat.size:
        pos = 0
        for piece in quantize_pieces(lambda: iter((flat,)), shape, layout, scale):
            out[pos:pos + piece.size] = piece.view(np.uint8)
            pos += piece.size
    else:
        scale[...] = np.float32(_TINY)
    return out.view(ml_dtypes.float8_e4m3fn).reshape(shape), scale



class Quantized:
    """Quantizes one tensor for its two outputs, the FP8 weight and its scale.

    The weight streams (:meth:`weight_pieces`): the source is read piece by piece and each
    piece's codes handed on, so memory holds a piece, not the tensor (nor the 3x its FP32
    size that quantizing it whole took). The scale is filled in as the weight is encoded and
    handed out once the weight is complete; asked for first (a shard of its own written by
    another ``--part``), or again, it is computed by one amax pass over the source.

    Args:
        load: Returns the whole source tensor (used when ``pieces`` is None).
        layout: ``block``, ``channel`` or ``tensor``.
        name: The tensor's name, for errors.
        pieces: Returns an iterator over the source values as flat arrays, row-major.
        shape: The source's shape (needed with ``pieces``).
    """

    def __init__(self, load: Callable[[], np.ndarray], layout: str, name: str, *,
                 pieces: Callable[[], Iterator[np.ndarray]] | None = None,
                 shape: tuple[int, ...] | None = None) -> None:
        self._load, self._layout, self._name = load, layout, name
        self._pieces = pieces if shape is not None else None
        self._shape = shape
        self._lock = threading.Lock()
        self._scale: np.ndarray | None = None  # complete, not yet taken

    def _source(self) -> Iterator[np.ndarray]:
        if self._pieces is not None:
            return self._pieces()
        return iter((self._load(),))

    def _shape_of(self) -> tuple[int, int]:
        if self._shape is None:
            arr = self._load()
            self._shape = tuple(int(d) for d in arr.shape)
        if len(self._shape) != 2:
            raise CkptError(f"{self._name}: only 2-D weights are quantized")
        return int(self._shape[0]), int(self._shape[1])

    def weight_pieces(self) -> Iterator[np.ndarray]:
        """The FP8 weight, as flat ``float8_e4m3fn`` pieces in row-major order."""
        shape = self._shape_of()
        scale = np.empty(scale_shape(shape, self._layout), dtype=np.float32)
        try:
            yield from quantize_pieces(self._source, shape, self._layout, scale)
        except CkptError as e:
            raise CkptError(f"{self._name}: {e}") from None
        with self._lock:
            self._scale = scale

    def weight(self) -> np.ndarray:
        """The FP8 weight, whole."""
        shape = self._shape_of()
        parts = list(self.weight_pieces())
        out = np.concatenate(parts) if len(parts) != 1 else parts[0]
        return out.reshape(shape)

    def scale(self) -> np.ndarray:
        """The FP32 scale."""
        with self._lock:
            got, self._scale = self._scale, None
        if got is not None:
            return got
        try:
            return scales_only(self._source(), self._shape_of(), self._layout)
        except CkptError as e:
            raise CkptError(f"{self._name}: {e}") from None


