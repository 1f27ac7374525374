"""convert --to fp8 (block, channel, tensor layouts) and --dequantize, on checkpoints written
by transformers, torch.distributed.checkpoint and DeepSpeed ZeRO; read back by transformers
and compressed-tensors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpt_cli import fp8
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.fp8 import LAYOUTS, convert_each_layout
from tests.helpers.loads import safetensors_dir as _tensors
from tests.helpers.makers import tiny_llama

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.requires_torch

# Relative L2 error of FP32 -> FP8 E4M3 -> BF16 per tensor, as the README states: E4M3 has
# 3 mantissa bits (relative rounding error up to 2**-4 per value, ~2.5-3.5% RMS on Gaussian
# weights); a per-tensor scale wastes range on outliers, hence the looser bound.
BOUND = {"block": 0.045, "channel": 0.045, "tensor": 0.06}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved by transformers: q/o 256x256, k/v 128x256, gate/up 400x256 and
    down 256x400 (400: partial 128-blocks), untied lm_head 320x256."""
    return tiny_llama(tmp_path_factory.mktemp("llama") / "src", 400)


@pytest.fixture(scope="module")
def quantized(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return convert_each_layout(llama, tmp_path_factory.mktemp("fp8"), "--max-shard-size", "1MB")


def _ref_dequant(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The reference, written here: FP32 product, rounded once to BF16."""
    if s.dim() == 2 and s.shape[1] != 1:
        full = s.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
        return (w.float() * full[: w.shape[0], : w.shape[1]]).to(torch.bfloat16)
    return (w.float() * s.float()).to(torch.bfloat16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_output_tensors_and_config(llama: Path, quantized: dict[str, Path],
                                       layout: str) -> None:
    out = quantized[layout]
    src = _tensors(llama)
    got = _tensors(out)
    assert (out / "model.safetensors.index.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert cfg["dtype" if "dtype" in cfg else "torch_dtype"] == "bfloat16"
    scale_key = "weight_scale_inv" if layout == "block" else "weight_scale"
    linear = [n for n in src if n.endswith("_proj.weight")]
    assert len(linear) == 14
    # block: the MLP's 400-wide weights are not whole 128-blocks: left in BF16 and listed
    mlp = sorted(n.removesuffix(".weight") for n in linear if ".mlp." in n)
    if layout == "block":
        for m in mlp:
            assert got[m + ".weight"].dtype == torch.bfloat16
            assert m + ".weight_scale_inv" not in got
        linear = [n for n in linear if ".mlp." not in n]
    for name in linear:
        w, s = got[name], got[name.removesuffix("weight") + scale_key]
        assert w.dtype == torch.float8_e4m3fn and w.shape == src[name].shape
        assert s.dtype == torch.float32
        assert tuple(s.shape) == fp8.scale_shape(tuple(w.shape), layout)
        assert torch.isfinite(s).all() and (s > 0).all()
        # round trip within the README's bound
        deq = _ref_dequant(w, s).float()
        err = (deq - src[name]).norm() / src[name].norm()
        assert err < BOUND[layout], (name, float(err))
        # saturating, amax maps to 448 in every group
        assert w.float().abs().max() <= 448
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert got[name].dtype == torch.bfloat16
    with safe_open(out / next(iter(sorted(p.name for p in out.glob("*.safetensors")))),
                   "pt") as f:
        assert "ckpt.conversion" in (f.metadata() or {})
        assert f"to=fp8 ({layout})" in f.metadata()["ckpt.conversion"]
    if layout == "block":
        ignore = sorted(["lm_head", *mlp])
        assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 128], "modules_to_not_convert": ignore,
                      "ignored_layers": ignore}
    else:
        assert qc["quant_method"] == "compressed-tensors"
        assert qc["format"] == "float-quantized" and qc["ignore"] == ["lm_head"]
        acts = qc["config_groups"]["group_0"]["input_activations"]
        assert acts["strategy"] == "token" and acts["dynamic"] is True


def test_block_scale_matches_amax_over_448(llama: Path, quantized: dict[str, Path]) -> None:
    src = _tensors(llama)["model.layers.0.self_attn.q_proj.weight"]  # 256x256
    got = _tensors(quantized["block"])
    s = got["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert s.shape == (2, 2)
    for i in range(2):
        for j in range(2):
            blk = src[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert s[i, j] == blk.abs().max() / 448
    w = got["model.layers.0.self_attn.q_proj.weight"]
    expect = (src / s.repeat_interleave(128, 0).repeat_interleave(128, 1)).clamp(
        -448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(w.view(torch.uint8), expect.view(torch.uint8))


def test_partial_blocks_quantize_per_edge_block() -> None:
    """fp8.quantize on a 400x256 weight (DeepSeek's ceil convention for an edge block)."""
    torch.manual_seed(3)
    src = torch.randn(400, 256)
    q, sc = fp8.quantize(src.numpy(), "block")
    s = torch.from_numpy(sc)
    assert s.shape == (4, 2)
    for i in range(4):
        for j in range(2):
            blk = src[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert s[i, j] == blk.abs().max() / 448
    expect = (src / s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:400]).clamp(
        -448, 448).to(torch.float8_e4m3fn)
    assert (q.view("uint8") == expect.view(torch.uint8).numpy()).all()


@pytest.mark.parametrize("layout", ["channel", "tensor"])
def test_compressed_tensors_reads_and_dequantizes_identically(quantized: dict[str, Path],
                                                              layout: str) -> None:
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    out = quantized[layout]
    qc = QuantizationConfig.model_validate(
        json.loads((out / "config.json").read_text())["quantization_config"])
    assert qc.format == "float-quantized"
    args = qc.config_groups["group_0"].weights
    assert args is not None and args.strategy == layout and args.num_bits == 8
    got = _tensors(out)
    names = [n for n in got if n.endswith(".weight_scale")]
    assert names
    for sname in names:
        wname = sname.removesuffix("_scale")
        theirs = dequantize(got[wname], got[sname], args=args).to(torch.bfloat16)
        import numpy as np
        ours = fp8.dequantize(got[wname].view(torch.uint8).numpy().view(
            __import__("ml_dtypes").float8_e4m3fn), got[sname].numpy(), "BF16")
        assert np.array_equal(theirs.view(torch.int16).numpy(), ours.view(np.int16)), wname


@pytest.mark.parametrize("layout", LAYOUTS)
def test_transformers_loads_on_cpu(llama: Path, quantized: dict[str, Path],
                                   layout: str, tmp_path: Path) -> None:
    """On CPU transformers dequantizes both configs to BF16 at load (the FP8 kernels need a
    GPU of compute capability >= 8.9); the loaded weights equal ckpt's --dequantize."""
    kw: dict[str, Any] = {}
    if layout != "block":
        kw["quantization_config"] = transformers.CompressedTensorsConfig(run_compressed=False)
    with third_party_quiet():
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            quantized[layout], output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    r = run_cli("convert", quantized[layout], "--to", "bf16", "--dequantize", "-o",
                tmp_path / "dq")
    assert r.exit_code == 0, r.output
    assert "quantization_config" not in json.loads((tmp_path / "dq" / "config.json").read_text())
    ours = _tensors(tmp_path / "dq")
    assert not any("scale" in n for n in ours)
    sd = model.state_dict()
    for name in ours:
        assert torch.equal(sd[name].to(torch.bfloat16), ours[name]), name
    ref = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        a = model(ids).logits.float()
        b = ref(ids).logits
    assert (a - b).norm() / b.norm() < 0.1


def test_dequantize_block_bit_for_bit(quantized: dict[str, Path], tmp_path: Path) -> None:
    got = _tensors(quantized["block"])
    r = run_cli("convert", quantized["block"], "--to", "bf16", "--dequantize", "-o",
                tmp_path / "dq")
    assert r.exit_code == 0, r.output
    ours = _tensors(tmp_path / "dq")
    n = 0
    for name, w in got.items():
        if w.dtype != torch.float8_e4m3fn:
            continue
        s = got[name.removesuffix("weight") + "weight_scale_inv"]
        ref = (w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[
            : w.shape[0], : w.shape[1]]).to(torch.bfloat16)
        assert torch.equal(ours[name].view(torch.int16), ref.view(torch.int16)), name
        n += 1
    assert n == 8


def test_dequantize_bf16_scales_and_scale_weight_name(tmp_path: Path) -> None:
    torch.manual_seed(1)
    w = (torch.randn(130, 260) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3).to(torch.bfloat16) + 0.01
    c = torch.rand(64, 1) + 0.01
    save_file({"a.weight": w, "a.weight_scale_inv": s,
               "b.weight": w[:64, :64].contiguous(), "b.scale_weight": c},
              str(tmp_path / "m.safetensors"))
    r = run_cli("convert", tmp_path / "m.safetensors", "--to", "fp32", "--dequantize", "-o",
                tmp_path / "o.safetensors")
    assert r.exit_code == 0, r.output
    got = load_file(tmp_path / "o.safetensors")
    assert set(got) == {"a.weight", "b.weight"}
    full = s.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :260]
    assert torch.equal(got["a.weight"], w.float() * full)
    assert torch.equal(got["b.weight"], w[:64, :64].float() * c)


@pytest.mark.parametrize("case", ["missing", "misshaped"])
def test_dequantize_refuses_missing_or_misshaped_scale(tmp_path: Path, case: str) -> None:
    w = torch.randn(256, 256).to(torch.float8_e4m3fn)
    sd = {"x.weight": w, "ok.weight": w.clone(), "ok.weight_scale_inv": torch.ones(2, 2)}
    if case == "misshaped":
        sd["x.weight_scale_inv"] = torch.ones(3, 2)
    save_file(sd, str(tmp_path / "m.safetensors"))
    r = run_cli("convert", tmp_path / "m.safetensors", "--to", "bf16", "--dequantize", "-o",
                tmp_path / "out")
    assert r.exit_code == 2, r.output
    assert "x.weight" in r.output and "Traceback" not in r.output
    assert "ok.weight" not in r.output.replace("x.weight", "")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_fp8_from_dcp(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(2)
    sd = {"model": {"enc.proj.weight": torch.randn(256, 384), "enc.norm.weight": torch.ones(384),
                    "head.weight": torch.randn(48, 256), "enc.proj.bias": torch.zeros(256)}}
    with third_party_quiet():
        dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"))  # type: ignore[attr-defined]
    for layout in LAYOUTS:
        out = tmp_path / layout
        r = run_cli("convert", tmp_path / "dcp", "--to", "fp8", "--fp8-layout", layout,
                    "-o", out)
        assert r.exit_code == 0, r.output
        got = _tensors(out)
        w = got["enc.proj.weight"]
        assert w.dtype == torch.float8_e4m3fn
        s = got["enc.proj." + fp8.scale_name(layout)]
        err = (_ref_dequant(w, s).float() - sd["model"]["enc.proj.weight"]).norm() / \
            sd["model"]["enc.proj.weight"].norm()
        assert err < BOUND[layout]
        assert got["enc.proj.bias"].dtype == torch.bfloat16
        # 48 rows: one partial 128-row block (the engines' ceil scale rows), a multiple of 16
        assert got["head.weight"].dtype == torch.float8_e4m3fn
        said = " ".join(r.output.split())
        if layout == "block":
            assert tuple(got["head.weight_scale_inv"].shape) == (1, 2)
            assert "1 weight(s) end in a partial 128-row block (e.g. head.weight)" in said
        else:
            assert "partial 128-row block" not in said


@pytest.fixture(scope="module")
def zero_wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import HAS_DEEPSPEED
    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    from tests.helpers.makers import deepspeed_checkpoints

    return deepspeed_checkpoints(tmp_path_factory.mktemp("dsw"), ["z2-fp32+wide"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_from_zero(zero_wide: Path, tmp_path: Path, layout: str) -> None:
    src = zero_wide / "z2-fp32+wide"
    full = tmp_path / "full.safetensors"
    assert run_cli("convert", src, "--to", "fp32", "-o", full).exit_code == 0
    ref = load_file(full)
    r = run_cli("convert", src, "--to", "fp8", "--fp8-layout", layout, "-o", tmp_path / "q")
    assert r.exit_code == 0, r.output
    got = _tensors(tmp_path / "q")
    w, s = got["0.weight"], got["0." + fp8.scale_name(layout)]  # 128x256
    assert w.dtype == torch.float8_e4m3fn
    assert tuple(s.shape) == fp8.scale_shape((128, 256), layout)
    err = (_ref_dequant(w, s).float() - ref["0.weight"]).norm() / ref["0.weight"].norm()
    assert err < BOUND[layout]
    # 32x128: one partial 128-row block (K = 128 whole): every layout holds it
    assert got["2.weight"].dtype == torch.float8_e4m3fn
    assert got["1.weight"].dtype == torch.bfloat16  # LayerNorm


def test_qualifies_is_explainable() -> None:
    assert fp8.qualifies("model.layers.0.mlp.gate_proj.weight", "F32", (512, 256), "block") \
        == (True, None)
    assert fp8.qualifies("model.embed_tokens.weight", "F32", (512, 256), "block")[1] \
        == "embedding"
    assert fp8.qualifies("lm_head.weight", "F32", (512, 256), "block")[1] \
        == "output head (lm_head)"
    assert fp8.qualifies("model.layers.0.mlp.gate.weight", "F32", (8, 256), "channel")[1] \
        == "MoE router"
    assert fp8.qualifies("x.bias", "F32", (512,), "block") == (False, None)
    assert "multiple of 16" in str(fp8.qualifies("x.weight", "F32", (40, 256), "channel")[1])
    assert math.ceil(400 / 128) == fp8.scale_shape((400, 256), "block")[0]


def test_bad_layout_is_a_usage_error(llama: Path, tmp_path: Path) -> None:
    r = run_cli("convert", llama, "--to", "fp8", "--fp8-layout", "rows", "-o", tmp_path / "o")
    assert r.exit_code == 2 and "--fp8-layout" in r.output
    r = run_cli("convert", llama, "--to", "fp8", "--dequantize", "-o", tmp_path / "o")
    assert r.exit_code == 2 and "--dequantize" in r.output


def test_validate_checks_fp8_scales_and_config(quantized: dict[str, Path],
                                               tmp_path: Path) -> None:
    r = run_cli("validate", quantized["block"], "--json")
    assert r.exit_code == 0, r.output
    checks = {c["id"]: c for c in json.loads(r.stdout)["checkpoints"][0]["checks"]}
    assert checks["quantization"]["status"] == "pass"
    assert "8 FP8 weight(s), scales: 8 per block" in checks["quantization"]["summary"]
    w = torch.randn(256, 256).to(torch.float8_e4m3fn)
    save_file({"a.weight": w.clone(), "a.weight_scale_inv": torch.tensor([[1.0, 0.0],
                                                                          [1.0, 1.0]]),
               "b.weight": w.clone(), "c.weight": w.clone(), "c.weight_scale": torch.ones(3)},
              str(tmp_path / "bad.safetensors"))
    r = run_cli("validate", tmp_path / "bad.safetensors", "--json")
    assert r.exit_code == 1, r.output
    got = {(f["code"], f["location"]) for f in json.loads(r.stdout)["checkpoints"][0]["findings"]
           if f["check"] == "quantization"}
    assert got == {("fp8-scale-values", "a.weight_scale_inv"), ("fp8-no-scale", "b.weight"),
                   ("fp8-scale-shape", "c.weight_scale")}


def test_validate_without_fp8_has_no_quantization_check(llama: Path) -> None:
    r = run_cli("validate", llama, "--json")
    assert r.exit_code == 0, r.output
    assert "quantization" not in {c["id"] for c in json.loads(r.stdout)["checkpoints"][0]["checks"]}


def test_fp8_refuses_pt_and_fp8_sources(quantized: dict[str, Path], llama: Path,
                                        tmp_path: Path) -> None:
    r = run_cli("convert", llama, "--to", "fp8", "--format", "pt", "-o", tmp_path / "o")
    assert r.exit_code == 2 and "--output-format pt" in r.output
    r = run_cli("convert", quantized["block"], "--to", "fp8", "-o", tmp_path / "o")
    assert r.exit_code == 2 and "already holds 8 FP8 tensor(s)" in " ".join(r.output.split())
    assert not (tmp_path / "o").exists()


def test_fp8_config_in_metadata_without_config_json(tmp_path: Path) -> None:
    torch.manual_seed(4)
    save_file({"l.weight": torch.randn(128, 128)}, str(tmp_path / "m.safetensors"))
    r = run_cli("convert", tmp_path / "m.safetensors", "--to", "fp8", "-o", tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert "ckpt.quantization_config" in " ".join(r.output.split())
    with safe_open(tmp_path / "o" / "model.safetensors", "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["ckpt.quantization_config"]) == fp8.quantization_config(
        "block", ["lm_head"])
