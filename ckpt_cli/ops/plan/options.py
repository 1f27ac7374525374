"""The options of :func:`ckpt_cli.ops.plan.plan`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """The run :func:`~ckpt_cli.ops.plan.plan` plans for (``ckpt plan``'s flags; None: not
    given).

    Attributes:
        params: Model parameters (exclusive with ``from_path``).
        precision: ``fp32``, ``bf16`` or ``mixed`` (``params`` only; default ``mixed``).
        optimizer: ``adam``, ``adamw``, ``sgd`` or ``adafactor`` (``params`` only; default
            ``adamw``).
        from_path: An existing checkpoint (or run directory) to take the sizes from.
        input_format: Force the format of ``from_path``.
        bandwidth: Storage write bandwidth in bytes per second (exclusive with
            ``measure_dir``).
        measure_dir: Measure the bandwidth by writing to this directory.
        measure_size: Bytes the measurement writes (default 1 GB).
        measure_streams: Parallel writers of the measurement (default 4).
        mtbf: The job's mean time between failures in seconds.
        gpus: Devices of the job (with ``gpu_mtbf``, instead of ``mtbf``).
        gpu_mtbf: One device's mean time between failures in seconds.
        ranks: Ranks writing in parallel, one file each (default: 1, or the file count of
            ``from_path``).
        keep: Checkpoints retained.
        async_save: Only the snapshot to host memory blocks training.
        snapshot_bandwidth: Device-to-host bytes per second per rank (``async_save`` only;
            default :data:`DEFAULT_SNAPSHOT_BANDWIDTH`).
        interval: The interval in use, in seconds of compute, to compare with the optimum.
        restart: Seconds to restart after a failure, counted as time lost.
        thin_after: Storage per day when all but the newest N checkpoints are thinned
            (``prune --thin-after``).
        thin_to: ``bf16``: thinned checkpoints keep BF16 weights.
    """

    # The checkpoint: its size from the model, or from a checkpoint on disk.
    params: int | None = None
    precision: str | None = None
    optimizer: str | None = None
    from_path: str | Path | None = None
    input_format: str | None = None
    # The storage: bandwidth given, or measured.
    bandwidth: float | None = None
    measure_dir: str | Path | None = None
    measure_size: int | None = None
    measure_streams: int | None = None
    # Failures: the job's MTBF, or the devices' and their count.
    mtbf: float | None = None
    gpus: int | None = None
    gpu_mtbf: float | None = None
    restart: float | None = None
    # Files, retention and thinning.
    ranks: int | None = None
    keep: int | None = None
    thin_after: int | None = None
    thin_to: str | None = None
    # Asynchronous saves, and the interval in use.
    async_save: bool = False
    snapshot_bandwidth: float | None = None
    interval: float | None = None
