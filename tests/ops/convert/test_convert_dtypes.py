"""``--to`` and dtypes: the copied config names the output's dtype, and quantized (FP8)
tensors and their scales are kept rather than widened (issue 24, items 1 and 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_cli.ops.consolidate import consolidate
from ckpt_cli.ops.convert import convert
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.makers import hf_sharded

pytestmark = pytest.mark.requires_torch


def _tiny_gpt2(out: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    with third_party_quiet():
        GPT2LMHeadModel(cfg).save_pretrained(out)
    return out


@pytest.mark.parametrize(("to", "want"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_from_pretrained_loads_the_converted_dtype(tmp_path: Path, to: str,
                                                   want: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    src = _tiny_gpt2(tmp_path / "gpt2")
    before = (src / "config.json").read_bytes()
    assert json.loads(before).get("dtype", json.loads(before).get("torch_dtype")) == "float32"
    out = tmp_path / "out"
    r = run_cli("convert", src, "--to", to, "-o", out)
    assert r.exit_code == 0, r.output
    with third_party_quiet():
        model = AutoModelForCausalLM.from_pretrained(out)  # its default dtype handling
    assert {p.dtype for p in model.parameters()} == {want}
    name = str(want).removeprefix("torch.")
    assert f"Config: config.json dtype float32 -> {name}" in r.stdout
    # Only the dtype's value changed: every other byte of the file is the source's.
    after = (out / "config.json").read_bytes()
    assert after == before.replace(b'"float32"', f'"{name}"'.encode())
    assert (src / "config.json").read_bytes() == before  # the source is untouched
    doc = json.loads(run_cli("convert", src, "--to", to, "-o", tmp_path / "o2",
                             "--json").stdout)
    assert doc["config_dtype"] == {"file": "config.json", "keys": ["dtype"], "from": "float32",
                                   "to": name}


def test_older_torch_dtype_spelling_and_nested_configs(tmp_path: Path) -> None:
    src = _tiny_gpt2(tmp_path / "gpt2")
    doc = json.loads((src / "config.json").read_text())
    # An older transformers file: "torch_dtype", plus a sub-config and a quantization config.
    doc = {("torch_dtype" if k == "dtype" else k): v for k, v in doc.items()}
    doc["text_config"] = {"torch_dtype": "float32", "hidden_size": 16}
    doc["quantization_config"] = {"quant_method": "fp8", "dtype": "float32"}
    (src / "config.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    doc = json.loads((src / "config.json").read_text())  # in the file's key order
    r = convert(src, tmp_path / "out", to="bf16")
    assert r.config_dtype is not None
    assert sorted(r.config_dtype["keys"]) == ["text_config.torch_dtype", "torch_dtype"]
    got = json.loads((tmp_path / "out" / "config.json").read_text())
    assert got["torch_dtype"] == "bfloat16" and got["text_config"]["torch_dtype"] == "bfloat16"
    assert got["quantization_config"] == {"quant_method": "fp8", "dtype": "float32"}
    assert list(got) == list(doc)  # key order kept
    assert {k: v for k, v in got.items() if k not in ("torch_dtype", "text_config")} == {
        k: v for k, v in doc.items() if k not in ("torch_dtype", "text_config")}


def test_config_untouched_without_a_cast(tmp_path: Path) -> None:
    from ckpt_cli.ops.convert import retype_config

    src = _tiny_gpt2(tmp_path / "gpt2")
    r = convert(src, tmp_path / "out")  # --to keep
    assert r.config_dtype is None
    assert (tmp_path / "out" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert retype_config(b"[1, 2]", "F16") == (b"[1, 2]", None)
    assert retype_config(b'{"dtype": "float16"}', "F16") == (b'{"dtype": "float16"}', None)


def _fp8_state_dict(fp8: torch.dtype) -> dict[str, torch.Tensor]:
    """Linear weights stored in FP8 with per-tensor scales, as FP8 training/serving saves them."""
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {"embed.weight": torch.randn(32, 8, generator=g)}
    for i in range(2):
        w = torch.randn(8, 8, generator=g)
        scale = w.abs().max() / torch.finfo(fp8).max
        sd[f"layers.{i}.fc.weight"] = (w / scale).to(fp8)
        sd[f"layers.{i}.fc.weight_scale"] = scale.reshape(())  # a 0-d FP32 scale
        sd[f"layers.{i}.fc.input_scale"] = torch.tensor(0.5)
        sd[f"layers.{i}.fc.bias"] = torch.randn(8, generator=g)
        sd[f"layers.{i}.norm.weight"] = torch.ones(8)
    return sd


@pytest.mark.parametrize(("fp8", "code"), [(torch.float8_e4m3fn, "F8_E4M3"),
                                           (torch.float8_e5m2, "F8_E5M2")])
@pytest.mark.parametrize("writer", ["safetensors", "torch"])
def test_fp8_tensors_and_scales_are_kept(tmp_path: Path, fp8: torch.dtype, code: str,
                                         writer: str) -> None:
    sd = _fp8_state_dict(fp8)
    if writer == "safetensors":
        src = tmp_path / "fp8.safetensors"
        save_file(sd, str(src))
    else:
        src = tmp_path / "fp8.pt"
        torch.save({"model": sd}, src)
    out = tmp_path / "out.safetensors"
    r = run_cli("convert", src, "--to", "fp16", "-o", out)
    assert r.exit_code == 0, r.output
    assert (f"Kept: {code} x2 (quantized; use a dequantizing conversion); F32 x4 (their "
            "scales)") in r.stdout
    got = load_file(out)
    for k, v in sd.items():
        if v.dtype == fp8 or k.endswith("_scale"):
            assert got[k].dtype == v.dtype, k  # not widened, not narrowed
            assert torch.equal(got[k].view(torch.uint8) if v.dtype == fp8 else got[k],
                               v.view(torch.uint8) if v.dtype == fp8 else v), k
        else:
            assert got[k].dtype == torch.float16, k
            assert torch.equal(got[k], v.to(torch.float16)), k
    # The scaled values are what the source means, not raw FP8 codes.
    deq = got["layers.0.fc.weight"].float() * got["layers.0.fc.weight_scale"]
    assert torch.equal(deq, sd["layers.0.fc.weight"].float() * sd["layers.0.fc.weight_scale"])
    doc = json.loads(run_cli("convert", src, "--to", "bf16", "-o",
                             tmp_path / "o2.safetensors", "--json").stdout)
    assert doc["kept"] == {code: 2} and doc["kept_scales"] == {"F32": 4}
    assert doc["casts"] == {"F32->BF16": 5}
    # --keep-fp32 does not widen a quantized tensor either.
    r2 = convert(src, tmp_path / "o3.safetensors", to="fp16", keep_fp32=("*",))
    assert r2.tensors["layers.0.fc.weight"][0] == code and r2.kept == {code: 2}


def test_consolidate_keeps_fp8_and_scales(tmp_path: Path) -> None:
    sd = _fp8_state_dict(torch.float8_e4m3fn)
    (tmp_path / "shards").mkdir()
    hf_sharded(tmp_path / "shards", sd, max_shard_size=300)
    r = consolidate(tmp_path / "shards", tmp_path / "one.safetensors", to="fp16",
                    max_shard_size=None)
    assert r.kept == {"F8_E4M3": 2} and r.kept_scales == {"F32": 4}
    got = load_file(tmp_path / "one.safetensors")
    assert got["layers.1.fc.weight"].dtype == torch.float8_e4m3fn
    assert got["layers.1.fc.weight_scale"].dtype == torch.float32
    assert got["layers.1.fc.bias"].dtype == torch.float16
    out = run_cli("consolidate", tmp_path / "shards", "-o", tmp_path / "two", "--to", "bf16")
    assert out.exit_code == 0, out.output
    # Beside "Kept: N tensors, all M of their elements": what was kept uncast.
    assert "Kept as is: F8_E4M3 x2 (quantized; use a dequantizing conversion)" in out.stdout


def test_to_fp32_still_widens_fp16_and_bf16(tmp_path: Path) -> None:
    """--to fp32 of 16-bit weights is an exact widening the user asks for: kept as before."""
    src = tmp_path / "half.safetensors"
    g = torch.Generator().manual_seed(0)
    sd = {"a": torch.randn(4, 4, generator=g).half(),
          "b": torch.randn(4, generator=g).bfloat16(), "c": torch.arange(3)}
    save_file(sd, str(src))
    r = convert(src, tmp_path / "f32.safetensors", to="fp32")
    assert r.casts == {"F16->F32": 1, "BF16->F32": 1} and r.kept == {}
    got = load_file(tmp_path / "f32.safetensors")
    assert torch.equal(got["a"], sd["a"].float()) and torch.equal(got["b"], sd["b"].float())
    assert torch.equal(got["c"], sd["c"])


def _packed_state_dict() -> dict[str, torch.Tensor]:
    """Integer-packed quantized layers as GPTQ/AWQ, compressed-tensors, bitsandbytes (4-bit and
    int8) save them, an FP8 attention with KV-cache scales, and plain FP32 tensors."""
    g = torch.Generator().manual_seed(0)

    def ints(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.randint(0, 100, shape, generator=g).to(dtype)

    return {
        "embed.weight": torch.randn(16, 8, generator=g),
        # GPTQ / AWQ
        "l.0.q_proj.qweight": ints(1, 8), "l.0.q_proj.qzeros": ints(1, 1),
        "l.0.q_proj.scales": torch.rand(1, 8, generator=g).half(),
        "l.0.q_proj.g_idx": ints(8), "l.0.q_proj.bias": torch.randn(8, generator=g).half(),
        # compressed-tensors pack-quantized
        "l.1.fc.weight_packed": ints(8, 1), "l.1.fc.weight_shape": torch.tensor([8, 8]),
        "l.1.fc.weight_scale": torch.rand(8, 1, generator=g),
        "l.1.fc.weight_zero_point": torch.rand(8, 1, generator=g),
        # bitsandbytes 4-bit and int8
        "l.2.fc.weight": ints(32, 1, dtype=torch.uint8),
        "l.2.fc.weight.absmax": torch.rand(1, generator=g),
        "l.2.fc.weight.quant_map": torch.rand(16, generator=g),
        "l.3.fc.weight": ints(8, 8, dtype=torch.int8), "l.3.fc.SCB": torch.rand(8, generator=g),
        # FP8 projections with the KV-cache scales in their parent module
        "l.4.self_attn.k_proj.weight": torch.randn(8, 8, generator=g).to(torch.float8_e4m3fn),
        "l.4.self_attn.k_proj.weight_scale": torch.tensor(0.25),
        "l.4.self_attn.k_scale": torch.tensor(0.5), "l.4.self_attn.v_scale": torch.tensor(0.5),
        "l.4.norm.weight": torch.ones(8),
    }


def test_integer_packed_quantized_tensors_and_companions_are_kept(tmp_path: Path) -> None:
    sd = _packed_state_dict()
    src = tmp_path / "packed.safetensors"
    save_file(sd, str(src))
    out = tmp_path / "out.safetensors"
    r = run_cli("convert", src, "--to", "fp16", "-o", out)
    assert r.exit_code == 0, r.output
    got = load_file(out)
    cast = {"embed.weight", "l.4.norm.weight", "l.0.q_proj.bias"}
    for k, v in sd.items():
        if k in cast:
            assert got[k].dtype == torch.float16, k
        else:  # packed codes, their scales/zeros/absmax/quant_map/SCB, the KV-cache scales
            assert got[k].dtype == v.dtype, k
            assert torch.equal(got[k].reshape(-1).view(torch.uint8),
                               v.reshape(-1).view(torch.uint8)), k
    assert "Kept: " in r.stdout and "(their scales)" in r.stdout
    doc = json.loads(run_cli("convert", src, "--to", "bf16", "-o",
                             tmp_path / "o2.safetensors", "--json").stdout)
    assert doc["kept"] == {"F8_E4M3": 1, "I32": 4, "U8": 1, "I8": 1}
    assert doc["kept_scales"] == {"F16": 1, "F32": 8}


def test_keep_fp32_beside_a_retyped_config_is_noted(tmp_path: Path) -> None:
    # The config now names float16, so from_pretrained casts the tensors kept in FP32 too:
    # the summary says so (issue #24 review).
    src = _tiny_gpt2(tmp_path / "gpt2")
    r = run_cli("convert", src, "--to", "fp16", "--keep-fp32", "*ln_*", "-o", tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert "--keep-fp32 kept in FP32 as float16 too" in r.output, r.output
    r = run_cli("convert", src, "--to", "fp16", "-o", tmp_path / "o2")
    assert "--keep-fp32" not in r.output
