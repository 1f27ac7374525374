"""``prune --thin-after``: old checkpoints rewritten in place without optimizer state, loading
with their framework's loader and holding the same weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_cli.trust.ledger import read_ledger
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.loads import holds_optimizer_state
from tests.helpers.makers import lightning_run

pytestmark = pytest.mark.requires_torch


def _training_run(run: Path, steps: tuple[int, ...]) -> None:
    run.mkdir()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters())
    for step in steps:
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                   run / f"step_{step:04d}.pt")


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


def _watch_thinning(run: Path) -> list[Any]:
    """Three passes of a watcher over ``run`` that thins all but the 2 newest checkpoints (no
    grace period); the events it reported."""
    from ckpt_cli.ops.prune.retention import PrunePolicy
    from ckpt_cli.ops.watch import Watcher, WatchOptions

    events: list[Any] = []
    w = Watcher(run, WatchOptions(settle=0, policy=PrunePolicy(thin_after=2, grace=0)),
                events.append)
    for _ in w.loop(0, passes=3):
        pass
    return events


def _aged_run(run: Path, steps: tuple[int, ...]) -> None:
    import os
    import time

    _training_run(run, steps)
    old = time.time() - 3600
    for p in run.iterdir():
        os.utime(p, (old, old))


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


# -- DCP step directories, step directories holding one torch file, HF to BF16, crashes ----------


def _dcp_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))


def _dcp_run(run: Path, steps: tuple[int, ...]) -> dict[int, dict[str, torch.Tensor]]:
    """A DCP training loop (no process group): model, Adam state, step and RNG state saved by
    torch.distributed.checkpoint every few steps. Returns the weights saved at each step."""
    import os
    import time

    import torch.distributed.checkpoint as dcp

    run.mkdir()
    torch.manual_seed(0)
    model = _dcp_model()
    opt = torch.optim.Adam(model.parameters())
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with third_party_quiet():
        for step in steps:
            model(torch.randn(8, 32)).sum().backward()
            opt.step()
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
                      "rng": torch.get_rng_state(), "train": {"epoch": step // 200}},
                     checkpoint_id=str(run / f"step_{step:06d}"), no_dist=True)
            saved[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    old = time.time() - 3600
    for dirpath, _dirs, files in os.walk(run):
        for name in (*files, "."):
            os.utime(os.path.join(dirpath, name), (old, old))
    return saved


def _dcp_load(path: Path, dtype: torch.dtype = torch.float32) -> dict:
    import torch.distributed.checkpoint as dcp

    fresh = {"model": {k: torch.zeros_like(v, dtype=dtype)
                       for k, v in _dcp_model().state_dict().items()},
             "step": -1, "train": {"epoch": -1}}
    with third_party_quiet():
        dcp.load(fresh, checkpoint_id=str(path), no_dist=True)
    return fresh


def test_thinned_dcp_keeps_0d_tensors_0d(tmp_path: Path) -> None:
    """A scalar tensor beside the weights (a loss, a step counter) is still 0-d after thinning:
    ``dcp.load`` into the training script's own state dict checks every shape."""
    import os
    import time

    import torch.distributed.checkpoint as dcp

    run = tmp_path / "run"
    run.mkdir()
    model = _dcp_model()
    opt = torch.optim.Adam(model.parameters())
    with third_party_quiet():
        for step in (100, 200):
            model(torch.randn(8, 32)).sum().backward()
            opt.step()
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict(),
                      "train": {"loss": torch.tensor(2.5), "step": torch.tensor(step)}},
                     checkpoint_id=str(run / f"step_{step:06d}"), no_dist=True)
    old = time.time() - 3600
    for dirpath, _dirs, files in os.walk(run):
        for name in (*files, "."):
            os.utime(os.path.join(dirpath, name), (old, old))
    r = run_cli("prune", run, "--keep", "2", "--thin-after", "1", "--grace", "0", "--yes")
    assert r.exit_code == 0, r.stderr
    assert "thinned step_000100" in r.stdout
    fresh = {"model": {k: torch.zeros_like(v) for k, v in _dcp_model().state_dict().items()},
             "train": {"loss": torch.tensor(0.0), "step": torch.tensor(0)}}
    with third_party_quiet():
        dcp.load(fresh, checkpoint_id=str(run / "step_000100"), no_dist=True)
    assert fresh["train"]["loss"].shape == () and float(fresh["train"]["loss"]) == 2.5
    assert fresh["train"]["step"].shape == () and int(fresh["train"]["step"]) == 100


@pytest.mark.parametrize("to", [None, "bf16"])
def test_thin_dcp_step_directories(tmp_path: Path, to: str | None) -> None:
    from ckpt_cli.formats import read_index

    run = tmp_path / "run"
    saved = _dcp_run(run, (100, 200, 300, 400))
    r = run_cli("watch", run, "--once", "--settle", "0")
    assert r.exit_code == 0, r.stderr
    mtime = (run / "step_000100").stat().st_mtime
    sizes = {s: sum(p.stat().st_size for p in (run / f"step_{s:06d}").iterdir()
                    if p.name != "ckpt-manifest.json") for s in saved}
    extra = ["--thin-to", to] if to else []
    r = run_cli("prune", run, "--thin-after", "2", *extra, "--grace", "0", "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)["thinning"]
    assert sorted(doc["thinned"]) == ["step_000100", "step_000200"]
    t = doc["thinned"]["step_000100"]
    assert t["dropped"] == ["optim"] and t["dtype"] == to
    # Adam keeps two FP32 moments per parameter: the thinned one is about a third (a sixth
    # with BF16 weights) of the whole one, plus the optimizer's param_groups, which DCP saves
    # as one small pickle per hyperparameter (about 1 KB each, much for this tiny model).
    assert t["bytes_after"] < t["bytes_before"] * (0.55 if to is None else 0.45)
    assert doc["bytes_saved"] == sum(v["bytes_before"] - v["bytes_after"]
                                     for v in doc["thinned"].values())
    print(f"DCP thin ({to or 'same dtype'}): {t['bytes_before']:,} -> {t['bytes_after']:,} "
          f"bytes, {doc['bytes_saved']:,} saved over 2 checkpoints")
    for step in (100, 200):
        path = run / f"step_{step:06d}"
        assert not any(n.startswith("optim.state.") for n in read_index(path).tensors)
        got = _dcp_load(path, torch.bfloat16 if to else torch.float32)
        assert got["step"] == step and got["train"]["epoch"] == step // 200
        for k, v in saved[step].items():
            want = v.to(torch.bfloat16) if to else v
            assert got["model"][k].dtype == want.dtype and torch.equal(got["model"][k], want)
        r = run_cli("validate", path)
        assert r.exit_code == 0, r.stdout
    assert (run / "step_000100").stat().st_mtime <= mtime  # no younger than it was
    for step in (300, 400):  # the newest two stay whole, byte for byte
        path = run / f"step_{step:06d}"
        assert any(n.startswith("optim.state.") for n in read_index(path).tensors)
        assert sum(p.stat().st_size for p in path.iterdir()
                   if p.name != "ckpt-manifest.json") == sizes[step]
    assert not [p.name for p in run.iterdir() if "ckpt-tmp" in p.name or "ckpt-trash" in p.name]
    ledger = read_ledger(run)
    assert ledger is not None
    line = ledger.latest()["step_000100"]
    assert line.event == "thinned" and line.detail["dropped"] == ["optim"]
    assert line.detail["bytes_before"] == t["bytes_before"] and line.bytes == t["bytes_after"]
    assert "pending" not in line.detail
    # The thinned ones are verified as they are now; resume still takes the newest whole one.
    r = run_cli("watch", run, "--once", "--settle", "0")
    assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr
    from ckpt_cli.ops.resume import latest_verified

    assert latest_verified(run, verify="full") == run / "step_000400"


def test_thin_sample_run_step_dirs_and_sharded_dcp(sample_copy: Path) -> None:
    """The sample run: ``step_N/checkpoint.pt`` directories thinned inside, and its 4-rank
    FSDP-sharded DCP checkpoint thinned to BF16 loads into a plain model with ``dcp.load``."""
    import torch.distributed.checkpoint as dcp

    from ckpt_cli.ops.sample import TinyGPT

    run = sample_copy
    (run / "latest").write_text("step_000300\n")  # so that step_000400 (DCP) is old enough
    os_ages(run)
    before = {n: torch.load(run / n / "checkpoint.pt", weights_only=True)
              for n in ("step_000100", "step_000200")}
    from ckpt_cli.runs import tree_scan

    ages = {n: tree_scan(run / n).mtime for n in before}
    fresh = TinyGPT().state_dict()
    whole = {"model": {k: torch.zeros_like(v) for k, v in fresh.items()}}
    with third_party_quiet():
        dcp.load(whole, checkpoint_id=str(run / "step_000400"), no_dist=True)
    # Order by step: 100, 200, 300, 400 -- with latest at 300, thin-after 1 keeps 400 (newest)
    # and 300 (latest names it) whole.
    r = run_cli("prune", run, "--thin-after", "1", "--thin-to", "bf16", "--grace", "0",
                "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)["thinning"]
    assert sorted(doc["thinned"]) == ["step_000100", "step_000200"], doc
    for n, orig in before.items():
        assert sorted(p.name for p in (run / n).iterdir()) == ["checkpoint.pt"]
        thin = torch.load(run / n / "checkpoint.pt", weights_only=True)
        assert not holds_optimizer_state(thin) and thin["step"] == orig["step"]
        assert torch.equal(thin["rng_state"], orig["rng_state"])
        for k, v in orig["model"].items():
            assert torch.equal(thin["model"][k], v.to(torch.bfloat16))
        assert run_cli("validate", run / n).exit_code == 0
        assert tree_scan(run / n).mtime <= ages[n]  # no younger than it was
    print("sample step dir:", doc["thinned"]["step_000100"])
    # The sharded DCP checkpoint, thinned directly.
    from ckpt_cli.trust.thinning import thin_file

    done = thin_file(run / "step_000400", to="bf16")
    assert done is not None and done.dropped == ["optim"]
    print(f"sample 4-rank DCP to bf16: {done.bytes_before:,} -> {done.bytes_after:,} bytes")
    got = {"model": {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in fresh.items()},
           "step": -1}
    with third_party_quiet():
        dcp.load(got, checkpoint_id=str(run / "step_000400"), no_dist=True)
    assert got["step"] == 400
    for k, v in whole["model"].items():
        assert torch.equal(got["model"][k], v.to(torch.bfloat16)), k
    assert run_cli("validate", run / "step_000400").exit_code == 0


def os_ages(run: Path) -> None:
    """Make every file of a run an hour old."""
    import os
    import time

    old = time.time() - 3600
    for dirpath, _dirs, files in os.walk(run):
        for name in (*files, "."):
            os.utime(os.path.join(dirpath, name), (old, old))


def test_thin_hf_trainer_checkpoint_to_bf16(hf_trainer_dir: Path, tmp_path: Path) -> None:
    import shutil

    from transformers import AutoModelForCausalLM

    run = tmp_path / "out"
    shutil.copytree(hf_trainer_dir, run, symlinks=True)
    os_ages(run)
    oldest = min(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    cfg = json.loads((oldest / "config.json").read_text())
    keys = [k for k in ("torch_dtype", "dtype") if k in cfg]
    assert keys and all(cfg[k] == "float32" for k in keys)
    untouched = {p.name: p.read_bytes() for p in oldest.iterdir()
                 if p.name not in ("optimizer.pt", "model.safetensors", "config.json")}
    with third_party_quiet():
        orig = AutoModelForCausalLM.from_pretrained(oldest).state_dict()
    assert run_cli("watch", run, "--once", "--settle", "0").exit_code == 0
    r = run_cli("prune", run, "--thin-after", "1", "--thin-to", "bf16", "--grace", "0",
                "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    t = json.loads(r.stdout)["thinning"]["thinned"][oldest.name]
    assert t["dropped"] == ["optimizer.pt"] and t["dtype"] == "bf16"
    print(f"HF checkpoint to bf16: {t['bytes_before']:,} -> {t['bytes_after']:,} bytes")
    assert not holds_optimizer_state(torch.load(oldest / "optimizer.pt", weights_only=True))
    cfg = json.loads((oldest / "config.json").read_text())
    assert all(cfg[k] == "bfloat16" for k in keys)
    for name, data in untouched.items():
        if name != "ckpt-manifest.json":
            assert (oldest / name).read_bytes() == data, name
    with third_party_quiet():
        thin = AutoModelForCausalLM.from_pretrained(oldest, dtype="auto")
    assert thin.dtype == torch.bfloat16
    sd = thin.state_dict()
    for k, v in orig.items():
        assert torch.equal(sd[k], v.to(torch.bfloat16)), k
    assert run_cli("validate", oldest).exit_code == 0
    r = run_cli("watch", run, "--once", "--settle", "0")
    assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr
    assert not [p.name for p in run.iterdir() if "ckpt-tmp" in p.name or "ckpt-trash" in p.name]


def _hf_sharded_run(run: Path) -> Any:
    """Two HF Trainer-style ``checkpoint-N`` directories with sharded safetensors weights
    (transformers' ``save_pretrained``), AdamW state and trainer_state.json. Returns the
    model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                       n_head=2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
    opt.step()
    for step in (2, 4):
        d = run / f"checkpoint-{step}"
        with third_party_quiet():
            model.save_pretrained(d, max_shard_size="20KB")
        torch.save(opt.state_dict(), d / "optimizer.pt")
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step,
                                                          "log_history": []}))
    assert len(list((run / "checkpoint-2").glob("model-*.safetensors"))) > 1
    return model


def test_thin_hf_sharded_checkpoint_to_bf16(tmp_path: Path) -> None:
    """Sharded weights (index + shards): every shard cast, the index's total_size updated."""
    import shutil

    from transformers import AutoModelForCausalLM

    run = tmp_path / "out"
    model = _hf_sharded_run(run)  # checks that checkpoint-2 holds several shards
    d = run / "checkpoint-2"
    shutil.copy(d / "model.safetensors.index.json", tmp_path / "index-before.json")
    os_ages(run)
    r = run_cli("prune", run, "--thin-after", "1", "--thin-to", "bf16", "--grace", "0", "--yes")
    assert r.exit_code == 0, r.stderr
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    old = json.loads((tmp_path / "index-before.json").read_text())
    assert idx["weight_map"] == old["weight_map"]
    assert idx["metadata"]["total_size"] * 2 == old["metadata"]["total_size"]
    with third_party_quiet():
        thin = AutoModelForCausalLM.from_pretrained(d, dtype="auto").state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(thin[k], v.to(torch.bfloat16)), k
    assert run_cli("validate", d).exit_code == 0


class _Killed(Exception):
    """Stands for the prune process dying at that point."""


def _kill_at(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    from ckpt_cli.trust.thinning import base as thinning

    if where == "manifest-set-aside":  # the old manifest removed, the file not yet replaced
        real = thinning._set_manifest_aside

        def aside_then_die(path: Path) -> str | None:
            real(path)
            raise _Killed

        monkeypatch.setattr(thinning, "_set_manifest_aside", aside_then_die)
    else:  # the thinned checkpoint in place, its new manifest not yet written

        def die(path: Path, algorithm: str | None) -> str | None:
            raise _Killed

        monkeypatch.setattr(thinning, "_manifest_again", die)


@pytest.mark.parametrize(("kind", "where"), [("torch", "manifest-set-aside"),
                                             ("torch", "replaced"), ("dcp", "replaced")])
def test_a_thinning_killed_midway_is_never_reported_bad(tmp_path: Path, kind: str, where: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """D6: a prune killed between setting the manifest aside and writing the new one left a
    checkpoint that the next watch pass reported bad (a false alarm, and --on-bad ran)."""
    from ckpt_cli.ops.prune import prune
    from ckpt_cli.ops.prune.retention import PrunePolicy
    from ckpt_cli.ops.resume import latest_verified

    run = tmp_path / "run"
    if kind == "torch":
        _aged_run(run, (100, 200, 300))
        names = ["step_0100.pt", "step_0200.pt", "step_0300.pt"]
    else:
        _dcp_run(run, (100, 200, 300))
        names = ["step_000100", "step_000200", "step_000300"]
    assert run_cli("watch", run, "--once", "--settle", "0").exit_code == 0
    _kill_at(monkeypatch, where)
    with pytest.raises(_Killed):
        prune(run, PrunePolicy(thin_after=1, grace=0))
    monkeypatch.undo()
    book = read_ledger(run)
    assert book is not None and book.latest()[names[0]].detail.get("pending") is True
    marker = tmp_path / "on-bad-ran"
    r = run_cli("watch", run, "--once", "--settle", "0", "--on-bad", f"touch {marker}")
    assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr
    assert not marker.exists()
    book = read_ledger(run)
    assert book is not None and all(line.good for line in book.latest().values())
    assert run_cli("validate", run / names[0]).exit_code == 0
    # Resume never takes the one whose thinning was cut short, even with the others damaged.
    assert latest_verified(run) == run / names[2]
    for name in names[1:]:
        for f in ([run / name] if kind == "torch" else list((run / name).glob("*.distcp"))):
            with open(f, "r+b") as fh:
                fh.truncate(100)
    assert latest_verified(run, verify="full") is None


@pytest.mark.parametrize("where", ["manifest-set-aside", "replaced"])
def test_the_next_prune_finishes_a_thinning_that_was_killed(tmp_path: Path, where: str,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    from ckpt_cli.manifest import verify_manifest
    from ckpt_cli.ops.prune import prune
    from ckpt_cli.ops.prune.retention import PrunePolicy
    from ckpt_cli.trust.ledger import manifest_digest

    run = tmp_path / "run"
    _aged_run(run, (100, 200, 300))
    assert run_cli("watch", run, "--once", "--settle", "0").exit_code == 0
    _kill_at(monkeypatch, where)
    with pytest.raises(_Killed):
        prune(run, PrunePolicy(thin_after=2, grace=0))
    monkeypatch.undo()
    r = run_cli("prune", run, "--thin-after", "2", "--grace", "0", "--yes")
    assert r.exit_code == 0, r.stderr
    assert not holds_optimizer_state(torch.load(run / "step_0100.pt", weights_only=True))
    book = read_ledger(run)
    assert book is not None
    line = book.latest()["step_0100.pt"]
    assert line.event == "thinned" and "pending" not in line.detail
    assert line.detail["dropped"] == ["optimizer"]
    assert line.manifest_digest == manifest_digest(run / "step_0100.pt")
    v = verify_manifest(run / "step_0100.pt")
    assert v is not None and v.ok
    r = run_cli("watch", run, "--once", "--settle", "0")
    assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr


def test_a_dcp_checkpoint_is_left_whole_where_directories_cannot_be_swapped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an atomic swap (renameat2 RENAME_EXCHANGE) a directory cannot be replaced with
    no moment at which its name is missing: it is left whole, nothing recorded, nothing left."""
    import errno

    from ckpt_cli.storage import atomic

    run = tmp_path / "run"
    _dcp_run(run, (100, 200))
    before = {p.name: p.read_bytes() for p in (run / "step_000100").iterdir()}

    def no_swap(a: Path, b: Path) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(atomic, "exchange", no_swap)
    r = run_cli("prune", run, "--thin-after", "1", "--grace", "0", "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)["thinning"]
    assert not doc["thinned"] and "swap" in doc["skipped"]["step_000100"]
    assert {p.name: p.read_bytes() for p in (run / "step_000100").iterdir()} == before
    assert sorted(p.name for p in run.iterdir()) == [".ckpt-prune.lock", "step_000100",
                                                     "step_000200"]
    assert read_ledger(run) is None


def test_watch_thins_a_dcp_run_and_trusts_it_after(tmp_path: Path) -> None:
    """``watch --thin-after`` on a DCP run: old step directories thinned as the run is watched,
    and the following passes find every checkpoint good."""
    run = tmp_path / "run"
    saved = _dcp_run(run, (100, 200, 300, 400))
    events = _watch_thinning(run)
    assert not [e for e in events if e.bad], [e.problems for e in events if e.bad]
    assert [e.thinned for e in events if e.event == "pruned"] == [["step_000100",
                                                                   "step_000200"]]
    got = _dcp_load(run / "step_000100")
    assert all(torch.equal(got["model"][k], v) for k, v in saved[100].items())
    book = read_ledger(run)
    assert book is not None and all(e.good for e in book.latest().values())


def test_thin_a_torchtitan_style_dcp_checkpoint(tmp_path: Path) -> None:
    """The model's entries at the top level and the optimizer flattened by torch's
    ``get_state_dict(flatten_optimizer_state_dict=True)`` (torchtitan's layout): the optimizer
    goes, the model (cast to BF16) and the train state stay."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from ckpt_cli.formats import read_index
    from ckpt_cli.trust.thinning import thin_file

    torch.manual_seed(0)
    model = _dcp_model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    with third_party_quiet():
        msd, osd = get_state_dict(model, opt,
                                  options=StateDictOptions(flatten_optimizer_state_dict=True))
        assert any(k.startswith("state.") for k in osd)
        dcp.save({**msd, "optimizer": osd, "lr_scheduler": {"last_epoch": 7},
                  "train_state": {"step": 7}}, checkpoint_id=str(tmp_path / "step-7"),
                 no_dist=True)
    done = thin_file(tmp_path / "step-7", to="bf16")
    assert done is not None and done.dropped == ["optimizer"]
    # The moments go; the flattened param_groups (one small pickle per parameter and
    # hyperparameter) stay.
    assert done.bytes_after < done.bytes_before * 0.65
    assert not [n for n in read_index(tmp_path / "step-7").tensors if n.startswith(
        "optimizer.state.")]
    got = {**{k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in msd.items()},
           "train_state": {"step": -1}, "lr_scheduler": {"last_epoch": -1}}
    with third_party_quiet():
        dcp.load(got, checkpoint_id=str(tmp_path / "step-7"), no_dist=True)
    assert got["train_state"]["step"] == 7 and got["lr_scheduler"]["last_epoch"] == 7
    for k, v in msd.items():
        assert torch.equal(got[k], v.to(torch.bfloat16)), k
    assert run_cli("validate", tmp_path / "step-7").exit_code == 0


@pytest.mark.parametrize("where", ["writing", "swapped"])
def test_a_dcp_thinning_killed_leaves_a_complete_checkpoint_under_its_name(
        tmp_path: Path, where: str) -> None:
    """SIGKILL while the thinned copy is being written, or right after it was swapped in: the
    name holds the original or the thinned checkpoint, complete; what is left beside it is a
    leftover no reader takes for a checkpoint, and the next prune finishes the work."""
    import signal
    import subprocess
    import sys

    from ckpt_cli.runs import list_run

    run = tmp_path / "run"
    saved = _dcp_run(run, (100, 200))
    assert run_cli("watch", run, "--once", "--settle", "0").exit_code == 0
    original = {p.name: p.read_bytes() for p in (run / "step_000100").iterdir()}
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.thin_killed", str(run), "1",
                           where], cwd=Path(__file__).parents[2], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = [p.name for p in run.iterdir() if "ckpt-tmp" in p.name or "ckpt-trash" in p.name]
    assert len(left) == 1, left
    listing = list_run(run)
    assert [e.name for e in listing.entries] == ["step_000100", "step_000200"]
    assert left[0] in listing.leftovers
    now = {p.name: p.read_bytes() for p in (run / "step_000100").iterdir()}
    if where == "writing":
        assert now == original  # untouched
        assert not (run / left[0] / ".metadata").exists()  # the copy never committed
    else:
        assert ".metadata" in now and "ckpt-manifest.json" not in now  # the thinned one
        got = _dcp_load(run / "step_000100")
        assert all(torch.equal(got["model"][k], v) for k, v in saved[100].items())
    r = run_cli("watch", run, "--once", "--settle", "0")
    assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr
    # The watch pass swept the copy (or the original) left beside it, as a prune would.
    assert not (run / left[0]).exists()
    r = run_cli("prune", run, "--thin-after", "1", "--grace", "0", "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["trash_removed"] == []
    if where == "swapped":  # the thinning is recorded as done
        assert not [p for p in run.iterdir() if "ckpt-" in p.name and "lock" not in p.name
                    and "ledger" not in p.name]
    book = read_ledger(run)
    assert book is not None
    line = book.latest()["step_000100"]
    assert line.event == "thinned" and "pending" not in line.detail
    got = _dcp_load(run / "step_000100")
    assert all(torch.equal(got["model"][k], v) for k, v in saved[100].items())
    assert run_cli("validate", run / "step_000100").exit_code == 0
