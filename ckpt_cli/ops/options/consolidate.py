"""The options of :func:`ckpt_cli.ops.consolidate.consolidate`: :class:`ConsolidateOptions`,
each field the one declaration of a ``ckpt consolidate`` flag and a ``ckpt_cli.consolidate()``
keyword (light: ``ckpt consolidate --help`` builds its flags from it without the op)."""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_cli.choices import CastTarget, OutputFormat
from ckpt_cli.ops.options import common
from ckpt_cli.optionspec import option
from ckpt_cli.parts import Part

DEFAULT_MAX_SHARD = 5_000_000_000
"""Bytes: the largest output file by default (5GB)."""


@dataclass(frozen=True, slots=True)
class ConsolidateOptions:
    """What :func:`~ckpt_cli.ops.consolidate.consolidate` does (``ckpt consolidate``'s
    options, declared once: see :mod:`ckpt_cli.optionspec`). Sizes are bytes here; the
    command line and the API also take them as text (``5GB``).

    ``with_optimizer`` keeps the optimizer state under the flattened names DCP uses, with
    non-tensor values in ``__metadata__["ckpt.objects"]``; ``manifest`` is
    ``ckpt-manifest.json`` (``<file>.ckpt-manifest.json`` beside a single-file output); with
    ``part`` each part verifies and hashes its own shards and the last one to finish writes
    the index and the manifest (:mod:`ckpt_cli.writers.parts`).
    """

    output_format: OutputFormat | None = common.output_format()
    max_shard_size: int | None = option(DEFAULT_MAX_SHARD, metavar="SIZE", kind="size",
                                        allow_zero=True, help=(
        "Largest output file (e.g. 5GB); 0 for one file."))
    with_optimizer: bool = option(False, off="--model-only", help=(
        "Keep the optimizer state too (to resume on a different world size), or only the "
        "model (default)."))
    to: CastTarget = option("keep", metavar="fp16|bf16|fp32|keep",
                            help="Cast floating-point model tensors.")
    clamp: bool = option(False, help=(
        "With `to=fp16`: clamp values beyond FP16's range to ±65504 instead of refusing."))
    verify: bool = option(False, help=(
        "Re-read every output tensor and compare it with its source chunks before the output "
        "is put in place."))
    manifest: bool = option(True, help=(
        "Write an integrity manifest that ckpt validate checks."))
    overwrite: bool = common.overwrite()
    part: Part | None = common.part()
    finalize: bool = common.finalize()
    max_memory: int | None = common.max_memory("data read ahead and written behind")
    concurrency: int | None = common.concurrency()
