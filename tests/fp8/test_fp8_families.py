"""FP8 for the families the engines read differently (issue 46, item 7): GPT-2's Conv1D
weights, GPT-NeoX's per-head ``query_key_value`` (head_dim 64 and 128), an MoE whose experts
the layout cannot hold (Qwen2-MoE, intermediate size 200), and a raw E5M2 tensor beside
scaled weights. Real models written by transformers with tiny configs; transformers loads the
outputs. vLLM and SGLang are not installed: each rule they apply is encoded in a function
below whose docstring names the engine file and function it follows.
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

from ckpt_cli import fp8
from ckpt_cli.fp8 import groups
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.loads import safetensors_dir as _tensors

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.requires_torch

LOGITS_BOUND = 0.1  # as tests/fp8/test_fp8_engines.py


def _save(model: Any, out: Path) -> Path:
    with third_party_quiet():
        model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """gpt2: hidden 256 (c_attn [256, 768], square c_proj [256, 256]); neox64 / neox128:
    hidden 256 with 4 / 2 heads; moe: Qwen2-MoE, 4 experts of intermediate size 200 and a
    shared expert of 256."""
    base = tmp_path_factory.mktemp("families")
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=320, n_positions=64, n_embd=256, n_layer=2, n_head=2))
    neox = {h: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=h, tie_word_embeddings=False)) for h in (4, 2)}
    moe = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=320, hidden_size=256, intermediate_size=512, moe_intermediate_size=200,
        shared_expert_intermediate_size=256, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        tie_word_embeddings=False))
    return {"gpt2": _save(gpt2, base / "gpt2"), "neox64": _save(neox[4], base / "neox64"),
            "neox128": _save(neox[2], base / "neox128"), "moe": _save(moe, base / "moe")}


def _convert(src: Path, dest: Path, layout: str) -> Path:
    r = run_cli("convert", src, "--to", "fp8", "--fp8-layout", layout, "-o", dest)
    assert r.exit_code == 0, r.output
    return dest


def _qc(d: Path) -> dict[str, Any]:
    qc: dict[str, Any] = json.loads((d / "config.json").read_text())["quantization_config"]
    return qc


def _ignore(qc: dict[str, Any]) -> list[str]:
    out: list[str] = qc["ignored_layers"] if qc["quant_method"] == "fp8" else qc["ignore"]
    return out


def _validate(d: Path, *args: str) -> tuple[int, set[tuple[str, str]]]:
    r = run_cli("validate", d, "--json", *args)
    doc = json.loads(r.stdout)["checkpoints"][0]
    return r.exit_code, {(f["code"], f["location"]) for f in doc["findings"]
                         if f["check"] == "quantization" and f["severity"] == "error"}


def _logits_close(out: Path, src: Path, layout: str) -> None:
    kw: dict[str, Any] = {}
    if layout != "block":
        kw["quantization_config"] = transformers.CompressedTensorsConfig(run_compressed=False)
    logging.disable(logging.WARNING)
    try:
        with third_party_quiet():
            m, info = transformers.AutoModelForCausalLM.from_pretrained(
                out, output_loading_info=True, **kw)
            ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    finally:
        logging.disable(logging.NOTSET)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        a, b = m(ids).logits.float(), ref(ids).logits
    assert float((a - b).norm() / b.norm()) < LOGITS_BOUND


# --- the engines' rules, as their sources state them ------------------------------------------

def sglang_skips(prefix: str, ignored: list[str]) -> bool:
    """SGLang ``is_layer_skipped`` (``python/sglang/srt/layers/quantization/utils.py``) for a
    layer that is not a fused one: ``prefix in ignored_layers``, exact. ``Fp8Config.
    get_quant_method`` (``srt/layers/quantization/fp8.py``) asks it for a ``FusedMoE`` with
    the ``experts`` module's prefix (older versions never skip one), and ``from_config`` adds
    each entry with and without a leading ``model.``."""
    names = {m.removeprefix("model.") for m in ignored}
    return prefix.removeprefix("model.") in names


def vllm_skips(prefix: str, ignored: list[str]) -> bool:
    """vLLM ``is_layer_skipped`` (``vllm/model_executor/layers/quantization/utils/
    quant_utils.py``): a prefix containing ``experts`` is skipped when an ignore entry that
    contains ``experts`` contains the prefix; any other unfused prefix exactly."""
    if "experts" in prefix:
        return any(prefix in m for m in ignored if "experts" in m)
    return prefix in ignored


def gpt2_engine_scale_fits(stored: tuple[int, int], scale: tuple[int, ...],
                           layout: str) -> bool:
    """Whether vLLM / SGLang load a GPT-2 Conv1D weight stored ``[in, out]`` with ``scale``:
    ``GPT2LMHeadModel.load_weights`` (``vllm/model_executor/models/gpt2.py``,
    ``python/sglang/srt/models/gpt2.py``) transposes a name containing ``c_attn``/``c_proj``/
    ``c_fc`` only when it ends in ``.weight``; the scale is loaded as stored into the Linear's
    parameter of ``[ceil(out/128), ceil(in/128)]`` (block) or ``[out, 1]`` (channel). A square
    weight passes this shape check with its block scales transposed."""
    n_in, n_out = stored
    want = (math.ceil(n_out / 128), math.ceil(n_in / 128)) if layout == "block" else (n_out, 1)
    return tuple(scale) == want


def neox_engine_reorder(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What ``GPTNeoXForCausalLM.load_weights`` (``vllm/model_executor/models/gpt_neox.py``,
    ``python/sglang/srt/models/gpt_neox.py``) does to every ``query_key_value`` parameter
    with an ``output_dim`` (the weight, and a block scale, ``BlockQuantScaleParameter
    (output_dim=0)``): ``view(num_heads, 3, -1)`` along dim 0, swap the two, reshape back
    (per-head q/k/v to all q, all k, all v). Raises where the view is impossible."""
    shape = t.shape
    return t.view((num_heads, 3, -1, *shape[1:])).transpose(0, 1).reshape(shape)


def moe_block_accepts(intermediate: int, hidden: int) -> bool:
    """``Fp8MoEMethod.create_weights`` (vllm ``model_executor/layers/quantization/fp8.py``,
    sglang ``srt/layers/quantization/fp8.py``) with a block config raises unless the experts'
    intermediate size is a multiple of ``block_n``; their activations are quantized in groups
    of 128 along K (hidden for gate/up, intermediate for down)."""
    return intermediate % 128 == 0 and hidden % 128 == 0


# --- GPT-2 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["block", "channel"])
def test_gpt2_conv1d_weights_stay_bf16_and_ignored(sources: dict[str, Path], tmp_path: Path,
                                                   layout: str) -> None:
    """Conv1D weights ``[in, out]`` are kept BF16 and named in the ignore list under the
    engines' prefix (``transformer.h.N...``, which both engines' ``gpt2.py`` build from the
    ``transformer`` module): no consumer reads them quantized (see
    :func:`gpt2_engine_scale_fits`). Before: quantized as stored, scales transposed."""
    out = _convert(sources["gpt2"], tmp_path / layout, layout)
    got = _tensors(out)
    conv = [n for n in got if n.endswith(".weight") and
            n.split(".")[-2] in ("c_attn", "c_proj", "c_fc")]
    assert len(conv) == 8
    ignore = _ignore(_qc(out))
    for n in conv:
        assert got[n].dtype == torch.bfloat16, n
        module = n.removesuffix(".weight")
        assert sglang_skips(module, ignore) and vllm_skips(module, ignore), module
    assert not any(t.dtype == torch.float8_e4m3fn for t in got.values())
    assert run_cli("validate", out, "--strict").exit_code == 0
    # inspect does not warn of a config without FP8 weights: its ignore list covers them
    doc = json.loads(run_cli("inspect", out, "--json").stdout)
    assert doc["quantization"]["problems"] == []
    _logits_close(out, sources["gpt2"], layout)


def _gpt2_quantized_as_stored(src: Path, dest: Path, layout: str) -> Path:
    """What ckpt wrote before: each Conv1D weight quantized in its stored [in, out] layout."""
    sd = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for n, t in sd.items():
        if n.endswith(".weight") and n.split(".")[-2] in ("c_attn", "c_proj", "c_fc"):
            q, s = fp8.quantize(t.float().numpy(), layout)
            out[n] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
            out[n.removesuffix("weight") + fp8.scale_name(layout)] = torch.from_numpy(s)
        else:
            out[n] = t.contiguous()
    dest.mkdir()
    save_file(out, dest / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = fp8.quantization_config(layout, ["lm_head"])
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_validate_flags_gpt2_conv1d_quantized_as_stored(sources: dict[str, Path],
                                                        tmp_path: Path, layout: str) -> None:
    """An FP8 GPT-2 whose Conv1D weights were quantized as stored: the engines' load gives a
    shape mismatch (c_attn, c_fc, mlp c_proj) or, for the square attention c_proj, transposed
    block scales (:func:`gpt2_engine_scale_fits`). validate fails it (before: passed
    --strict)."""
    out = _gpt2_quantized_as_stored(sources["gpt2"], tmp_path / "q", layout)
    got = load_file(out / "model.safetensors")
    scale = fp8.scale_name(layout)
    c_attn = "transformer.h.0.attn.c_attn."
    assert not gpt2_engine_scale_fits(tuple(got[c_attn + "weight"].shape),
                                      tuple(got[c_attn + scale].shape), layout)
    square = "transformer.h.0.attn.c_proj."
    assert tuple(got[square + "weight"].shape) == (256, 256)
    code, errors = _validate(out)
    assert code == 1
    flagged = {loc for c, loc in errors if c == "fp8-conv1d"}
    assert flagged == {n for n in got if n.endswith(".weight") and n.split(".")[-2] in (
        "c_attn", "c_proj", "c_fc")}
    assert square + "weight" in flagged
    assert run_cli("validate", out, "--strict").exit_code != 0


# --- GPT-NeoX ----------------------------------------------------------------------------------

@pytest.mark.parametrize("heads,head_dim", [(4, 64), (2, 128)])
def test_neox_query_key_value_in_block_layout(sources: dict[str, Path], tmp_path: Path,
                                              heads: int, head_dim: int) -> None:
    """Block layout quantizes ``query_key_value`` only where head_dim is a multiple of 128,
    the one case in which the engines' per-head reorder (:func:`neox_engine_reorder`) of the
    scale succeeds and keeps each 128-row block within one head's q, k or v. Before: head_dim
    64 was quantized (the reorder's view fails)."""
    name = f"neox{head_dim}"
    out = _convert(sources[name], tmp_path / "block", "block")
    got = _tensors(out)
    qkv = "gpt_neox.layers.0.attention.query_key_value."
    ignore = _ignore(_qc(out))
    if head_dim % 128:
        assert got[qkv + "weight"].dtype == torch.bfloat16
        assert qkv + "weight_scale_inv" not in got
        assert sglang_skips(qkv.rstrip("."), ignore) and vllm_skips(qkv.rstrip("."), ignore)
        # what the engine would have met: the view of a 6-row block scale by (4, 3, -1)
        with pytest.raises(RuntimeError):
            neox_engine_reorder(torch.ones(math.ceil(3 * 256 / 128), 2), heads)
    else:
        w, s = got[qkv + "weight"], got[qkv + "weight_scale_inv"]
        assert w.dtype == torch.float8_e4m3fn and tuple(s.shape) == (6, 2)
        # the engine reorders weight and scale alike; dequantized, it equals the reordered
        # source within one E4M3 rounding
        src = load_file(sources[name] / "model.safetensors")[qkv + "weight"].float()
        rw, rs = neox_engine_reorder(w.float(), heads), neox_engine_reorder(s, heads)
        deq = rw * rs.repeat_interleave(128, 0).repeat_interleave(128, 1)
        ref = neox_engine_reorder(src, heads)
        assert float((deq - ref).norm() / ref.norm()) < 0.045
    assert run_cli("validate", out, "--strict").exit_code == 0
    _logits_close(out, sources[name], "block")


def test_neox_channel_layout_quantizes_query_key_value(sources: dict[str, Path],
                                                       tmp_path: Path) -> None:
    """A per-channel scale ``[N, 1]`` reorders per head like the weight: quantized."""
    out = _convert(sources["neox64"], tmp_path / "channel", "channel")
    got = _tensors(out)
    qkv = "gpt_neox.layers.0.attention.query_key_value."
    assert got[qkv + "weight"].dtype == torch.float8_e4m3fn
    neox_engine_reorder(got[qkv + "weight_scale"], 4)  # no error


def test_validate_flags_neox_head_dim_64_block_qkv(sources: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """A block-FP8 ``query_key_value`` with head_dim 64 (what ckpt wrote before) is an
    error: the engines' reorder cannot view its scale per head."""
    out = _convert(sources["neox64"], tmp_path / "q", "block")
    sd = load_file(out / "model.safetensors")
    qkv = "gpt_neox.layers.1.attention.query_key_value."
    q, s = fp8.quantize(sd[qkv + "weight"].float().numpy(), "block")
    sd[qkv + "weight"] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
    sd[qkv + "weight_scale_inv"] = torch.from_numpy(s)
    save_file(sd, out / "model.safetensors")
    qc = _qc(out)
    for key in ("ignored_layers", "modules_to_not_convert"):
        qc[key] = [m for m in qc[key] if m != qkv.rstrip(".")]
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))
    code, errors = _validate(out)
    assert code == 1
    assert ("fp8-fused-heads", qkv + "weight") in errors


# --- MoE ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["block", "channel"])
def test_moe_odd_intermediate_experts_module_ignored(sources: dict[str, Path], tmp_path: Path,
                                                     layout: str) -> None:
    """Experts of intermediate size 200 fit neither layout (:func:`moe_block_accepts`; 200 is
    not a multiple of 16 either): every expert of each ``experts`` module stays BF16, and the
    ignore list names the ``experts`` module itself, which SGLang matches exactly
    (:func:`sglang_skips`), as well as each projection. The shared expert (256 wide) is an
    ordinary MLP and is quantized. Before: only the projections were listed."""
    assert not moe_block_accepts(200, 256)
    out = _convert(sources["moe"], tmp_path / layout, layout)
    got = _tensors(out)
    ignore = _ignore(_qc(out))
    for layer in (0, 1):
        unit = f"model.layers.{layer}.mlp.experts"
        assert sglang_skips(unit, ignore) and vllm_skips(unit, ignore), unit
        experts = [n for n in got if n.startswith(unit + ".") and n.endswith(".weight")]
        assert len(experts) == 12
        assert all(got[n].dtype == torch.bfloat16 for n in experts)
        shared = f"model.layers.{layer}.mlp.shared_expert.gate_proj.weight"
        assert got[shared].dtype == torch.float8_e4m3fn
        assert got[f"model.layers.{layer}.mlp.gate.weight"].dtype == torch.bfloat16
    assert run_cli("validate", out, "--strict").exit_code == 0
    _logits_close(out, sources["moe"], layout)


def test_moe_experts_decided_together_and_validated(sources: dict[str, Path],
                                                    tmp_path: Path) -> None:
    """Whole experts modules: one expert that cannot be held keeps all of its module BF16
    (one ``FusedMoE`` layer, one method); validate flags a module partly FP8, and an
    ``fp8`` config whose ignore list names the projections but not the ``experts`` module
    (ckpt's output before)."""
    shapes = [(f"m.layers.0.mlp.experts.{e}.{p}.weight", "F32",
               (256, 384) if p == "down_proj" else (384, 256))
              for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    c = groups.choose(shapes, "block")
    assert len(c.picked) == 6 and "m.layers.0.mlp.experts" not in c.ignore
    shapes[-1] = ("m.layers.0.mlp.experts.1.down_proj.weight", "F32", (256, 200))
    c = groups.choose(shapes, "block")
    assert c.picked == [] and "m.layers.0.mlp.experts" in c.ignore
    assert all(why.startswith("experts m.layers.0.mlp.experts") for _, why in c.left)

    out = _convert(sources["moe"], tmp_path / "q", "block")
    cfg = json.loads((out / "config.json").read_text())
    unit = "model.layers.0.mlp.experts"
    qc = cfg["quantization_config"]
    for key in ("ignored_layers", "modules_to_not_convert"):
        qc[key] = [m for m in qc[key] if m != unit]
    (out / "config.json").write_text(json.dumps(cfg))
    code, errors = _validate(out)
    assert code == 1 and {c for c, _ in errors} == {"fp8-experts-ignore"}
    sd = load_file(out / "model.safetensors")
    w = f"{unit}.0.down_proj."
    sd[w + "weight"] = torch.zeros(256, 200, dtype=torch.float8_e4m3fn)
    sd[w + "weight_scale_inv"] = torch.ones(2, 2)
    save_file(sd, out / "model.safetensors")
    code, errors = _validate(out)
    assert ("fp8-experts-partial", f"{unit}.0.gate_proj.weight") in errors


# --- raw FP8 -----------------------------------------------------------------------------------

def test_raw_e5m2_beside_scaled_weights_is_a_note(tmp_path: Path) -> None:
    """An E5M2 tensor with no scale, no config and no scale-named tensor of its own, in a
    file whose E4M3 weights have scales: raw FP8 values (a note). Before: an error because
    other tensors had scales. An E4M3 weight without its scale there stays an error."""
    torch.manual_seed(0)
    w = torch.randn(128, 128)
    sd = {"proj.weight": (w / (w.abs().max() / 448)).to(torch.float8_e4m3fn),
          "proj.weight_scale_inv": (w.abs().max() / 448).reshape(1, 1),
          "grad_cache.weight": torch.randn(64, 64).to(torch.float8_e5m2)}
    save_file(sd, tmp_path / "a.safetensors")
    r = run_cli("validate", tmp_path / "a.safetensors", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)["checkpoints"][0]
    found = [(f["severity"], f["code"], f["location"]) for f in doc["findings"]
             if f["check"] == "quantization"]
    assert found == [("info", "fp8-raw", "grad_cache.weight")]
    sd["other.weight"] = torch.randn(64, 64).to(torch.float8_e4m3fn)
    save_file(sd, tmp_path / "b.safetensors")
    code, errors = _validate(tmp_path / "b.safetensors")
    assert code == 1 and errors == {("fp8-no-scale", "other.weight")}
