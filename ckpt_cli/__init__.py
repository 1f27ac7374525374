"""ckpt: a toolkit for the checkpoints of large-scale deep-learning training.

The library API mirrors the commands; nothing here imports torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

from ckpt_cli.errors import CkptError
from ckpt_cli.formats import detect, read_index
from ckpt_cli.model import CheckpointIndex, FileInfo, Finding, TensorInfo

__all__ = ["CheckpointIndex", "CkptError", "FileInfo", "Finding", "TensorInfo", "__version__",
           "detect", "read_index"]
