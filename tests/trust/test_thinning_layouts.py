"""``prune --thin-after`` on more layouts: DCP step directories, step directories holding one
torch file, HF sharded weights to BF16.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckpt_cli.trust.ledger import read_ledger
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.loads import holds_optimizer_state
from tests.trust.conftest import (
    _dcp_load,
    _dcp_model,
    _dcp_run,
    _hf_sharded_run,
)

pytestmark = pytest.mark.requires_torch


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
