"""FP8 quantization's numpy kernel (ckpt_cli.fp8.quantize / quantize_pieces / Quantized)
against a straightforward torch reference written here: E4M3 codes and scales bit for bit,
over edge values, partial edge blocks, odd piece boundaries, and through ``convert``."""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from safetensors.torch import load_file

from ckpt_cli import fp8
from ckpt_cli.errors import CkptError
from ckpt_cli.fp8 import encode
from ckpt_cli.storage import reads
from tests.conftest import run_cli

pytestmark = pytest.mark.requires_torch

LAYOUTS = ("block", "channel", "tensor")


def reference(w: np.ndarray, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """Scales ``amax / 448`` (at least 2**-126, FP32's smallest normal) per 128x128 block
    (padded with zeros at the edges), row or tensor;
    ``(w / scale).clamp(-448, 448).to(float8_e4m3fn)`` with torch. Returns the codes as
    uint8 and the scales."""
    t = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    rows, cols = t.shape
    if layout == "block":
        r, c = math.ceil(rows / 128), math.ceil(cols / 128)
        padded = torch.zeros(r * 128, c * 128)
        padded[:rows, :cols] = t
        blocks = padded.view(r, 128, c, 128)
        amax = blocks.abs().amax(dim=(1, 3))
        scale = torch.clamp(amax / 448.0, min=2.0 ** -126)
        q = (blocks / scale[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        q = q.view(r * 128, c * 128)[:rows, :cols]
    else:
        amax = (t.abs().amax(dim=1, keepdim=True) if layout == "channel"
                else t.abs().amax().reshape(1))
        scale = torch.clamp(amax / 448.0, min=2.0 ** -126)
        q = (t / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.contiguous().view(torch.uint8).numpy(), scale.contiguous().numpy()


def assert_same(w: np.ndarray, layout: str) -> None:
    q, s = fp8.quantize(w, layout)
    rq, rs = reference(w, layout)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == np.float32 and s.shape == fp8.scale_shape(w.shape, layout)
    codes = q.view(np.uint8)
    bad = np.argwhere(codes != rq)
    assert bad.size == 0, (layout, bad[:5].tolist(), codes[tuple(bad[0])], rq[tuple(bad[0])])
    assert np.array_equal(s.view(np.uint32), rs.view(np.uint32)), layout


def edge_matrix() -> np.ndarray:
    """300x400 (partial edge blocks both ways) holding the cases the kernel branches on."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((300, 400)).astype(np.float32) * 0.02
    w[:128, :128] = 0.0                                   # an all-zero block
    w[5, 5] = -0.0                                        # in it: a negative zero
    w[140] = 0.0                                          # an all-zero row
    w[141, 128:256] = -0.0
    w[150:160, 10:20] = np.float32(1e-41)                 # FP32 subnormals beside normals
    # an all-subnormal block
    w[:128, 128:256] = rng.standard_normal((128, 128)).astype(np.float32) * 1e-41
    w[:128, 256:384] = 0.0
    w[3, 300], w[4, 301] = np.float32(1.4e-45), np.float32(-2.8e-45)  # amax/448 underflows to 0
    w[128:256, 256:384] *= np.float32(1e-36)              # a scale that is an FP32 subnormal
    w[256:, 384:] = np.float32(-3.0)                      # a constant partial edge block
    # A block whose amax is 448 (scale exactly 1): exact E4M3 ties and their neighbours.
    ties = np.array([448, 17, 19, 21, 23, 0.5 + 2**-5, 0.5 + 3 * 2**-5, 1.5 * 2**-9,
                     2.5 * 2**-9, 0.5 * 2**-9, 2**-10, 2**-6 - 2**-10, 2**-6 - 2**-11,
                     np.nextafter(np.float32(17), np.float32(0)), np.nextafter(
                         np.float32(17), np.float32(99)), 464, 447.99, 240, 232, 248],
                    dtype=np.float32)
    w[256:276, 128] = ties
    w[276:296, 128] = -ties
    w[256:, 129:256] = 0.0
    return w


@pytest.mark.parametrize("layout", LAYOUTS)
def test_edge_values_bit_for_bit(layout: str) -> None:
    assert_same(edge_matrix(), layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_kind_of_fp32_value_encodes_as_torch_does(layout: str) -> None:
    """2M random FP32 bit patterns within ±448 (normals, subnormals, zeros of both signs)
    in rows whose amax is 448, so the scale is exactly 1 and every value meets the encoder
    as it is."""
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 0x43E00001, size=(128, 16384), dtype=np.uint32)
    bits[:, ::2] |= np.uint32(0x80000000)
    bits[:, 0] = 0x43E00000  # 448: every row, block and the tensor have amax 448
    bits[:, 1:64] = rng.integers(0, 0x3C800000, size=(128, 63), dtype=np.uint32)  # < 2**-6
    assert_same(bits.view(np.float32), layout)


@pytest.mark.parametrize("dtype", [np.float64, np.float16, ml_dtypes.bfloat16])
def test_other_source_dtypes_widen_first(dtype: type) -> None:
    w = np.random.default_rng(2).standard_normal((256, 384)).astype(dtype)
    for layout in LAYOUTS:
        assert_same(w, layout)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_finite_values_are_refused(bad: float, layout: str) -> None:
    w = np.ones((256, 256), dtype=np.float32)
    w[200, 7] = bad
    with pytest.raises(CkptError, match="non-finite values cannot be quantized"):
        fp8.quantize(w, layout)
    q = fp8.Quantized(lambda: w, layout, "m.weight")
    with pytest.raises(CkptError, match=r"^m\.weight: non-finite"):
        q.weight()
    with pytest.raises(CkptError, match=r"^m\.weight: non-finite"):
        q.scale()


def _split(flat: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    out, pos = [], 0
    for n in sizes:
        out.append(flat[pos:pos + n])
        pos += n
    out.append(flat[pos:])
    return [p for p in out if p.size]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sizes", [[1000] * 200, [7, 128 * 384 - 7, 1, 128 * 384 * 2 + 5],
                                   [300 * 384 - 1]])
def test_pieces_split_anywhere_give_the_same_codes(layout: str, sizes: list[int]) -> None:
    """Pieces that split rows and 128-row groups anywhere (a group straddling two pieces is
    copied together) give the whole tensor's codes and scales."""
    w = edge_matrix()[:, :384].copy()
    flat = w.reshape(-1)
    scale = np.empty(fp8.scale_shape(w.shape, layout), dtype=np.float32)
    got = list(fp8.quantize_pieces(lambda: iter(_split(flat, sizes)), w.shape, layout, scale))
    assert all(p.dtype == ml_dtypes.float8_e4m3fn and p.ndim == 1 for p in got)
    rq, rs = reference(w, layout)
    assert np.array_equal(np.concatenate(got).view(np.uint8), rq.reshape(-1))
    assert np.array_equal(scale, rs)


def test_pieces_of_the_wrong_total_are_refused() -> None:
    scale = np.empty((1, 1), dtype=np.float32)
    w = np.ones(128 * 100, dtype=np.float32)
    with pytest.raises(ValueError, match="expected"):
        list(fp8.quantize_pieces(lambda: iter((w[:-1],)), (128, 100), "block", scale))
    with pytest.raises(ValueError, match="more than"):
        list(fp8.quantize_pieces(lambda: iter((w, w[:1])), (128, 100), "block", scale))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantized_streams_and_gives_the_scale_in_any_order(layout: str) -> None:
    w = edge_matrix()
    flat = w.reshape(-1)
    rq, rs = reference(w, layout)
    calls = []

    def pieces() -> object:
        calls.append(1)
        return iter(_split(flat, [5000] * 30))

    def no_load() -> np.ndarray:
        raise AssertionError("the whole tensor was loaded")

    q = fp8.Quantized(no_load, layout, "x.weight", pieces=pieces, shape=w.shape)
    # the scale first (a shard of its own): one amax pass over the source
    assert np.array_equal(q.scale(), rs)
    parts = list(q.weight_pieces())
    assert len(parts) > 1
    assert np.array_equal(np.concatenate(parts).view(np.uint8), rq.reshape(-1))
    assert np.array_equal(q.scale(), rs)  # the one the weight pass filled in
    assert np.array_equal(q.scale(), rs)  # asked again: computed again
    assert np.array_equal(q.weight().view(np.uint8), rq)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_convert_streams_a_weight_larger_than_a_piece(layout: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With 64 KiB pieces a 640x384 FP32 weight (960 KiB) is read, quantized and written in
    pieces that split rows and blocks; the output is the reference's, bit for bit."""
    monkeypatch.setattr(reads, "PIECE_BYTES", 64 << 10)
    w = np.random.default_rng(5).standard_normal((640, 384)).astype(np.float32) * 0.05
    w[130:140] = 0.0
    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.layers.0.mlp.up_proj.weight": w,
               "model.norm.weight": np.ones(384, dtype=np.float32)},
              str(src / "model.safetensors"))
    seen: list[int] = []
    real = fp8.quantize_pieces

    def counting(*args: object, **kw: object) -> object:
        for p in real(*args, **kw):  # type: ignore[arg-type]
            seen.append(p.size)
            yield p

    monkeypatch.setattr(encode, "quantize_pieces", counting)  # where Quantized finds it
    r = run_cli("convert", src, "--to", "fp8", "--fp8-layout", layout, "-o", tmp_path / "out")
    assert r.exit_code == 0, r.output
    got = load_file(tmp_path / "out" / "model.safetensors")
    rq, rs = reference(w, layout)
    name = "model.layers.0.mlp.up_proj"
    assert np.array_equal(got[name + ".weight"].view(torch.uint8).numpy(), rq)
    assert np.array_equal(got[name + "." + fp8.scale_name(layout)].numpy(), rs)
    assert len(seen) > 3 and sum(seen) == w.size and max(seen) <= (64 << 10) // 4 + 128 * 384


def reference_dequant(w: np.ndarray, s: np.ndarray, dst: str) -> np.ndarray:
    """``(w.float() * s).to(dst)`` with torch, the scale repeated over its 128x128 blocks."""
    tw = torch.from_numpy(w.view(np.uint8)).view(
        torch.float8_e4m3fn if w.dtype == ml_dtypes.float8_e4m3fn else torch.float8_e5m2)
    ts = torch.from_numpy(s.astype(np.float32))
    kind = fp8.scale_kind(w.shape, s.shape)
    if kind == "block":
        ts = ts.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    elif kind == "channel":
        ts = ts.reshape(-1, 1)
    else:
        ts = ts.reshape(())
    tdt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[dst]
    out = (tw.float() * ts).to(tdt)
    return out.view(torch.int16).numpy() if dst != "F32" else out.view(torch.int32).numpy()


@pytest.mark.parametrize("fmt", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2])
@pytest.mark.parametrize("dst", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("scale_shape", ["block", "channel", "tensor", "channel-1d",
                                         "tensor-0d"])
def test_dequantize_bit_for_bit_torch(fmt: type, dst: str, scale_shape: str) -> None:
    """Every FP8 code but NaN (E5M2's inf too), partial edge blocks, scales in FP32, BF16 and
    FP16 (F16 overflow to inf as torch gives it)."""
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 256, size=(300, 272), dtype=np.uint8)
    codes[0, :256] = np.arange(256, dtype=np.uint8)
    w = codes.view(fmt)
    nan = np.isnan(w.astype(np.float32))
    codes[nan] = 0
    shapes = {"block": (3, 3), "channel": (300, 1), "tensor": (1,), "channel-1d": (300,),
              "tensor-0d": ()}
    for sdt in (np.float32, ml_dtypes.bfloat16, np.float16):
        s = (rng.uniform(1e-4, 300.0, size=shapes[scale_shape])).astype(sdt)
        got = fp8.dequantize(w, s, dst)
        bits = got.view(np.int16 if dst != "F32" else np.int32)
        assert np.array_equal(bits, reference_dequant(w, s, dst)), (sdt, dst)


def test_dequantize_refuses_a_scale_of_no_known_shape() -> None:
    w = np.zeros((256, 256), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    with pytest.raises(CkptError, match="fits no convention"):
        fp8.dequantize(w, np.ones((3, 3), dtype=np.float32), "BF16")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sizes", [[1000] * 200, [7, 128 * 272 - 7, 1, 128 * 272 * 2 + 5]])
def test_dequantize_pieces_split_anywhere(layout: str, sizes: list[int],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Flat FP8 pieces split anywhere, outputs capped at a (small) piece: the whole
    tensor's dequantization, in order."""
    monkeypatch.setattr(reads, "PIECE_BYTES", 200 * 272 * 2)
    w = np.random.default_rng(9).standard_normal((300, 272)).astype(np.float32)
    q, s = fp8.quantize(w, layout)
    flat = q.reshape(-1)
    got = list(fp8.dequantize_pieces(iter(_split(flat, sizes)), s, q.shape, "BF16"))
    assert len(got) > 1 and all(p.ndim == 1 and p.nbytes <= 200 * 272 * 2 for p in got)
    whole = fp8.dequantize(q, s, "BF16")
    assert np.array_equal(np.concatenate(got).view(np.int16), whole.reshape(-1).view(np.int16))


def test_convert_dequantize_streams_a_weight_larger_than_a_piece(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block-FP8 640x384 weight read and dequantized in 64 KiB pieces equals torch's
    ``w.float() * scale_inv`` (repeated over the blocks) in BF16."""
    monkeypatch.setattr(reads, "PIECE_BYTES", 64 << 10)
    w = np.random.default_rng(6).standard_normal((640, 384)).astype(np.float32)
    q, s = fp8.quantize(w, "block")
    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.layers.0.mlp.up_proj.weight": q.view(np.uint8),
               "model.layers.0.mlp.up_proj.weight_scale_inv": s},
              str(src / "model.safetensors"))
    # safetensors.numpy writes uint8: retag the weight as F8_E4M3 through torch
    t = load_file(src / "model.safetensors")
    t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].view(
        torch.float8_e4m3fn)
    from safetensors.torch import save_file as save_torch
    save_torch(t, str(src / "model.safetensors"))
    r = run_cli("convert", src, "--to", "bf16", "--dequantize", "-o", tmp_path / "out")
    assert r.exit_code == 0, r.output
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert list(got) == ["model.layers.0.mlp.up_proj.weight"]
    ref = reference_dequant(q, s, "BF16")
    assert np.array_equal(got["model.layers.0.mlp.up_proj.weight"].view(torch.int16).numpy(),
                          ref)
