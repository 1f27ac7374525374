"""Reading back what a command wrote, with the libraries' own loaders."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def safetensors_dir(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``d`` (files in name order)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def holds_optimizer_state(obj: object) -> bool:
    """Whether a loaded training state (or an optimizer file's ``state_dict()``) holds any
    optimizer's per-parameter state: thinning empties each ``state`` and keeps ``param_groups``."""
    if isinstance(obj, dict) and "state" in obj and "param_groups" in obj:
        return bool(obj["state"])
    if isinstance(obj, list | tuple):
        return any(holds_optimizer_state(v) for v in obj)
    return isinstance(obj, dict) and any(holds_optimizer_state(v) for v in obj.values())
