"""FP8 that inference engines run as FP8 (issue 36): what is quantized (Linear weights, fused
layers all or none, never embeddings or the output head), block scales of one block, dynamic
activations, the ignore list under every key, and a dequantizer that refuses what would write
a wrong model. Real models written by transformers (Llama with hidden 128, 256 with 64-wide
k/v, 320; a GPT-NeoX), read back by transformers and compressed-tensors.

The engines cannot run on a CPU; their acceptance rules are encoded in
:func:`vllm_block_accepts` and :func:`vllm_skips_consistently`, each naming the source it
follows.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_cli.fp8 import groups
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.fp8 import LAYOUTS
from tests.helpers.loads import safetensors_dir as _tensors
from tests.helpers.makers import tiny_llama_shaped, tiny_neox

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.requires_torch

MODELS = ("h128", "h256kv64", "h320", "neox")
# Relative L2 of logits, FP8 model against the FP32 source (README: "FP8 for deployment").
LOGITS_BOUND = 0.1
TINY = 2.0 ** -126


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("engines")
    with third_party_quiet():
        return {"h128": tiny_llama_shaped(base / "h128", 128, 256, 2, 2),
                "h256kv64": tiny_llama_shaped(base / "h256kv64", 256, 512, 4, 1),
                "h320": tiny_llama_shaped(base / "h320", 320, 640, 5, 5),
                "neox": tiny_neox(base / "neox")}


@pytest.fixture(scope="module")
def outputs(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> dict[tuple[str, str], Path]:
    base = tmp_path_factory.mktemp("engines-fp8")
    out = {}
    for model, src in sources.items():
        for layout in LAYOUTS:
            dest = base / f"{model}-{layout}"
            r = run_cli("convert", src, "--to", "fp8", "--fp8-layout", layout, "-o", dest)
            assert r.exit_code == 0, r.output
            out[model, layout] = dest
    return out


def _config(d: Path) -> dict[str, Any]:
    return json.loads((d / "config.json").read_text())


# --- the engines' rules, as their sources state them ------------------------------------------

def vllm_block_accepts(parts: list[tuple[int, int]], block: int = 128) -> bool:
    """Whether vLLM and SGLang both load one (fused) Linear of ``parts`` (``(N, K)`` each, in
    the fused order) block-quantized, at tensor parallelism 1:

    - vLLM ``validate_fp8_block_shape`` (``model_executor/layers/quantization/utils/
      fp8_utils.py``): a merged GEMM's output partitions except the last must be multiples
      of ``block_n``;
    - SGLang ``Fp8LinearMethod.validate_block_quant_shapes`` (``srt/layers/quantization/
      fp8.py``): when ``len(output_partition_sizes) > 1`` every partition, the last too, must
      be a multiple of ``block_n`` (so ckpt needs whole blocks in every part of a fused layer);
    - ``per_token_group_quant_fp8`` (both engines' ``fp8_utils``/``fp8_kernel``) asserts
      ``x.shape[-1] % group_size == 0``: the input dim K a multiple of 128.
    """
    if any(k % block for _, k in parts):
        return False
    vllm = all(n % block == 0 for n, _ in parts[:-1])
    sglang = len(parts) == 1 or all(n % block == 0 for n, _ in parts)
    return vllm and sglang


def vllm_skips_consistently(ignore: list[str], fused: dict[str, list[str]]) -> bool:
    """vLLM's ``is_layer_skipped`` (``quantization/utils/quant_utils.py``) and SGLang's
    (``srt/layers/quantization/utils.py``) raise "some but not all shards of X are
    quantized" unless every part of a fused layer is ignored or none is."""
    return all(len({p in ignore for p in parts}) == 1 for parts in fused.values())


def _fused(tensors: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in tensors:
        found = groups.group_of(name.removesuffix(".weight")) if name.endswith(".weight") \
            else None
        if found is not None:
            parent, members, fused = found
            out[f"{parent}.{fused}"] = [f"{parent}.{m}" for m in members]
    return out


def test_moe_routers_and_experts() -> None:
    """Routers (vLLM builds them unquantized: ``ReplicatedLinear(..., quant_config=None)`` for
    Qwen2-MoE's ``shared_expert_gate``, the ``gate`` of Mixtral/DeepSeek) stay BF16 and are
    listed; an expert's gate/up are decided together."""
    c = groups.choose([("m.mlp.shared_expert_gate.weight", "F32", (1, 256)),
                       ("m.mlp.gate.weight", "F32", (8, 256)),
                       ("m.mlp.experts.0.gate_proj.weight", "F32", (128, 256)),
                       ("m.mlp.experts.0.up_proj.weight", "F32", (128, 256)),
                       ("m.moe.experts.1.w1.weight", "F32", (96, 256)),
                       ("m.moe.experts.1.w3.weight", "F32", (96, 256))], "block")
    assert c.picked == ["m.mlp.experts.0.gate_proj.weight", "m.mlp.experts.0.up_proj.weight"]
    assert c.ignore == ["lm_head", "m.mlp.gate", "m.mlp.shared_expert_gate", "m.moe.experts",
                        "m.moe.experts.1.w1", "m.moe.experts.1.w3"]
    assert [why.split(":")[:2] for _, why in c.left] == [
        ["experts m.moe.experts (one MoE layer)", " fused m.moe.experts.1.w13 (MoE expert "
         "gate/up)"]] * 2


def test_engine_rules_encoded_by_the_groups() -> None:
    """The planner's rule equals the engines' on the shapes the issue names."""
    cases = [
        [(256, 256), (64, 256), (64, 256)],     # 64-wide k/v: k is not the last part
        [(256, 256), (128, 256), (64, 256)],    # only the last part partial: SGLang refuses
        [(400, 256), (400, 256)],               # gate/up 400 rows
        [(320, 320), (320, 320), (320, 320)],   # K = 320
        [(128, 128), (128, 128), (128, 128)],   # one block each
    ]
    for parts in cases:
        named = [(f"p{i}", shape) for i, shape in enumerate(parts)]
        assert (groups.group_fits(named, "block") is None) == vllm_block_accepts(parts), parts
    for n, k in [(320, 640), (48, 256), (576, 7168), (256, 400), (128, 320)]:
        assert (groups.group_fits([("w", (n, k))], "block") is None) == \
            vllm_block_accepts([(n, k)]), (n, k)


# --- ckpt's own outputs -----------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_output_validates_strict_and_engines_accept_it(
        outputs: dict[tuple[str, str], Path], sources: dict[str, Path], model: str,
        layout: str) -> None:
    out = outputs[model, layout]
    r = run_cli("validate", out, "--strict", "--json")
    assert r.exit_code == 0, r.output
    got = _tensors(out)
    qc = _config(out)["quantization_config"]
    fp8_w = {n for n, t in got.items() if t.dtype == torch.float8_e4m3fn}
    two_d = {n: tuple(t.shape) for n, t in got.items()
             if n.endswith(".weight") and t.dim() == 2}
    # fused layers all or none, in the tensors and in the ignore list
    assert groups.half_quantized(fp8_w, two_d) == []
    ignore = qc["modules_to_not_convert"] if layout == "block" else qc["ignore"]
    assert vllm_skips_consistently(ignore, _fused(got))
    for n, t in got.items():
        if n.endswith(".weight") and t.dim() == 2 and t.dtype != torch.float8_e4m3fn:
            module = n.removesuffix(".weight")
            assert module in ignore or "embed" in module or "norm" in module, n
    # embeddings and the output head stay BF16
    emb = ("gpt_neox.embed_in.weight", "embed_out.weight") if model == "neox" else (
        "model.embed_tokens.weight", "lm_head.weight")
    for n in emb:
        assert got[n].dtype == torch.bfloat16, n
        assert n.removesuffix("weight") + "weight_scale" not in got
    if layout == "block":
        assert qc["ignored_layers"] == qc["modules_to_not_convert"]
        assert qc["activation_scheme"] == "dynamic"
        by_fused = _fused(got)
        for w in fp8_w:
            n, k = got[w].shape
            assert k % 128 == 0
            s = got[w.removesuffix("weight") + "weight_scale_inv"]
            assert tuple(s.shape) == (math.ceil(n / 128), math.ceil(k / 128))
        for parts in by_fused.values():
            names = [p + ".weight" for p in parts if p + ".weight" in got]
            if names and names[0] in fp8_w:
                assert vllm_block_accepts([tuple(got[n].shape) for n in names])
    else:
        acts = qc["config_groups"]["group_0"]["input_activations"]
        assert acts["type"] == "float" and acts["num_bits"] == 8
        assert acts["strategy"] == "token" and acts["dynamic"] is True
    # inspect: one layout (a 128x128 weight's [1, 1] scale is a block), parameters = weights
    doc = json.loads(run_cli("inspect", out, "--json").stdout)
    assert doc["quantization"]["layout"] == layout
    src_params = json.loads(run_cli("inspect", sources[model], "--json").stdout)
    assert doc["num_parameters"] == src_params["num_parameters"]


def test_what_each_model_quantizes_in_block_layout(
        outputs: dict[tuple[str, str], Path]) -> None:
    """Which weights the block layout quantizes, model by model."""
    def fp8_names(model: str) -> set[str]:
        got = _tensors(outputs[model, "block"])
        return {n for n, t in got.items() if t.dtype == torch.float8_e4m3fn}

    linear = [f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    # hidden 128: every Linear is one 128x128 block (or two), scales [1, 1]
    assert fp8_names("h128") == set(linear)
    s = _tensors(outputs["h128", "block"])["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert tuple(s.shape) == (1, 1)
    # 64-wide k/v: q/k/v stay BF16 together (k is not the fused layer's last part)
    assert fp8_names("h256kv64") == {n for n in linear if "_proj" in n
                                     and not any(x in n for x in ("q_proj", "k_proj", "v_proj"))}
    # hidden 320: K = 320 fits no block; down_proj (640 in, 320 out) ends in a partial block
    assert fp8_names("h320") == {n for n in linear if "down_proj" in n}
    # head_dim 64: the per-head query_key_value stays BF16 (tests/fp8/test_fp8_families.py)
    assert fp8_names("neox") == {f"gpt_neox.layers.{i}.{m}.weight" for i in (0, 1) for m in (
        "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")}


def test_convert_names_what_it_left_and_why(sources: dict[str, Path], tmp_path: Path) -> None:
    r = run_cli("convert", sources["h256kv64"], "--to", "fp8", "-o", tmp_path / "q")
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "6 Linear weight(s) left unquantized" in said
    assert "fused model.layers.0.self_attn.qkv_proj: model.layers.0.self_attn.k_proj" in said
    assert "dynamic per-token FP8 activations (W8A8)" in said
    r = run_cli("convert", sources["h320"], "--to", "fp8", "-o", tmp_path / "q320")
    said = " ".join(r.output.split())
    assert "2 weight(s) end in a partial 128-row block" in said


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_transformers_loads_within_bound(outputs: dict[tuple[str, str], Path],
                                         sources: dict[str, Path], model: str,
                                         layout: str, tmp_path: Path) -> None:
    """transformers loads the output (block: its dequantizing FP8 loader; channel/tensor:
    compressed-tensors, decompressed) and its logits stay within the bound.

    transformers 5.24's CPU dequantizer derives the block size from the scale grid
    (``rows // scale_rows``), so it refuses a partial trailing block (hidden 320's down_proj,
    which the engines accept): that model's block output is loaded through ckpt's own
    ``--dequantize`` instead, and the README says so."""
    out = outputs[model, layout]
    kw: dict[str, Any] = {}
    if layout != "block":
        kw["quantization_config"] = transformers.CompressedTensorsConfig(run_compressed=False)
    if model == "h320" and layout == "block":
        r = run_cli("convert", out, "--to", "bf16", "--dequantize", "-o", tmp_path / "dq")
        assert r.exit_code == 0, r.output
        out = tmp_path / "dq"
    logging.disable(logging.WARNING)
    try:
        with third_party_quiet():
            m, info = transformers.AutoModelForCausalLM.from_pretrained(
                out, output_loading_info=True, **kw)
            ref = transformers.AutoModelForCausalLM.from_pretrained(sources[model],
                                                                    dtype=torch.float32)
    finally:
        logging.disable(logging.NOTSET)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        a = m(ids).logits.float()
        b = ref(ids).logits
    assert float((a - b).norm() / b.norm()) < LOGITS_BOUND


@pytest.mark.parametrize("layout", ["channel", "tensor"])
@pytest.mark.parametrize("model", MODELS)
def test_compressed_tensors_decompression_equals_dequantize(
        outputs: dict[tuple[str, str], Path], model: str, layout: str,
        tmp_path: Path) -> None:
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    out = outputs[model, layout]
    qc = QuantizationConfig.model_validate(_config(out)["quantization_config"])
    args = qc.config_groups["group_0"].weights
    assert args is not None
    r = run_cli("convert", out, "--to", "bf16", "--dequantize", "-o", tmp_path / "dq")
    assert r.exit_code == 0, r.output
    ours = _tensors(tmp_path / "dq")
    got = _tensors(out)
    n = 0
    for name, w in got.items():
        if w.dtype != torch.float8_e4m3fn:
            continue
        theirs = dequantize(w, got[name.removesuffix("weight") + "weight_scale"],
                            args=args).to(torch.bfloat16)
        assert torch.equal(theirs.view(torch.int16), ours[name].view(torch.int16)), name
        n += 1
    assert n == (14 if model.startswith("h") else 8)


def test_weight_only_activations_and_refusals(sources: dict[str, Path],
                                              tmp_path: Path) -> None:
    r = run_cli("convert", sources["h128"], "--to", "fp8", "--fp8-layout", "channel",
                "--fp8-activations", "none", "-o", tmp_path / "w8a16")
    assert r.exit_code == 0, r.output
    assert "weight-only (W8A16)" in " ".join(r.output.split())
    qc = _config(tmp_path / "w8a16")["quantization_config"]
    assert qc["config_groups"]["group_0"]["input_activations"] is None
    r = run_cli("convert", sources["h128"], "--to", "fp8", "--fp8-activations", "none",
                "-o", tmp_path / "no")
    assert r.exit_code == 2 and not (tmp_path / "no").exists()
    assert "--fp8-activations none" in r.output
    r = run_cli("convert", sources["h128"], "--to", "fp8", "--fp8-activations", "static",
                "-o", tmp_path / "no")
    assert r.exit_code == 2 and "dynamic or none" in r.output


# --- dequantize refuses what would write a wrong model -----------------------------------------

@pytest.fixture(scope="module")
def block_fp8(outputs: dict[tuple[str, str], Path]) -> Path:
    return outputs["h128", "block"]


def _mutated(src: Path, dest: Path, change: Any) -> Path:
    dest.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            change(tensors)
            save_file(tensors, dest / f.name, metadata={"format": "pt"})
        else:
            (dest / f.name).write_bytes(f.read_bytes())
    return dest


SCALE = "model.layers.0.mlp.down_proj.weight_scale_inv"


@pytest.mark.parametrize("bad", ["nan", "zero", "negative", "inf"])
def test_dequantize_refuses_bad_scales(block_fp8: Path, tmp_path: Path, bad: str) -> None:
    def change(t: dict[str, torch.Tensor]) -> None:
        s = t[SCALE].clone()
        s[0, 0] = {"nan": float("nan"), "zero": 0.0, "negative": -s[0, 0].item(),
                   "inf": float("inf")}[bad]
        t[SCALE] = s

    src = _mutated(block_fp8, tmp_path / "src", change)
    r = run_cli("convert", src, "--to", "bf16", "--dequantize", "-o", tmp_path / "out")
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())
    assert f"{SCALE} holds non-finite, zero or negative scales" in said
    assert "nothing written" in said and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("case", ["orphan", "beside-bf16"])
def test_dequantize_refuses_scales_without_an_fp8_weight(block_fp8: Path, tmp_path: Path,
                                                         case: str) -> None:
    def change(t: dict[str, torch.Tensor]) -> None:
        if case == "orphan":
            t["model.layers.0.mlp.extra.weight_scale_inv"] = torch.ones(1, 1)
        else:
            t["model.norm.weight_scale"] = torch.ones(1)

    src = _mutated(block_fp8, tmp_path / "src", change)
    r = run_cli("convert", src, "--to", "bf16", "--dequantize", "-o", tmp_path / "out")
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())
    if case == "orphan":
        assert ("model.layers.0.mlp.extra.weight_scale_inv is a scale, but there is no "
                "model.layers.0.mlp.extra.weight") in said
    else:
        assert "model.norm.weight_scale is a scale, but its weight model.norm.weight is BF16, " \
               "not FP8" in said
    assert not (tmp_path / "out").exists()


def test_dequantize_to_fp16_refuses_overflow_and_clamps_when_asked(block_fp8: Path,
                                                                   tmp_path: Path) -> None:
    def change(t: dict[str, torch.Tensor]) -> None:
        t[SCALE] = t[SCALE] * 1e6  # |w| up to ~448 x 1e6 x scale: beyond FP16's 65504

    src = _mutated(block_fp8, tmp_path / "src", change)
    codes = load_file(next(src.glob("*.safetensors")))
    w = codes[SCALE.removesuffix("_scale_inv")].float() * \
        codes[SCALE].repeat_interleave(128, 0).repeat_interleave(128, 1)[:128, :256]
    over = int((w.abs() > 65504).sum())
    assert over > 0
    r = run_cli("convert", src, "--to", "fp16", "--dequantize", "-o", tmp_path / "out")
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())
    assert f"{over:,} value(s) exceed FP16's range" in said
    assert "model.layers.0.mlp.down_proj.weight" in said and "nothing written" in said
    assert not (tmp_path / "out").exists()
    r = run_cli("convert", src, "--to", "fp16", "--dequantize", "--clamp", "-o",
                tmp_path / "clamped")
    assert r.exit_code == 0, r.output
    got = _tensors(tmp_path / "clamped")["model.layers.0.mlp.down_proj.weight"]
    assert torch.isfinite(got).all()
    assert int((got.abs() == 65504).sum()) == over
    assert torch.equal(got[w.abs() <= 65504], w[w.abs() <= 65504].half())


def test_zero_and_subnormal_weights_quantize_to_a_valid_output(tmp_path: Path) -> None:
    sd = {"a.proj.weight": torch.zeros(128, 128), "b.proj.weight": torch.full((128, 128), 1e-40),
          "c.proj.weight": torch.randn(128, 128)}
    save_file(sd, tmp_path / "model.safetensors")
    for layout in LAYOUTS:
        out = tmp_path / layout
        r = run_cli("convert", tmp_path / "model.safetensors", "--to", "fp8", "--fp8-layout",
                    layout, "-o", out)
        assert r.exit_code == 0, r.output
        got = load_file(out / "model.safetensors")
        name = "weight_scale_inv" if layout == "block" else "weight_scale"
        for m in ("a", "b"):
            s = got[f"{m}.proj.{name}"]
            assert torch.all(s == TINY), (layout, m, s)
        r = run_cli("validate", out, "--strict")
        assert r.exit_code == 0, r.output
        r = run_cli("convert", out, "--to", "bf16", "--dequantize", "-o", tmp_path / f"dq-{layout}")
        assert r.exit_code == 0, r.output
        dq = load_file(tmp_path / f"dq-{layout}" / "model.safetensors")
        assert torch.equal(dq["a.proj.weight"], torch.zeros(128, 128, dtype=torch.bfloat16))


# --- validate ----------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_raw_fp8_without_scale_or_config_is_a_note(tmp_path: Path, suffix: str) -> None:
    """What a CUDA run saves: an E5M2 tensor with no scale and no quantization_config."""
    torch.manual_seed(0)
    sd = {"grad_cache.weight": torch.randn(64, 64).to(torch.float8_e5m2),
          "proj.weight": torch.randn(64, 64)}
    path = tmp_path / f"state{suffix}"
    if suffix == ".pt":
        torch.save(sd, path)
    else:
        save_file(sd, path)
    r = run_cli("validate", path, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)["checkpoints"][0]
    found = [(f["severity"], f["code"]) for f in doc["findings"] if f["check"] == "quantization"]
    assert found == [("info", "fp8-raw")]
    # with a config saying it is quantized, the same tensor without a scale is an error
    (tmp_path / "d").mkdir()
    save_file(sd, tmp_path / "d" / "model.safetensors")
    (tmp_path / "d" / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}}))
    r = run_cli("validate", tmp_path / "d", "--json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)["checkpoints"][0]
    assert ("error", "fp8-no-scale") in [(f["severity"], f["code"]) for f in doc["findings"]]


def test_validate_flags_what_the_engines_refuse(block_fp8: Path, tmp_path: Path) -> None:
    """A half-quantized fused layer, a quantized embedding, a block weight whose K is not a
    multiple of 128: errors when a quantization_config addresses the engines."""
    def change(t: dict[str, torch.Tensor]) -> None:
        k = "model.layers.0.self_attn.k_proj"
        t[f"{k}.weight"] = t[f"{k}.weight"].float().to(torch.bfloat16)
        del t[f"{k}.weight_scale_inv"]
        e = torch.randn(320, 128)
        t["model.embed_tokens.weight"] = (e / (e.abs().max() / 448)).to(torch.float8_e4m3fn)
        t["model.embed_tokens.weight_scale_inv"] = (e.abs().max() / 448).reshape(1, 1).repeat(3, 1)
        t["model.layers.1.mlp.odd.weight"] = torch.randn(128, 96).to(torch.float8_e4m3fn)
        t["model.layers.1.mlp.odd.weight_scale_inv"] = torch.ones(1, 1)

    src = _mutated(block_fp8, tmp_path / "src", change)
    r = run_cli("validate", src, "--json")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)["checkpoints"][0]
    found = {(f["code"], f["location"]) for f in doc["findings"] if f["severity"] == "error"}
    assert ("fp8-fused-partial", "model.layers.0.self_attn.k_proj.weight") in found
    assert ("fp8-not-linear", "model.embed_tokens.weight") in found
    assert ("fp8-block-input", "model.layers.1.mlp.odd.weight") in found
    human = " ".join(run_cli("validate", src).output.split())
    assert "fused layer model.layers.0.self_attn.qkv_proj" in human


# --- diff ---------------------------------------------------------------------------------------

def test_diff_of_a_model_and_its_fp16_conversion_is_equal(sources: dict[str, Path],
                                                          tmp_path: Path) -> None:
    model = sources["h128"]
    r = run_cli("convert", model, "--to", "fp16", "-o", tmp_path / "fp16")
    assert r.exit_code == 0, r.output
    r = run_cli("diff", model, tmp_path / "fp16")
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "config.dtype float32 → float16 as the tensors' dtypes (F32 -> F16; not a " \
           "difference)" in said
    # a config dtype that does not follow the tensors, or any other config change, still is one
    for key, value in (("dtype", "bfloat16"), ("model_type", "mistral")):
        d = tmp_path / f"edited-{key}"
        d.mkdir()
        for f in (tmp_path / "fp16").iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        cfg = _config(d)
        cfg[key] = value
        (d / "config.json").write_text(json.dumps(cfg))
        r = run_cli("diff", model, d, "--json")
        assert r.exit_code == 1, (key, r.output)
        doc = json.loads(r.stdout)
        assert doc["differences"] == ["1 metadata value changed"], key


def test_inspect_counts_weights_not_scales(outputs: dict[tuple[str, str], Path],
                                           sources: dict[str, Path]) -> None:
    for layout in LAYOUTS:
        doc = json.loads(run_cli("inspect", outputs["h256kv64", layout], "--json").stdout)
        got = _tensors(outputs["h256kv64", layout])
        weights = sum(t.numel() for n, t in got.items() if "scale" not in n)
        assert doc["num_parameters"] == weights
        assert sum(doc["params_by_dtype"].values()) == weights
        assert np.sum([t.numel() for n, t in got.items() if "scale" in n]) > 0
