"""FP8 weights dequantized: ``w = q * scale`` in FP32 (the scale broadcast per tensor, row or
128x128 block), rounded once to BF16, F16 or F32, whole (:func:`dequantize`) or streamed piece
by piece (:func:`dequantize_pieces`), in row blocks on the cast threads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ckpt_cli import dtypes
from ckpt_cli.errors import CkptError
from ckpt_cli.fp8.rows import JOB, SCRATCH, row_groups, rows_per_pass, run_jobs
from ckpt_cli.fp8.scheme import BLOCK, scale_kind
from ckpt_cli.storage import reads
from ckpt_cli.tensors.cast import f16_overflow, f32_to_f16

if TYPE_CHECKING:
    from ckpt_cli.tensors.cast import CastStats


@dataclass(frozen=True, slots=True)
class Overflow:
    """Where FP16 overflow of a dequantized tensor goes: counted into ``stats`` under
    ``name`` (the conversion refuses it before committing, as a plain ``--to fp16`` does), or
    clamped to ±65504 with ``clamp`` (and counted, for the summary)."""

    name: str
    stats: CastStats
    clamp: bool = False


def _dequantize_rows(w8: np.ndarray, lut: np.ndarray, s: np.ndarray, out: np.ndarray,
                     dst: str, overflow: Overflow | None) -> None:
    """Rows of FP8 codes (uint8, 2-D) times ``s`` (broadcast) in FP32, rounded once into
    ``out`` (``dst``), a few rows per pass."""
    rows, cols = w8.shape
    step = rows_per_pass(rows, cols)
    buf = SCRATCH.get(min(rows, step) * cols)[0]
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
                over = f16_overflow(f, o, overflow is not None and overflow.clamp)
                if over and overflow is not None:
                    overflow.stats.add(overflow.name, over)
            else:
                np.copyto(o, f, casting="unsafe")


def _dequantize_jobs(codes: np.ndarray, r0: int, lut: np.ndarray, s: np.ndarray, kind: str,
                     out: np.ndarray, dst: str,
                     overflow: Overflow | None = None) -> list[Callable[[], None]]:
    """Pool tasks dequantizing rows ``r0...`` (``codes``: uint8, 2-D, starting at a block
    row for the block layout) into ``out``, with the whole scale ``s`` (FP32, reshaped:
    block ``[rb, cb]``, channel ``[rows, 1]``, tensor ``[1]``)."""
    rows, cols = codes.shape
    if kind == "block":
        return [functools.partial(_dequantize_rows, codes[r:r + BLOCK], lut,
                                  np.repeat(s[(r0 + r) // BLOCK], BLOCK)[:cols],
                                  out[r:r + BLOCK], dst, overflow)
                for r in range(0, rows, BLOCK)]
    per = max(1, JOB // max(1, cols))
    return [functools.partial(_dequantize_rows, codes[r:r + per], lut,
                              s[r0 + r:r0 + min(rows, r + per)] if kind == "channel"
                              else s,
                              out[r:r + per], dst, overflow) for r in range(0, rows, per)]


def _dequantize_setup(dtype: Any, shape: tuple[int, ...], scale: np.ndarray
                      ) -> tuple[str, np.ndarray, np.ndarray]:
    """The scale's kind, the FP8 codes' FP32 table and the scale as FP32, reshaped."""
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


def dequantize(weight: np.ndarray, scale: np.ndarray, dst: str,
               overflow: Overflow | None = None) -> np.ndarray:
    """``weight * scale`` in FP32 (the scale broadcast per tensor, row or 128x128 block),
    rounded once to ``dst`` (``BF16``, ``F16``, ``F32``): bit for bit torch's
    ``(w.float() * s).to(dst)`` for every value but NaN (whose bits are numpy's, as in every
    cast, see :mod:`ckpt_cli.tensors.cast`). numpy in row blocks on the cast threads; memory
    holds the output and a few rows of FP32, not the FP32 product and the repeated scale whole.
    To FP16, values beyond its range are counted (or clamped) through ``overflow``; without
    it they become inf, as a plain cast makes them."""
    kind, lut, s = _dequantize_setup(weight.dtype, tuple(weight.shape), scale)
    rows, cols = int(weight.shape[0]), int(weight.shape[1])
    codes = np.ascontiguousarray(weight).view(np.uint8).reshape(rows, cols)
    out = np.empty((rows, cols), dtype=dtypes.numpy_dtype(dst))
    jobs = _dequantize_jobs(codes, 0, lut, s, kind, out, dst, overflow)
    if jobs:
        run_jobs(jobs, out.nbytes, "dequantize")
    return out


def dequantize_pieces(pieces: Iterator[np.ndarray], scale: np.ndarray,
                      shape: tuple[int, ...], dst: str,
                      overflow: Overflow | None = None) -> Iterator[np.ndarray]:
    """:func:`dequantize` of a weight streamed as flat FP8 pieces (row-major), piece by
    piece: memory holds a source piece and its output, never the tensor.

    Yields:
        Flat arrays of ``dst``, together the dequantized tensor in row-major order (each at
        most :data:`ckpt_cli.storage.reads.PIECE_BYTES`, or one row of 128x128 blocks).
    """
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

    for r0, group in row_groups(chained(), rows, cols, unit, widen=False):
        codes = group.view(np.uint8)
        for r in range(0, codes.shape[0], most):
            part = codes[r:r + most]
            out = np.empty(part.shape, dtype=want)
            run_jobs(_dequantize_jobs(part, r0 + r, lut, s, kind, out, dst, overflow),
                     out.nbytes, "dequantize")
            yield out.reshape(-1)
            del out
