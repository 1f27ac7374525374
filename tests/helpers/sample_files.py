"""``ckpt sample``'s run, written without training: the same layout, names, dtypes and shapes.

For the tests that only need checkpoint files. Each of the sample's checkpoints is written by
the real library, as ``ckpt sample`` writes it: ``torch.save`` training checkpoints of its model
(model, AdamW state, step, epoch, lr, loss, config, RNG state) at steps 100, 200 and 300, a
4-process torch.distributed.checkpoint save (FSDP2-sharded model and optimizer, gloo) at step
400, the HF-style sharded safetensors export and the ``latest`` pointer. Instead of 400
training steps, each checkpoint is one AdamW step on random gradients after the last: the
weights change from one checkpoint to the next and the optimizer holds real state, but no
forward or backward pass runs. The losses are made up (falling, finite); a test that needs a
real loss curve, or tests ``ckpt sample`` itself, uses ``trained_sample_run``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ckpt_cli.ops.sample import (
    DCP_STEP,
    STEPS,
    TinyGPT,
    _config,
    _export,
    _lr,
    _save_dcp,
)

EPOCH_LEN = 150  # as ckpt sample counts epochs


def _one_step(model: TinyGPT, opt: torch.optim.Optimizer, step: int,
              gen: torch.Generator) -> None:
    """One AdamW update on random gradients, at ``step``'s learning rate."""
    for g in opt.param_groups:
        g["lr"] = _lr(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 0.01
    opt.step()
    opt.zero_grad(set_to_none=True)


def _loss(step: int) -> float:
    return 6.3 * math.exp(-step / 250) + 0.4


def write_sample_files(dest: Path) -> Path:
    """Write the sample run's files into ``dest`` (created; it must not exist); return it."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=_lr(0), weight_decay=0.1)
    dest.mkdir(parents=True)
    for step in STEPS:
        _one_step(model, opt, step - 1, gen)
        d = dest / f"step_{step:06d}"
        d.mkdir()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "step": step, "epoch": step // EPOCH_LEN, "lr": _lr(step - 1),
                    "loss": _loss(step), "config": _config(),
                    "rng_state": torch.get_rng_state()}, d / "checkpoint.pt")
    _one_step(model, opt, DCP_STEP - 1, gen)
    dcp_dir = dest / f"step_{DCP_STEP:06d}"
    _save_dcp(model, opt, dcp_dir, {"step": DCP_STEP, "epoch": DCP_STEP // EPOCH_LEN,
                                     "lr": _lr(DCP_STEP - 1), "loss": _loss(DCP_STEP)})
    _export(model, dest / "export")
    (dest / "latest").write_text(dcp_dir.name + "\n")
    return dest
