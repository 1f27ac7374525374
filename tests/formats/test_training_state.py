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
    # The finding names the global (issue #23), and the item it was found in.
    assert unsafe[0]["location"] in ("posix.system", "os.system")
    assert "train_state.hook" in unsafe[0]["message"]
    assert doc["metadata"]["step"] == 50  # the other items are still read
    r = run_cli("validate", d)
    assert r.exit_code == 1 and "system" in r.stdout + r.stderr
    assert not marker.exists()
    index = read_index(d)
    assert "posix.system" in str(index.objects["train_state.hook"])


# --- tied weights: one model, one parameter count, whatever the format ----------------------


class _TiedLM(torch.nn.Module):
    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(64, 16)
        self.h = torch.nn.Linear(16, 16)
        self.lm_head = torch.nn.Linear(16, 64, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight


def test_tied_weights_counted_once_in_every_format(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = _TiedLM()
    expected = sum(p.numel() for p in model.parameters())  # torch counts the tie once
    sd = model.state_dict()
    torch.save(sd, tmp_path / "m.pt")
    dcp_save({"model": sd}, tmp_path / "dcp")
    # safetensors refuses shared storage: a clone per name is how such files hold a tie.
    save_file({k: v.detach().clone() for k, v in sd.items()}, str(tmp_path / "m.safetensors"))
    ties = {}
    for name in ("m.pt", "dcp", "m.safetensors"):
        doc = _json("inspect", tmp_path / name)
        assert doc["num_parameters"] == expected, name
        ties[name] = doc["tied_tensors"]
    assert [t["tie"] for t in ties["m.pt"]] == ["storage"]
    assert ties["dcp"] == [{"name": "model.lm_head.weight", "tied_to": "model.wte.weight",
                            "tie": "values", "counted_twice": False}]
    assert [(t["name"], t["tie"]) for t in ties["m.safetensors"]] == [
        ("lm_head.weight", "values")]


def test_untied_head_of_the_same_shape_is_counted_twice(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = _TiedLM(tie=False)
    save_file(model.state_dict(), str(tmp_path / "m.safetensors"))
    doc = _json("inspect", tmp_path / "m.safetensors")
    assert doc["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert doc["tied_tensors"] == []


def test_tie_detection_samples_only_the_candidates(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt_cli.formats import ties

    torch.manual_seed(0)
    big = _TiedLM()
    big.wte = torch.nn.Embedding(4096, 64)  # 1 MiB: far more than the samples
    big.lm_head.weight = big.wte.weight
    d = dcp_save({"model": big.state_dict()}, tmp_path / "dcp")
    index = read_index(d)
    assert index.aliases == {"model.lm_head.weight": "model.wte.weight"}
    read: list[int] = []
    orig = ties.read_full

    def counting(fd: int, offset: int, out: memoryview) -> int:
        read.append(len(out))
        return orig(fd, offset, out)

    monkeypatch.setattr(ties, "read_full", counting)
    index.aliases.clear()
    ties.find_ties(index)
    assert index.aliases == {"model.lm_head.weight": "model.wte.weight"}
    # Two candidates, one chunk each (one process), three windows each; h.weight never read.
    assert sum(read) == 2 * 3 * ties.WINDOW


def test_unverifiable_tie_is_said_to_be_counted_twice(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _TiedLM()
    d = dcp_save({"model": model.state_dict()}, tmp_path / "dcp")
    for p in d.glob("*.distcp"):
        p.unlink()  # the bytes cannot be sampled
    doc = _json("inspect", d)
    assert doc["tied_tensors"] == [{"name": "model.lm_head.weight",
                                    "tied_to": "model.wte.weight", "tie": "unverified",
                                    "counted_twice": True}]
    assert doc["num_parameters"] == sum(p.numel() for p in model.parameters()) + 64 * 16
    out = run_cli("inspect", d).stdout
    assert "may repeat model.wte.weight" in out and "counted twice" in out
