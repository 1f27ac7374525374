"""Casting: bit-exact with torch from FP32/FP16/BF16 and rounded once from FP64, whichever
backend does it; FP16 overflow counted."""

from __future__ import annotations

from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest
import torch

from ckpt_cli import cast
from ckpt_cli.cast import CastStats, cast_array

pytestmark = pytest.mark.requires_torch


@pytest.fixture(params=["numpy", "torch"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test with the numpy casts, then with torch's kernels."""
    saved = cast._TORCH.torch
    cast._TORCH.torch = torch if request.param == "torch" else None
    try:
        yield request.param
    finally:
        cast._TORCH.torch = saved


def _values() -> np.ndarray:
    g = np.random.default_rng(0)
    special = [0.0, -0.0, 1e-40, 6e-8, 3e-8, 65504.0, 65519.0, 65520.0, 1e5, -1e5, 3.4e38,
               np.inf, -np.inf, np.nan, 1.0 + 2**-11, 1.0 + 3 * 2**-11]
    return np.concatenate([g.standard_normal(5_000_000).astype(np.float32) * 100,
                           np.array(special, np.float32)])


@pytest.mark.parametrize("dst,tdt", [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_bit_exact_with_torch(backend: str, dst: str, tdt: torch.dtype) -> None:
    x = _values()
    stats = CastStats()
    ours = cast_array(x, dst, name="x", stats=stats)
    want = torch.from_numpy(x).to(tdt)
    got = torch.from_numpy(ours.view(np.int16)).view(tdt)
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    assert bool(same.all()), backend
    if dst == "F16":
        finite_big = np.isfinite(x) & (np.abs(x) >= 65520.0)
        assert stats.overflow == {"x": int(finite_big.sum())}
    else:
        assert stats.overflow == {}


def test_from_bf16(backend: str) -> None:
    bf = _values()[:1000].astype(ml_dtypes.bfloat16)
    want = torch.from_numpy(bf.view(np.int16)).view(torch.bfloat16).to(torch.float16)
    got = torch.from_numpy(cast_array(bf, "F16"))
    assert torch.equal(got.nan_to_num(), want.nan_to_num()), backend


@pytest.mark.parametrize("dst,tdt,bits", [("F16", torch.float16, 10),
                                          ("BF16", torch.bfloat16, 7)])
def test_from_f64_rounds_once(backend: str, dst: str, tdt: torch.dtype, bits: int) -> None:
    # Just above and below halfway between two neighbours, by less than FP32 can hold: the
    # nearest value is clear, but rounding through FP32 (torch's FP64 -> FP16/BF16) lands on
    # the tie and goes to even. ckpt rounds once, whichever backend casts.
    k = np.arange(1, 2**bits, dtype=np.float64)
    lo = 1 + k * 2.0**-bits  # representable; the last mantissa bit is k's
    half, tiny = 2.0**-(bits + 1), 2.0**-40
    x = np.concatenate([lo + half + tiny, lo + half - tiny, -(lo + half + tiny), lo + half])
    even = np.where(k % 2 == 1, lo + 2 * half, lo)  # exact ties go to the even neighbour
    want = np.concatenate([lo + 2 * half, lo, -(lo + 2 * half), even])
    assert np.array_equal(cast_array(x, dst).astype(np.float64), want), backend
    # What the README says torch does (double rounding).
    via_torch = torch.from_numpy(x).to(tdt).double().numpy()
    assert not np.array_equal(via_torch, want)
    one = torch.tensor([1 + 2**-11 + 2**-40], dtype=torch.float64)
    assert one.to(torch.float16).item() == 1.0
    assert cast_array(one.numpy(), "F16").item() == 1.0009765625


def test_clamp(backend: str) -> None:
    x = np.array([1e5, -7e4, 6e4, np.inf], np.float32)
    stats = CastStats()
    got = cast_array(x, "F16", name="w", clamp=True, stats=stats)
    assert got.tolist() == [65504.0, -65504.0, 60000.0, np.inf]
    assert stats.overflow == {"w": 2}


def test_nan_and_source_inf_are_not_overflow(backend: str) -> None:
    x = np.array([np.nan, 1.0, -np.inf, 65504.0], np.float32)
    stats = CastStats()
    got = cast_array(x, "F16", name="n", clamp=True, stats=stats)
    assert np.isnan(got[0]) and got[1:].tolist() == [1.0, -np.inf, 65504.0]
    assert stats.overflow == {}


def test_prefer_torch_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[bool] = []
    monkeypatch.setattr(cast._TORCH, "start", lambda: started.append(True))
    assert cast.prefer_torch(cast.TORCH_WORTH_IT - 1) is False and started == []
    assert cast.prefer_torch(cast.TORCH_WORTH_IT) is True and started == [True]
    monkeypatch.setenv("CKPT_NO_TORCH_CAST", "1")
    assert cast.prefer_torch(10 * cast.TORCH_WORTH_IT) is False
