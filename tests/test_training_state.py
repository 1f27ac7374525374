"""Training metadata kept beside the tensors: torch DCP ``bytes`` items (step, epoch,
scheduler, RNG state), the step a checkpoint's name gives, and hostile item pickles."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpt_cli.formats import read_index
from tests.conftest import run_cli, third_party_quiet

pytestmark = pytest.mark.requires_torch


def _trained(seed: int = 0, steps: int = 1) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    for _ in range(steps):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def dcp_save(state: dict[str, Any], out: Path) -> Path:
    """One process, no process group: torch.distributed.checkpoint's own save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with third_party_quiet():
        dcp.save(state, storage_writer=FileSystemWriter(str(out)), no_dist=True)
    return out


def recipe_state(step: int, epoch: int, steps: int = 1) -> dict[str, Any]:
    """torch's recipe layout: model, optimizer, a train_state dict, scheduler and RNG."""
    model, opt, sched = _trained(steps=steps)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "train_state": {"step": step, "epoch": epoch},
            "scheduler": sched.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": np.random.get_state()}}


def _json(*args: str | Path) -> dict[str, Any]:
    r = run_cli(*args, "--json")
    assert r.exit_code in (0, 1), r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_dcp_train_state_scheduler_and_rng(tmp_path: Path) -> None:
    d = dcp_save(recipe_state(50, 2, steps=3), tmp_path / "ckpt")
    doc = _json("inspect", d)
    meta = doc["metadata"]
    assert meta["step"] == 50 and meta["epoch"] == 2
    assert doc["step"] == 50 and doc["step_source"] == "metadata"
    # StepLR's own state dict after three scheduler steps.
    assert meta["scheduler"]["last_epoch"] == 3 and meta["scheduler"]["step_size"] == 10
    assert meta["scheduler"]["_last_lr"] == pytest.approx([1e-3])
    assert set(meta["rng_states"]) == {"rng.torch", "rng.python", "rng.numpy"}
    assert not [w for w in doc["warnings"] if w["severity"] == "error"]
    human = run_cli("inspect", d)
    assert "step 50, epoch 2" in human.stdout
    assert "last_epoch 3" in human.stdout and "rng.python" in human.stdout


def test_diff_shows_the_training_metadata(tmp_path: Path) -> None:
    a = dcp_save(recipe_state(50, 2, steps=1), tmp_path / "a")
    b = dcp_save(recipe_state(60, 3, steps=2), tmp_path / "b")
    doc = _json("diff", a, b)
    changed = {m["key"]: (m["a"], m["b"]) for m in doc["metadata"] if m["status"] == "changed"}
    assert changed["step"] == (50, 60) and changed["epoch"] == (2, 3)
    assert changed["scheduler.last_epoch"] == (1, 2)


def test_step_from_the_directory_name_when_none_is_recorded(tmp_path: Path) -> None:
    model, _, _ = _trained()
    d = dcp_save({"model": model.state_dict()}, tmp_path / "step_000070")
    doc = _json("inspect", d)
    assert doc["step"] == 70 and doc["step_source"] == "name"
    assert "step" not in doc["metadata"]  # metadata holds what the checkpoint records
    assert "step 70 (from the name" in run_cli("inspect", d).stdout
    # A recorded step wins over the name.
    e = dcp_save(recipe_state(50, 2), tmp_path / "step_000090")
    assert _json("inspect", e)["step"] == 50


class _Hostile:
    """Pickles as a call of os.system: what a malicious bytes item holds."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_hostile_bytes_item_is_reported_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    model, _, _ = _trained()
    d = dcp_save({"model": model.state_dict(),
                  "train_state": {"step": 50, "hook": _Hostile(marker)}}, tmp_path / "evil")
    assert not marker.exists()
    doc = _json("inspect", d)
    unsafe = [w for w in doc["warnings"] if w["code"] == "unsafe-global"]
    assert unsafe and "system" in unsafe[0]["message"]
    assert unsafe[0]["location"] == "train_state.hook"
    assert doc["metadata"]["step"] == 50  # the other items are still read
    r = run_cli("validate", d)
    assert r.exit_code == 1 and "system" in r.stdout + r.stderr
    assert not marker.exists()
    index = read_index(d)
    assert "posix.system" in str(index.objects["train_state.hook"])
