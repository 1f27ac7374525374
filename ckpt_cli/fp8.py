"""FP8 (E4M3) weight quantization for deployment, and its inverse.

Layouts (what inference engines load from an HF directory):

* ``block``: DeepSeek-V3 / transformers ``"fp8"`` method. ``weight`` is ``float8_e4m3fn``;
  ``weight_scale_inv`` is FP32 ``[ceil(out/128), ceil(in/128)]``, one value per 128x128 block
  (a partial block at the edge has its own scale, which is how the engines pad); despite its
  name it is the *multiplier* that dequantizes: ``w = q * weight_scale_inv``.
* ``channel`` / ``tensor``: compressed-tensors ``float-quantized``. ``weight`` FP8,
  ``weight_scale`` FP32 ``[out, 1]`` (channel) or ``[1]`` (tensor); ``w = q * weight_scale``.

Scales are ``amax / 448`` (448: E4M3's largest finite value) over the block, row or tensor
(an all-zero group gets scale 1.0); values are divided by their scale, clamped to ±448
(saturating) and rounded to nearest even: bit for bit torch's ``.to(float8_e4m3fn)``, computed
with numpy integer passes over row blocks on the cast threads, streamed piece by piece
(:func:`quantize_pieces`, :class:`Quantized`). Dequantizing streams the same way
(:func:`dequantize_pieces`).

Which tensors qualify (:func:`qualifies`) is decided by name and shape, and explainable: a
2-D floating ``*.weight`` whose module name does not match :data:`SKIP_PATTERNS`
(embeddings, norms, ``lm_head``, MoE routers/gates) and whose dims suit the layout
(:func:`layout_fits`). Linear weights that do not fit are left in the ``--rest`` dtype and
listed in the config's ignore list.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ckpt_cli.errors import CkptError

if TYPE_CHECKING:
    import numpy as np

FP8_MAX = 448.0
BLOCK = 128
LAYOUTS = ("block", "channel", "tensor")
CHANNEL_MULTIPLE = 16
"""channel/tensor layouts: both dims must be multiples of 16 (the FP8 GEMM kernels' rule)."""

SKIP_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"(^|\.)(embed_tokens|embeddings?|wte|wpe|word_embeddings|tok_embeddings)(\.|$)",
     "embedding"),
    (r"(^|\.)(lm_head|output|embed_out)$", "output head (lm_head)"),
    (r"norm|(^|\.)ln_", "norm"),
    (r"(^|\.)(router|gate)$", "MoE router"),
)
"""``(regex on the module name, reason)``: modules never quantized."""

SCALE_NAMES = ("weight_scale_inv", "weight_scale", "scale_weight")


def skip_reason(module: str) -> str | None:
    """Why module ``module`` is never quantized (None: it may be)."""
    for pattern, reason in SKIP_PATTERNS:
        if re.search(pattern, module):
            return reason
    return None


def layout_fits(shape: tuple[int, ...], layout: str) -> bool:
    """Whether a 2-D weight of ``shape`` can be stored in ``layout``."""
    if len(shape) != 2:
        return False
    if layout == "block":
        return all(d % BLOCK == 0 and d > 0 for d in shape)
    return all(d % CHANNEL_MULTIPLE == 0 and d > 0 for d in shape)


def qualifies(name: str, dtype: str, shape: tuple[int, ...],
              layout: str) -> tuple[bool, str | None]:
    """Whether tensor ``name`` is quantized, and if not while being a Linear-like weight,
    why (for the ignore list and the notes).

    Returns:
        ``(True, None)``: quantize. ``(False, reason)``: a 2-D ``*.weight`` left unquantized
        (its module goes in the ignore list). ``(False, None)``: not a candidate at all.
    """
    if dtype not in ("F64", "F32", "F16", "BF16") or not name.endswith(".weight"):
        return False, None
    if len(shape) != 2:
        return False, None
    module = name[: -len(".weight")]
    reason = skip_reason(module)
    if reason is not None:
        return False, reason
    if not layout_fits(shape, layout):
        rule = f"a dim not a multiple of {BLOCK if layout == 'block' else CHANNEL_MULTIPLE}"
        return False, f"shape {list(shape)}: {rule}"
    return True, None


def scale_name(layout: str) -> str:
    """The scale tensor's last name part in ``layout``."""
    return "weight_scale_inv" if layout == "block" else "weight_scale"


def scale_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The scale's shape for a weight of ``shape`` in ``layout``."""
    if layout == "block":
        return (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))
    if layout == "channel":
        return (shape[0], 1)
    return (1,)


# FP32 bit patterns and constants of the E4M3 encoder (see :func:`_encode`).
_ABS = 0x7FFFFFFF
_F32_MIN_NORMAL_E4M3 = 0x3C800000  # 2**-6, E4M3's smallest normal value
_REBIAS = (0x7FFFF - (120 << 23)) & 0xFFFFFFFF  # half an E4M3 ulp less one, exponent 127 -> 7
_F32_2_14 = 0x46800000  # 16384.0: its FP32 ulp is 2**-9, E4M3's subnormal step
_TINY = 2.0 ** -126  # FP32's smallest normal value
_SUB = 1 << 16
"""Elements per pass of the encoder: its few temporaries stay in the L2 cache (measured on
the 2-core VM: 64K elements per pass ran ~0.3-0.4 G elements/s per core, 1M 0.07)."""
_JOB = 1 << 20
"""Elements per pool task for the channel and tensor layouts (the block layout's task is one
row of 128x128 blocks)."""


class _Scratch(threading.local):
    """Each thread's buffers for :func:`_encode` (reused: no allocation per pass)."""

    def __init__(self) -> None:
        self.size = 0

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """FP32 values, two uint32 and one bool buffer of at least ``n`` elements."""
        import numpy as np

        if n > self.size:
            self.size = max(n, _SUB)
            self.q = np.empty(self.size, dtype=np.float32)
            self.a = np.empty(self.size, dtype=np.uint32)
            self.h = np.empty(self.size, dtype=np.uint32)
            self.b = np.empty(self.size, dtype=np.bool_)
        return self.q[:n], self.a[:n], self.h[:n], self.b[:n]


_SCRATCH = _Scratch()


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
    import numpy as np

    u32 = np.uint32
    if careful:
        np.clip(q, np.float32(-FP8_MAX), np.float32(FP8_MAX), out=q)
    _, a, h, flags = _SCRATCH.get(q.size)
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
    """``amax / 448`` in FP32 (1.0 where the amax is 0), from the amax's FP32 bits."""
    import numpy as np

    if amax_bits.size and int(amax_bits.max()) >= 0x7F800000:
        raise _non_finite()
    amax = amax_bits.view(np.float32)
    s = amax / np.float32(FP8_MAX)
    s[amax_bits == 0] = np.float32(1.0)
    return s


def _careful(s: np.ndarray) -> bool:
    import numpy as np

    return bool(s.size) and bool(float(np.min(s)) < _TINY)


def _rows_per_pass(rows: int, cols: int) -> int:
    """Rows per pass of about :data:`_SUB` elements, evened out (128 rows of 1536 in passes
    of 43, 43 and 42, not 42, 42, 42 and 2: each pass costs the same Python overhead)."""
    passes = max(1, -(-rows * cols // _SUB))
    return max(1, -(-rows // passes))


def _divide_encode(x: np.ndarray, s: np.ndarray, out: np.ndarray, careful: bool) -> None:
    """Encode rows ``x`` (2-D FP32) divided by ``s`` (broadcast to ``x``) into ``out``
    (uint8, ``x``'s shape), a few rows per pass."""
    import numpy as np

    rows, cols = x.shape
    step = _rows_per_pass(rows, cols)
    buf = _SCRATCH.get(min(rows, step) * cols)[0]
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
    import numpy as np

    u32 = np.uint32
    rows, cols = x.shape
    step = _rows_per_pass(rows, cols)
    parts = []
    acc: np.ndarray | None = None
    scratch = _SCRATCH.get(min(rows, step) * cols)[1]
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
    import numpy as np

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


def _row_groups(pieces: Iterator[np.ndarray], rows: int, cols: int,
                unit: int, widen: bool = True) -> Iterator[tuple[int, np.ndarray]]:
    """Regroup a tensor's flat pieces (row-major, any sizes) into 2-D FP32 arrays (with
    ``widen``; else in the pieces' dtype) of whole ``unit``-row groups (the last one may be
    short): as many as each piece holds, as views of it; a group split between pieces is
    copied together.

    Yields:
        ``(first row, rows x cols array)``.
    """
    import numpy as np

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


def _run(jobs: list[Callable[[], None]], nbytes: int, stage: str = "quantize") -> None:
    """Run ``jobs`` on the cast threads (inline when one thread or one job), their time
    counted as ``stage`` (see :mod:`ckpt_cli.storage.stages`)."""
    from ckpt_cli.storage import stages
    from ckpt_cli.tensors.cast import cast_pool, cast_threads

    each = nbytes // max(1, len(jobs))

    def job(f: Callable[[], None]) -> None:
        with stages.stage(stage, each):
            f()

    if len(jobs) == 1 or cast_threads() <= 1:
        for f in jobs:
            job(f)
        return
    for _ in cast_pool().map(job, jobs):
        pass


def _amax_into(chunk: np.ndarray, found: np.ndarray) -> None:
    found[...] = _abs_max_bits(chunk.reshape(1, -1), None)


def _tensor_amax(pieces: Iterator[np.ndarray]) -> np.ndarray:
    """The per-tensor layout's first pass: the largest ``|x|`` over all pieces, as bits."""
    import numpy as np

    from ckpt_cli.tensors.cast import cast_threads

    best = np.zeros(1, dtype=np.uint32)
    for p in pieces:
        flat = np.asarray(p).reshape(-1)
        if flat.dtype != np.float32:
            flat = flat.astype(np.float32)
        if not flat.size:
            continue
        n = max(_JOB, -(-flat.size // max(1, 2 * cast_threads())))
        found = [np.zeros(1, dtype=np.uint32) for _ in range(0, flat.size, n)]
        _run([functools.partial(_amax_into, flat[i:i + n], found[k])
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
    import ml_dtypes
    import numpy as np

    rows, cols = shape
    tensor_scale: np.ndarray | None = None
    if layout == "tensor":
        tensor_scale = _scales(_tensor_amax(pieces()))
        scale_out[...] = tensor_scale.reshape(scale_out.shape)
    # Rows go in groups of whole block rows (of one row, per channel or tensor); a job is a
    # block row, or about _JOB elements of rows.
    unit = BLOCK if layout == "block" else 1
    per_job = BLOCK if layout == "block" else max(1, _JOB // max(1, cols))
    for r0, x in _row_groups(pieces(), rows, cols, unit):
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
        _run(jobs, x.nbytes)
        yield out.reshape(-1).view(ml_dtypes.float8_e4m3fn)
        del out, x


def scales_only(pieces: Iterator[np.ndarray], shape: tuple[int, ...],
                layout: str) -> np.ndarray:
    """The scales :func:`quantize_pieces` gives, without encoding (one pass of amax)."""
    import numpy as np

    rows, cols = shape
    scale = np.empty(scale_shape(shape, layout), dtype=np.float32)
    if layout == "tensor":
        scale[...] = _scales(_tensor_amax(pieces)).reshape(scale.shape)
        return scale
    unit = BLOCK if layout == "block" else 1
    per_job = BLOCK if layout == "block" else max(1, _JOB // max(1, cols))
    for r0, x in _row_groups(pieces, rows, cols, unit):
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
    own), row or the whole tensor, 1.0 where the amax is 0; values are divided by their scale,
    clamped to ±448 and rounded to nearest even: bit for bit what torch gives for
    ``(w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``, computed with numpy in row
    blocks on the cast threads (see :func:`quantize_pieces`).

    Returns:
        ``(weight, scale)``: the FP8 values (numpy ``float8_e4m3fn``) and the FP32 scales.

    Raises:
        CkptError: NaN or infinite values.
    """
    import ml_dtypes
    import numpy as np

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
    elif layout == "tensor":
        scale[...] = 1.0
    return out.view(ml_dtypes.float8_e4m3fn).reshape(shape), scale


def _dequantize_rows(w8: np.ndarray, lut: np.ndarray, s: np.ndarray, out: np.ndarray,
                     dst: str) -> None:
    """Rows of FP8 codes (uint8, 2-D) times ``s`` (broadcast) in FP32, rounded once into
    ``out`` (``dst``), a few rows per pass."""
    import numpy as np

    from ckpt_cli.tensors.cast import f32_to_f16

    rows, cols = w8.shape
    step = _rows_per_pass(rows, cols)
    buf = _SCRATCH.get(min(rows, step) * cols)[0]
    per_row = s.ndim == 2 and s.shape[0] == rows and rows > 1
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(0, rows, step):
            n = min(step, rows - i)
            f = buf[: n * cols].reshape(n, cols)
            np.take(lut, w8[i:i + n], out=f)
            f *= s[i:i + n] if per_row else s
            o = out[i:i + n]
            if dst == "F16":
                f32_to_f16(f.reshape(-1), o.reshape(-1))
            else:
                np.copyto(o, f, casting="unsafe")


def _dequantize_jobs(codes: np.ndarray, r0: int, lut: np.ndarray, s: np.ndarray, kind: str,
                     out: np.ndarray, dst: str) -> list[Callable[[], None]]:
    """Pool tasks dequantizing rows ``r0...`` (``codes``: uint8, 2-D, starting at a block
    row for the block layout) into ``out``, with the whole scale ``s`` (FP32, reshaped:
    block ``[rb, cb]``, channel ``[rows, 1]``, tensor ``[1]``)."""
    rows, cols = codes.shape
    if kind == "block":
        import numpy as np

        return [functools.partial(_dequantize_rows, codes[r:r + BLOCK], lut,
                                  np.repeat(s[(r0 + r) // BLOCK], BLOCK)[:cols],
                                  out[r:r + BLOCK], dst) for r in range(0, rows, BLOCK)]
    per = max(1, _JOB // max(1, cols))
    return [functools.partial(_dequantize_rows, codes[r:r + per], lut,
                              s[r0 + r:r0 + min(rows, r + per)] if kind == "channel"
                              else s,
                              out[r:r + per], dst) for r in range(0, rows, per)]


def _dequantize_setup(dtype: Any, shape: tuple[int, ...], scale: np.ndarray
                      ) -> tuple[str, np.ndarray, np.ndarray]:
    """The scale's kind, the FP8 codes' FP32 table and the scale as FP32, reshaped."""
    import numpy as np

    kind = scale_kind(tuple(shape), tuple(scale.shape))
    if kind is None:
        raise CkptError(f"scale shape {list(scale.shape)} fits no convention for a weight of "
                        f"shape {list(shape)}")
    rows, cols = int(shape[0]), int(shape[1])
    lut = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    s = np.ascontiguousarray(scale).astype(np.float32)
    s = (s.reshape(-(-rows // BLOCK), -(-cols // BLOCK)) if kind == "block"
         else s.reshape(-1, 1) if kind == "channel" else s.reshape(1))
    return kind, lut, s


def dequantize(weight: np.ndarray, scale: np.ndarray, dst: str) -> np.ndarray:
    """``weight * scale`` in FP32 (the scale broadcast per tensor, row or 128x128 block),
    rounded once to ``dst`` (``BF16``, ``F16``, ``F32``): bit for bit torch's
    ``(w.float() * s).to(dst)`` for every value but NaN (whose bits are numpy's, as in every
    cast, see :mod:`ckpt_cli.tensors.cast`). numpy in row blocks on the cast threads; memory
    holds the output and a few rows of FP32, not the FP32 product and the repeated scale whole."""
    import numpy as np

    from ckpt_cli import dtypes
    kind, lut, s = _dequantize_setup(weight.dtype, tuple(weight.shape), scale)
    rows, cols = int(weight.shape[0]), int(weight.shape[1])
    codes = np.ascontiguousarray(weight).view(np.uint8).reshape(rows, cols)
    out = np.empty((rows, cols), dtype=dtypes.numpy_dtype(dst))
    jobs = _dequantize_jobs(codes, 0, lut, s, kind, out, dst)
    if jobs:
        _run(jobs, out.nbytes, "dequantize")
    return out


def dequantize_pieces(pieces: Iterator[np.ndarray], scale: np.ndarray,
                      shape: tuple[int, ...], dst: str) -> Iterator[np.ndarray]:
    """:func:`dequantize` of a weight streamed as flat FP8 pieces (row-major), piece by
    piece: memory holds a source piece and its output, never the tensor.

    Yields:
        Flat arrays of ``dst``, together the dequantized tensor in row-major order (each at
        most :data:`ckpt_cli.storage.reads.PIECE_BYTES`, or one row of 128x128 blocks).
    """
    import numpy as np

    from ckpt_cli import dtypes
    from ckpt_cli.storage import reads

    rows, cols = int(shape[0]), int(shape[1])
    it = iter(pieces)
    first = next(it, None)
    if first is None:
        if rows * cols:
            raise ValueError(f"produced 0 values, expected {rows * cols:,}")
        return
    kind, lut, s = _dequantize_setup(first.dtype, (rows, cols), scale)
    unit = BLOCK if kind == "block" else 1
    want = dtypes.numpy_dtype(dst)
    most = max(unit, reads.PIECE_BYTES // max(1, cols * want.itemsize) // unit * unit)

    def chained() -> Iterator[np.ndarray]:
        yield first
        yield from it

    for r0, group in _row_groups(chained(), rows, cols, unit, widen=False):
        codes = group.view(np.uint8)
        for r in range(0, codes.shape[0], most):
            part = codes[r:r + most]
            out = np.empty(part.shape, dtype=want)
            _run(_dequantize_jobs(part, r0 + r, lut, s, kind, out, dst), out.nbytes,
                 "dequantize")
            yield out.reshape(-1)
            del out


def scale_kind(weight: tuple[int, ...], scale: tuple[int, ...]) -> str | None:
    """Which convention a scale of shape ``scale`` follows for ``weight`` (None: none)."""
    if len(weight) != 2:
        return None
    if scale in ((), (1,), (1, 1)):
        return "tensor"
    if scale in ((weight[0], 1), (weight[0],)):
        return "channel"
    if scale == (math.ceil(weight[0] / BLOCK), math.ceil(weight[1] / BLOCK)):
        return "block"
    return None


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
        import numpy as np

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
        import numpy as np

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


def quantization_config(layout: str, ignore: list[str]) -> dict[str, Any]:
    """The ``quantization_config`` for ``config.json``.

    Args:
        layout: ``block``, ``channel`` or ``tensor``.
        ignore: Module names of Linear-like weights left unquantized.
    """
    if layout == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ignore}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": layout,
               "dynamic": False, "group_size": None, "block_structure": None,
               "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None,
                                          "output_activations": None}},
            "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None}


def check_quantized(index: Any) -> tuple[list[Any], str] | None:
    """validate's ``quantization`` check: every FP8 weight has one scale of a legal shape and
    dtype, with finite positive values, and ``config.json``'s ``quantization_config`` agrees
    with the tensors (block size, ignored modules unquantized). None: no FP8 tensor.

    Args:
        index: The :class:`~ckpt_cli.model.CheckpointIndex`.
    """
    import json

    import numpy as np

    from ckpt_cli.model import Finding
    from ckpt_cli.tensors.source import TensorSource

    tensors = index.tensors
    weights = [t for t in tensors.values() if t.dtype in ("F8_E4M3", "F8_E5M2")]
    if not weights:
        return None
    found: list[Finding] = []

    def bad(code: str, msg: str, where: str | None) -> None:
        found.append(Finding("error", code, msg, None, where))

    kinds: dict[str, int] = {}
    reader = TensorSource(index)
    try:
        for w in weights:
            module, _, last = w.name.rpartition(".")
            scales = [tensors[f"{module}.{n}"] for n in SCALE_NAMES
                      if f"{module}.{n}" in tensors]
            if last != "weight" or not scales:
                bad("fp8-no-scale", f"{w.name} ({w.dtype} {list(w.shape)}) has no scale "
                    f"({', '.join(SCALE_NAMES)}): a loader ignoring that reads garbage", w.name)
                continue
            if len(scales) > 1:
                bad("fp8-scale-ambiguous", f"{w.name} has several scales: "
                    f"{', '.join(s.name for s in scales)}", w.name)
                continue
            s = scales[0]
            kind = scale_kind(tuple(w.shape), tuple(s.shape))
            if kind is None or s.dtype not in ("F32", "BF16", "F16"):
                bad("fp8-scale-shape", f"{s.name} ({s.dtype} {list(s.shape)}) fits no scale "
                    f"convention for {w.name} {list(w.shape)}", s.name)
                continue
            kinds[kind] = kinds.get(kind, 0) + 1
            vals = np.asarray(reader.read(s), dtype=np.float32)
            if not (np.isfinite(vals).all() and (vals > 0).all()):
                bad("fp8-scale-values", f"{s.name} holds non-finite, zero or negative "
                    "scales", s.name)
    finally:
        reader.close()
    qc = None
    try:
        config = index.base / "config.json"
        if index.base.is_dir() and config.is_file():
            qc = json.loads(config.read_bytes()).get("quantization_config")
    except (ValueError, AttributeError, OSError, CkptError):
        qc = None
    if isinstance(qc, dict):
        ignore = qc.get("modules_to_not_convert") or qc.get("ignore") or []
        fp8_modules = {w.name.rpartition(".")[0] for w in weights}
        for m in ignore if isinstance(ignore, list) else []:
            if isinstance(m, str) and m in fp8_modules:
                bad("fp8-config-ignored", f"config.json's quantization_config ignores {m}, "
                    "but its weight is FP8", f"{m}.weight")
        size = qc.get("weight_block_size")
        if qc.get("quant_method") == "fp8" and size not in (None, [BLOCK, BLOCK]):
            found.append(Finding("warning", "fp8-config-block",
                                 f"weight_block_size {size}: ckpt checks 128x128 blocks only",
                                 "config.json", None))
        elif qc.get("quant_method") == "fp8" and set(kinds) - {"block"}:
            bad("fp8-config-block", "config.json says block-wise FP8, but some scales are "
                f"per {' / '.join(sorted(set(kinds) - {'block'}))}", "config.json")
    summary = (f"{len(weights)} FP8 weight(s), scales: "
               + (", ".join(f"{n} per {k}" for k, n in sorted(kinds.items())) or "none")
               + ("; quantization_config " + str(qc.get("quant_method")) if isinstance(qc, dict)
                  else "; no quantization_config"))
    return found, summary
