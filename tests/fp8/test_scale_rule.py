"""One scale rule for ``validate`` and ``convert --dequantize`` (issue #46): a 0-d scale under
a block-wise config, and a subnormal BF16 block scale, are refused by both. The checkpoints are
real torch FP8 tensors saved with safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.requires_torch

_CONFIG = {"model_type": "llama", "torch_dtype": "bfloat16",
           "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "fmt": "e4m3", "weight_block_size": [128, 128]}}


def _fp8_checkpoint(where: Path, scale: object) -> Path:
    import torch
    from safetensors.torch import save_file

    where.mkdir()
    w = (torch.randn(256, 256) * 0.5).to(torch.float8_e4m3fn)
    save_file({"model.layers.0.mlp.up_proj.weight": w,
               "model.layers.0.mlp.up_proj.weight_scale_inv": scale,
               "model.norm.weight": torch.ones(256, dtype=torch.bfloat16)},
              str(where / "model.safetensors"), metadata={"format": "pt"})
    (where / "config.json").write_text(json.dumps(_CONFIG))
    return where


def _zero_d(tmp_path: Path) -> Path:
    import torch

    return _fp8_checkpoint(tmp_path / "zero-d", torch.tensor(0.01, dtype=torch.float32))


def _subnormal(tmp_path: Path) -> Path:
    import torch

    scale = torch.full((2, 2), 0.01, dtype=torch.bfloat16)
    scale[1, 0] = torch.tensor(1e-39, dtype=torch.bfloat16)  # below BF16's 2**-126
    assert 0 < scale[1, 0].item() < torch.finfo(torch.bfloat16).smallest_normal
    return _fp8_checkpoint(tmp_path / "subnormal", scale)


@pytest.mark.parametrize(("make", "said"), [
    (_zero_d, "is a 0-d scale, but its scales are block-wise"),
    (_subnormal, "subnormal scale(s), below the smallest normal BF16"),
])
def test_validate_and_dequantize_refuse_the_same_scales(tmp_path: Path, make: object,
                                                        said: str) -> None:
    src = make(tmp_path)  # type: ignore[operator]
    r = run_cli("validate", src)
    assert r.exit_code == 1, r.output
    assert said in " ".join(r.output.split())
    out = tmp_path / "out"
    r = run_cli("convert", src, "--to", "bf16", "--dequantize", "-o", out)
    assert r.exit_code == 2, r.output
    assert "cannot dequantize" in r.output and said in " ".join(r.output.split())
    assert not out.exists()


def test_a_normal_block_scale_still_dequantizes(tmp_path: Path) -> None:
    import torch

    src = _fp8_checkpoint(tmp_path / "good", torch.full((2, 2), 0.01, dtype=torch.bfloat16))
    assert run_cli("validate", src).exit_code == 0
    assert run_cli("convert", src, "--to", "bf16", "--dequantize", "-o",
                   tmp_path / "out").exit_code == 0
