"""``ckpt convert SRC --to dcp`` end to end from the framework sources (issue 48): a Lightning
``.ckpt``, an HF Trainer ``checkpoint-N`` and DeepSpeed ZeRO checkpoints, each written by the
framework itself, converted through the public API, read back with torch's own
``dcp_to_torch_save``: every weight and optimizer moment equals what the source's reader gives
(whose own tests compare it with what the framework restores), the step is carried, and
``validate --require optimizer,step`` passes on the output.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckpt_cli
from ckpt_cli.ops.to_dcp import SOURCES, source_format
from ckpt_cli.ops.to_dcp.state import LazyTensor, TrainingState
from tests.conftest import requires_deepspeed, run_cli, third_party_quiet

pytestmark = pytest.mark.requires_torch


def _read_back(out: Path, tmp_path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = tmp_path / "back.pt"
    with third_party_quiet():
        dcp_to_torch_save(str(out), str(flat))
        return dict(torch.load(flat, weights_only=False))  # written by torch just now


def _np(v: LazyTensor | float | int) -> np.ndarray:
    return np.asarray(v.load() if isinstance(v, LazyTensor) else v)


def _same(ours: torch.Tensor | Any, expected: LazyTensor | float | int) -> bool:
    want = _np(expected)
    got = ours.detach().float().numpy() if isinstance(ours, torch.Tensor) else np.asarray(ours)
    return got.shape == want.shape and np.array_equal(got, want.astype(got.dtype))


def _convert_and_check(src: Path, tmp_path: Path, fmt: str) -> TrainingState:
    kind, path, _ = source_format(src, None)
    assert kind == fmt
    state = SOURCES[kind](path)
    assert state.optimizer_state, "the source has optimizer state"
    out = tmp_path / "dcp"
    r = ckpt_cli.convert(src, out, to="dcp", dcp_layout="recipe")
    assert r.metadata["ckpt.conversion"] == f"{fmt} -> dcp (recipe)"
    back = _read_back(out, tmp_path)
    model, optim = back["model"], back["optim"]
    assert set(model) == set(state.model)
    bad = [n for n, t in state.model.items() if not _same(model[n], t)]
    assert not bad, bad
    assert set(optim["state"]) == set(state.optimizer_state)
    for fqn, per in state.optimizer_state.items():
        for key, value in per.items():
            assert _same(optim["state"][fqn][key], value), (fqn, key)
    assert [g["params"] for g in optim["param_groups"]] == [
        g["params"] for g in state.param_groups]
    if state.step is not None:
        assert back["train_state"]["step"] == state.step
    v = run_cli("validate", out, "--require", "optimizer,step")
    assert v.exit_code == 0, v.stdout + v.stderr
    return state


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                    reason="lightning is not installed")
def test_lightning_checkpoint_to_dcp(lightning_dir: Path, tmp_path: Path) -> None:
    state = _convert_and_check(lightning_dir / "epoch=0-step=4.ckpt", tmp_path, "lightning")
    assert state.step == 4


def test_hf_trainer_checkpoint_to_dcp(hf_trainer_dir: Path, tmp_path: Path) -> None:
    state = _convert_and_check(hf_trainer_dir / "checkpoint-4", tmp_path, "hf-trainer")
    assert state.step == 4


@requires_deepspeed
@pytest.mark.parametrize("config", ["z1-fp32", "z2-bf16", "z3-fp32"])
def test_deepspeed_checkpoint_to_dcp(ds_dir: Path, tmp_path: Path, config: str) -> None:
    tags = sorted(p for p in (ds_dir / config).iterdir() if p.name.startswith("global_step"))
    state = _convert_and_check(tags[-1], tmp_path, "deepspeed")
    # Mixed precision: the FP32 master weights are the output's weights.
    assert all(t.dtype == "F32" for t in state.model.values()
               if t.dtype in ("F32", "BF16", "F16"))
