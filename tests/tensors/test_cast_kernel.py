"""The integer FP32->FP16 kernel (``cast.f32_to_f16``) against numpy's and torch's casts, the
thread knob (``CKPT_THREADS``) and the per-stage report (``CKPT_STAGE_REPORT``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ckpt_cli.storage import reads
from ckpt_cli.tensors import cast

pytestmark = pytest.mark.requires_torch


KERNELS = ["numpy", "f16c"]


@pytest.fixture(params=KERNELS)
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each FP32->FP16 kernel in turn: the compiled F16C one and the numpy one."""
    cast._compiled_f16.cache_clear()
    if request.param == "numpy":
        monkeypatch.setenv("CKPT_NO_F16C", "1")
    else:
        monkeypatch.delenv("CKPT_NO_F16C", raising=False)
        if cast.f16_kernel() != "f16c":
            pytest.skip("the compiled F16C kernel is not built or this CPU lacks F16C")
    assert cast.f16_kernel() == request.param
    yield request.param
    cast._compiled_f16.cache_clear()


def _kernel(bits: np.ndarray) -> np.ndarray:
    src = bits.astype(np.uint32).view(np.float32)
    out = np.full(src.size, 12345, np.uint16).view(np.float16)
    cast.f32_to_f16(src, out)
    return out.view(np.uint16)


def _numpy(bits: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return bits.astype(np.uint32).view(np.float32).astype(np.float16).view(np.uint16)


def _boundaries() -> np.ndarray:
    """For every FP16 value: the FP32 values at, just below, on and just above the midpoint
    to the next one (ties to even), both signs, plus every exponent's edges and NaN bits."""
    h = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    nxt = np.arange(1, 0x7C01, dtype=np.uint16).view(np.float16).astype(np.float32)
    mid = ((h.astype(np.float64) + nxt.astype(np.float64)) / 2).astype(np.float32)
    m = mid.view(np.uint32)
    pos = np.concatenate([h.view(np.uint32), m - 1, m, m + 1])
    exps = (np.arange(256, dtype=np.uint32) << 23)[:, None] + np.array(
        [0, 1, 0xFFF, 0x1000, 0x1001, 0x2000, 0x3FFFFF, 0x400000, 0x7FFFFF], np.uint32)
    pos = np.concatenate([pos, exps.reshape(-1)])
    return np.concatenate([pos, pos | np.uint32(0x80000000)])


def test_every_rounding_boundary_matches_numpy(kernel: str) -> None:
    bits = _boundaries()
    assert np.array_equal(_kernel(bits), _numpy(bits))


def test_random_bit_patterns_match_numpy(kernel: str) -> None:
    g = np.random.default_rng(7)
    bits = g.integers(0, 2**32, size=3_000_001, dtype=np.uint64)  # not a multiple of a pass
    assert np.array_equal(_kernel(bits), _numpy(bits))


def test_matches_torch_except_nan_bits(kernel: str) -> None:
    bits = _boundaries()
    src = bits.view(np.float32)
    ours = _kernel(bits)
    theirs = torch.from_numpy(src.copy()).half().numpy().view(np.uint16)
    finite = ~np.isnan(src)
    assert np.array_equal(ours[finite], theirs[finite])
    # NaNs: sign and top 10 payload bits kept (a zero payload becomes 1), as numpy does.
    nan = bits[~finite]
    want = ((nan >> 16) & 0x8000) | 0x7C00 | np.maximum((nan >> 13) & 0x3FF, 1)
    assert np.array_equal(ours[~finite], want.astype(np.uint16))


def test_edges_named(kernel: str) -> None:
    vals = np.array([0.0, -0.0, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-14,
                     65504.0, 65519.996, 65520.0, -65520.0, 1e30, np.inf, -np.inf],
                    np.float32)
    out = np.empty(vals.size, np.float16)
    cast.f32_to_f16(vals, out)
    assert out.view(np.uint16).tolist() == [
        0x0000, 0x8000, 0x0001, 0x0000, 0x0001, 0x0400,
        0x7BFF, 0x7BFF, 0x7C00, 0xFC00, 0x7C00, 0x7C00, 0xFC00]


def test_empty(kernel: str) -> None:
    out = np.empty(0, np.float16)
    cast.f32_to_f16(np.empty(0, np.float32), out)
    assert out.size == 0


def test_cast_array_uses_it_with_overflow_counted(kernel: str) -> None:
    vals = np.array([1.0, 7e4, -7e4, np.inf, np.nan, 3.0], np.float32)
    stats = cast.CastStats()
    saved = cast._TORCH.torch
    cast._TORCH.torch = None
    try:
        out = cast.cast_array(vals, "F16", name="w", stats=stats)
    finally:
        cast._TORCH.torch = saved
    assert stats.overflow == {"w": 2}
    assert np.array_equal(out.view(np.uint16), _numpy(vals.view(np.uint32)))


def test_threads_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_THREADS", "3")
    assert reads.worker_threads() == 3
    assert reads.default_jobs() == 3
    monkeypatch.setenv("CKPT_THREADS", "zero")
    assert 1 <= reads.worker_threads() <= 64
    assert 1 <= reads.default_jobs() <= 8
    monkeypatch.delenv("CKPT_THREADS")
    assert reads.worker_threads() == max(1, min(64, reads.usable_cpus()))


def test_stage_report(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    src = tmp_path / "m.safetensors"
    save_file({f"w{i}": torch.randn(512, 1024, generator=g) for i in range(4)}, str(src))
    report = tmp_path / "stages.json"
    env = {**os.environ, "CKPT_STAGE_REPORT": str(report), "CKPT_THREADS": "2"}
    code = "from ckpt_cli.cli.app import main; main()"
    p = subprocess.run([sys.executable, "-c", code, "convert", str(src), "--to", "fp16",
                        "-o", str(tmp_path / "out.safetensors"), "--quiet"],
                       env=env, capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    data = json.loads(report.read_text())
    assert data["threads_setting"] == 2
    st = data["stages"]
    assert st["cast"]["bytes"] == 4 * 512 * 1024 * 4
    assert 1 <= st["cast"]["threads"] <= 2
    assert st["write"]["bytes"] == 4 * 512 * 1024 * 2
    assert st["write"]["threads"] == 1
    assert st["read+cast"]["busy_s"] > 0


@pytest.mark.parametrize("threads", [1, 2, 16, 64])
def test_block_size_gives_every_thread_work(threads: int) -> None:
    n = 16 << 20  # a 64 MB piece of FP32
    step = cast._block_size(n, threads)
    assert cast._MIN_BLOCK <= step <= cast._BLOCK
    assert step % cast._MIN_BLOCK == 0
    assert -(-n // step) >= min(2 * threads, n // cast._MIN_BLOCK)
    assert cast._block_size(5, threads) == cast._MIN_BLOCK


def test_same_bytes_whatever_the_block_size(monkeypatch: pytest.MonkeyPatch) -> None:
    g = np.random.default_rng(3)
    vals = g.integers(0, 2**32, size=1_000_003, dtype=np.uint64).astype(np.uint32).view(
        np.float32)
    saved = cast._TORCH.torch
    cast._TORCH.torch = None
    try:
        outs = []
        for threads in (1, 7, 64):
            monkeypatch.setattr(cast, "_block_size", lambda n, t, k=threads: max(
                cast._MIN_BLOCK, -(-n // k)))
            stats = cast.CastStats()
            outs.append((cast.cast_array(vals, "F16", name="w", stats=stats).view(np.uint16),
                         stats.overflow))
    finally:
        cast._TORCH.torch = saved
    assert all(np.array_equal(o, outs[0][0]) and s == outs[0][1] for o, s in outs)
    assert outs[0][1]["w"] > 0


def test_every_length_and_offset_matches_numpy(kernel: str) -> None:
    """Tails (the compiled kernel converts 8 at a time) and unaligned starts, NaNs in both."""
    g = np.random.default_rng(11)
    bits = g.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    bits[::7] = 0x7F800001  # signalling NaNs (F16C would quiet them)
    bits[3::11] = 0xFFC00000
    src = bits.view(np.float32)
    for start in range(0, 9):
        for n in (0, 1, 7, 8, 9, 15, 16, 17, 63, 1000):
            s = src[start:start + n]
            out = np.full(s.size, 12345, np.uint16).view(np.float16)
            cast.f32_to_f16(s, out)
            assert np.array_equal(out.view(np.uint16), _numpy(s.view(np.uint32))), (start, n)


def test_the_compiled_kernel_is_built_where_it_can_be() -> None:
    """On x86-64 Linux with F16C and a C compiler, the install builds the kernel (setup.py's
    optional extension); elsewhere casts fall back to numpy's kernel."""
    import platform
    import shutil

    cpu = Path("/proc/cpuinfo")
    if not (sys.platform.startswith("linux") and platform.machine() == "x86_64"
            and cpu.exists() and " f16c" in cpu.read_text() and shutil.which("cc")):
        pytest.skip("not an x86-64 Linux machine with F16C and a C compiler")
    cast._compiled_f16.cache_clear()
    try:
        import ckpt_cli.tensors._f16c as f16c  # type: ignore[import-not-found]

        assert f16c.available
        assert os.environ.get("CKPT_NO_F16C") is not None or cast.f16_kernel() == "f16c"
    finally:
        cast._compiled_f16.cache_clear()


def test_compiled_kernel_refuses_mismatched_buffers() -> None:
    f16c = pytest.importorskip("ckpt_cli.tensors._f16c")
    with pytest.raises(ValueError, match="as many 2-byte halves"):
        f16c.f32_to_f16(np.zeros(4, np.float32), np.zeros(3, np.uint16))
    with pytest.raises(BufferError):
        f16c.f32_to_f16(np.zeros(4, np.float32), b"\0" * 8)  # read-only


def test_convert_output_is_the_same_with_either_kernel(tmp_path: Path) -> None:
    """A whole ``ckpt convert --to fp16`` gives the same bytes with the compiled kernel and
    with numpy's (overflow refused the same way, NaN bits the same)."""
    g = torch.Generator().manual_seed(3)
    t = torch.randn(300, 1001, generator=g) * 1000
    t[0, :5] = torch.tensor([float("nan"), -float("nan"), float("inf"), 65519.0, -1e-8])
    src = tmp_path / "m.safetensors"
    save_file({"w": t, "b": torch.randn(7, generator=g)}, str(src))
    outs = []
    for env_extra in ({}, {"CKPT_NO_F16C": "1"}):
        out = tmp_path / f"out{len(outs)}.safetensors"
        env = {k: v for k, v in os.environ.items() if k != "CKPT_NO_F16C"} | env_extra
        p = subprocess.run([sys.executable, "-m", "ckpt_cli", "convert", str(src), "--to",
                            "fp16", "-o", str(out), "--quiet"],
                           env=env, capture_output=True, text=True, check=False)
        assert p.returncode == 0, p.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
