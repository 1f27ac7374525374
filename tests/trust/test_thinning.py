"""``prune --thin-after``: old checkpoints rewritten in place without optimizer state, loading
with their framework's loader and holding the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckpt_cli.trust.ledger import read_ledger
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.loads import holds_optimizer_state
from tests.helpers.makers import lightning_run
from tests.trust.conftest import (
    _aged_run,
    _training_run,
    _watch_thinning,
)

pytestmark = pytest.mark.requires_torch


def test_thin_after_keeps_weights_drops_optimizer(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _training_run(run, (100, 200, 300, 400))
    before = {p.name: torch.load(p, weights_only=True) for p in run.iterdir()}
    sizes = {p.name: p.stat().st_size for p in run.iterdir()}
    r = run_cli("prune", run, "--thin-after", "2", "--keep-full-every", "200", "--grace", "0",
                "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)["thinning"]
    # step 400 and 300 are the newest 2; 200 is a multiple of --keep-full-every; 100 is thinned.
    assert doc["to_thin"] == ["step_0100.pt"] and list(doc["thinned"]) == ["step_0100.pt"]
    t = doc["thinned"]["step_0100.pt"]
    assert t["dropped"] == ["optimizer"] and t["bytes_before"] == sizes["step_0100.pt"]
    assert t["bytes_after"] < t["bytes_before"] / 2 and doc["bytes_saved"] > 0
    thin = torch.load(run / "step_0100.pt", weights_only=True)
    # The optimizer's per-parameter state goes, its hyperparameters stay.
    assert set(thin) == {"model", "optimizer", "step"} and thin["step"] == 100
    assert thin["optimizer"]["state"] == {}
    assert thin["optimizer"]["param_groups"] == before["step_0100.pt"]["optimizer"][
        "param_groups"]
    for k, v in before["step_0100.pt"]["model"].items():
        assert torch.equal(thin["model"][k], v)
    for name in ("step_0200.pt", "step_0300.pt", "step_0400.pt"):
        assert holds_optimizer_state(torch.load(run / name, weights_only=True))
    assert run_cli("validate", run / "step_0100.pt").exit_code == 0
    ledger = read_ledger(run)
    assert ledger is not None
    line = ledger.latest()["step_0100.pt"]
    assert line.event == "thinned" and line.detail["bytes_before"] == sizes["step_0100.pt"]
    # Thinning again finds nothing to drop; no temporaries are left.
    r = run_cli("prune", run, "--thin-after", "2", "--grace", "0", "--yes")
    assert r.exit_code == 0 and not [p for p in run.iterdir() if "ckpt-tmp" in p.name]


def test_thin_lightning_checkpoint_to_bf16(tmp_path: Path) -> None:
    with third_party_quiet():
        run = lightning_run(tmp_path / "ckpts", steps=6, every=2, save_last=False)
    files = sorted(run.glob("*step=*.ckpt"), key=lambda p: int(p.stem.split("step=")[1]))
    oldest = files[0]
    orig = torch.load(oldest, weights_only=True)
    assert "optimizer_states" in orig
    r = run_cli("prune", run, "--thin-after", "1", "--thin-to", "bf16", "--grace", "0", "--yes")
    assert r.exit_code == 0, r.stderr
    assert "thinned" in r.stdout and "saved" in r.stdout
    thin = torch.load(oldest, weights_only=True)
    assert not holds_optimizer_state(thin)
    assert thin["optimizer_states"][0]["param_groups"] == orig["optimizer_states"][0][
        "param_groups"]
    assert thin["global_step"] == orig["global_step"] and "loops" in thin
    for k, v in orig["state_dict"].items():
        assert thin["state_dict"][k].dtype == torch.bfloat16
        assert torch.equal(thin["state_dict"][k], v.to(torch.bfloat16))
    assert holds_optimizer_state(torch.load(files[-1], weights_only=True))


def test_thin_options_need_thin_after(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _training_run(run, (1, 2))
    r = run_cli("prune", run, "--keep", "1", "--thin-to", "bf16", "--yes")
    assert r.exit_code == 2 and "--thin-after" in r.stderr


def test_thin_hf_trainer_checkpoint(hf_trainer_dir: Path, tmp_path: Path) -> None:
    import shutil

    from transformers import AutoModelForCausalLM

    run = tmp_path / "out"
    shutil.copytree(hf_trainer_dir, run, symlinks=True)
    ckpts = sorted((p for p in run.glob("checkpoint-*")), key=lambda p: int(p.name.split("-")[1]))
    oldest = ckpts[0]
    assert (oldest / "optimizer.pt").is_file()
    with third_party_quiet():
        orig = AutoModelForCausalLM.from_pretrained(oldest).state_dict()
    r = run_cli("prune", run, "--thin-after", "1", "--grace", "0", "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)["thinning"]
    assert oldest.name in doc["thinned"] and doc["bytes_saved"] > 0
    assert not holds_optimizer_state(torch.load(oldest / "optimizer.pt", weights_only=True))
    assert (oldest / "trainer_state.json").is_file()
    assert (ckpts[-1] / "optimizer.pt").is_file()
    with third_party_quiet():
        thin = AutoModelForCausalLM.from_pretrained(oldest).state_dict()
    assert all(torch.equal(thin[k], v) for k, v in orig.items())
    assert run_cli("validate", oldest).exit_code == 0


def test_a_watched_run_stays_valid_and_verified_after_thinning(tmp_path: Path) -> None:
    """Manifests written by ``watch`` are rewritten for the thinned files (a stale one would make
    the thinned checkpoint fail validate), and the ledger's line records the new manifest."""
    import os
    import time

    from ckpt_cli.manifest import manifest_path, verify_manifest
    from ckpt_cli.ops.resume import latest_verified
    from ckpt_cli.trust.ledger import manifest_digest

    run = tmp_path / "run"
    _training_run(run, (100, 200, 300))
    old = time.time() - 60
    for p in run.iterdir():
        os.utime(p, (old, old))
    r = run_cli("watch", run, "--once", "--settle", "0")
    assert r.exit_code == 0, r.stderr
    assert manifest_path(run / "step_0100.pt").is_file()
    r = run_cli("prune", run, "--thin-after", "1", "--grace", "0", "--yes")
    assert r.exit_code == 0, r.stderr
    for name in ("step_0100.pt", "step_0200.pt"):
        assert not holds_optimizer_state(torch.load(run / name, weights_only=True))
        assert verify_manifest(run / name).ok
        ledger = read_ledger(run)
        assert ledger is not None
        line = ledger.latest()[name]
        assert line.event == "thinned" and line.manifest_digest == manifest_digest(run / name)
    r = run_cli("validate", run)
    assert r.exit_code == 0, r.stdout + r.stderr
    # The next watch pass finds nothing wrong, and resume still picks the newest whole one.
    r = run_cli("watch", run, "--once", "--settle", "0")
    assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr
    found = latest_verified(run, verify="full")
    assert found is not None and Path(found).name == "step_0300.pt"


def test_watch_applies_thinning_after_verifying(tmp_path: Path) -> None:
    import os
    import time

    run = tmp_path / "run"
    _training_run(run, (100, 200, 300))
    old = time.time() - 60
    for p in run.iterdir():
        os.utime(p, (old, old))
    r = run_cli("watch", run, "--once", "--settle", "0", "--grace", "0", "--thin-after", "2",
                "--json")
    assert r.exit_code == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    pruned = [e for e in events if e["event"] == "pruned"]
    assert len(pruned) == 1 and pruned[0]["thinned"] == ["step_0100.pt"]
    assert pruned[0]["deleted"] == []  # --thin-after alone deletes nothing
    assert not holds_optimizer_state(torch.load(run / "step_0100.pt", weights_only=True))
    assert holds_optimizer_state(torch.load(run / "step_0200.pt", weights_only=True))
    r = run_cli("watch", run, "--once", "--settle", "0", "--thin-after", "2", "--thin-to",
                "fp16")
    assert r.exit_code == 2 and "--thin-to" in r.stderr


def test_a_long_running_watch_trusts_what_thinning_rewrote(tmp_path: Path) -> None:
    """The watcher's cached ledger lines must not outlive a thinning (its own, or a cron
    prune's): the rewritten checkpoints are good, never reported bad."""
    from ckpt_cli.ops.watch import Watcher, WatchOptions
    from ckpt_cli.trust.ledger import read_ledger as read

    run = tmp_path / "run"
    _aged_run(run, (100, 200, 300, 400))
    events = _watch_thinning(run)
    assert not [e for e in events if e.bad], [e.problems for e in events if e.bad]
    assert [e.thinned for e in events if e.event == "pruned"] == [["step_0100.pt",
                                                                   "step_0200.pt"]]
    # A watcher without retention, and a cron prune thinning under it.
    run2 = tmp_path / "run2"
    _aged_run(run2, (100, 200, 300))
    events2: list = []
    w = Watcher(run2, WatchOptions(settle=0), events2.append)
    w.run_pass()
    r = run_cli("prune", run2, "--thin-after", "1", "--grace", "0", "--yes")
    assert r.exit_code == 0, r.stderr
    w.run_pass()
    w.run_pass()
    assert not [e for e in events2 if e.bad], [e.problems for e in events2 if e.bad]
    book = read(run2)
    assert book is not None and all(e.good for e in book.latest().values())


def test_resume_never_picks_a_thinned_or_symlinked_checkpoint(tmp_path: Path) -> None:
    import os

    from ckpt_cli.ops.resume import choose, latest_verified

    run = tmp_path / "run"
    _aged_run(run, (100, 200, 300, 400))
    assert run_cli("watch", run, "--once", "--settle", "0").exit_code == 0
    assert run_cli("prune", run, "--thin-after", "2", "--grace", "0", "--yes").exit_code == 0
    assert latest_verified(run) == run / "step_0400.pt"
    # The two whole ones damaged: only thinned ones are left good, and none is resumable.
    for name in ("step_0300.pt", "step_0400.pt"):
        with open(run / name, "r+b") as f:
            f.truncate(1000)
    assert latest_verified(run, verify="full") is None
    # A verified file swapped for a link to a same-size file outside the run.
    run2 = tmp_path / "run2"
    _aged_run(run2, (100, 200))
    assert run_cli("watch", run2, "--once", "--settle", "0").exit_code == 0
    outside = tmp_path / "evil.pt"
    outside.write_bytes((run2 / "step_0100.pt").read_bytes())
    os.unlink(run2 / "step_0200.pt")
    os.symlink(outside, run2 / "step_0200.pt")
    chosen = choose(run2)
    assert chosen is not None and chosen.path == run2 / "step_0100.pt"
    assert any("symbolic link" in why for _p, why in chosen.rejected)


def test_thinning_drops_only_optimizer_state_and_keeps_age(tmp_path: Path) -> None:
    import os

    run = tmp_path / "run"
    run.mkdir()
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    hyper = {"lr": 0.01, "batch": 32, "data": "coco.yaml"}
    for step in (100, 200, 300):
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "opt": hyper,
                    "optim": "adamw", "step": step}, run / f"step_{step}.pt")
    weights_only = run / "step_50.pt"
    torch.save({"model": {k: v.double() for k, v in model.state_dict().items()}, "step": 50},
               weights_only)
    old = 1_600_000_000
    for p in run.iterdir():
        os.utime(p, (old, old))
    plain_bytes = weights_only.read_bytes()
    r = run_cli("prune", run, "--thin-after", "1", "--thin-to", "bf16", "--grace", "0", "--yes")
    assert r.exit_code == 0, r.stderr
    thin = torch.load(run / "step_100.pt", weights_only=True)
    assert not holds_optimizer_state(thin)
    assert thin["opt"] == hyper and thin["optim"] == "adamw"  # not optimizer state: kept
    assert (run / "step_100.pt").stat().st_mtime == old  # still as old as it was
    # No optimizer state to drop: --thin-to alone does not cast it.
    assert weights_only.read_bytes() == plain_bytes


def test_a_checkpoint_left_whole_says_why_in_the_callers_words(hf_trainer_dir: Path,
                                                               tmp_path: Path) -> None:
    # The reason names thin_to as the caller spells it: thin_to=bf16 from Python,
    # --thin-to bf16 on the command line (JSON and the log line).
    import shutil

    import ckpt_cli

    runs = []
    for name in ("py", "cli"):
        run = tmp_path / name
        shutil.copytree(hf_trainer_dir, run, symlinks=True)
        oldest = min(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        (oldest / "extra").mkdir()
        runs.append((run, oldest.name))
    (run, oldest) = runs[0]
    doc = ckpt_cli.prune(run, thin_after=1, thin_to="bf16", grace=0, dry_run=False).to_dict()
    why = "holds links or subdirectories; thin_to=bf16 leaves it whole"
    assert doc["thinning"]["skipped"] == {oldest: why}
    (run, oldest) = runs[1]
    r = run_cli("prune", run, "--thin-after", "1", "--thin-to", "bf16", "--grace", "0",
                "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    cli_why = why.replace("thin_to=bf16", "--thin-to bf16")
    assert json.loads(r.stdout)["thinning"]["skipped"] == {oldest: cli_why}
    (run / oldest / "extra").rmdir()
    (run / oldest / "extra2").mkdir()
    r = run_cli("prune", run, "--thin-after", "1", "--thin-to", "bf16", "--grace", "0", "--yes")
    assert f"left {oldest} whole: {cli_why}" in r.stdout, r.stdout
