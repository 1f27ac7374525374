"""The DeepSpeed side of the resume proof (issue 48): train :mod:`fsdp_resume`'s model, data,
AdamW and warmup schedule with DeepSpeed ZeRO on CPU (gloo), save, then continue from that
checkpoint in a fresh engine, recording what the FSDP2 resume is compared with.

Run under torchrun (world 2, gloo, CPU)::

    torchrun --standalone --nproc-per-node 2 tests/helpers/ds_resume.py OUT K0 K CONFIG...

CONFIG is ``z<stage>-<fp32|bf16>`` (``z2-bf16``), ``+clip`` to clip gradients (DeepSpeed's
``gradient_clipping`` = :data:`CLIP`), ``+cpuadam`` for DeepSpeed's own CPU Adam
(``offload_optimizer`` to the CPU, the op built on first use). For each, a ZeRO engine
trains steps ``0..K0-1`` (rank r's half of :func:`fsdp_resume.batch`) and saves OUT/CONFIG
with ``engine.save_checkpoint``; a fresh engine ``load_checkpoint``\\ s it and trains steps
``K0..K0+K-1``. Rank 0 then saves OUT/CONFIG.cont.pt: ``{"model", "optim", "lrs", "step"}``
as :mod:`fsdp_resume` saves them: every parameter's full FP32 master weight and Adam
moments (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``), the optimizer's
step, the LR each continued step used and the step the engine resumed at.

The optimizer is otherwise torch's AdamW (``torch_adam``: the math the FSDP2 loop does),
the schedule a client ``LambdaLR`` (DeepSpeed saves its ``state_dict()``, which the FSDP2
loop loads). BF16 runs cast the model to BF16 (DeepSpeed's ``bf16`` mode, FP32 master
weights in the optimizer) and the inputs too.
All configs run in one pair of processes, so deepspeed is imported once.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

from tests.helpers import fsdp_resume as fr

#: The global gradient norm a ``+clip`` config clips to: this run's norms are 1.0-1.6, so
#: about half the steps are clipped and half are not.
CLIP = 1.25


def _config(name: str) -> tuple[dict[str, Any], bool]:
    base, *flags = name.split("+")
    stage_s, dtype = base.split("-")
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": fr.GLOBAL_BATCH // 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": int(stage_s[1:])},
        "optimizer": {"type": "AdamW", "params": {
            "lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1,
            "torch_adam": True}},
        "gradient_clipping": CLIP if "clip" in flags else 0.0}
    if "cpuadam" in flags:  # DeepSpeed's own C++ Adam, on the offloaded optimizer state
        del cfg["optimizer"]["params"]["torch_adam"]
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    bf16 = dtype == "bf16"
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg, bf16


def _engine(deepspeed: Any, torch: Any, cfg: dict[str, Any]) -> Any:
    model = fr.tiny_model()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=list(model.parameters()), config=cfg,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, fr.warmup))
    return engine


def _train(torch: Any, engine: Any, first: int, steps: int, bf16: bool, rank: int
           ) -> list[list[float]]:
    lrs = []
    for s in range(first, first + steps):
        x, y = fr.batch(s, 2, rank)
        if bf16:
            x = x.to(torch.bfloat16)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        lrs.append([float(lr) for lr in engine.get_lr()])  # one per param group, as fsdp_resume
        engine.step()
    return lrs


def _gathered(torch: Any, engine: Any) -> dict[str, Any]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    steps = {float(s["step"]) for s in base.state.values()}
    assert len(steps) == 1, steps  # every flat partition stepped together
    step = torch.tensor(steps.pop())
    model, optim = {}, {}
    for n, p in engine.module.named_parameters():  # collectives under ZeRO-3: same order
        model[n] = safe_get_full_fp32_param(p).clone()
        optim[n] = {m: safe_get_full_optimizer_state(p, m).clone()
                    for m in ("exp_avg", "exp_avg_sq")}
        optim[n]["step"] = step
    return {"model": model, "optim": optim}


def main() -> None:
    out, k0, k, configs = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.simplefilter("ignore")
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == 2
    for name in configs:
        cfg, bf16 = _config(name)
        engine = _engine(deepspeed, torch, cfg)
        _train(torch, engine, 0, k0, bf16, rank)
        engine.save_checkpoint(str(out / name))
        dist.barrier()
        engine = _engine(deepspeed, torch, cfg)  # the source continuing from its checkpoint
        engine.load_checkpoint(str(out / name))
        step = engine.global_steps
        lrs = _train(torch, engine, step, k, bf16, rank)
        got = _gathered(torch, engine)
        if rank == 0:
            torch.save({**got, "lrs": lrs, "step": step}, out / f"{name}.cont.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
