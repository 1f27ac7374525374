"""inspect and diff of FP8 checkpoints: the scheme from metadata alone, and values compared
dequantized against the source (the README's error bounds)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_cli import fp8
from tests.conftest import run_cli

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.requires_torch

# The README's bound on the relative L2 error of one FP32 -> E4M3 round trip, per layout.
BOUND = {"block": 0.045, "channel": 0.045, "tensor": 0.06}
LAYOUTS = ("block", "channel", "tensor")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved by transformers in FP32: 256-wide attention (whole 128-blocks),
    400-wide MLP (left unquantized in the block layout), untied lm_head."""
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=400,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    out = tmp_path_factory.mktemp("llama") / "src"
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def quantized(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("fp8")
    outs = {}
    for layout in LAYOUTS:
        r = run_cli("convert", llama, "--to", "fp8", "--fp8-layout", layout, "-o",
                    base / layout)
        assert r.exit_code == 0, r.output
        outs[layout] = base / layout
    return outs


def _json(*args: Any) -> dict[str, Any]:
    r = run_cli(*args, "--json")
    assert r.exit_code in (0, 1), r.output
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def _no_data_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any read of tensor data fail the test."""
    from ckpt_cli.tensors import TensorSource

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("inspect read tensor data")

    for name in ("read", "read_into", "iter_pieces"):
        monkeypatch.setattr(TensorSource, name, refuse)


# --- inspect ---------------------------------------------------------------------------------

def test_inspect_block_scheme_from_metadata_only(quantized: dict[str, Path], llama: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _no_data_reads(monkeypatch)
    q = _json("inspect", quantized["block"])["quantization"]
    src = load_file(llama / "model.safetensors")
    attn = [n for n in src if ".self_attn." in n]
    assert q["layout"] == "block" and q["block_size"] == [128, 128]
    assert q["quantized"] == len(attn) == 8 and q["layouts"] == {"block": 8}
    assert q["scale_names"] == {"weight_scale_inv": 8} and q["scale_dtypes"] == {"F32": 8}
    assert q["scale_convention"].startswith("weight_scale_inv: w = q x scale_inv")
    # embed_tokens, lm_head and the six 400-wide MLP weights stay BF16; all but the
    # embedding are in the ignore list
    assert q["unquantized_weights"] == 8 and q["unquantized_ignored"] == 7
    assert sorted(q["ignore"]) == q["config"]["ignore"] == q["ignore"]
    assert "lm_head" in q["ignore"]
    numel = sum(src[n].numel() for n in attn)
    assert q["fp8_bytes"] == numel and q["bf16_bytes"] == 2 * numel
    # FP32 [ceil(out/128), ceil(in/128)]: [2, 2] for q/o (256x256), [1, 2] for k/v (128x256)
    assert q["scale_bytes"] == 4 * sum(math.prod(fp8.scale_shape(tuple(src[n].shape), "block"))
                                       for n in attn) == 96
    assert q["bytes_saved"] == numel - q["scale_bytes"]
    assert q["config"]["quant_method"] == "fp8" and q["config"]["source"] == "config.json"
    pairs = {p["weight"]: p for p in q["pairs"]}
    p = pairs["model.layers.0.self_attn.q_proj.weight"]
    assert p == {"weight": "model.layers.0.self_attn.q_proj.weight",
                 "scale": "model.layers.0.self_attn.q_proj.weight_scale_inv",
                 "layout": "block", "scale_dtype": "F32", "scale_shape": [2, 2]}
    assert q["problems"] == []


@pytest.mark.parametrize("layout", ["channel", "tensor"])
def test_inspect_compressed_tensors_scheme(quantized: dict[str, Path], layout: str) -> None:
    doc = _json("inspect", quantized[layout])
    q = doc["quantization"]
    assert q["layout"] == layout and q["block_size"] is None
    assert q["quantized"] == 14 and q["scale_names"] == {"weight_scale": 14}
    assert q["config"]["quant_method"] == "compressed-tensors"
    assert q["config"]["strategy"] == layout and q["config"]["targets"] == ["Linear"]
    assert q["ignore"] == ["lm_head"] and q["unquantized_ignored"] == 1
    assert q["bf16_total_bytes"] == doc["total_bytes"] + q["bytes_saved"]
    shapes = {tuple(p["scale_shape"]) for p in q["pairs"]}
    assert shapes == ({(256, 1), (128, 1), (400, 1)} if layout == "channel" else {(1,)})
    r = run_cli("inspect", quantized[layout])
    assert r.exit_code == 0, r.output
    assert "Quantization" in r.stdout and f"{layout} (one scale per" in r.stdout
    assert "14 weight(s) quantized (F8_E4M3 14)" in r.stdout
    assert "compressed-tensors" in r.stdout


def test_inspect_human_block(quantized: dict[str, Path]) -> None:
    r = run_cli("inspect", quantized["block"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())
    assert "Layout block, 128x128 (one scale per block)" in out
    assert "8 weight(s) quantized (F8_E4M3 8), each paired with its scale" in out
    assert "saved" in out and "quant_method fp8" in out


def test_inspect_flags_unpaired_scales_and_weights(tmp_path: Path) -> None:
    """A file written by safetensors from torch tensors: one FP8 weight with its scale, one
    without, a scale whose weight is BF16, and a misshaped scale."""
    torch.manual_seed(1)
    w = torch.randn(256, 256)
    q, s = fp8.quantize(w.numpy(), "block")
    good = torch.from_numpy(q.view("uint8")).view(torch.float8_e4m3fn)
    tensors = {"a.weight": good, "a.weight_scale_inv": torch.from_numpy(s),
               "b.weight": good.clone(),
               "c.weight": w.to(torch.bfloat16), "c.weight_scale_inv": torch.ones(2, 2),
               "d.weight": good.clone(), "d.weight_scale": torch.ones(3, 3)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)
    q_ = _json("inspect", path)["quantization"]
    assert q_["quantized"] == 1 and q_["fp8_tensors"] == 3
    assert [p["weight"] for p in q_["pairs"]] == ["a.weight"]
    codes = {(p["code"], p["location"]) for p in q_["problems"]}
    assert codes == {("fp8-no-scale", "b.weight"), ("fp8-scale-without-weight",
                                                    "c.weight_scale_inv"),
                     ("fp8-scale-shape", "d.weight_scale")}
    assert q_["config"] is None
    r = run_cli("inspect", path)
    assert r.exit_code == 0
    assert "b.weight (F8_E4M3 [256, 256]) has no scale" in " ".join(r.output.split())


def test_inspect_without_quantization_has_no_key(llama: Path) -> None:
    doc = _json("inspect", llama)
    assert "quantization" not in doc
    assert "Quantization" not in run_cli("inspect", llama).stdout


def test_inspect_reads_config_from_ckpt_metadata(tmp_path: Path) -> None:
    torch.manual_seed(2)
    src = tmp_path / "m.safetensors"
    save_file({"l.weight": torch.randn(128, 256)}, src)
    out = tmp_path / "q"
    assert run_cli("convert", src, "--to", "fp8", "-o", out).exit_code == 0
    q = _json("inspect", out)["quantization"]
    assert q["config"]["source"] == "metadata (ckpt.quantization_config)"
    assert q["layout"] == "block" and q["quantized"] == 1 and not math.isnan(q["bytes_saved"])
