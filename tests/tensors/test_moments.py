"""``tensors/moments``: per-piece figures (both kernels: the compiled ``_moments`` and numpy's)
against torch's ``float64`` computations on the whole tensor, independence from how the values
are split into pieces, ``diff_sumsq``, and the cache form of :class:`Moments`."""

from __future__ import annotations

import json
import math
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ckpt_cli.tensors import moments
from ckpt_cli.tensors.moments import HIST_BINS, HIST_LO, Moments

pytestmark = pytest.mark.requires_torch

REL = 1e-12


def _use(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    moments._compiled.cache_clear()
    if kernel == "numpy":
        monkeypatch.setenv("CKPT_NO_COMPILED_MOMENTS", "1")
    else:
        monkeypatch.delenv("CKPT_NO_COMPILED_MOMENTS", raising=False)
    if moments.moments_kernel() != kernel:
        pytest.skip("the compiled moments kernel is not built")


@pytest.fixture(params=["numpy", "compiled"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each kernel in turn: numpy's, then the compiled one (skipped where it is not built)."""
    _use(request.param, monkeypatch)
    yield request.param
    moments._compiled.cache_clear()


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A torch tensor's values as numpy holds them (BF16 as ml_dtypes)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _close(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=REL, abs_tol=0.0) or got == want


def _hist(d: torch.Tensor) -> list[int]:
    """Binade counts of the non-zero finite float64 values ``d``, with torch.frexp."""
    d = d[d != 0]
    _, e = torch.frexp(d)  # d = m * 2**e, 0.5 <= |m| < 1: binade e - 1
    idx = (e.long() - 1 - HIST_LO).clamp(0, HIST_BINS - 1)
    return torch.bincount(idx, minlength=HIST_BINS).tolist()


def _check(m: Moments, t: torch.Tensor, *, spread: bool = False) -> None:
    """``m`` holds the figures torch computes in float64 on the whole of ``t``. With ``spread``
    (values of every magnitude, summing to ~0) the mean is compared within 1e-12 of the largest
    ``|x|``: no summation order gets closer there."""
    flat = t.reshape(-1)
    fin = flat[torch.isfinite(flat)].double()
    assert m.numel == flat.numel()
    assert m.count == fin.numel()
    assert m.nan == int(torch.isnan(flat).sum())
    assert m.posinf == int(torch.isposinf(flat).sum())
    assert m.neginf == int(torch.isneginf(flat).sum())
    assert m.zeros == int((flat == 0).sum())
    assert m.hist == _hist(fin)
    if fin.numel() == 0:
        assert (m.min, m.max, m.sumsq, m.absmax, m.std) == (math.inf, -math.inf, 0.0, None, None)
        return
    assert m.min == float(fin.min()) and m.max == float(fin.max())
    if spread:
        assert abs(m.mean - float(fin.mean())) <= REL * float(fin.abs().max())
    else:
        assert _close(m.mean, float(fin.mean())), (m.mean, float(fin.mean()))
    assert _close(m.l2, float(torch.linalg.vector_norm(fin))), (m.l2, fin.norm())
    if fin.numel() > 1:
        assert m.std is not None
        assert _close(m.std, float(fin.std())), (m.std, float(fin.std()))
    else:
        assert m.std is None


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(41)
    randn = torch.randn(300_001, generator=g)
    special = torch.randn(20_000, generator=g) * 3
    special[::97] = float("nan")
    special[5::211] = float("inf")
    special[7::307] = float("-inf")
    special[11::13] = 0.0
    special[17::29] = -0.0
    return {
        "randn_f32": randn * 0.02,
        "layernorm_f32": 1 + 1e-4 * torch.randn(1_000_003, generator=g),
        "layernorm_f64": 1 + 1e-7 * torch.randn(200_000, generator=g, dtype=torch.float64),
        "randn_bf16": (randn * 0.5).to(torch.bfloat16),
        "randn_f16": (randn * 3).to(torch.float16),
        "randn_f64": randn.double() * 1e3 + 5,
        "special_f32": special,
        "special_f16": special.to(torch.float16),
        "special_bf16": special.to(torch.bfloat16),
        "special_f64": special.double(),
        "subnormal_f32": torch.tensor([1e-45, -1e-45, 3e-42, -1.1e-38, 1.2e-38, 0.0, 5.0]),
        "subnormal_f16": torch.tensor([6e-8, -6e-8, 1e-6, 3e-5, -6.1e-5, 6.2e-5, -0.0, 1.0],
                                      dtype=torch.float16),
        "subnormal_bf16": torch.tensor([9.2e-41, -1e-39, 5e-39, 1.1e-38, 0.0, 2.0],
                                       dtype=torch.bfloat16),
        "subnormal_f64": torch.tensor([5e-324, -1e-310, 1e-300, 0.0, 2.0], dtype=torch.float64),
        "empty": torch.zeros(0),
        "single": torch.tensor([-2.5]),
        "all_nan": torch.full((10_000,), float("nan")),
        "all_inf": torch.tensor([float("inf"), float("-inf")] * 3000, dtype=torch.float16),
        "all_zero": torch.zeros(9000, dtype=torch.bfloat16),
        "huge_f32": torch.tensor([3.4e38, 3.3e38, -1e-30] * 1000),
    }


TENSORS = _tensors()


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_piece_equals_torch_float64(kernel: str, name: str) -> None:
    """One piece's figures equal torch's float64 figures of the tensor: counts exact, the
    moments within 1e-12 relative, the binade histogram exact."""
    t = TENSORS[name]
    _check(moments.piece_moments(_numpy(t)), t)


@pytest.mark.parametrize("name", ["randn_f32", "layernorm_f32", "special_f32", "randn_bf16",
                                  "special_f16", "randn_f64", "subnormal_bf16"])
def test_pieces_merge_to_the_whole(kernel: str, name: str) -> None:
    """Split at random points, the pieces merged with Moments.merge give the whole's figures
    (and so torch's)."""
    t = TENSORS[name]
    arr = _numpy(t)
    rng = random.Random(name)
    cuts = sorted(rng.sample(range(1, arr.size), min(7, arr.size - 1)))
    pieces = np.split(arr, cuts)
    merged = moments.tensor_moments(lambda: pieces)
    whole = moments.piece_moments(arr)
    _check(merged, t)
    for f in ("numel", "count", "zeros", "nan", "posinf", "neginf", "min", "max", "hist"):
        assert getattr(merged, f) == getattr(whole, f), f
    for f in ("mean", "m2", "sumsq"):
        assert _close(getattr(merged, f), getattr(whole, f)), f


def test_a_mean_near_zero_among_spread_values(kernel: str) -> None:
    """Adam's exp_avg after a step or two: FP32 values of +-1e-5 whose mean is ~1e-10. Each
    x - c rounds at the scale of x, which a mean taken from those deviations carries into its
    last digits (2.3e-12 relative on an HF Trainer run's exp_avg, 3.3e-11 on this one of 2048
    values); a block's sum of FP32 values in float64, exact here, gives its mean, and merged
    blocks stay within 1e-12 of the exact mean, as torch's does."""
    g = torch.Generator().manual_seed(11)
    for n in (768, 2048, 5000):
        t = torch.randn(n, generator=g) * 2e-6
        t[::50] *= 500  # a few large values (1e-3), as in a real exp_avg
        for i in range(1, 5):  # move the sum close to 4e-10 * n, keeping every value FP32
            t[i] -= (t.double().sum() - 4e-10 * n).float()
        exact = math.fsum(t.double().tolist()) / n
        assert abs(exact) < 1e-8
        got = moments.piece_moments(t.numpy()).mean
        assert math.isclose(got, exact, rel_tol=1e-12), (kernel, n, got, exact)
        assert math.isclose(t.double().mean().item(), exact, rel_tol=1e-12)  # torch: too


def test_every_16_bit_value(kernel: str) -> None:
    """All 65536 FP16 and BF16 bit patterns (subnormals, both zeros, NaN payloads, Inf), as one
    piece and one value at a time."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    for dt in (torch.float16, torch.bfloat16):
        t = bits.view(dt)
        _check(moments.piece_moments(_numpy(t)), t, spread=True)
        for v in t[::251]:
            _check(moments.piece_moments(_numpy(v.reshape(1))), v.reshape(1))


def test_layout_and_read_only(kernel: str) -> None:
    """A transposed (non-contiguous) or read-only array, and integer or FP8 values."""
    t = TENSORS["randn_f32"][:30_000].reshape(100, 300)
    _check(moments.piece_moments(t.numpy().T), t)
    ro = t.numpy().copy()
    ro.setflags(write=False)
    _check(moments.piece_moments(ro), t)
    ints = torch.arange(-500, 500, dtype=torch.int32)
    _check(moments.piece_moments(ints.numpy()), ints.double())
    f8 = (t[0] * 10).to(torch.float8_e4m3fn)
    _check(moments.piece_moments(f8.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)),
           f8.float())


def test_float64_overflow(kernel: str) -> None:
    """FP64 values whose squares (or sum) pass DBL_MAX: sums scaled by a power of two, as BLAS
    nrm2 keeps them; std and mean equal torch's on the values scaled by 2^-600 (exact); L2 is
    infinite only where the norm itself is past DBL_MAX; exact extremes and counts, never NaN."""
    big = torch.tensor([1e300, -1e300, 1e308, 1e308, float("nan")] * 1000, dtype=torch.float64)
    for t in (big, big[:4], big[:2050], big[:2048]):
        m = moments.piece_moments(t.numpy())
        fin = t[torch.isfinite(t)]
        assert (m.count, m.nan, m.min, m.max) == (len(fin), len(t) - len(fin), -1e300, 1e308)
        l2 = float((fin / 2.0**600).norm()) * 2.0**600  # inf past DBL_MAX (all but [:4])
        assert math.isclose(m.l2, l2, rel_tol=REL) and (m.l2 == math.inf) == (len(fin) > 4)
        assert math.isclose(m.std or 0, float((fin / 2.0**600).std()) * 2.0**600, rel_tol=REL)
        assert math.isclose(m.mean, float((fin / 2**20).sum() / len(fin) * 2**20), rel_tol=REL)
    twin = moments.piece_moments(np.array([1e200, 1e200]))
    assert (twin.mean, twin.std) == (1e200, 0.0)
    assert math.isclose(twin.l2, math.sqrt(2) * 1e200, rel_tol=REL)


@pytest.mark.parametrize("dt", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_diff_sumsq_equals_torch(kernel: str, dt: torch.dtype) -> None:
    """sum((a - b)**2) equals torch's float64 sum; NaN when a value is NaN or Inf."""
    g = torch.Generator().manual_seed(7)
    a = torch.randn(100_003, generator=g).to(dt)
    b = (a.double() + 1e-2 * torch.randn(100_003, generator=g, dtype=torch.float64)).to(dt)
    want = float(((a.double() - b.double()) ** 2).sum())
    assert want > 0
    assert _close(moments.diff_sumsq(_numpy(a), _numpy(b)), want)
    assert moments.diff_sumsq(_numpy(a), _numpy(a)) == 0.0
    assert moments.diff_sumsq(_numpy(a[:0]), _numpy(b[:0])) == 0.0
    for bad in (float("nan"), float("inf"), float("-inf")):
        c = b.clone()
        c[4097] = bad
        assert math.isnan(moments.diff_sumsq(_numpy(a), _numpy(c)))
        assert math.isnan(moments.diff_sumsq(_numpy(c), _numpy(a)))
    with pytest.raises(ValueError, match="values against"):
        moments.diff_sumsq(_numpy(a), _numpy(b[:-1]))
    wide = b.double()  # another dtype on one side: numpy's path, the same sum
    assert _close(moments.diff_sumsq(_numpy(a), wide.numpy()), want)


_F32 = hnp.arrays(np.float32, st.integers(0, 5000),
                  elements=st.floats(width=32, allow_nan=True, allow_infinity=True,
                                     allow_subnormal=True)
                  | st.sampled_from([0.0, -0.0, 1.0, float("nan"), float("inf")]))


@settings(max_examples=150, deadline=None)
@given(_F32)
def test_compiled_kernel_equals_numpy_kernel(arr: np.ndarray) -> None:
    """On any float32 values the two kernels agree: counts, extremes and histogram exactly, the
    moments within 1e-12 of the values' scale (their summation orders differ)."""
    compiled = moments._compiled()
    if compiled is None:
        pytest.skip("the compiled moments kernel is not built")
    hist = np.zeros(HIST_BINS, np.int64)
    count, mean, m2, sumsq, lo, hi, zeros, nan, posinf, neginf = compiled.piece(
        arr, "float32", hist)
    want = moments.numpy_piece_moments(arr)
    assert (count, zeros, nan, posinf, neginf) == (
        want.count, want.zeros, want.nan, want.posinf, want.neginf)
    assert (lo, hi) == (want.min, want.max)
    assert hist.tolist() == want.hist
    fin = arr[np.isfinite(arr)].astype(np.float64)
    scale = float(np.abs(fin).max()) if fin.size else 0.0
    assert abs(mean - want.mean) <= REL * scale
    assert abs(sumsq - want.sumsq) <= REL * want.sumsq
    assert abs(m2 - want.m2) <= REL * want.sumsq


def test_compiled_rejects_bad_arguments() -> None:
    """The compiled functions refuse a wrong dtype name, ragged buffers, a short histogram and
    unequal lengths, with ValueError (never a crash)."""
    compiled = moments._compiled()
    if compiled is None:
        pytest.skip("the compiled moments kernel is not built")
    hist = np.zeros(HIST_BINS, np.int64)
    x = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="dtype must be"):
        compiled.piece(x, "int8", hist)
    with pytest.raises(ValueError, match="whole float64"):
        compiled.piece(x[:3], "float64", hist)
    with pytest.raises(ValueError, match="hist must hold"):
        compiled.piece(x, "float32", hist[:-1])
    with pytest.raises(ValueError, match="hist must hold"):
        compiled.piece(x, "float32", np.zeros(HIST_BINS, np.float64))
    with pytest.raises(ValueError, match="values against"):
        compiled.diff_sumsq(x, x[:9], "float32")
    with pytest.raises(BufferError):
        compiled.piece(x, "float32", np.zeros(HIST_BINS, np.int64).tobytes())
    assert hist.sum() == 0
    compiled.piece(x, "float32", hist)
    compiled.piece(x, "float32", hist)
    assert hist[-HIST_LO] == 20  # the histogram is added to, not overwritten


def test_compiled_releases_the_gil() -> None:
    """Another thread runs Python while piece() and diff_sumsq() compute (so ckpt stats' threads
    summarise pieces in parallel). With a long switch interval a kernel that held the GIL would
    let the main thread in only after it returned: no iteration would be counted."""
    compiled = moments._compiled()
    if compiled is None:
        pytest.skip("the compiled moments kernel is not built")
    values = np.random.default_rng(1).standard_normal(1 << 23).astype(np.float32)
    calls = [lambda: compiled.piece(values, "float32", np.zeros(HIST_BINS, np.int64)),
             lambda: compiled.diff_sumsq(values, values, "float32")]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        for call in calls:
            started, finished = threading.Event(), threading.Event()

            def work(call: Callable[[], Any], started: threading.Event,
                     finished: threading.Event) -> None:
                started.set()
                call()
                finished.set()

            worker = threading.Thread(target=work, args=(call, started, finished))
            worker.start()
            started.wait()
            count = 0
            while not finished.is_set():
                count += 1
                time.sleep(0)
            worker.join()
            assert count > 0
    finally:
        sys.setswitchinterval(interval)


def test_moments_list_round_trip() -> None:
    """to_list/from_list give back the same figures (infinite extremes included); from_list
    refuses anything that is not such a list."""
    m = moments.piece_moments(_numpy(TENSORS["special_f16"]))
    again = Moments.from_list(json.loads(json.dumps(m.to_list(), allow_nan=False)))
    assert again == m
    huge = moments.piece_moments(np.array([1e300, -1e300, 1e308, 1e308]))
    assert math.isfinite(huge.sumsq) and huge.scale == 1024  # scaled: no overflow
    again = Moments.from_list(json.loads(json.dumps(huge.to_list(), allow_nan=False)))
    assert again == huge and len(huge.to_list()) == 14
    # an entry written before sums were scaled (an overflowed sum) is recomputed, not trusted
    old = [*huge.to_list()[:3], "inf", "inf", *huge.to_list()[5:13]]
    with pytest.raises(ValueError, match="range"):
        Moments.from_list(old)
    for scale in (True, 5000, "1"):
        with pytest.raises(ValueError):
            Moments.from_list([*huge.to_list()[:13], scale])
    empty = Moments.from_list(Moments().to_list())
    assert empty == Moments()
    good = m.to_list()
    for bad in (None, {}, good[:-1], [*good[:1], -1, *good[2:]], [*good[:5], "x", *good[6:]],
                [*good[:5], "NaN", *good[6:]], [*good[:11], HIST_BINS, good[12]],
                [*good[:12], [1, -1]], [*good[:12], "hist"], [True, *good[1:]],
                [*good[:12], [True]], [*good[:4], None, *good[5:]],
                [*good[:2], "0.5", *good[3:]]):
        with pytest.raises(ValueError):
            Moments.from_list(bad)


def _run_of(values: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The values laid end to end in one byte buffer, with their (byte offset, count) spans."""
    buf = np.concatenate([v.view(np.uint8) for v in values])
    offsets = np.cumsum([0] + [v.nbytes for v in values[:-1]])
    spans = np.array([[o, v.size] for o, v in zip(offsets, values, strict=True)], np.int64)
    return buf, spans


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_run_moments_gives_each_piece_its_own_figures(kernel: str, dtype: Any) -> None:
    """One call over a run of pieces (issue 46 item 3): each piece's figures are exactly
    piece_moments' of it, specials, empty pieces and extreme float64 values included."""
    rng = np.random.default_rng(3)
    values = [rng.standard_normal(n).astype(dtype) for n in (0, 1, 2, 5, 3000, 7)]
    values.append(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 3e-39, 1.0]).astype(dtype))
    values += [np.array([-0.0, -0.0]).astype(dtype), np.array([np.inf]).astype(dtype),
               np.zeros(4, dtype)]
    if dtype == np.float64:
        values.append(np.array([1e200, 3e200]))  # squares past float64: a scaled sum
    buf, spans = _run_of(values)
    got = moments.run_moments(buf, np.dtype(dtype), spans)
    want = [moments.piece_moments(v) for v in values]
    assert [repr(m) for m in got] == [repr(m) for m in want]  # repr: NaN, -0.0 and all
    assert got[-1].scale if dtype == np.float64 else True


def test_run_moments_refuses_pieces_outside_or_across_items(kernel: str) -> None:
    buf = np.zeros(16, np.uint8)
    for bad in ([[0, 5]], [[2, 1]], [[-4, 1]], [[12, 2]]):
        with pytest.raises(ValueError):
            moments.run_moments(buf, np.dtype(np.float32), np.array(bad, np.int64))
    with pytest.raises(ValueError, match="kernel dtype"):
        moments.run_moments(buf, np.dtype(np.int32), np.array([[0, 1]], np.int64))
    assert moments.run_moments(buf, np.dtype(np.float32), np.zeros((0, 2), np.int64)) == []
