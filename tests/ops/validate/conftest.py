"""Fixtures and helpers the validate test modules share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ckpt_cli.model import Finding
from ckpt_cli.ops.validate import validate
from ckpt_cli.ops.validate.result import CHECKS, CheckpointReport
from tests.helpers.makers import (
    hf_sharded,
    save_training_checkpoint,
    tiny_state_dict,
)


def report(path: Path, **kw: Any) -> CheckpointReport:
    result = validate(path, **kw)
    assert result.kind == "checkpoint"
    return result.checkpoints[0]


def found(r: CheckpointReport, code: str, severity: str | None = "error") -> list[Finding]:
    """Findings with ``code`` (and ``severity``), checking they sit in a failing check."""
    out = [f for f in r.findings if f.code == code
           and (severity is None or f.severity == severity)]
    for f in out:
        owner = next(c for c in r.checks if f in c.findings)
        assert owner.status in {"error": ("fail",), "warning": ("warn", "fail"),
                                "info": ("pass", "warn", "fail")}[f.severity], (owner, f)
    return out


def check_of(r: CheckpointReport, code: str) -> str:
    return next(c.id for c in r.checks for f in c.findings if f.code == code)


def assert_clean(r: CheckpointReport) -> None:
    assert r.valid, [f for f in r.findings if f.severity == "error"]
    assert r.warnings == 0, [f for f in r.findings if f.severity == "warning"]
    assert all(c.id in CHECKS for c in r.checks)


# -- safetensors -------------------------------------------------------------------------------


@pytest.fixture
def st_file(tmp_path: Path) -> Path:
    p = tmp_path / "model.safetensors"
    save_file(tiny_state_dict(), str(p), metadata={"format": "pt"})
    return p


# -- torch zip ---------------------------------------------------------------------------------


@pytest.fixture
def pt_file(tmp_path: Path) -> Path:
    return save_training_checkpoint(tmp_path / "train.pt")


# -- HF sharded --------------------------------------------------------------------------------


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    out = tmp_path / "export"
    out.mkdir()
    sd = {f"layer.{i}.weight": torch.randn(64, 64) for i in range(4)}
    hf_sharded(out, sd, max_shard_size=40_000)  # 16 KB tensors: two shards of two
    return out
