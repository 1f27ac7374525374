"""Fixtures and helpers the thinning test modules share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.conftest import third_party_quiet


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


def _watch_thinning(run: Path) -> list[Any]:
    """Three passes of a watcher over ``run`` that thins all but the 2 newest checkpoints (no
    grace period); the events it reported."""
    from ckpt_cli.ops.watch import Watcher, WatchOptions

    events: list[Any] = []
    w = Watcher(run, WatchOptions(settle=0, thin_after=2, grace=0), events.append)
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
