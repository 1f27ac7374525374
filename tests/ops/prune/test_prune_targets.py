"""prune and watch aimed one level too deep, at a checkpoint (issue 37 item 7): refused,
naming the run directory, and nothing is created inside the checkpoint; a stale prune lock a
prune once left inside one is removed, never taken for a writer's."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli, third_party_quiet

pytestmark = pytest.mark.requires_torch


def _torch_step_run(run: Path, steps: tuple[int, ...] = (700, 800)) -> Path:
    """Step directories each holding one ``torch.save`` file (the sample run's older layout)."""
    for s in steps:
        d = run / f"step_{s:06d}"
        d.mkdir(parents=True)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": s},
                   d / "checkpoint.pt")
    return run


def _hf_final_model(out: Path) -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    with third_party_quiet():
        GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                   n_head=2)).save_pretrained(out)
    return out


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("kind", ["torch-step-dir", "hf-final-model"])
@pytest.mark.parametrize("extra", [[], ["--any-dir"]], ids=["plain", "any-dir"])
def test_prune_refuses_a_checkpoint_and_names_its_run(tmp_path: Path, kind: str,
                                                      extra: list[str]) -> None:
    if kind == "torch-step-dir":
        target = _torch_step_run(tmp_path / "run") / "step_000800"
    else:
        target = _hf_final_model(tmp_path / "run" / "final")
    before = _tree(target)
    r = run_cli("prune", target, "--keep", "1", "--grace", "0", "--yes", *extra)
    assert r.exit_code == 2, r.output
    assert "is itself a checkpoint" in r.stderr and str(tmp_path / "run") in r.stderr
    assert "Traceback" not in r.stderr
    assert _tree(target) == before  # no .ckpt-prune.lock inside it
    r = run_cli("prune", target, "--keep", "1", "--thin-after", "1", "--grace", "0", "--yes",
                *extra)
    assert r.exit_code == 2 and _tree(target) == before


@pytest.mark.parametrize("kind", ["torch-step-dir", "hf-final-model"])
def test_watch_refuses_a_checkpoint_and_names_its_run(tmp_path: Path, kind: str) -> None:
    if kind == "torch-step-dir":
        target = _torch_step_run(tmp_path / "run") / "step_000800"
    else:
        target = _hf_final_model(tmp_path / "run" / "final")
    before = _tree(target)
    r = run_cli("watch", target, "--once", "--settle", "0")
    assert r.exit_code == 2, r.output
    assert "is itself a checkpoint" in r.stderr and str(tmp_path / "run") in r.stderr
    assert _tree(target) == before  # no ledger, no manifest inside it


def test_a_stale_prune_lock_inside_a_checkpoint_is_removed_not_obeyed(tmp_path: Path) -> None:
    run = _torch_step_run(tmp_path / "run", (600, 700, 800))
    stray = run / "step_000800" / ".ckpt-prune.lock"
    stray.write_bytes(b"")  # what a prune aimed at step_000800 used to leave
    r = run_cli("watch", run, "--once", "--settle", "0", "--json")
    assert r.exit_code == 0, r.output
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(e["path"], e["verdict"]) for e in events] == [
        ("step_000600", "good"), ("step_000700", "good"), ("step_000800", "good")]
    assert not stray.exists()
    assert run_cli("validate", run / "step_000800", "--strict").exit_code == 0
    # Held by a live process, it is a lock: prune keeps that checkpoint and does not count it.
    stray.write_bytes(b"")
    with open(stray) as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        r = run_cli("prune", run, "--keep", "1", "--grace", "0", "--dry-run", "--json")
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        status = {c["name"]: c["action"] for c in doc["checkpoints"]}
        assert status["step_000800"] == "keep" and status["step_000700"] == "keep"
        assert status["step_000600"] == "delete"
    assert stray.exists()
    # Unheld again: the next prune neither counts it as in progress nor leaves it.
    r = run_cli("prune", run, "--keep", "1", "--grace", "0", "--dry-run", "--json")
    doc = json.loads(r.stdout)
    status = {c["name"]: c["action"] for c in doc["checkpoints"]}
    assert status == {"step_000600": "delete", "step_000700": "delete", "step_000800": "keep"}
    assert not stray.exists()


def test_a_dry_run_says_would_thin_and_every_line_has_its_reason(sample_copy: Path) -> None:
    for args in (["--thin-after", "2"], ["--keep", "3", "--thin-after", "1"]):
        r = run_cli("prune", sample_copy, *args, "--grace", "0", "--dry-run")
        assert r.exit_code == 0, r.output
        lines = [s for s in r.stdout.splitlines()
                 if s.startswith(("keep ", "would ", "thin ", "delete "))]
        assert len(lines) == 4, r.stdout
        assert all(s.split("): ", 1)[1].strip() for s in lines), lines
        assert any(s.startswith("would thin step_000") for s in lines), lines
        assert not any("thinned" in s for s in lines), lines


def test_plan_counts_thinned_checkpoints_at_their_thinned_size() -> None:
    r = run_cli("plan", "--params", "7e9", "--keep", "5", "--thin-after", "3", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    ret, size = doc["retention"], doc["sizes"]
    assert ret["kept_whole"] == 3
    thinned = doc["thinning"]["thinned_bytes"] if doc.get("thinning") else None
    assert thinned is not None and 0 < thinned < size["training"]
    assert ret["steady_bytes"] == 3 * size["training"] + 2 * thinned
    human = run_cli("plan", "--params", "7e9", "--keep", "5", "--thin-after", "3")
    assert "(3 whole, 2 thinned)" in human.stdout
