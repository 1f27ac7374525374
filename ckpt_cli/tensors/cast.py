"""Casting floating-point tensors between FP32, FP16 and BF16, with FP16's range checked.

Rounding is to nearest even, once. From FP32, FP16 and BF16 every value but NaN is bit for bit
what torch's ``.to()`` gives, whichever backend casts. From FP64 it is not always: torch rounds
FP64 to FP16 or BF16 through FP32, twice (``1 + 2**-11 + 2**-40`` becomes 1.0 in FP16, which
is the tie ``1 + 2**-11`` rounded to even, instead of the nearest FP16 value, ``1 + 2**-10``);
here every value is rounded directly.

NaNs get numpy's (and ml_dtypes') bits from either backend: to FP16 the sign and the top 10
payload bits are kept (a signalling NaN stays signalling); to BF16 they become the quiet NaN
with their sign. torch's own NaN bits depend on where an element falls in its loops (FP32 to
BF16 gives 0xFFFF in the vector loop, 0x7FC0 in the scalar tail), so blocks that torch cast
and that hold a NaN have their NaNs recast with numpy.

Backends: numpy (FP32 to FP16 through :func:`f32_to_f16`: the compiled F16C kernel
``ckpt_cli/tensors/_f16c.c`` where ``setup.py``'s optional extension was built, else integer
passes over cache-sized pieces; ``CKPT_NO_F16C=1`` forces the latter; the same bytes either
way) and, above :data:`TORCH_WORTH_IT` elements, torch, imported in the background by
:func:`prefer_torch` (its import costs about 2 s of CPU and 340 MB, more than it saved in every
end-to-end conversion measured). Blocks are sized by :func:`_block_size` so every cast thread
gets work; ``CKPT_THREADS`` sets the thread count. The measurements behind these choices are in
docs/benchmarks.md.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckpt_cli import dtypes
from ckpt_cli.errors import CkptError
from ckpt_cli.storage import stages
from ckpt_cli.storage.reads import worker_threads
from ckpt_cli.tensors.extensions import load

FP16_MAX = 65504.0
TORCH_WORTH_IT = 4_000_000_000
"""Elements to cast from which torch's faster kernels are used (importing torch first): above
every conversion measured, all of which were faster with numpy (see the module docstring)."""

_BLOCK = 1 << 21  # most elements per cast block: small temporaries
_MIN_BLOCK = 1 << 16  # fewest elements per cast block: a pool task costs ~10-50 us


def _block_size(n: int, threads: int) -> int:
    """Elements per cast block for ``n`` elements on ``threads`` threads: at most
    :data:`_BLOCK`, and small enough that every thread gets about two blocks (a 64 MB piece of
    FP32 is 8 blocks of 2M, which would leave half of 16 cores idle), in multiples of
    :data:`_MIN_BLOCK`. Results do not depend on it: every element is cast on its own."""
    per = -(-n // max(1, 2 * threads))
    per = -(-per // _MIN_BLOCK) * _MIN_BLOCK
    return max(_MIN_BLOCK, min(_BLOCK, per))


@dataclass(slots=True)
class CastStats:
    """Per-tensor counts gathered while casting (values beyond FP16's range)."""

    overflow: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, n: int) -> None:
        """Record ``n`` out-of-range values in tensor ``name``."""
        with self._lock:
            self.overflow[name] = self.overflow.get(name, 0) + n


class _TorchLoader:
    """Imports torch on a background thread, once, and says whether it is ready."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.torch: Any = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._load, name="ckpt-import-torch",
                                            daemon=True)
            self._thread.start()

    def _load(self) -> None:
        try:
            import torch  # heavy: torch
        except (ImportError, OSError, MemoryError):
            # Not installed, or it cannot load (its libraries need more address space than
            # `ulimit -v` leaves): casts stay on numpy.
            return
        # Blocks are cast in parallel on ckpt's own threads, one block per thread: torch's
        # intra-op threads on top would oversubscribe the cores (N pool threads x N OpenMP
        # threads, each with its own stack and allocator arena).
        torch.set_num_threads(1)
        self.torch = torch


_TORCH = _TorchLoader()


def torch_speeds_up(src: str, dst: str) -> bool:
    """Whether torch's kernels cast ``src`` to ``dst`` faster than ckpt's own: the casts
    from FP32/FP16/BF16 to another of FP16/BF16, except FP32 to FP16 where the compiled F16C kernel
    is built (it casts at torch's rate). Not from FP64, which torch rounds to FP16/BF16 through
    FP32 (twice) where numpy rounds once. What :func:`prefer_torch`'s callers count, and what
    :func:`cast_array` uses torch for once it is loaded.

    Args:
        src: Source dtype code (``F32``...).
        dst: Target dtype code.
    """
    if src == dst or dst not in ("F16", "BF16") or src not in ("F32", "F16", "BF16"):
        return False
    return not (src == "F32" and dst == "F16" and _compiled_f16() is not None)


_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def prefer_torch(elements: int) -> bool:
    """Start importing torch for casts if ``elements`` to cast make it worth it.

    Args:
        elements: How many elements the caller is about to cast that torch's kernels speed
            up (:func:`torch_speeds_up`).

    Returns:
        Whether the background import was started.
    """
    if elements >= TORCH_WORTH_IT and os.environ.get("CKPT_NO_TORCH_CAST") is None:
        _TORCH.start()
        return True
    return False


def cast_array(arr: np.ndarray, dst: str, *, name: str = "", clamp: bool = False,
               stats: CastStats | None = None) -> np.ndarray:
    """Cast floating values to ``dst`` (round to nearest even), in parallel blocks.

    Casting to FP16 counts values beyond FP16's range (which become inf) into ``stats``; with
    ``clamp`` they are clamped to ±65504 instead. The check costs one integer pass over the
    output's bits; exact counting happens only in blocks that hold an inf or NaN.

    Args:
        arr: Source values (any float dtype numpy or ml_dtypes knows).
        dst: Target dtype code (``F16``, ``BF16``, ``F32``, ``F64``).
        name: The tensor's name, for ``stats``.
        clamp: Clamp out-of-range values (FP16 only).
        stats: Where to count overflow.

    Returns:
        A new array of the target dtype and the same shape.
    """
    out = np.empty(arr.shape, dtype=dtypes.numpy_dtype(dst))
    src_flat, out_flat = arr.reshape(-1), out.reshape(-1)
    torch = _TORCH.torch
    # FP32 to FP16 goes through f32_to_f16 unless torch is loaded and no compiled kernel is.
    fast_f16 = dst == "F16" and arr.dtype == np.float32
    use_torch = torch is not None and torch_speeds_up(_CODES.get(arr.dtype.name, ""), dst)
    step = _block_size(src_flat.size, _pool_threads())

    def block(start: int) -> int:
        with stages.stage("cast", min(step, src_flat.size - start) * arr.dtype.itemsize):
            return cast_block(start)

    def cast_block(start: int) -> int:
        s, o = src_flat[start:start + step], out_flat[start:start + step]
        if fast_f16 and not use_torch:
            f32_to_f16(s, o)
        elif use_torch:
            _torch_copy(torch, s, o, dst)
            if dst == "BF16" and _any_nan_bf16(o):
                _numpy_nans(s, o)
        else:
            # Overflow is counted below (inf is what plain casting gives); a signalling NaN
            # raises "invalid" and stays a NaN.
            with np.errstate(over="ignore", invalid="ignore"):
                o[...] = s
        if dst != "F16" or not _any_inf_or_nan(o):
            return 0
        if use_torch:
            _numpy_nans(s, o)
        over = int(np.count_nonzero(np.isinf(o))) - int(np.count_nonzero(np.isinf(s)))
        if over and clamp:
            # FP64 stays FP64: through FP32 it would round twice, and values beyond FP32's
            # range would become inf instead of ±65504.
            with np.errstate(invalid="ignore"):
                wide = s.astype(np.float64 if s.dtype == np.float64 else np.float32)
                keep = np.isinf(wide)  # infinities in the source stay infinite
                o[...] = np.clip(wide, -FP16_MAX, FP16_MAX)
            o[keep] = wide[keep]
            _numpy_nans(s, o)  # NaN bits as a plain cast gives them, not as clip leaves them
        return over

    # numpy and torch release the GIL in casts, so blocks run on all cores.
    if src_flat.size <= step:
        over = block(0)  # one block: no hand-off to the pool
    else:
        over = sum(_pool().map(block, range(0, src_flat.size, step)))
    if stats is not None and over:
        stats.add(name, over)
    return out


def f16_overflow(wide: np.ndarray, half: np.ndarray, clamp: bool) -> int:
    """Values of ``half`` (FP16, just cast from the finite FP32 ``wide`` of the same shape)
    that overflowed to inf; with ``clamp`` they are set to ±65504 instead. Costs one integer
    pass over ``half`` when nothing overflowed (the FP8 dequantizer's check, as
    :func:`cast_array` checks its own casts)."""
    if not _any_inf_or_nan(half):
        return 0
    with np.errstate(invalid="ignore"):
        over = np.isinf(half) & ~np.isinf(wide)
    n = int(np.count_nonzero(over))
    if n and clamp:
        half[over] = np.where(wide[over] > 0, np.float16(FP16_MAX), np.float16(-FP16_MAX))
    return n


def _any_inf_or_nan(half: np.ndarray) -> bool:
    """Whether an FP16 block holds an inf or a NaN: its magnitude bits reach 0x7C00.

    Integer ops on the bits run about 3x faster than ``np.isinf`` on float16, which numpy
    evaluates one element at a time; only blocks that hit go on to exact counting.
    """
    bits = np.bitwise_and(half.view(np.uint16), 0x7FFF)
    return bool(bits.size) and int(bits.max()) >= 0x7C00


def _any_nan_bf16(bf: np.ndarray) -> bool:
    """Whether a BF16 block holds a NaN: its magnitude bits exceed 0x7F80 (inf)."""
    bits = np.bitwise_and(bf.view(np.uint16), 0x7FFF)
    return bool(bits.size) and int(bits.max()) > 0x7F80


def _numpy_nans(s: np.ndarray, o: np.ndarray) -> None:
    """Give the NaNs of a block torch cast the bits numpy/ml_dtypes give them.

    torch's NaN bits depend on where an element falls (its vector loop and scalar tail
    differ: FP32 to BF16 gives 0xFFFF in the loop and 0x7FC0 in the tail, dropping the sign;
    to FP16 the loop quiets signalling NaNs); numpy's do not. So a cast gives the same bytes
    whichever backend, and however many threads, cast a block.
    """
    nan = np.isnan(s)
    if nan.any():
        with np.errstate(invalid="ignore"):
            o[nan] = s[nan].astype(o.dtype)


def _torch_copy(torch: Any, s: np.ndarray, o: np.ndarray, dst: str) -> None:
    """``o[...] = s`` with torch's kernels (both are plain buffers; bf16 travels as int16)."""
    def as_tensor(a: np.ndarray) -> Any:
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    with warnings.catch_warnings():
        # Mapped source arrays are read-only; torch only reads them here.
        warnings.simplefilter("ignore", UserWarning)
        src_t = as_tensor(s)
    as_tensor(o).copy_(src_t)


CAST_THREAD = "ckpt-cast"
"""The names of the cast threads start with this."""


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """The cast threads: :func:`_pool_threads` of them."""
    return ThreadPoolExecutor(max_workers=_pool_threads(), thread_name_prefix=CAST_THREAD)


def cast_pool() -> ThreadPoolExecutor:
    """The cast threads' pool (``CKPT_THREADS`` threads), shared with FP8 quantization."""
    return _pool()


def cast_threads() -> int:
    """How many threads :func:`cast_pool` has."""
    return _pool_threads()


@functools.cache
def _pool_threads() -> int:
    """How many cast threads (``CKPT_THREADS``, else one per usable CPU), fixed per process."""
    return worker_threads()


_SUB = 1 << 16  # elements per pass of f32_to_f16: its temporaries stay in the L2 cache


@functools.cache
def _compiled_f16() -> Callable[[Any, Any], None] | None:
    """The compiled F16C kernel's function (``ckpt_cli.tensors._f16c``), or None where it was
    not built, the CPU lacks F16C, or ``CKPT_NO_F16C`` is set (numpy's kernel then)."""
    f16c = load("_f16c", "CKPT_NO_F16C")
    kernel: Callable[[Any, Any], None] | None = None if f16c is None else f16c.f32_to_f16
    return kernel


def f16_kernel() -> str:
    """Which FP32->FP16 kernel casts use: ``"f16c"`` (compiled) or ``"numpy"``."""
    return "numpy" if _compiled_f16() is None else "f16c"


def f32_to_f16(src: np.ndarray, out: np.ndarray) -> None:
    """``out[...] = src`` from FP32 to FP16, bit for bit numpy's cast.

    With the compiled kernel (:func:`f16_kernel`), 8 elements per instruction (about torch's
    per-core rate); else :func:`f32_to_f16_numpy`.

    Args:
        src: 1-D FP32 values.
        out: 1-D FP16 array of the same size, written in place.
    """
    compiled = _compiled_f16()
    if compiled is not None and src.flags.c_contiguous and out.flags.c_contiguous:
        compiled(src, out.view(np.uint16))
    else:
        f32_to_f16_numpy(src, out)


def f32_to_f16_numpy(src: np.ndarray, out: np.ndarray) -> None:
    """``out[...] = src`` from FP32 to FP16 with integer operations, bit for bit numpy's cast.

    numpy casts FP32 to FP16 one element at a time (~0.15-0.27 G elements/s per core here);
    this runs whole-array integer passes over cache-sized pieces (~0.4 G/s per core here),
    rounding to nearest even. Subnormal results are rounded by adding 0.5 in FP32 (the FPU
    rounds); values from 65520 up become inf; NaNs keep their sign and top 10 payload bits
    (an all-zero payload becomes 1), as numpy's ``npy_floatbits_to_halfbits`` gives them.

    Args:
        src: 1-D FP32 values.
        out: 1-D FP16 array of the same size, written in place.
    """
    u32 = np.uint32
    for i in range(0, src.size, _SUB):
        u = src[i:i + _SUB].view(np.uint32)
        a = np.bitwise_and(u, u32(0x7FFFFFFF))
        # Normal results: rebias the exponent, add half an FP16 ulp minus one plus the kept
        # mantissa's lowest bit (ties to even), shift. Wraps modulo 2**32 below the range.
        h = np.right_shift(a, u32(13))
        h &= u32(1)
        h += a
        h += u32(0xC8000FFF)
        h >>= u32(13)
        if a.size and int(a.max()) >= 0x47800000:  # 65536 and up, inf, NaN
            big = a >= u32(0x47800000)
            ab = a[big]
            payload = np.maximum(np.bitwise_and(np.right_shift(ab, u32(13)), u32(0x3FF)), u32(1))
            h[big] = np.where(ab > u32(0x7F800000), u32(0x7C00) + payload, u32(0x7C00))
        if a.size and int(a.min()) < 0x38800000:  # below FP16's smallest normal: subnormal, 0
            small = a < u32(0x38800000)
            f = a[small].view(np.float32) + np.float32(0.5)
            h[small] = f.view(np.uint32) - u32(0x3F000000)
        o = out[i:i + _SUB].view(np.uint16)
        np.copyto(o, h, casting="unsafe")
        sign = np.right_shift(u, u32(16)).astype(np.uint16)
        sign &= np.uint16(0x8000)
        o |= sign


def check_overflow(stats: CastStats, clamp: bool) -> None:
    """Refuse a cast to FP16 that turned finite values into inf (unless they were clamped).

    Args:
        stats: Counts gathered by :func:`cast_array`.
        clamp: Whether ``--clamp`` was given.

    Raises:
        CkptError: If any value overflowed and was not clamped.
    """
    if stats.overflow and not clamp:
        worst = sorted(stats.overflow.items(), key=lambda kv: -kv[1])
        listed = ", ".join(f"{n} ({c:,})" for n, c in worst[:5])
        more = f" and {len(worst) - 5} more" if len(worst) > 5 else ""
        raise CkptError(f"{sum(stats.overflow.values()):,} value(s) exceed FP16's range "
                        f"(±{FP16_MAX:g}) and would become inf: {listed}{more}; nothing written",
                        hint="use to bf16, keep_fp32 GLOB for those tensors, or clamp",
                        param=("to", "keep_fp32", "clamp"))


TARGETS: dict[str, str | None] = {"fp16": "F16", "bf16": "BF16", "fp32": "F32", "keep": None}
"""``--to`` choices and the dtype each casts floating tensors to (``keep``: none)."""



_TO_ALIASES = {"float16": "fp16", "half": "fp16", "f16": "fp16", "bfloat16": "bf16",
               "float32": "fp32", "float": "fp32", "f32": "fp32", "float8": "fp8",
               "float8_e4m3fn": "fp8", "f8_e4m3": "fp8", "e4m3": "fp8"}
"""Other spellings ``--to`` takes (torch's and safetensors' dtype names), any case."""


def target_name(to: str) -> str:
    """``--to``'s value as its canonical choice: case-insensitive, torch's and safetensors'
    names as aliases (``FP16``, ``float16``, ``half`` -> ``fp16``; ``bfloat16`` -> ``bf16``).
    Anything else comes back lowercased, for the caller to refuse."""
    low = to.strip().lower()
    return _TO_ALIASES.get(low, low)


def choice(target: str | None) -> str:
    """The ``--to`` choice that casts to ``target`` (``F16`` -> ``fp16``; None -> ``keep``),
    as ``ckpt.conversion`` spells it whichever command wrote the file."""
    return next(k for k, v in TARGETS.items() if v == target) if target in TARGETS.values() \
        else str(target).lower()


CASTABLE = frozenset({"F64", "F32", "F16", "BF16"})
"""The floating dtypes ``--to`` casts. Any other floating dtype (FP8, FP6, FP4) holds quantized
values that mean something only with their scales: casting them would widen the raw codes
(an FP8 weight with a per-tensor scale would come out wrong by the scale), so they are kept."""

_PACKED_INTS = frozenset({"I8", "U8", "I16", "U16", "I32", "U32"})
"""Integer dtypes that hold packed quantized codes (GPTQ/AWQ ``qweight`` I32, compressed-tensors
``weight_packed`` I32, bitsandbytes ``weight`` U8/I8) when a companion lies beside them."""

_COMPANIONS = frozenset({"scales", "qzeros", "g_idx", "absmax", "quant_map", "scb",
                         "nested_absmax", "nested_quant_map", "zeros", "zero_point"})
"""Last name parts of a quantized tensor's companions (compared lowercased), besides any part
holding "scale" and any ending in ``_zero_point``."""

_KV_SCALES = frozenset({"k_scale", "v_scale", "q_scale", "kv_scale", "prob_scale"})


class CastPlan:
    """What ``--to`` does to each floating model tensor, and what it leaves as it is.

    FP64/FP32/FP16/BF16 become the target (``--to fp32`` also widens FP16/BF16, which is
    exact). Quantized tensors are kept, with their companions; the rule, by name and dtype:

    * a *companion* is a tensor whose last name part is ``scales``, ``qzeros``, ``g_idx``,
      ``absmax``, ``quant_map``, ``SCB`` (any case), holds "scale" (``weight_scale``,
      ``input_scale``, ``weight_scale_inv``...) or ends in ``zero_point``; its *holder* is
      the module it lies in (for ``X.weight.absmax``, bitsandbytes' spelling, ``X``);
    * a *quantized* tensor is one of a non-standard floating dtype (FP8/FP6/FP4), or of an
      8/16/32-bit integer dtype in a module holding a companion (GPTQ/AWQ ``qweight``,
      compressed-tensors ``weight_packed``, bitsandbytes ``weight``);
    * kept uncast: every quantized tensor, every companion in a module holding one, and
      ``k_scale``/``v_scale`` (FP8 KV-cache scales) anywhere in a model holding one.

    Loaders expect all of these in their saved precision (a GPTQ ``scales`` tensor is FP16 by
    contract). What was kept is counted by dtype for the summary (``Kept:``).

    Args:
        target: The dtype code ``--to`` names (None: ``keep``, nothing is cast).
        tensors: ``(name, dtype)`` of every tensor that may be cast (to find the scales).
    """

    def __init__(self, target: str | None, tensors: Iterable[tuple[str, str]]) -> None:
        self.target = target
        pairs = list(tensors)
        names = {n for n, _ in pairs}
        self.kept: Counter[str] = Counter()
        self.kept_scales: Counter[str] = Counter()
        companions = {n for n, _ in pairs if _is_companion(n)}
        with_companion = {_holder(n, names) for n in companions}
        self._quantized = {n for n, d in pairs if _is_quantized(d) or (
            d in _PACKED_INTS and _module(n) in with_companion)}
        holders = {_module(n) for n in self._quantized}
        self._scales = {n for n in companions if _holder(n, names) in holders} | (
            {n for n in names if n.rpartition(".")[2] in _KV_SCALES} if self._quantized
            else set())

    def dtype(self, name: str, dtype: str) -> str:
        """The dtype to write for floating model tensor ``name`` (counting what is kept).

        Args:
            name: The tensor's name (as given to the constructor).
            dtype: Its dtype code.

        Returns:
            The target, or ``dtype`` for a quantized tensor, its scales, non-floating tensors
            and ``--to keep``.
        """
        if self.target is None:
            return dtype
        if name in self._quantized:
            self.kept[dtype] += 1
            return dtype
        if dtype not in CASTABLE:
            return dtype
        if name in self._scales:
            self.kept_scales[dtype] += 1
            return dtype
        return self.target

    def is_kept(self, name: str) -> bool:
        """Whether ``name`` is a quantized tensor or one of their scales (never cast, not even
        by ``--keep-fp32``)."""
        return name in self._quantized or name in self._scales


def _is_quantized(dtype: str) -> bool:
    d = dtypes.DTYPES.get(dtype)
    return d is not None and d.is_floating and dtype not in CASTABLE


def _module(name: str) -> str:
    return name.rpartition(".")[0]


def _is_companion(name: str) -> bool:
    last = name.rpartition(".")[2].lower()
    return last in _COMPANIONS or "scale" in last or last.endswith("zero_point")


def _holder(name: str, names: set[str]) -> str:
    """The module a companion belongs to: ``X`` for ``X.scales`` and for ``X.weight.absmax``
    (a companion named after its tensor)."""
    module = _module(name)
    return _module(module) if module in names else module


def kept_summary(kept: Mapping[str, int], scales: Mapping[str, int]) -> str:
    """``F8_E4M3 x16 (quantized; use a dequantizing conversion), F32 x16 (their scales)``.

    Args:
        kept: Quantized tensors kept, by dtype.
        scales: Their scales kept, by dtype.

    Returns:
        The text after "kept: ", or ``""`` when nothing was kept.
    """
    parts = []
    if kept:
        parts.append(", ".join(f"{d} x{n}" for d, n in sorted(kept.items()))
                     + " (quantized; use a dequantizing conversion)")
    if scales:
        parts.append(", ".join(f"{d} x{n}" for d, n in sorted(scales.items()))
                     + " (their scales)")
    return "; ".join(parts)


def piece_caster(pieces_of: Callable[[Any], Iterator[np.ndarray]], t: Any, dst: str,
                 name: str, clamp: bool, stats: CastStats) -> Callable[[], Iterator[np.ndarray]]:
    """Cast a tensor piece by piece: a tensor of several GB never sits in memory whole
    (it holds the source piece, or the one buffer a whole-read layout needs, and one cast
    piece). Overflow counts add up in ``stats`` across the pieces; the refusal comes before
    the output is renamed into place.

    Args:
        pieces_of: Yields the source pieces of a tensor (``TensorSource.iter_pieces``...).
        t: The source tensor (its ``dtype`` says whether to cast).
        dst: The dtype to write.
        name: The tensor's name in messages.
        clamp: Clamp FP16 overflow instead of refusing it.
        stats: Where overflow is counted.

    Returns:
        A function yielding the pieces to write.
    """
    def pieces() -> Iterator[np.ndarray]:
        for piece in pieces_of(t):
            yield piece if dst == t.dtype else cast_array(piece, dst, name=name, clamp=clamp,
                                                          stats=stats)
            del piece
    return pieces
