"""``convert --to fp8`` decides per tensor on the plan (quantize, keep BF16, keep FP32, write a
scale) before anything is built, and builds once; counters and provenance are computed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from ckpt_cli.ops.convert import convert
from ckpt_cli.tensors import source as tensor_source

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


def _llama_ish(path: Path) -> Path:
    rng = np.random.default_rng(0)
    sd = {"model.embed_tokens.weight": rng.standard_normal((256, 128), np.float32),
          "model.layers.0.input_layernorm.weight": np.ones(128, np.float32),
          "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((256, 128), np.float32),
          "lm_head.weight": rng.standard_normal((256, 128), np.float32)}
    for p in PROJ:
        sd[f"model.layers.0.self_attn.{p}.weight"] = rng.standard_normal((128, 128), np.float32)
    save_file(sd, str(path))
    return path


def test_the_plan_decides_each_tensor_before_anything_is_built(tmp_path: Path) -> None:
    from ckpt_cli.formats import read_index
    from ckpt_cli.ops.convert import fp8
    from ckpt_cli.ops.convert.plan import plan_index

    src = _llama_ish(tmp_path / "m.safetensors")
    plan = plan_index(read_index(src), src, "fp8 (block)", "BF16", "safetensors",
                      ("*.o_proj.weight", "*layernorm*"), False, False, None)
    qc = fp8.choose(plan, "block", src)
    steps = {s.name: (s.plain, s.dtype, s.quantize) for s in plan.steps}
    for p in ("q_proj", "k_proj", "v_proj"):  # chosen: read in FP32, not rounded to BF16
        assert steps[f"model.layers.0.self_attn.{p}.weight"] == ("BF16", "F32", True)
    assert steps["model.layers.0.self_attn.o_proj.weight"] == ("F32", "F32", True)
    assert steps["model.layers.0.input_layernorm.weight"] == ("F32", "F32", False)  # kept FP32
    assert steps["lm_head.weight"] == ("BF16", "BF16", False)
    # computed, not patched: the quantized weights count as ->F8_E4M3 only
    assert plan.casts() == {"->F8_E4M3": 5, "F32->BF16": 2}
    assert plan.meta["ckpt.conversion"].startswith("to=fp8 (block); ")
    assert json.loads(plan.meta["ckpt.quantization_config"]) == qc
    assert qc["weight_block_size"] == [128, 128] and "lm_head" in qc["ignored_layers"]


def test_fp8_reads_the_source_through_one_build(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    src = _llama_ish(tmp_path / "m.safetensors")
    opened: list[Any] = []
    real = tensor_source.TensorSource.__init__

    def counted(self: Any, *a: Any, **k: Any) -> None:
        opened.append(self)
        real(self, *a, **k)

    monkeypatch.setattr(tensor_source.TensorSource, "__init__", counted)
    r = convert(src, tmp_path / "q", to="fp8", keep_fp32=("*layernorm*",))
    assert len(opened) == 1  # built once (it was built in BF16, then again)
    assert r.casts == {"->F8_E4M3": 5, "F32->BF16": 2}
    assert r.metadata["ckpt.conversion"].startswith("to=fp8 (block); ")
    assert r.kept_fp32 == {"*layernorm*": ["model.layers.0.input_layernorm.weight"]}
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "numpy") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "F8_E4M3"
    assert dtypes["model.layers.0.self_attn.q_proj.weight_scale_inv"] == "F32"
    assert dtypes["model.layers.0.input_layernorm.weight"] == "F32"
    assert dtypes["lm_head.weight"] == "BF16"
