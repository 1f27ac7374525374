"""Options several commands take, declared once each: a command's options dataclass makes its
field with one of these (``max_memory: int | None = max_memory()``), so the name, default and
help are the same in every command that takes it."""

from __future__ import annotations

from typing import Any

from ckpt_cli.optionspec import option


def max_memory() -> Any:
    """``max_memory``: the budget of data read ahead and written behind (bytes)."""
    return option(None, metavar="SIZE", kind="size", help=(
        "Budget for data read ahead and written behind, e.g. 512MB (default 256MB; the "
        "largest tensor may add to it)."))


def concurrency() -> Any:
    """``concurrency``: ranged GETs in flight per object streamed from a store. A setting of
    the stores (applied before the op runs), not of the op."""
    return option(None, metavar="N", min=1, help=(
        "URLs: ranged GETs in flight per object streamed (default 8)."))


def part() -> Any:
    """``part``: do only part K of N of a split job."""
    return option(None, metavar="K/N|auto", kind="part", help=(
        "Do only part K of N of the work (auto: from torchrun's RANK/WORLD_SIZE or a SLURM "
        "array); the last part to finish completes the job (index, manifest, report)."))


def finalize() -> Any:
    """``finalize``: complete a split job from its parts' receipts."""
    return option(False, help=(
        "Complete a job split with `part` from every part's receipt (an error naming the parts "
        "missing)."))


def overwrite() -> Any:
    """``overwrite``: replace an existing output (``--force`` is its old name, and means
    nothing else in any command)."""
    return option(False, aliases=("--force",), old_keywords=("force",),
                  help="Replace an existing output.")


def output_format() -> Any:
    """``output_format``: the file format written (``format`` was its keyword, shadowing the
    builtin)."""
    return option(None, short="-f", aliases=("--format",), old_keywords=("format",),
                  metavar="safetensors|pt", help=(
        "Output file format (default: from the output's suffix, else safetensors)."))


__all__ = ["concurrency", "finalize", "max_memory", "output_format", "overwrite", "part"]
