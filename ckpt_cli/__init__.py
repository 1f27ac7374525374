"""ckpt: a toolkit for the checkpoints of large-scale deep-learning training.

The library API mirrors the commands, one function per command (``docs/python.md``)::

    import ckpt_cli

    result = ckpt_cli.validate("demo-run")
    result.ok                   # what exit status 0 means
    result.to_dict()            # the document `ckpt validate demo-run --json` prints

Importing it loads no torch, typer or rich: each function loads its command's code when first
used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpt_cli.choices import (
    CastTarget,
    ConvertTarget,
    Fp8Activations,
    Fp8Layout,
    InputFormat,
    InspectSort,
    ManifestHash,
    MetricMode,
    Optimizer,
    OutputFormat,
    Precision,
    ThinDtype,
)
from ckpt_cli.errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    DestinationError,
    DestinationExistsError,
    StorageError,
    UnknownFormatError,
    UnsafeCheckpointError,
    UnsupportedError,
    UsageError,
)
from ckpt_cli.model import CheckpointIndex, FileInfo, Finding, TensorInfo, WrittenFile

if TYPE_CHECKING:
    from ckpt_cli.api.checkpoint import Checkpoint, TensorEntry

    # open is not in __all__: a star import would shadow the builtin.
    from ckpt_cli.api.checkpoint import open as open
    from ckpt_cli.api.commands import (
        PathLike,
        ProgressCallback,
        consolidate,
        convert,
        diff,
        inspect,
        plan,
        prune,
        resume_path,
        stats,
        validate,
        watch_once,
    )
    from ckpt_cli.formats import detect, read_index

    __version__: str


#: The commands' functions (``ckpt_cli.api.commands``), loaded on first use.
COMMANDS = ("consolidate", "convert", "diff", "inspect", "plan", "prune", "resume_path",
            "stats", "validate", "watch_once")


def _version() -> str:
    """The installed distribution's version (``pyproject.toml``'s, through the package
    metadata), so that ``ckpt --version`` and a manifest's ``tool`` cannot drift from it."""
    from importlib.metadata import PackageNotFoundError, version  # lazy: ~0.1 s, on first use

    try:
        return version("ckpt-cli")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    """The command functions and ``detect``/``read_index`` load their code on first use, so
    that ``import ckpt_cli`` (and ``ckpt --help``, which imports this package) stays cheap;
    ``__version__`` reads the package metadata on first use."""
    if name in ("detect", "read_index"):
        from ckpt_cli import formats  # lazy: keeps import ckpt_cli (and ckpt --help) cheap

        return getattr(formats, name)
    if name == "__version__":
        globals()["__version__"] = v = _version()
        return v
    if name in ("open", "Checkpoint", "TensorEntry"):
        from ckpt_cli.api import checkpoint  # lazy: keeps import ckpt_cli (and ckpt --help) cheap

        return getattr(checkpoint, name)
    if name in COMMANDS or name in ("PathLike", "ProgressCallback"):
        from ckpt_cli.api import commands  # lazy: keeps import ckpt_cli (and ckpt --help) cheap

        return getattr(commands, name)
    raise AttributeError(f"module 'ckpt_cli' has no attribute {name!r}")


__all__ = [
    "COMMANDS",
    "CastTarget",
    "Checkpoint",
    "CheckpointIndex",
    "CheckpointNotFoundError",
    "CkptError",
    "ConvertTarget",
    "CorruptCheckpointError",
    "DestinationError",
    "DestinationExistsError",
    "FileInfo",
    "Finding",
    "Fp8Activations",
    "Fp8Layout",
    "InputFormat",
    "InspectSort",
    "ManifestHash",
    "MetricMode",
    "Optimizer",
    "OutputFormat",
    "PathLike",
    "Precision",
    "ProgressCallback",
    "StorageError",
    "TensorEntry",
    "TensorInfo",
    "ThinDtype",
    "UnknownFormatError",
    "UnsafeCheckpointError",
    "UnsupportedError",
    "UsageError",
    "WrittenFile",
    "__version__",
    "consolidate",
    "convert",
    "detect",
    "diff",
    "inspect",
    "plan",
    "prune",
    "read_index",
    "resume_path",
    "stats",
    "validate",
    "watch_once",
]
