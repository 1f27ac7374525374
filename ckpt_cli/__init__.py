"""ckpt: a toolkit for the checkpoints of large-scale deep-learning training.

The library API mirrors the commands; nothing here imports torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

from ckpt_cli.errors import CkptError
from ckpt_cli.model import CheckpointIndex, FileInfo, Finding, TensorInfo

if TYPE_CHECKING:
    from ckpt_cli.formats import detect, read_index


def __getattr__(name: str) -> Any:
    """``detect`` and ``read_index`` load the format readers on first use, so that
    ``ckpt --help`` (which imports this package) does not import every reader."""
    if name in ("detect", "read_index"):
        from ckpt_cli import formats

        return getattr(formats, name)
    raise AttributeError(f"module 'ckpt_cli' has no attribute {name!r}")

__all__ = ["CheckpointIndex", "CkptError", "FileInfo", "Finding", "TensorInfo", "__version__",
           "detect", "read_index"]
