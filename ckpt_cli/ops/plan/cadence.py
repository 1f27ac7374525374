"""Checkpoint cadence arithmetic: how big a checkpoint is from its parameter count, how often
to save (Young, Daly) and what that costs (expected time lost). Pure: no files, no clock.

The model (README "ckpt plan" states it for users):
- **Size.** From ``--params`` with the bytes per parameter of :func:`bytes_per_parameter`, or
  from an existing checkpoint (its bytes on disk, and its weights vs optimizer bytes).
- **Cost C of one checkpoint** (the time training stalls): the write time, size / storage
  bandwidth. With ``--async`` only the snapshot to host memory blocks, size / (snapshot
  bandwidth per rank x ranks); the write W overlaps the next compute interval, and training waits
  only if W is longer than that interval.
- **Failures** arrive as a Poisson process with mean time between failures M (the job's, or
  one device's divided by the number of devices).
- **Interval tau** is the compute time between two checkpoints; one period is tau + C.
- **Optimum.** Young (1974): tau = sqrt(2 C M). Daly (2006), for C < 2M:
  tau = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C; for C >= 2M it degenerates to
  tau = M, and :func:`plan` refuses such inputs.
- **Expected time lost** at an interval, Daly's full model of the same process: each period
  takes M e^(R/M) (e^((tau + C)/M) - 1) of wall time on average (R = restart time), so the
  useful fraction is tau over that; checkpointing takes C/tau of the useful time and failures
  (rework and restarts) the rest. With ``--async`` a save protects only once written, so each
  failure costs W more rework, modelled as R + W.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ckpt_cli.errors import UsageError
from ckpt_cli.units import require_positive

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "mixed")
"""``fp32``: everything in fp32. ``bf16``: pure bf16, optimizer state in bf16 too, no fp32
copy. ``mixed``: bf16 (or fp16) weights with an fp32 master copy and fp32 optimizer state."""
OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "sgd", "adafactor")
DEFAULT_PRECISION = "mixed"
DEFAULT_OPTIMIZER = "adamw"
DEFAULT_SNAPSHOT_BANDWIDTH = 10e9
"""Device-to-host copy rate of one rank for ``--async``: conservative for PCIe 4.0 x16, whose
peak is 32 GB/s (pinned host memory gets closer to it than pageable memory)."""
DAY = 86400.0

_WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "mixed": 2}
_MASTER_BYTES = {"fp32": 0, "bf16": 0, "mixed": 4}
# Bytes of one optimizer-state element: torch.optim keeps state in the parameter's dtype, and
# mixed-precision optimizers keep it in fp32 next to the master copy.
_STATE_BYTES = {"fp32": 4, "bf16": 2, "mixed": 4}
# Full-size state tensors per parameter: Adam/AdamW exp_avg and exp_avg_sq; SGD its momentum
# buffer; Adafactor none (its factored second moment is one row and one column vector per
# matrix, O(rows + cols), and it keeps no first moment unless beta1 is set).
_STATE_TENSORS = {"adam": 2, "adamw": 2, "sgd": 1, "adafactor": 0}

@dataclass(frozen=True, slots=True)
class BytesPerParameter:
    """Checkpoint bytes per model parameter.

    Attributes:
        weights: The model weights as trained (inference checkpoints hold only these).
        master: The fp32 master copy kept by mixed-precision training.
        optimizer: Optimizer state (moments, momentum).
    """

    weights: int
    master: int
    optimizer: int

    @property
    def training(self) -> int:
        """Bytes per parameter of a training checkpoint: weights, master copy, optimizer."""
        return self.weights + self.master + self.optimizer

    @property
    def inference(self) -> int:
        """Bytes per parameter of an inference checkpoint (the weights only)."""
        return self.weights

    def to_dict(self) -> dict[str, int]:
        """JSON-ready form."""
        return {"weights": self.weights, "master": self.master, "optimizer": self.optimizer,
                "training": self.training, "inference": self.inference}


def bytes_per_parameter(precision: str, optimizer: str) -> BytesPerParameter:
    """Checkpoint bytes per parameter for a precision and an optimizer.

    =========  =======  ======  ==========  ======  =========  =========
    precision  weights  master  Adam/AdamW  SGD     Adafactor  inference
    =========  =======  ======  ==========  ======  =========  =========
    fp32       4        0       8 (12)      4 (8)   0 (4)      4
    bf16       2        0       4 (6)       2 (4)   0 (2)      2
    mixed      2        4       8 (14)      4 (10)  0 (6)      2
    =========  =======  ======  ==========  ======  =========  =========

    (Training totals in parentheses.) SGD means SGD with momentum; Adafactor's factored
    statistics are O(rows + cols) per matrix and counted as 0.

    Args:
        precision: ``fp32``, ``bf16`` or ``mixed``.
        optimizer: ``adam``, ``adamw``, ``sgd`` or ``adafactor``.

    Returns:
        The :class:`BytesPerParameter`.

    Raises:
        UsageError: Unknown precision or optimizer.
    """
    if precision not in PRECISIONS:
        raise UsageError(f"precision must be {_one_of(PRECISIONS)}, not {precision!r}",
                         param="precision")
    if optimizer not in OPTIMIZERS:
        raise UsageError(f"optimizer must be {_one_of(OPTIMIZERS)}, not {optimizer!r}",
                         param="optimizer")
    return BytesPerParameter(weights=_WEIGHT_BYTES[precision], master=_MASTER_BYTES[precision],
                             optimizer=_STATE_TENSORS[optimizer] * _STATE_BYTES[precision])


@dataclass(frozen=True, slots=True)
class CheckpointSize:
    """How big one checkpoint is, and what it holds.

    Attributes:
        training: Bytes of a training checkpoint (with ``--from``: its bytes on disk).
        inference: Bytes of the weights alone (with ``--from``: model weights and buffers).
        weights: Bytes of the model weights.
        master: Bytes of the fp32 master copy; None with ``--from``, where it is stored with
            the optimizer state when at all.
        optimizer: Bytes of the optimizer state.
        other: The rest of a ``--from`` checkpoint (buffers, RNG, scheduler, headers); 0 for
            ``--params``.
        files: Files per checkpoint.
        dirs: Directories per checkpoint (0 for a single file).
        parameters: Number of model parameters.
        per_parameter: The bytes-per-parameter model (``--params`` only).
        precision: The ``--precision`` (``--params`` only).
        optimizer_name: The ``--optimizer`` (``--params`` only).
        path: The checkpoint read (``--from`` only).
        format: Its format (``--from`` only).
    """

    training: int
    inference: int
    weights: int
    master: int | None
    optimizer: int
    other: int
    files: int
    dirs: int
    parameters: int
    per_parameter: BytesPerParameter | None = None
    precision: str | None = None
    optimizer_name: str | None = None
    path: Path | None = None
    format: str | None = None


def size_from_params(params: int, precision: str = DEFAULT_PRECISION,
                     optimizer: str = DEFAULT_OPTIMIZER) -> CheckpointSize:
    """The checkpoint of a model with ``params`` parameters (weights and optimizer state only).

    Args:
        params: Number of parameters.
        precision: ``fp32``, ``bf16`` or ``mixed``.
        optimizer: ``adam``, ``adamw``, ``sgd`` or ``adafactor``.

    Returns:
        The :class:`CheckpointSize` (one file, no directory).

    Raises:
        UsageError: Non-positive ``params``, unknown precision or optimizer.
    """
    require_positive(params, "params", param=True)
    bpp = bytes_per_parameter(precision, optimizer)
    return CheckpointSize(training=params * bpp.training, inference=params * bpp.inference,
                          weights=params * bpp.weights, master=params * bpp.master,
                          optimizer=params * bpp.optimizer, other=0, files=1, dirs=0,
                          parameters=params, per_parameter=bpp, precision=precision,
                          optimizer_name=optimizer)


def young_interval(cost: float, mtbf: float) -> float:
    """Young's first-order optimum checkpoint interval, sqrt(2 C M).

    Args:
        cost: Seconds one checkpoint stalls training (C).
        mtbf: Mean time between failures in seconds (M).

    Returns:
        The compute time between checkpoints, in seconds.

    Raises:
        UsageError: A non-positive argument.
    """
    _check_cost_mtbf(cost, mtbf)
    return math.sqrt(2 * cost * mtbf)


def _check_cost_mtbf(cost: float, mtbf: float) -> None:
    require_positive(cost, "checkpoint cost")
    require_positive(mtbf, "MTBF")


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum checkpoint interval (FGCS 22(3), 2006): for C < 2M,
    sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C; for C >= 2M, M. Arguments, result
    and errors as :func:`young_interval`'s."""
    _check_cost_mtbf(cost, mtbf)
    if cost >= 2 * mtbf:
        return mtbf
    ratio = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost


@dataclass(frozen=True, slots=True)
class Overhead:
    """Expected fractions of wall-clock time not spent on useful training.

    Attributes:
        total: All time lost: ``checkpointing + failures``.
        checkpointing: Time stalled by checkpoints that completed.
        failures: Time lost to failures: rework since the last checkpoint, restarts, and
            checkpoints cut short.
    """

    total: float
    checkpointing: float
    failures: float

    def to_dict(self) -> dict[str, float]:
        """JSON-ready form."""
        return {"total": self.total, "checkpointing": self.checkpointing,
                "failures": self.failures}


def expected_overhead(interval: float, cost: float, mtbf: float,
                      restart: float = 0.0) -> Overhead:
    """Expected fraction of time lost at an interval, by Daly's model of Poisson failures.

    One period (``interval`` of compute, then ``cost`` of checkpoint) takes
    M e^(R/M) (e^((interval + cost)/M) - 1) of wall time on average, restarts included.

    Args:
        interval: Compute seconds between checkpoints (tau).
        cost: Seconds one checkpoint stalls training (C).
        mtbf: Mean time between failures in seconds (M).
        restart: Seconds to get going again after a failure (R), before rework.

    Returns:
        The :class:`Overhead`.

    Raises:
        UsageError: A non-positive interval or MTBF, or a negative cost or restart.
    """
    require_positive(interval, "interval")
    require_positive(mtbf, "MTBF")
    if cost < 0 or restart < 0:
        raise UsageError("checkpoint cost and restart time cannot be negative")
    try:
        wall = mtbf * math.exp(restart / mtbf) * math.expm1((interval + cost) / mtbf)
    except OverflowError:
        wall = math.inf
    if not math.isfinite(wall):
        # Periods hundreds of MTBFs long essentially never complete.
        return Overhead(total=1.0, checkpointing=0.0, failures=1.0)
    useful = interval / wall
    checkpointing = useful * cost / interval
    return Overhead(total=1.0 - useful, checkpointing=checkpointing,
                    failures=max(0.0, 1.0 - useful - checkpointing))


def job_mtbf(device_mtbf: float, devices: int) -> float:
    """A job's MTBF when any one of ``devices`` independent devices failing stops it.

    Args:
        device_mtbf: One device's mean time between failures, in seconds.
        devices: How many devices the job uses.

    Returns:
        ``device_mtbf / devices`` in seconds.

    Raises:
        UsageError: A non-positive argument.
    """
    require_positive(device_mtbf, "gpu_mtbf", param=True)
    require_positive(devices, "gpus", param=True)
    return device_mtbf / devices


def _one_of(names: tuple[str, ...]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1]
