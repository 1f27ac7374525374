"""Resume a run from a DCP checkpoint in an FSDP2 (``fully_shard``) loop, and the plain-torch run
it is compared with (issue 48: ``ckpt convert --to dcp``, proven by resuming).

The model, data, optimizer and LR schedule are fixed here, so that a source framework's run
(plain torch here; DeepSpeed in its tests) and the resumed FSDP2 run do the same math:
:func:`tiny_model`, :func:`batch` (global batch of step ``s``, a rank's slice of it),
:func:`make_optimizer` (AdamW) and :func:`make_scheduler` (linear warmup ``LambdaLR``), with
the MSE loss of :func:`mse`: together the :class:`Recipe` ``plain``. The HF Trainer and
Lightning runs have recipes of their own (``tests/helpers/resume_recipes.py``).

Run under torchrun (gloo, CPU), any world size::

    torchrun --standalone --nproc-per-node N tests/helpers/fsdp_resume.py DCP OUT \
        --layout torchtitan|recipe --steps K [--weights-only] [--bf16] [--clip C]
        [--recipe plain|hf|lightning]

Each rank joins a gloo group, shards the model with ``fully_shard``, builds the state dict
the layout names (``get_state_dict``), ``dcp.load``\\ s it, ``set_state_dict``\\ s it, loads
the LR scheduler, then trains K steps. Rank 0 saves ``{"model", "optim", "trace", "lrs",
"step", "param_groups"}`` to OUT: full FP32 parameters and the optimizer state by FQN after the
K steps (``trace``: after each step), the LRs each resumed step used (one per param group), the
step it resumed at, and the groups' hyperparameters at the end.

The resuming optimizer is built with the recipe's param groups (the same FQNs in each) but
:data:`PLACEHOLDER` hyperparameters: ``set_state_dict`` must bring each group's ``lr``,
``betas``, ``eps``, ``weight_decay`` (and flags such as ``fused``) from the checkpoint, so a
converted group that lost or mixed up its hyperparameters shows in the result.
``--weights-only`` loads everything but the optimizer state (a fresh AdamW with the real
hyperparameters, on the same schedule and data), as a run that kept only the weights would:
the difference it makes is the moments' alone.
``--bf16`` computes in BF16 and reduces the gradients in BF16
(``MixedPrecisionPolicy(param_dtype=reduce_dtype=bfloat16)``, inputs cast by FSDP2) on the
FP32 sharded parameters, as DeepSpeed's ``bf16`` mode does by default; ``--clip C`` clips the
gradients' global norm to C before each step.

:func:`launch` starts a helper of this directory under torchrun for the tests;
:func:`resume` runs this one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
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


PLACEHOLDER: dict[str, Any] = {"lr": 1.0, "betas": (0.5, 0.5), "eps": 0.5, "weight_decay": 0.5}
"""Hyperparameters no recipe trains with: what a resuming optimizer's groups hold until the
checkpoint's ``param_groups`` replace them."""

Groups = list[tuple[list[torch.nn.Parameter], dict[str, Any]]]


def adamw(groups: Groups, placeholder: bool = False, **flags: Any) -> torch.optim.Optimizer:
    """AdamW over ``groups`` (parameters, hyperparameters), or with :data:`PLACEHOLDER`
    hyperparameters in every group."""
    return torch.optim.AdamW([{"params": ps, **(PLACEHOLDER if placeholder else hp)}
                              for ps, hp in groups], **flags)


def make_optimizer(model: torch.nn.Module, placeholder: bool = False) -> torch.optim.Optimizer:
    hp = {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1}
    return adamw([(list(model.parameters()), hp)], placeholder)


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP)


def make_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, warmup)


def mse(model: torch.nn.Module, step: int, world: int = 1, rank: int = 0) -> torch.Tensor:
    """The plain run's loss on rank ``rank``'s slice of step ``step``'s batch."""
    x, y = batch(step, world, rank)
    return torch.nn.functional.mse_loss(model(x).float(), y)  # float: BF16 runs


Loss = Callable[[torch.nn.Module, int, int, int], torch.Tensor]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer,
          sched: torch.optim.lr_scheduler.LRScheduler, first: int, steps: int,
          world: int = 1, rank: int = 0, loss: Loss = mse,
          on_step: Callable[[], None] | None = None, clip: float = 0.0) -> list[list[float]]:
    """Train steps ``first..first+steps-1``; the LRs (one per param group) each step used.
    ``on_step`` is called after each optimizer step; ``clip`` > 0 clips the gradients' global
    norm to it before each step."""
    lrs = []
    for s in range(first, first + steps):
        opt.zero_grad()
        loss(model, s, world, rank).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        lrs.append([float(g["lr"]) for g in opt.param_groups])
        opt.step()
        sched.step()
        if on_step is not None:
            on_step()
    return lrs


@dataclass(frozen=True)
class Recipe:
    """What a source run and its FSDP2 resumption share: how to build the model, the optimizer
    (``placeholder``: see :data:`PLACEHOLDER`) and the LR schedule, and the loss of a step on
    one rank's slice of its batch (a mean over that slice: FSDP2 averages the ranks)."""

    model: Callable[[], torch.nn.Module]
    optimizer: Callable[[torch.nn.Module, bool], torch.optim.Optimizer]
    scheduler: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
    loss: Loss


PLAIN = Recipe(tiny_model, make_optimizer, make_scheduler, mse)


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


def save_training_dict(path: Path, steps: int = 2) -> Path:
    """The plain run after ``steps`` steps, saved to ``path`` as a ``torch.save`` training
    dict (model, optimizer, LR scheduler, step, RNG state): a ``convert --to dcp`` source."""
    model, opt, sched = source_run(steps)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "lr_scheduler": sched.state_dict(), "step": steps,
                "rng_state": torch.get_rng_state()}, path)
    return path


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


def resume(dcp: Path, out: Path, world: int, *, layout: str, steps: int,
           recipe: str = "plain", weights_only: bool = False) -> dict[str, Any]:
    """Run this module under torchrun (gloo, ``world`` ranks, one thread each) on ``dcp``;
    what rank 0 saved to ``out``."""
    launch(world, Path(__file__), str(dcp), str(out), "--layout", layout, "--steps", str(steps),
           "--recipe", recipe, *(["--weights-only"] * weights_only))
    return dict(torch.load(out, weights_only=True))


def copied(tree: Any) -> Any:
    """``tree`` with every tensor cloned."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: copied(v) for k, v in tree.items()}
    return tree


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
    ap.add_argument("--recipe", default="plain", choices=("plain", "hf", "lightning"))
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    if a.recipe == "plain":
        recipe = PLAIN
    else:
        from tests.helpers import resume_recipes

        recipe = getattr(resume_recipes, a.recipe.upper())
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    model = recipe.model()
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
          if a.bf16 else MixedPrecisionPolicy())
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)), mp_policy=mp)
    opt = recipe.optimizer(model, not a.weights_only)
    sched = recipe.scheduler(opt)
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
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    trace: list[dict[str, Any]] = []

    def record() -> None:  # every rank joins the gathers; rank 0 keeps the full tensors
        model_sd = get_model_state_dict(model, options=full)
        optim_sd = get_optimizer_state_dict(model, opt, options=full)
        # copies: at world 1 the "gathered" tensors are the live ones
        trace.append(copied({"model": model_sd, "optim": optim_sd.get("state", {})}))

    lrs = train(model, opt, sched, step, a.steps, world, rank, recipe.loss, record, a.clip)
    if rank == 0:
        torch.save({**trace[-1], "trace": trace, "lrs": lrs, "step": step,
                    "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                     for g in opt.param_groups]}, Path(a.out))
    dist.barrier()  # no rank tears gloo down while another still works
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: once, at world 2 under load, a rank aborted in
    # it ("terminate called without an active exception", exit -6: a thread torch started
    # still joinable when C++ static destructors ran) after every result was saved. Nothing is
    # left to write but stdio.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
