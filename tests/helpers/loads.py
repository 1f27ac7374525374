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
