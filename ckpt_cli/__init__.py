"""ckpt: a toolkit for the checkpoints of large-scale deep-learning training.

The library API mirrors the commands; nothing here imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpt_cli.errors import CkptError
from ckpt_cli.model import CheckpointIndex, FileInfo, Finding, TensorInfo

if TYPE_CHECKING:
    from ckpt_cli.formats import detect, read_index

    __version__: str


def _version() -> str:
    """The installed distribution's version (``pyproject.toml``'s, through the package
    metadata), so that ``ckpt --version`` and a manifest's ``tool`` cannot drift from it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ckpt-cli")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    """``detect`` and ``read_index`` load the format readers on first use, so that
    ``ckpt --help`` (which imports this package) does not import every reader; ``__version__``
    reads the package metadata on first use."""
    if name in ("detect", "read_index"):
        from ckpt_cli import formats

        return getattr(formats, name)
    if name == "__version__":
        globals()["__version__"] = v = _version()
        return v
    raise AttributeError(f"module 'ckpt_cli' has no attribute {name!r}")

__all__ = ["CheckpointIndex", "CkptError", "FileInfo", "Finding", "TensorInfo", "__version__",
           "detect", "read_index"]
