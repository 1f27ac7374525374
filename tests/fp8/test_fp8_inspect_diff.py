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
from tests.helpers.fp8 import LAYOUTS, convert_each_layout
from tests.helpers.makers import tiny_llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.requires_torch

# The README's bound on the relative L2 error of one FP32 -> E4M3 round trip, per layout.
BOUND = {"block": 0.045, "channel": 0.045, "tensor": 0.06}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved by transformers in FP32: 256-wide attention (whole 128-blocks),
    400-wide MLP (left unquantized in the block layout), untied lm_head."""
    return tiny_llama(tmp_path_factory.mktemp("llama") / "src", 400)


@pytest.fixture(scope="module")
def quantized(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return convert_each_layout(llama, tmp_path_factory.mktemp("fp8"))


def _json(*args: Any) -> dict[str, Any]:
    r = run_cli(*args, "--json")
    assert r.exit_code in (0, 1), r.output
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def _no_data_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any read of tensor data fail the test."""
    from ckpt_cli.tensors.source import TensorSource

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


# --- diff ------------------------------------------------------------------------------------

def _torch_rel_l2(src: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> tuple[float, float]:
    """Relative L2 and max abs error of ``w * s`` against ``src``, written here with torch."""
    if s.dim() == 2 and s.shape[1] != 1:
        s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    deq = w.float() * s.float()
    d = (deq.double() - src.double())
    rel = d.norm() / max(deq.double().norm(), src.double().norm())
    return float(rel), float(d.abs().max())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_diff_source_against_quantized_compares_dequantized(
        llama: Path, quantized: dict[str, Path], layout: str) -> None:
    doc = _json("diff", llama, quantized[layout])
    q = doc["quantization"]
    src = load_file(llama / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for f in quantized[layout].glob("*.safetensors"):
        out.update(load_file(f))
    scale_key = "weight_scale_inv" if layout == "block" else "weight_scale"
    fp8_names = sorted(n for n, t in out.items() if t.dtype == torch.float8_e4m3fn)
    assert q["dequantized"] == len(fp8_names) == (8 if layout == "block" else 14)
    assert q["quantized_side"] == "b" and q["scales_a"] == []
    assert sorted(q["scales_b"]) == sorted(n.removesuffix("weight") + scale_key
                                           for n in fp8_names)
    # the scales are neither additions nor compared on their own
    assert doc["only_in_b"] == [] and doc["summary"]["only_in_b"] == 0
    assert not any(t["name"].endswith(scale_key) for t in doc["tensors"])
    by_name = {t["name"]: t for t in doc["tensors"]}
    for row in q["tensors"]:
        name = row["name"]
        rel, max_abs = _torch_rel_l2(src[name], out[name],
                                     out[name.removesuffix("weight") + scale_key])
        assert row["rel_l2"] == pytest.approx(rel, rel=1e-4)
        assert row["max_abs"] == pytest.approx(max_abs, rel=1e-4)
        assert 0.01 < row["rel_l2"] < BOUND[layout] == row["bound"]
        assert row["b"]["layout"] == layout and row["a"] is None
        assert row["status"] == by_name[name]["status"] == "within_tolerance"
        assert by_name[name]["tolerance"] == "fp8:F8_E4M3"
    assert q["above_bound"] == []
    assert q["rel_l2_max"] == max(r["rel_l2"] for r in q["tensors"])
    # no tensor value differs beyond tolerance, and the config's dtype (F32 -> BF16) changed
    # as the unquantized tensors did: a note, not a difference (issue 36)
    assert doc["summary"]["changed"] == 0
    assert doc["differences"] == [] and doc["equal"] is True
    notes = [m for m in doc["metadata"] if m["follows"] is not None]
    assert [(m["key"], m["a"], m["b"], m["follows"]) for m in notes] == [
        ("config.dtype", "float32", "bfloat16", "F32 -> BF16")]


def test_diff_works_both_directions_and_both_quantized(llama: Path,
                                                       quantized: dict[str, Path]) -> None:
    ab = _json("diff", llama, quantized["channel"])["quantization"]
    ba = _json("diff", quantized["channel"], llama)["quantization"]
    assert ba["quantized_side"] == "a" and ba["scales_b"] == [] and ba["scales_a"]
    assert {r["name"]: r["rel_l2"] for r in ab["tensors"]} == pytest.approx(
        {r["name"]: r["rel_l2"] for r in ba["tensors"]}, rel=1e-6)
    both = _json("diff", quantized["block"], quantized["channel"])
    q = both["quantization"]
    assert q["quantized_side"] == "both"
    # block leaves the 400-wide MLP in BF16: 8 weights FP8 on both sides, 6 on B only
    assert q["dequantized"] == 14 and len(q["scales_a"]) == 8 and len(q["scales_b"]) == 14
    assert both["only_in_a"] == both["only_in_b"] == []
    two = [r for r in q["tensors"] if r["a"] and r["b"]]
    assert len(two) == 8
    for r in two:  # two roundings: about sqrt(2) x one, within sqrt(2) x the bound
        assert 0.02 < r["rel_l2"] < r["bound"] == pytest.approx(BOUND["channel"] * math.sqrt(2))
    assert both["equal"] is True
    same = _json("diff", quantized["tensor"], quantized["tensor"] / ".")
    assert same["equal"] is True


def test_diff_catches_a_wrong_scale(llama: Path, quantized: dict[str, Path],
                                    tmp_path: Path) -> None:
    """A checkpoint whose one scale is twice what it should be: that weight is changed."""
    out = load_file(quantized["block"] / "model.safetensors")
    bad = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    out[bad] = out[bad] * 2
    d = tmp_path / "bad"
    d.mkdir()
    save_file(out, d / "model.safetensors")
    r = run_cli("diff", llama, d, "--json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    rows = {t["name"]: t for t in doc["quantization"]["tensors"]}
    wrong = rows["model.layers.1.self_attn.o_proj.weight"]
    # ||2w - w|| / ||2w||: 0.5
    assert wrong["status"] == "changed" and wrong["rel_l2"] == pytest.approx(0.5, abs=0.01)
    assert doc["quantization"]["above_bound"] == ["model.layers.1.self_attn.o_proj.weight"]
    assert "1 tensor changed" in doc["differences"]
    human = run_cli("diff", llama, d)
    text = " ".join(human.stdout.split())
    assert "above it: model.layers.1.self_attn.o_proj.weight" in text
    assert "(above bound)" in text


def test_diff_human_says_what_is_normal(llama: Path, quantized: dict[str, Path]) -> None:
    r = run_cli("diff", llama, quantized["block"])
    text = " ".join(r.stdout.split())
    assert "8 FP8 weights compared dequantized" in text
    assert "Normal for one E4M3 rounding: about 2-4%" in text
    assert "the bound docs/fp8.md states is block 4.50%" in text
    assert "8 scale tensors paired with their weights (not additions)" in text
    assert "Dequantized FP8 weights (8, largest error first)" in text
    assert "Only in" not in text


def test_diff_structure_only_pairs_scales(llama: Path, quantized: dict[str, Path]) -> None:
    doc = _json("diff", llama, quantized["block"], "--structure-only")
    assert doc["only_in_b"] == [] and len(doc["quantization"]["scales_b"]) == 8
    assert doc["quantization"]["rel_l2_max"] is None


# --- a checkpoint written by compressed-tensors itself ----------------------------------------

@pytest.fixture(scope="module")
def ct_channel(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Llama quantized by compressed-tensors (per-channel FP8, ``lm_head`` ignored): its
    ``apply_quantization_config``, min/max scales by its ``calculate_qparams``, compressed by
    its ``ModelCompressor`` and the config written by ``update_config``."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    from tests.conftest import third_party_quiet

    assert ct.__version__
    with third_party_quiet():
        model = transformers.LlamaForCausalLM.from_pretrained(llama, dtype=torch.float32)
        args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True,
                                dynamic=False)
        cfg = QuantizationConfig(config_groups={"group_0": QuantizationScheme(
            targets=["Linear"], weights=args)}, ignore=["lm_head"], format="float-quantized")
        apply_quantization_config(model, cfg)
        with torch.no_grad():
            for mod in model.modules():
                if hasattr(mod, "weight_scale"):
                    w = mod.weight
                    s, zp = calculate_qparams(w.amin(dim=1, keepdim=True),
                                              w.amax(dim=1, keepdim=True), args)
                    mod.weight_scale.copy_(s.reshape(mod.weight_scale.shape))
                    mod.weight_zero_point.copy_(zp.reshape(mod.weight_zero_point.shape))
        compressor = ModelCompressor(quantization_config=cfg)
        compressor.compress_model(model)
        out = tmp_path_factory.mktemp("ct") / "channel"
        model.save_pretrained(out)
        compressor.update_config(str(out))
    return out


def test_inspect_and_diff_a_compressed_tensors_checkpoint(
        llama: Path, quantized: dict[str, Path], ct_channel: Path) -> None:
    q = _json("inspect", ct_channel)["quantization"]
    assert q["layout"] == "channel" and q["quantized"] == 14
    assert q["scale_names"] == {"weight_scale": 14} and q["problems"] == []
    assert q["config"]["quant_method"] == "compressed-tensors"
    assert q["config"]["strategy"] == "channel" and q["ignore"] == ["lm_head"]
    doc = _json("diff", llama, ct_channel)
    assert doc["equal"] is True and doc["only_in_b"] == []
    errors = [r["rel_l2"] for r in doc["quantization"]["tensors"]]
    assert len(errors) == 14 and all(0.01 < e < BOUND["channel"] for e in errors)
    # ckpt's channel layout and compressed-tensors' dequantize to the same values
    both = _json("diff", quantized["channel"], ct_channel)["quantization"]
    assert both["quantized_side"] == "both" and both["dequantized"] == 14
    assert {r["status"] for r in both["tensors"]} == {"identical"}
    assert both["rel_l2_max"] == 0


def test_diff_partial_blocks_bf16_scales_and_a_weight_without_scale(tmp_path: Path) -> None:
    """DeepSeek's conventions written with torch + safetensors: a 400x256 weight whose last
    block row is partial (scale [4, 2]) with BF16 scales; and an FP8 weight without a scale,
    which is compared as stored and said so."""
    torch.manual_seed(4)
    src = {"l.weight": torch.randn(400, 256), "m.weight": torch.randn(256, 256),
           "n.weight": torch.randn(256, 256)}
    save_file(src, tmp_path / "src.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name in ("l.weight", "m.weight", "n.weight"):
        q, s = fp8.quantize(src[name].numpy(), "block")
        out[name] = torch.from_numpy(q.view("uint8")).view(torch.float8_e4m3fn)
        if name != "n.weight":
            out[name + "_scale_inv"] = torch.from_numpy(s).to(torch.bfloat16)
    assert out["l.weight_scale_inv"].shape == (4, 2)
    save_file(out, tmp_path / "fp8.safetensors")
    r = run_cli("diff", tmp_path / "src.safetensors", tmp_path / "fp8.safetensors", "--json")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    q = doc["quantization"]
    rows = {t["name"]: t for t in q["tensors"]}
    assert sorted(rows) == ["l.weight", "m.weight"]
    for name, row in rows.items():
        rel, max_abs = _torch_rel_l2(src[name], out[name], out[name + "_scale_inv"])
        assert row["rel_l2"] == pytest.approx(rel, rel=1e-4) and rel < BOUND["block"]
        assert row["max_abs"] == pytest.approx(max_abs, rel=1e-4)
        assert row["status"] == "within_tolerance"
    assert q["scales_b"] == ["l.weight_scale_inv", "m.weight_scale_inv"]
    assert q["unpaired"] == [
        "B: n.weight (F8_E4M3 [256, 256]) has no scale (weight_scale_inv, weight_scale, "
        "scale_weight): a loader ignoring that reads garbage; compared as stored"]
    n = {t["name"]: t for t in doc["tensors"]}["n.weight"]
    assert n["status"] == "changed" and n["tolerance"] == "dtype:F8_E4M3"
    assert doc["differences"] == ["1 tensor changed"]
    text = " ".join(run_cli("diff", tmp_path / "src.safetensors",
                            tmp_path / "fp8.safetensors").stdout.split())
    assert "FP8 without a usable scale: B: n.weight" in text


def test_inspect_flags_a_quantization_config_without_fp8(llama: Path, quantized: dict[str, Path],
                                                         tmp_path: Path) -> None:
    """An FP32 checkpoint whose config.json still carries a quantization_config (a copy
    dequantized by a tool that kept the config)."""
    import shutil

    d = tmp_path / "m"
    shutil.copytree(llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = json.loads(
        (quantized["block"] / "config.json").read_text())["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    q = _json("inspect", d)["quantization"]
    assert q["layout"] is None and q["quantized"] == 0 and q["bytes_saved"] == 0
    assert [p["code"] for p in q["problems"]] == ["fp8-config-without-fp8"]
    r = run_cli("inspect", d)
    assert r.exit_code == 0 and "no FP8 weight paired with a scale" in r.stdout
    assert "quantization_config but no tensor is FP8" in " ".join(r.output.split())
