"""Reading back what a command wrote, with the libraries' own loaders."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def safetensors_dir(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``d`` (files in name order)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def dcp_dir(path: Path) -> dict[str, Any]:
    """Everything a DCP directory holds, as ``dcp.load`` gives it (no template needed)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load_state_dict(sd, storage_reader=FileSystemReader(str(path)),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return sd


def holds_optimizer_state(obj: object) -> bool:
    """Whether a loaded training state (or an optimizer file's ``state_dict()``) holds any
    optimizer's per-parameter state: thinning empties each ``state`` and keeps ``param_groups``."""
    if isinstance(obj, dict) and "state" in obj and "param_groups" in obj:
        return bool(obj["state"])
    if isinstance(obj, list | tuple):
        return any(holds_optimizer_state(v) for v in obj)
    return isinstance(obj, dict) and any(holds_optimizer_state(v) for v in obj.values())
