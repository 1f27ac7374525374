"""Casting: bit-exact with torch from FP32/FP16/BF16 and rounded once from FP64, whichever
backend does it; FP16 overflow counted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from ckpt_cli.errors import CkptError
from ckpt_cli.tensors import cast
from ckpt_cli.tensors.cast import CastStats, cast_array

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


def test_torch_speeds_up_only_where_its_kernels_are_faster(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert cast.torch_speeds_up("F32", "BF16") and cast.torch_speeds_up("F16", "BF16")
    assert cast.torch_speeds_up("BF16", "F16")
    for src, dst in (("F64", "F16"), ("F64", "BF16"), ("F32", "F32"), ("F16", "F32"),
                     ("I64", "F16"), ("F8_E4M3", "BF16"), ("BF16", "BF16"), ("F16", "F16")):
        assert not cast.torch_speeds_up(src, dst), (src, dst)
    monkeypatch.setattr(cast, "_compiled_f16", lambda: None)  # numpy's FP16 kernel
    assert cast.torch_speeds_up("F32", "F16")
    monkeypatch.setattr(cast, "_compiled_f16", lambda: lambda a, b: None)  # F16C
    assert not cast.torch_speeds_up("F32", "F16")


@pytest.mark.parametrize(("to", "kernel", "imports"), [
    ("fp16", "f16c", False), ("fp16", "numpy", True), ("bf16", "f16c", True)])
def test_convert_imports_torch_only_for_casts_it_speeds_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to: str, kernel: str,
        imports: bool) -> None:
    """Above TORCH_WORTH_IT elements, convert starts importing torch for its kernels, but not
    for an FP32 -> FP16 cast that the compiled F16C kernel does as fast."""
    from safetensors.numpy import save_file

    from ckpt_cli.ops.convert import convert

    if kernel == "numpy":
        monkeypatch.setattr(cast, "_compiled_f16", lambda: None)
    else:
        monkeypatch.setattr(cast, "_compiled_f16", lambda: lambda a, b: None)
        monkeypatch.setattr(cast, "f16_kernel", lambda: "numpy")  # no real F16C needed
        monkeypatch.setattr(cast, "f32_to_f16", cast.f32_to_f16_numpy)
    started: list[bool] = []
    monkeypatch.setattr(cast._TORCH, "start", lambda: started.append(True))
    monkeypatch.setattr(cast, "TORCH_WORTH_IT", 1000)
    w = np.arange(4000, dtype=np.float32)
    save_file({"w": w}, str(tmp_path / "m.safetensors"))
    convert(tmp_path / "m.safetensors", tmp_path / "o.safetensors", to=to)
    assert started == ([True] if imports else [])


# --- edge values -------------------------------------------------------------------------------

def _f32(*bits: int) -> np.ndarray:
    return np.array(bits, np.uint32).view(np.float32)


def _edge_f32() -> np.ndarray:
    """FP32 values where rounding to FP16/BF16 is delicate (no NaNs: those are tested apart)."""
    f16_ties = [1 + k * 2.0**-10 + 2.0**-11 for k in range(8)]  # halfway between FP16s
    bf16_ties = [1 + k * 2.0**-7 + 2.0**-8 for k in range(8)]  # halfway between BF16s
    ties = np.array(f16_ties + bf16_ties + [2.0**-25, 3 * 2.0**-25, 2.0**-15 + 2.0**-25],
                    np.float32)
    up, down = np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(0))
    special = np.concatenate([
        _f32(0x00000001, 0x00000002, 0x00400000, 0x007FFFFF,  # FP32 subnormals
             0x80000001, 0x807FFFFF, 0x00800000, 0x80800000),  # and the smallest normals
        np.array([0.0, -0.0, 2.0**-24, -(2.0**-24), 2.0**-26, 6e-8, 3e-8, 2.0**-14,
                  np.nextafter(np.float32(2.0**-14), np.float32(0)), 1e-39, -1e-39,
                  65504.0, 65519.99, 65520.0, -65519.99, -65520.0, 65536.0, 1e5, -1e5,
                  3.38e38, 3.4e38, np.inf, -np.inf], np.float32),
        _f32(0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF),  # BF16 overflow boundary
        ties, -ties, up, down, -up, -down])
    return special.astype(np.float32)


def _embedded(values: np.ndarray, n: int = 40_000) -> np.ndarray:
    """``values`` at the start (torch's vector loop), in the middle and at the very end (its
    scalar tail: the length is odd), among ordinary values."""
    base = np.linspace(-2, 2, n, dtype=values.dtype)
    return np.concatenate([values, base[:n // 2], values, base[n // 2:], values[:7]])


def _torch_bits(x: np.ndarray, tdt: torch.dtype) -> np.ndarray:
    src = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
           if x.dtype == ml_dtypes.bfloat16 else torch.from_numpy(x))
    out = src.to(tdt)
    return out.view(torch.int16 if out.element_size() == 2 else torch.int32).numpy()


_NARROW = [("F16", torch.float16, np.float16), ("BF16", torch.bfloat16, ml_dtypes.bfloat16)]


@pytest.mark.parametrize("dst,tdt,ndt", _NARROW)
def test_edge_values_bit_exact(backend: str, dst: str, tdt: torch.dtype, ndt: type) -> None:
    x = _embedded(_edge_f32())
    stats = CastStats()
    got = cast_array(x, dst, name="e", stats=stats)
    assert got.dtype == np.dtype(ndt)
    assert np.array_equal(got.view(np.int16), _torch_bits(x, tdt)), backend
    # Spot checks of what the rules say, independently of torch.
    as64 = cast_array(_edge_f32(), dst).astype(np.float64)
    edge = _edge_f32().astype(np.float64)
    if dst == "F16":
        assert as64[edge == np.float32(65519.99)].tolist() == [65504.0]
        assert np.isposinf(as64[edge == 65520.0]).all()
        assert as64[edge == 2.0**-25].tolist() == [0.0]  # the tie with 0 goes to even (0)
        assert as64[edge == 3 * 2.0**-25].tolist() == [2 * 2.0**-24]  # 1.5 ulp: to even
        sub = (np.abs(edge) < 2.0**-126) & (edge != 0)  # FP32 subnormals underflow to ±0
        assert (as64[sub] == 0).all() and (np.signbit(as64[sub]) == np.signbit(edge[sub])).all()
        finite_big = np.isfinite(x) & (np.abs(x.astype(np.float64)) >= 65520.0)
        assert stats.overflow == {"e": int(finite_big.sum())}
    else:
        assert stats.overflow == {}
        sub = (np.abs(edge) < 2.0**-126) & (edge != 0)  # BF16 keeps FP32's exponent range
        assert (as64[sub] != 0).sum() > 0
        assert np.isposinf(as64[edge == _f32(0x7F7FFFFF)[0]]).all()  # rounds up to inf
    for k in range(8):  # exact ties go to the even neighbour
        bits = 10 if dst == "F16" else 7
        tie = 1 + k * 2.0**-bits + 2.0**-(bits + 1)
        even = 1 + (k + (k % 2)) * 2.0**-bits
        assert as64[edge == tie][0] == even, (dst, k)


@pytest.mark.parametrize("dst,tdt,ndt", _NARROW)
def test_random_bit_patterns(backend: str, dst: str, tdt: torch.dtype, ndt: type) -> None:
    # Every kind of FP32 value, NaNs aside (tested below): non-NaNs match torch bit for bit.
    bits = np.random.default_rng(1).integers(0, 2**32, 3_000_001, dtype=np.uint64)
    x = bits.astype(np.uint32).view(np.float32)
    x = np.where(np.isnan(x), np.float32(1.5), x)
    got = cast_array(x, dst, clamp=True)  # clamping changes only values beyond FP16's range
    want = _torch_bits(x, tdt)
    beyond = np.isfinite(x) & (np.abs(x.astype(np.float64)) >= 65520.0) if dst == "F16" else 0
    same = got.view(np.int16) == want
    assert same[~beyond].all() if dst == "F16" else same.all(), backend


_NAN_BITS = (0x7FC00000, 0xFFC00000,  # quiet NaN, both signs
             0x7F800001, 0xFF800001, 0x7FA00000, 0x7F802000,  # signalling, with payloads
             0x7FC02000, 0x7FC00001, 0x7FFFFFFF, 0xFFFFFFFF)  # quiet, with payloads


@pytest.mark.parametrize("dst", ["F16", "BF16"])
def test_nan_payloads_same_from_both_backends(backend: str, dst: str) -> None:
    """What a NaN becomes is numpy's rule, whichever backend casts (torch's own bits depend
    on where an element falls: its vector loop and scalar tail differ).

    To FP16: sign kept, the payload's top 10 bits kept (a signalling NaN stays signalling; a
    payload that would vanish becomes the lowest one). To BF16: the quiet NaN, sign kept.
    """
    x = _embedded(_f32(*_NAN_BITS), n=5_000)
    got = cast_array(x, dst, name="n", stats=(stats := CastStats())).view(np.uint16)
    f16 = {0x7FC00000: 0x7E00, 0xFFC00000: 0xFE00, 0x7F800001: 0x7C01, 0xFF800001: 0xFC01,
           0x7FA00000: 0x7D00, 0x7F802000: 0x7C01, 0x7FC02000: 0x7E01, 0x7FC00001: 0x7E00,
           0x7FFFFFFF: 0x7FFF, 0xFFFFFFFF: 0xFFFF}
    want = {b: (f16[b] if dst == "F16" else 0x7FC0 | (0x8000 if b >> 31 else 0))
            for b in _NAN_BITS}
    k = len(_NAN_BITS)
    for at in (0, k + 2_500, x.size - 7):  # vector loop, middle, scalar tail
        for i, b in enumerate(_NAN_BITS[: 7 if at == x.size - 7 else k]):
            assert got[at + i] == want[b], (backend, dst, hex(b), at)
    assert stats.overflow == {}  # NaN is not overflow
    # torch's own bits for comparison: NaN, sign not always kept.
    t = _torch_bits(x, torch.float16 if dst == "F16" else torch.bfloat16).view(np.uint16)
    assert np.isnan(t.view(np.float16 if dst == "F16" else ml_dtypes.bfloat16)[:k]).all()


def test_nan_bits_under_clamp(backend: str) -> None:
    x = _embedded(np.concatenate([_f32(*_NAN_BITS), np.array([1e6], np.float32)]), n=5_000)
    plain = cast_array(x, "F16", clamp=False)
    clamped = cast_array(x, "F16", clamp=True)
    nan = np.isnan(x)
    assert np.array_equal(plain.view(np.uint16)[nan], clamped.view(np.uint16)[nan]), backend
    assert clamped[x == 1e6].tolist() == [65504.0] * 2


@pytest.mark.parametrize("src_dt,tsrc", [(np.float16, torch.float16),
                                         (ml_dtypes.bfloat16, torch.bfloat16)])
def test_widening_and_between_halves(backend: str, src_dt: type, tsrc: torch.dtype) -> None:
    """Every FP16 (or BF16) bit pattern widened to FP32 and cast to the other half type: each
    non-NaN exact as torch gives it; NaNs NaN with their sign (numpy's bits)."""
    x = np.arange(2**16, dtype=np.uint16).view(src_dt)
    nan = np.isnan(x.astype(np.float32))
    wide = cast_array(x, "F32")
    assert np.array_equal(wide.view(np.int32)[~nan], _torch_bits(x, torch.float32)[~nan])
    assert np.isnan(wide[nan]).all()
    assert (np.signbit(wide[nan]) == np.signbit(x.astype(np.float32)[nan])).all()
    other, tother = (("BF16", torch.bfloat16) if src_dt is np.float16
                     else ("F16", torch.float16))
    stats = CastStats()
    got = cast_array(x, other, name="h", stats=stats)
    assert np.array_equal(got.view(np.int16)[~nan], _torch_bits(x, tother)[~nan]), backend
    assert np.isnan(got[nan].astype(np.float32)).all()
    if other == "F16":  # BF16 reaches 3.4e38: those become inf, and count
        big = np.isfinite(x.astype(np.float32)) & (np.abs(x.astype(np.float32)) >= 65520)
        assert stats.overflow == {"h": int(big.sum())}


def test_from_f64_edges(backend: str) -> None:
    x = np.array([1e300, -1e300, 1e-300, -1e-300, 5e-324, 65519.99999, 65520.0, np.inf,
                  -np.inf, 2.0**-149, 2.0**-150, 3 * 2.0**-150, 3.5e38], np.float64)
    stats = CastStats()
    f16 = cast_array(x, "F16", name="d", stats=stats).astype(np.float64)
    assert f16[:4].tolist() == [np.inf, -np.inf, 0.0, -0.0]
    assert f16[5:7].tolist() == [65504.0, np.inf]
    assert stats.overflow == {"d": 4}  # ±1e300, 65520 and 3.5e38; not the infinities
    clamped = cast_array(x, "F16", clamp=True).astype(np.float64)
    assert clamped[[0, 1, 6, 12]].tolist() == [65504.0, -65504.0, 65504.0, 65504.0]
    assert clamped[[7, 8]].tolist() == [np.inf, -np.inf]
    f32 = cast_array(x, "F32")
    # FP32: beyond its range is inf (not counted: only FP16 refuses); 2**-150 is the tie
    # with 0 (to even), 3 * 2**-150 rounds up to 2 * 2**-149.
    assert f32[[0, 9, 10, 11]].tolist() == [np.inf, 2.0**-149, 0.0, 2.0**-148]
    with np.errstate(over="ignore"):
        assert np.array_equal(f32, x.astype(np.float32))
    bf = cast_array(x, "BF16").astype(np.float64)
    # BF16's smallest subnormal is 2**-133: 2**-149 underflows to 0; 3.5e38 overflows.
    assert bf[[0, 9, 12]].tolist() == [np.inf, 0.0, np.inf]
    nan = cast_array(np.array([np.nan, -np.nan]), "F16")
    assert np.isnan(nan).all() and np.signbit(nan).tolist() == [False, True]


def test_overflow_refusal_unchanged() -> None:
    stats = CastStats()
    cast_array(np.array([7e4, 1.0, -9e4], np.float32), "F16", name="w", stats=stats)
    with pytest.raises(CkptError) as e:
        cast.check_overflow(stats, clamp=False)
    assert e.value.message == ("2 value(s) exceed FP16's range (±65504) and would become inf: "
                               "w (2); nothing written")
    assert e.value.hint == "use to bf16, keep_fp32 GLOB for those tensors, or clamp"
    assert e.value.params == ("to", "keep_fp32", "clamp")  # the CLI words them as flags
    cast.check_overflow(stats, clamp=True)  # clamped: no refusal
