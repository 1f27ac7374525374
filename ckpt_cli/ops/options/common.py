"""Options several commands take, declared once here and placed in each command's options
dataclass (:mod:`ckpt_cli.optionspec`): the same name, type, flag and help wherever they
appear."""

from __future__ import annotations

from typing import Any

from ckpt_cli.optionspec import option

INPUT_FORMATS = "safetensors, hf-index, torch, dcp, deepspeed, megatron or dir"
"""The formats ``input_format`` names, for its help."""


def input_format(what: str = "the input") -> Any:
    """``input_format`` (``-F``): skip detection and read ``what`` as this format."""
    return option(None, short="-F", metavar="NAME", help=(
        f"Skip detection and read {what} as this format: {INPUT_FORMATS}."))


def allow_global() -> Any:
    """``allow_global``: pickle globals the user trusts (repeatable)."""
    return option((), metavar="MODULE.NAME", kind="names", help=(
        "Trust this pickle global (repeatable), like torch's add_safe_globals; every other "
        "global outside ckpt's allowlist is an error."))


def pattern() -> Any:
    """``pattern``: which entries of a run directory are checkpoints."""
    return option(None, metavar="REGEX", help=(
        "Run directories: which entries are checkpoints (a 'step' group gives the step)."))


def part() -> Any:
    """``part``: this process's share of a job split over processes."""
    return option(None, metavar="K/N|auto", kind="part", help=(
        "Do only part K of N of the work (auto: from torchrun's RANK/WORLD_SIZE or a SLURM "
        "array); the last part to finish completes the job (index, manifest, report)."))


def max_memory(what: str) -> Any:
    """``max_memory``: the budget for the data in flight, ``what`` it holds."""
    return option(None, metavar="SIZE", kind="size", help=(
        f"Budget for {what}, e.g. 512MB (default 256MB; the largest tensor may add to it)."))


def concurrency() -> Any:
    """``concurrency``: ranged GETs in flight per object (a store setting, which the caller
    applies; the op reads through the store)."""
    return option(None, min=1, metavar="N", help=(
        "URLs: ranged GETs in flight per object streamed (default 8)."))


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


def thin_after() -> Any:
    """``thin_after``: thin what stays beyond the newest N (prune, watch)."""
    return option(None, metavar="N", help=(
        "Rewrite checkpoints older than the newest N complete ones without optimizer state, "
        "in place (torch and Lightning files, HF checkpoint-N)."))


def thin_to() -> Any:
    """``thin_to``: also cast thinned weights (prune, watch)."""
    return option(None, metavar="bf16", help="Also cast thinned checkpoints' weights to BF16.")


def keep_full_every() -> Any:
    """``keep_full_every``: milestones thinning leaves whole (prune, watch)."""
    return option(None, metavar="STEPS", kind="count", help=(
        "Never thin checkpoints whose step is a multiple of STEPS (e.g. 10K, as "
        "`keep_every`)."))


def keep_abandoned() -> Any:
    """``keep_abandoned``: keep an abandoned timeline's checkpoints (prune, watch)."""
    return option(False, help=(
        "Keep checkpoints of a timeline a rollback abandoned (higher steps a resume from an "
        "earlier one left behind); by default they are deleted. They never count towards "
        "`keep` or `keep_every`."))


__all__ = ["INPUT_FORMATS", "allow_global", "concurrency", "finalize", "input_format",
           "keep_abandoned", "keep_full_every", "max_memory", "output_format", "overwrite",
           "part", "pattern", "thin_after", "thin_to"]
