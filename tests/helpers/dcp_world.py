"""Run under torchrun: every rank saves its shard of a model with torch.distributed.checkpoint.

A real multi-process DCP save (gloo), tensors sharded across the ranks as FSDP does
(DTensor ``Shard(0)``), plus a replicated bias that DCP writes once.

Usage: torchrun --standalone --nproc-per-node N tests/helpers/dcp_world.py OUT
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
    g = torch.Generator().manual_seed(1000 + rank)
    rows = 96 // world
    model = {f"layers.{i}.weight": DTensor.from_local(torch.randn(rows, 128, generator=g),
                                                      mesh, [Shard(0)]) for i in range(9)}
    torch.manual_seed(7)  # the same on every rank: a replicated tensor
    model["head.bias"] = DTensor.from_local(torch.randn(96), mesh, [Replicate()])
    dcp.save({"model": model}, checkpoint_id=sys.argv[1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
