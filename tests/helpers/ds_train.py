"""Train a tiny model with DeepSpeed ZeRO on CPU (gloo, 2 processes) and save checkpoints.

Usage: python ds_train.py OUT_DIR CONFIG [CONFIG ...]   where CONFIG is like ``z2-fp32``.
Each config is saved to OUT_DIR/<config>/ with DeepSpeed's own ``engine.save_checkpoint``, once
after the last step, or after every step with a ``+each`` suffix (``z1-fp32+each``). A
``+frozen`` suffix freezes the LayerNorm's parameters (DeepSpeed saves frozen parameters apart);
``+tied`` appends two layers sharing one weight. ``+sgd`` trains with torch's SGD (momentum)
as a client optimizer; ``+groups`` puts the matrices (weight decay 0.1) and the vectors (0.0)
in two param groups. ``+sched`` adds a WarmupLR scheduler;
``+view`` then loads the checkpoint into a fresh engine and saves, beside it as
OUT_DIR/<config>.view.pt, what DeepSpeed restored: per trainable parameter its full FP32 master
weight and Adam moments (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``), the
step, the groups' learning rates and the scheduler's state.
All configs run inside one pair of processes, so deepspeed is imported only once.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any


def _worker(rank: int, world: int, port: int, out: str, configs: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    for cfg_name in configs:
        base, *flags = cfg_name.split("+")
        stage_s, dtype = base.split("-")
        each = "each" in flags
        stage = int(stage_s[1:])
        # "+wide": dims FP8 layouts can hold (a 128x256 and a 32x128 weight).
        d_in, d_hid, d_out = (256, 128, 32) if "wide" in flags else (7, 13, 5)
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        if "sched" in flags:
            cfg["scheduler"] = {"type": "WarmupLR", "params": {
                "warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}}
        engine = _engine(deepspeed, torch, cfg, flags, d_in, d_hid, d_out)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x = torch.randn(2, d_in, generator=gen)
            if dtype == "bf16":
                x = x.to(torch.bfloat16)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            if each:
                engine.save_checkpoint(os.path.join(out, cfg_name))
        if not each:
            engine.save_checkpoint(os.path.join(out, cfg_name))
        dist.barrier()
        if "view" in flags:
            _view(deepspeed, torch, _engine(deepspeed, torch, cfg, flags, d_in, d_hid, d_out),
                  os.path.join(out, cfg_name), rank)
            dist.barrier()
    dist.destroy_process_group()


def _engine(deepspeed: Any, torch: Any, cfg: dict[str, Any], flags: list[str], d_in: int,
            d_hid: int, d_out: int) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(d_in, d_hid), torch.nn.LayerNorm(d_hid),
                                torch.nn.Linear(d_hid, d_out))
    model.register_buffer("counter", torch.arange(3, dtype=torch.float32))
    if "tied" in flags:  # two more layers sharing one weight (DeepSpeed's shared_params)
        model.append(torch.nn.Linear(d_out, d_out))
        model.append(torch.nn.Linear(d_out, d_out))
        model[4].weight = model[3].weight
    if "frozen" in flags:
        for p in model[1].parameters():
            p.requires_grad_(False)
    trainable: list[Any] = [p for p in model.parameters() if p.requires_grad]
    if "groups" in flags:  # two param groups, as a weight-decay split makes them
        matrices = [p for p in trainable if p.dim() > 1]
        trainable = [{"params": matrices, "weight_decay": 0.1},
                     {"params": [p for p in trainable if p.dim() <= 1], "weight_decay": 0.0}]
    opt = None
    if "sgd" in flags:  # a client optimizer whose state is not Adam's
        cfg = {k: v for k, v in cfg.items() if k != "optimizer"}
        cfg["zero_allow_untested_optimizer"] = True
        opt = torch.optim.SGD(trainable, lr=1e-2, momentum=0.9)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable,
                                           optimizer=opt, config=cfg)
    return engine


def _view(deepspeed: Any, torch: Any, engine: Any, save_dir: str, rank: int) -> None:
    """Load ``save_dir`` into ``engine`` and save what DeepSpeed restored (see the module)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine.load_checkpoint(save_dir)
    # ZeRO 1/2 link each parameter to its optimizer state at the first step; do it now
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()
    view: dict[str, Any] = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        # collectives under ZeRO-3: every rank asks, in the same order
        view["params"][n] = safe_get_full_fp32_param(p).clone()
        for m in ("exp_avg", "exp_avg_sq"):
            view[m][n] = safe_get_full_optimizer_state(p, m).clone()
    view["step"] = engine.global_steps
    view["lr"] = [g["lr"] for g in engine.optimizer.param_groups]
    sched = engine.lr_scheduler
    view["lr_scheduler"] = sched.state_dict() if sched is not None else None
    if rank == 0:
        torch.save(view, save_dir + ".view.pt")


def main() -> None:
    import torch.multiprocessing as mp

    out, configs = sys.argv[1], sys.argv[2:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, out, configs), nprocs=2, join=True)


if __name__ == "__main__":
    main()
