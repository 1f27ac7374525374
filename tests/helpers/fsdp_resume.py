"""Resume a run from a DCP checkpoint in an FSDP2 (``fully_shard``) loop, and the plain-torch run
it is compared with (issue 48: ``ckpt convert --to dcp``, proven by resuming).

The model, data, optimizer and LR schedule are fixed here, so that a source framework's run
(plain torch here; DeepSpeed, HF Trainer, Lightning in their tests) and the resumed FSDP2 run
do the same math: :func:`tiny_model`, :func:`batch` (global batch of step ``s``, a rank's
slice of it), :func:`make_optimizer` (AdamW) and :func:`make_scheduler` (linear warmup
``LambdaLR``).

Run under torchrun (gloo, CPU), any world size::

    torchrun --standalone --nproc-per-node N tests/helpers/fsdp_resume.py DCP OUT \
        --layout torchtitan|recipe --steps K [--weights-only] [--bf16] [--clip C]

Each rank joins a gloo group, shards the model with ``fully_shard``, builds the state dict
the layout names (``get_state_dict``), ``dcp.load``\\ s it, ``set_state_dict``\\ s it, loads
the LR scheduler, then trains K steps. Rank 0 saves ``{"model", "optim", "lrs", "step"}`` to
OUT: full FP32 parameters and the optimizer state by FQN after the K steps, the LR each
resumed step used, the step it resumed at. ``--weights-only`` loads everything but the
optimizer state (a fresh AdamW on the same schedule and data), as a run that kept only the
weights would: the difference it makes is the moments' alone. ``--bf16`` computes in BF16
and reduces the gradients in BF16 (``MixedPrecisionPolicy(param_dtype=reduce_dtype=
bfloat16)``, inputs cast by FSDP2) on the FP32 sharded parameters, as DeepSpeed's ``bf16``
mode does by default; ``--clip C`` clips the gradients' global norm to C before each step.

:func:`launch` starts a helper of this directory under torchrun for the tests.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

GLOBAL_BATCH = 8
WARMUP = 20


def tiny_model() -> torch.nn.Module:
    """The model every framework trains (same FQNs everywhere: ``0.weight``...)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batch(step: int, world: int = 1, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s inputs and targets: the global batch, or rank ``rank``'s equal slice."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP)


def make_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, warmup)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer,
          sched: torch.optim.lr_scheduler.LRScheduler, first: int, steps: int,
          world: int = 1, rank: int = 0, clip: float = 0.0) -> list[float]:
    """Train steps ``first..first+steps-1``; the LR each step used. ``clip`` > 0 clips the
    gradients' global norm to it before each step."""
    lrs = []
    for s in range(first, first + steps):
        x, y = batch(s, world, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).float(), y).backward()  # float: BF16 runs
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        lrs.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        sched.step()
    return lrs


def source_run(k0: int) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                 torch.optim.lr_scheduler.LRScheduler]:
    """The plain-torch source run after ``k0`` steps."""
    model = tiny_model()
    opt = make_optimizer(model)
    sched = make_scheduler(opt)
    train(model, opt, sched, 0, k0)
    return model, opt, sched


def by_fqn(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """A plain optimizer's state keyed by parameter FQN (ids in ``model.parameters()`` order)."""
    names = [n for n, _ in model.named_parameters()]
    return {names[i]: v for i, v in opt.state_dict()["state"].items()}


def launch(n: int, script: Path, *argv: str) -> None:
    """Run ``script`` under ``torchrun --standalone`` with ``n`` CPU processes (one thread
    each, this checkout importable); fail showing the end of its output."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=str(Path(__file__).parents[2]))
    torchrun = Path(sys.executable).with_name("torchrun")
    p = subprocess.run([str(torchrun), "--standalone", f"--nproc-per-node={n}", str(script),
                        *argv], capture_output=True, text=True, env=env, timeout=900,
                       check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def main() -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ap = argparse.ArgumentParser()
    ap.add_argument("dcp")
    ap.add_argument("out")
    ap.add_argument("--layout", default="torchtitan")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--weights-only", action="store_true")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--clip", type=float, default=0.0)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    model = tiny_model()
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
          if a.bf16 else MixedPrecisionPolicy())
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)), mp_policy=mp)
    opt = make_optimizer(model)
    sched = make_scheduler(opt)
    titan = a.layout == "torchtitan"
    opts = StateDictOptions(flatten_optimizer_state_dict=titan)
    msd, osd = get_state_dict(model, opt, options=opts)
    state: dict[str, Any] = dict(msd) if titan else {"model": msd}
    if not a.weights_only:
        state["optimizer" if titan else "optim"] = osd
    state["lr_scheduler"] = sched.state_dict()
    state["train_state"] = {"step": torch.tensor(0, dtype=torch.int32) if titan else 0}
    dcp.load(state, checkpoint_id=a.dcp)
    model_state = {k: state[k] for k in msd} if titan else state["model"]
    if a.weights_only:
        set_model_state_dict(model, model_state)
    else:
        set_state_dict(model, opt, model_state_dict=model_state,
                       optim_state_dict=state["optimizer" if titan else "optim"], options=opts)
    sched.load_state_dict(state["lr_scheduler"])
    for group, lr in zip(opt.param_groups, sched.get_last_lr(), strict=True):
        group["lr"] = lr  # a fresh optimizer's groups: the schedule's LR, as the source had
    step = int(state["train_state"]["step"])
    lrs = train(model, opt, sched, step, a.steps, world, rank, a.clip)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=full)
    optim_sd = get_optimizer_state_dict(model, opt, options=full)
    if rank == 0:
        torch.save({"model": model_sd, "optim": optim_sd["state"], "lrs": lrs, "step": step},
                   Path(a.out))
    dist.barrier()  # no rank tears gloo down while another still works
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
