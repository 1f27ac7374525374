"""Train a tiny model with DeepSpeed ZeRO on CPU (gloo, 2 processes) and save checkpoints.

Usage: python ds_train.py OUT_DIR CONFIG [CONFIG ...]   where CONFIG is like ``z2-fp32``.
Each config is saved to OUT_DIR/<config>/ with DeepSpeed's own ``engine.save_checkpoint``, once
after the last step, or after every step with a ``+each`` suffix (``z1-fp32+each``). A
``+frozen`` suffix freezes the LayerNorm's parameters (DeepSpeed saves frozen parameters apart);
``+tied`` appends two layers sharing one weight.
All configs run inside one pair of processes, so deepspeed is imported only once.
"""

from __future__ import annotations

import os
import socket
import sys


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
        torch.manual_seed(0)
        # "+wide": dims FP8 layouts can hold (a 128x256 and a 32x128 weight).
        d_in, d_hid, d_out = (256, 128, 32) if "wide" in flags else (7, 13, 5)
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
        cfg = {"train_micro_batch_size_per_gpu": 2,
               "zero_optimization": {"stage": stage},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable,
                                               config=cfg)
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
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    out, configs = sys.argv[1], sys.argv[2:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, out, configs), nprocs=2, join=True)


if __name__ == "__main__":
    main()
