"""Run under torchrun: save a given state dict with torch.distributed.checkpoint, sharded.

Every rank loads the same state dict (a ``torch.save`` file) and saves it collectively: a
tensor whose first dimension divides by the world size is a DTensor ``Shard(0)`` (each rank
holds its rows, as FSDP does), any other one a replicated DTensor (DCP writes it once). The
keys stay as they are, so the DCP checkpoint holds the same names and values as the file.

Usage: torchrun --standalone --nproc-per-node N tests/helpers/dcp_save_sd.py SD.pt OUT
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard


def main() -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    sd = torch.load(sys.argv[1], weights_only=True)
    out: dict[str, DTensor] = {}
    for name, t in sd.items():
        if t.dim() and t.shape[0] % world == 0:
            rows = t.shape[0] // world
            local = t[rank * rows:(rank + 1) * rows].clone()
            out[name] = DTensor.from_local(local, mesh, [Shard(0)])
        else:
            out[name] = DTensor.from_local(t.clone(), mesh, [Replicate()])
    dcp.save(out, checkpoint_id=sys.argv[2])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
