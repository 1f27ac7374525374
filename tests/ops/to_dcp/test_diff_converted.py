"""``ckpt diff SRC OUT --all-tensors`` where OUT is ``convert SRC --to dcp``'s output (issue
48): every weight, moment, the step and the RNG state compare equal and diff exits 0, for
each source the conversion reads (a ``torch.save`` training dict, an HF Trainer
``checkpoint-N``, a Lightning ``.ckpt``), in both layouts and both directions; a source that
is not the output's still differs."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.requires_torch

torch = pytest.importorskip("torch")

from tests.helpers import fsdp_resume as fr  # noqa: E402


def _train_pt(path: Path, steps: int) -> Path:
    model, opt, sched = fr.source_run(steps)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "lr_scheduler": sched.state_dict(), "step": steps,
                "rng_state": torch.get_rng_state()}, path)
    return path


def _diff(cli: Callable[..., Any], a: Path, b: Path, code: int = 0) -> dict[str, Any]:
    r = cli("diff", a, b, "--all-tensors", "--json")
    assert r.exit_code == code, r.output
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def _all_equal(doc: dict[str, Any], *, tensors: int) -> None:
    assert doc["equal"] and doc["differences"] == [], doc["differences"]
    status = {t["name"]: t["status"] for t in doc["tensors"]}
    assert len(status) >= tensors and set(status.values()) == {"identical"}, status
    assert all(o["tied_to"] for o in doc["only_in_a"] + doc["only_in_b"]), (
        doc["only_in_a"], doc["only_in_b"])
    assert "convert --to dcp" in doc["optimizer_ids"]


@pytest.mark.parametrize("layout", ["torchtitan", "recipe"])
def test_torch_dict(tmp_path: Path, cli: Callable[..., Any], layout: str) -> None:
    src = _train_pt(tmp_path / "train.pt", 3)
    out = tmp_path / "out"
    assert cli("convert", src, "--to", "dcp", "--dcp-layout", layout, "-o", out).exit_code == 0
    for a, b in ((src, out), (out, src)):
        doc = _diff(cli, a, b)
        # 6 weights, 18 moments and steps, the RNG state (and torchtitan's step tensor)
        _all_equal(doc, tensors=25)
        names = {t["name"] for t in doc["tensors"]}
        opt = "optimizer." if layout == "torchtitan" else "optim."
        assert {"rng.cpu", f"{opt}state.0.weight.exp_avg_sq"} <= names
        rng = next(m for m in doc["metadata"] if m["key"] == "rng_states")
        assert rng["follows"] and "identical" in rng["follows"]
        if layout == "torchtitan":  # an int32 tensor the conversion made from step=3
            assert "train_state.step equals" in doc["optimizer_ids"]
    # The human summary says it too.
    r = cli("diff", src, out, "--all-tensors")
    assert r.exit_code == 0 and "equal" in r.stdout


def test_another_run_still_differs(tmp_path: Path, cli: Callable[..., Any]) -> None:
    out = tmp_path / "out"
    assert cli("convert", _train_pt(tmp_path / "a.pt", 3), "--to", "dcp", "-o",
               out).exit_code == 0
    doc = _diff(cli, _train_pt(tmp_path / "b.pt", 4), out, code=1)
    changed = {t["name"] for t in doc["tensors"] if t["status"] == "changed"}
    assert "optimizer.state.0.weight.exp_avg" in changed and "0.weight" in changed
    # Step 4 is not the output's step 3: its step tensor stays one-sided.
    assert [o["name"] for o in doc["only_in_b"]] == ["train_state.step"]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed")
@pytest.mark.parametrize("layout", ["torchtitan", "recipe"])
def test_hf_trainer(hf_trainer_dir: Path, tmp_path: Path, cli: Callable[..., Any],
                    layout: str) -> None:
    """Two param groups (decay, no decay), named by Trainer's grouping as the conversion
    names them; the RNG states of rng_state.pth; ``lm_head.weight``, which model.safetensors
    keeps once (tied to the embeddings), a tied copy."""
    src = hf_trainer_dir / "checkpoint-4"
    out = tmp_path / "out"
    assert cli("convert", src, "--to", "dcp", "--dcp-layout", layout, "-o", out).exit_code == 0
    doc = _diff(cli, src, out)
    _all_equal(doc, tensors=60)
    moments = [t for t in doc["tensors"] if ".exp_avg" in t["name"]]
    assert len(moments) == 32 and all(t["name_a"].startswith("optimizer.state.")
                                      for t in moments)
    assert [o["name"] for o in doc["only_in_b"]] == ["lm_head.weight"]


def test_lightning(lightning_dir: Path, tmp_path: Path, cli: Callable[..., Any]) -> None:
    """The module's ``net.`` names met with the FQNs; the ModelCheckpoint callback's tensor,
    which the conversion does not carry, is named and left out of the comparison."""
    src = lightning_dir / "last.ckpt"
    out = tmp_path / "out"
    assert cli("convert", src, "--to", "dcp", "-o", out).exit_code == 0
    doc = _diff(cli, out, src)
    _all_equal(doc, tensors=8)
    assert {t["name"]: t["name_b"] for t in doc["tensors"]}["weight"] == "state_dict.net.weight"
    assert "not carry them: callbacks.ModelCheckpoint" in doc["optimizer_ids"]
    assert doc["b"]["excluded"] == {"other": 1}
