"""The options of :func:`ckpt_cli.ops.plan.plan`: :class:`PlanOptions`, each field the one
declaration of a ``ckpt plan`` flag and a ``ckpt_cli.plan()`` keyword."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckpt_cli.choices import InputFormat, Optimizer, Precision, ThinDtype
from ckpt_cli.optionspec import option


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """The run :func:`~ckpt_cli.ops.plan.plan` plans for (None: not given). Sizes, rates,
    durations and counts are numbers here (bytes, bytes per second, seconds); the command line
    and the API also take them as text (``7B``, ``10GB/s``, ``4h``)."""

    # The checkpoint: its size from the model, or from a checkpoint on disk.
    params: int | None = option(None, metavar="N", kind="count", help=(
        "Model parameters, e.g. 175B, 7.5B, 350M (exclusive with `from_path`)."))
    precision: Precision | None = option(None, metavar="fp32|bf16|mixed", help=(
        "With `params`. fp32: 4 bytes/param weights, fp32 state. bf16: 2, state in bf16, no "
        "fp32 copy. mixed: 2 + a 4-byte fp32 master copy, fp32 state. Default: mixed."))
    optimizer: Optimizer | None = option(None, metavar="adam|adamw|sgd|adafactor", help=(
        "With `params`. adam/adamw: 2 state values per param (m, v); sgd: 1 (momentum); "
        "adafactor: 0 (factored, O(rows+cols) per matrix). Default: adamw."))
    from_path: str | Path | None = option(None, metavar="PATH", kind="path",
                                          aliases=("--from",), help=(
        "Take the sizes from an existing checkpoint (a run directory: its latest complete "
        "one)."))
    input_format: InputFormat | None = option(None, short="-F", metavar="NAME", help=(
        "Skip detection and read `from_path` as this format: safetensors, hf-index, torch, "
        "dcp, deepspeed, megatron or dir."))
    # The storage: bandwidth given, or measured.
    bandwidth: float | None = option(None, metavar="RATE", kind="rate", help=(
        "Aggregate storage write bandwidth, e.g. 10GB/s (exclusive with `measure_dir`)."))
    measure_dir: str | Path | None = option(None, metavar="DIR", kind="path",
                                            aliases=("--measure",), old_keywords=("measure",),
                                            help=(
        "Measure the write bandwidth by writing and fsyncing a test file in DIR (removed "
        "afterwards; a local directory)."))
    measure_size: int | None = option(None, metavar="SIZE", kind="size", help=(
        "Bytes `measure_dir` writes. Default: 1GB."))
    measure_streams: int | None = option(None, metavar="N", kind="count", help=(
        "Parallel writers of `measure_dir`. Default: 4."))
    # Failures: the job's MTBF, or the devices' and their count.
    mtbf: float | None = option(None, metavar="DURATION", kind="duration", help=(
        "The job's mean time between failures, e.g. 4h."))
    gpus: int | None = option(None, metavar="N", kind="count", help=(
        "Devices in the job; with `gpu_mtbf`, job MTBF = `gpu_mtbf` / N."))
    gpu_mtbf: float | None = option(None, metavar="DURATION", kind="duration", help=(
        "One device's mean time between failures, e.g. 5y."))
    # Files, retention and thinning.
    ranks: int | None = option(None, metavar="N", kind="count", help=(
        "Ranks writing in parallel, one file each (files per checkpoint). Default: 1, or the "
        "files of `from_path`."))
    keep: int | None = option(None, metavar="N", kind="count", help=(
        "Checkpoints retained: steady-state storage and files."))
    thin_after: int | None = option(None, metavar="N", kind="count", help=(
        "Storage per day when all but the newest N checkpoints are thinned (as prune thins "
        "them)."))
    thin_to: ThinDtype | None = option(None, metavar="bf16", help=(
        "Thinned checkpoints keep BF16 weights."))
    # Asynchronous saves, and the interval in use.
    async_save: bool = option(False, aliases=("--async",), help=(
        "Asynchronous saves: only the copy to host memory blocks training; the write overlaps "
        "compute."))
    snapshot_bandwidth: float | None = option(None, metavar="RATE", kind="rate", help=(
        "With `async_save`: device-to-host copy rate of each rank. Default: 10GB/s."))
    interval: float | None = option(None, metavar="DURATION", kind="duration", help=(
        "Your current interval (compute time between saves), to compare, e.g. 30m."))
    restart: float | None = option(None, metavar="DURATION", kind="duration", allow_zero=True,
                                   help=(
        "Time to restart after a failure, counted as lost. Default: not counted."))
