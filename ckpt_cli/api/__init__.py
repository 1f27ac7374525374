"""The Python API: one function per command, each returning the result the CLI renders.

``ckpt_cli.validate(path)`` is this package's :func:`~ckpt_cli.api.commands.validate`; the
functions are documented in ``docs/python.md`` and in their docstrings. Importing this package
loads no torch, typer or rich.
"""

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
    validate,
    watch_once,
)

__all__ = ["PathLike", "ProgressCallback", "consolidate", "convert", "diff", "inspect", "plan",
           "prune", "resume_path", "validate", "watch_once"]
