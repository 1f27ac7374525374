"""``plan``: how big a checkpoint is, how long it stalls training, how often to save, and what
the retention policy costs in bytes and files.

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

import contextlib
import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ckpt_cli.atomic import tmp_sibling
from ckpt_cli.errors import CkptError, UsageError

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "mixed")
"""``fp32``: everything in fp32. ``bf16``: pure bf16, optimizer state in bf16 too, no fp32
copy. ``mixed``: bf16 (or fp16) weights with an fp32 master copy and fp32 optimizer state."""
OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "sgd", "adafactor")
DEFAULT_PRECISION = "mixed"
DEFAULT_OPTIMIZER = "adamw"
DEFAULT_SNAPSHOT_BANDWIDTH = 10e9
"""Device-to-host copy rate of one rank for ``--async``: conservative for PCIe 4.0 x16, whose
peak is 32 GB/s (pinned host memory gets closer to it than pageable memory)."""
DEFAULT_MEASURE_SIZE = 1_000_000_000
DEFAULT_MEASURE_STREAMS = 4
MAX_MEASURE_STREAMS = 256
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

_CHUNK = 4 << 20
_MIN_STREAM_BYTES = 64 << 10


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
        raise UsageError(f"--precision must be {_one_of(PRECISIONS)}, not {precision!r}")
    if optimizer not in OPTIMIZERS:
        raise UsageError(f"--optimizer must be {_one_of(OPTIMIZERS)}, not {optimizer!r}")
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
    _positive(params, "--params")
    bpp = bytes_per_parameter(precision, optimizer)
    return CheckpointSize(training=params * bpp.training, inference=params * bpp.inference,
                          weights=params * bpp.weights, master=params * bpp.master,
                          optimizer=params * bpp.optimizer, other=0, files=1, dirs=0,
                          parameters=params, per_parameter=bpp, precision=precision,
                          optimizer_name=optimizer)


def size_from_checkpoint(path: str | Path, fmt: str | None = None) -> CheckpointSize:
    """The real sizes of an existing checkpoint (a run directory: its latest complete one).

    Args:
        path: A checkpoint file or directory, or a run directory.
        fmt: Force a format instead of detecting it.

    Returns:
        The :class:`CheckpointSize`: bytes on disk, model vs optimizer bytes, files.

    Raises:
        CkptError: Missing or unreadable input, or a run directory without a complete
            checkpoint.
    """
    from ckpt_cli.ops.inspect import inspect

    result = inspect(path, fmt=fmt)
    index = result.index
    if index is None:
        raise CkptError(result.describe_error or "no complete checkpoint in this run directory",
                        path=path)
    groups = index.bytes_by_group
    training = index.file_bytes
    multi = len(index.files) > 1 or index.root.is_dir()
    dirs = len({PurePosixPath(f.path).parent for f in index.files}) if multi else 0
    return CheckpointSize(
        training=training, inference=groups["model"] + groups["buffer"],
        weights=groups["model"], master=None, optimizer=groups["optimizer"],
        # Tied weights are counted once per name, so the groups can exceed the bytes on disk.
        other=max(0, training - groups["model"] - groups["optimizer"]),
        files=len(index.files), dirs=max(dirs, 1) if multi else 0,
        parameters=index.num_parameters, path=index.root, format=index.format)


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
    _positive(cost, "checkpoint cost")
    _positive(mtbf, "MTBF")
    return math.sqrt(2 * cost * mtbf)


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum checkpoint interval (FGCS 22(3), 2006).

    For C < 2M: sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C; for C >= 2M, M.

    Args:
        cost: Seconds one checkpoint stalls training (C).
        mtbf: Mean time between failures in seconds (M).

    Returns:
        The compute time between checkpoints, in seconds.

    Raises:
        UsageError: A non-positive argument.
    """
    _positive(cost, "checkpoint cost")
    _positive(mtbf, "MTBF")
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
    _positive(interval, "interval")
    _positive(mtbf, "MTBF")
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
    _positive(device_mtbf, "--gpu-mtbf")
    _positive(devices, "--gpus")
    return device_mtbf / devices


@dataclass(frozen=True, slots=True)
class Measurement:
    """A measured write bandwidth.

    Attributes:
        path: The directory written to.
        bytes: Bytes written.
        streams: Parallel writers.
        seconds: From the first write to the end of fsync.
    """

    path: Path
    bytes: int
    streams: int
    seconds: float

    @property
    def bytes_per_second(self) -> float:
        """The measured bandwidth."""
        return self.bytes / self.seconds

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"path": str(self.path), "bytes": self.bytes, "streams": self.streams,
                "seconds": self.seconds}


def measure_bandwidth(directory: str | Path, size: int = DEFAULT_MEASURE_SIZE,
                      streams: int = DEFAULT_MEASURE_STREAMS,
                      on_progress: Callable[[int, int], None] | None = None) -> Measurement:
    """Measure write bandwidth: write ``size`` bytes to one file in parallel streams, fsync.

    The test file is a hidden ``.ckpt-plan-measure.ckpt-tmp-*`` sibling (which ``validate`` and
    ``prune`` report if a SIGKILL leaves it) and is removed on every exit, Ctrl-C included. Its
    bytes are random so that compressing storage cannot flatter the result.

    Args:
        directory: A directory on the storage to measure.
        size: Bytes to write.
        streams: Threads writing disjoint ranges of the file at once (fewer when ``size`` is
            too small to give each 64 KiB).
        on_progress: Called as ``on_progress(bytes_written, size)`` before, while and after
            writing.

    Returns:
        The :class:`Measurement`.

    Raises:
        CkptError: ``directory`` is missing, not a directory or not writable, or a write fails.
        UsageError: Non-positive size or streams, too many streams, not enough free space.
    """
    _positive(size, "--measure-size")
    _positive(streams, "--measure-streams")
    if streams > MAX_MEASURE_STREAMS:
        raise UsageError(f"--measure-streams must be at most {MAX_MEASURE_STREAMS}")
    where = Path(directory)
    if not where.is_dir():
        raise CkptError("not a directory" if where.exists() else "no such directory",
                        path=where)
    free = shutil.disk_usage(where).free
    if size > free:
        raise UsageError(f"--measure-size is {size:,} bytes but only {free:,} are free",
                         path=where)
    streams = max(1, min(streams, size // _MIN_STREAM_BYTES))
    target = tmp_sibling(where / "ckpt-plan-measure")
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise CkptError(f"cannot create a test file: {e.strerror}", path=where) from None
    stop = threading.Event()
    done = [0] * streams
    failed: list[OSError] = []
    data = os.urandom(min(_CHUNK, size))
    bounds = [size * i // streams for i in range(streams + 1)]

    def write_range(i: int) -> None:
        pos, end = bounds[i], bounds[i + 1]
        view = memoryview(data)
        try:
            while pos < end and not stop.is_set():
                n = os.pwrite(fd, view[:min(len(data), end - pos)], pos)
                if n <= 0:
                    raise OSError(0, "wrote nothing")
                pos += n
                done[i] += n
        except OSError as e:
            failed.append(e)
            stop.set()

    threads = [threading.Thread(target=write_range, args=(i,), daemon=True)
               for i in range(streams)]
    try:
        if on_progress is not None:
            on_progress(0, size)
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.05)
                if on_progress is not None:
                    on_progress(sum(done), size)
        if failed:
            raise CkptError(f"writing the test file failed: {failed[0].strerror}", path=where)
        try:
            os.fsync(fd)
        except OSError as e:
            raise CkptError(f"fsync of the test file failed: {e.strerror}", path=where) from None
        seconds = time.perf_counter() - start
        if on_progress is not None:
            on_progress(sum(done), size)
    finally:
        # Also on Ctrl-C: stop the writers before the file they write to goes away.
        stop.set()
        for t in threads:
            if t.ident is not None:
                t.join()
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
    return Measurement(path=where, bytes=size, streams=streams, seconds=max(seconds, 1e-9))


@dataclass(frozen=True, slots=True)
class IntervalFigures:
    """What checkpointing at one interval costs.

    Attributes:
        seconds: Compute time between checkpoints (tau).
        blocking: Seconds training stalls per checkpoint at this interval; None without a
            bandwidth.
        overhead: Expected time lost; None without an MTBF or a bandwidth.
        checkpoints_per_day: Checkpoints completed per day of wall-clock time: useful
            compute per day over the interval (a day over the period when no MTBF is known).
        bytes_per_day: Bytes written per day.
        files_per_day: Files created per day.
        inodes_per_day: Files and directories created per day.
    """

    seconds: float
    blocking: float | None
    overhead: Overhead | None
    checkpoints_per_day: float
    bytes_per_day: float
    files_per_day: float
    inodes_per_day: float

    @property
    def period(self) -> float:
        """Wall-clock seconds from one checkpoint to the next (failures aside)."""
        return self.seconds + (self.blocking or 0.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"seconds": self.seconds, "blocking_seconds": self.blocking,
                "period_seconds": self.period,
                "overhead": self.overhead.to_dict() if self.overhead else None,
                "checkpoints_per_day": self.checkpoints_per_day,
                "bytes_per_day": round(self.bytes_per_day),
                "files_per_day": self.files_per_day, "inodes_per_day": self.inodes_per_day}


@dataclass(slots=True)
class PlanResult:
    """What ``plan`` worked out. Figures that need an input not given are None.

    Attributes:
        size: The checkpoint.
        files_per_checkpoint: ``--ranks``, else the checkpoint's own file count.
        inodes_per_checkpoint: Files plus the directories holding them.
        bandwidth: Storage write bandwidth in bytes per second.
        measurement: The ``--measure`` run that gave ``bandwidth``.
        async_save: Whether only the snapshot to host memory blocks training.
        snapshot_bandwidth: Device-to-host bytes per second of one rank (``--async``).
        mtbf: The job's mean time between failures in seconds.
        gpus: ``--gpus``, when the MTBF comes from a per-device figure.
        gpu_mtbf: ``--gpu-mtbf`` in seconds.
        restart: Seconds to restart after a failure (``--restart``; 0 when not given).
        keep: Checkpoints retained (``--keep``).
        young: Figures at Young's interval.
        daly: Figures at Daly's interval (the optimum).
        current: Figures at ``--interval``.
        notes: Plain-words remarks on the figures (assumptions, what is missing).
    """

    size: CheckpointSize
    files_per_checkpoint: int
    inodes_per_checkpoint: int
    bandwidth: float | None = None
    measurement: Measurement | None = None
    async_save: bool = False
    snapshot_bandwidth: float | None = None
    mtbf: float | None = None
    gpus: int | None = None
    gpu_mtbf: float | None = None
    restart: float = 0.0
    keep: int | None = None
    young: IntervalFigures | None = None
    daly: IntervalFigures | None = None
    current: IntervalFigures | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def write_seconds(self) -> float | None:
        """Seconds to write one training checkpoint to storage (W)."""
        return None if self.bandwidth is None else self.size.training / self.bandwidth

    @property
    def snapshot_seconds(self) -> float | None:
        """Seconds to copy one checkpoint to host memory, all ranks at once (``--async``)."""
        if not self.async_save or self.snapshot_bandwidth is None:
            return None
        return self.size.training / (self.snapshot_bandwidth * self.files_per_checkpoint)

    @property
    def cost(self) -> float | None:
        """Seconds one checkpoint stalls training when the interval is long enough (C)."""
        return self.snapshot_seconds if self.async_save else self.write_seconds

    def blocking_at(self, interval: float) -> float | None:
        """Seconds training stalls per checkpoint at ``interval``.

        Synchronous: the write. ``--async``: the snapshot, plus the wait for the previous
        write when it takes longer than ``interval``.
        """
        write = self.write_seconds
        if write is None:
            return None
        if not self.async_save:
            return write
        return (self.snapshot_seconds or 0.0) + max(0.0, write - interval)

    def overhead_at(self, interval: float) -> Overhead | None:
        """Expected time lost at ``interval``; None without an MTBF or a bandwidth."""
        blocking = self.blocking_at(interval)
        if blocking is None or self.mtbf is None:
            return None
        # A save protects only once it is on storage: with --async each failure also loses
        # the work done while the last one was still being written.
        lag = (self.write_seconds or 0.0) if self.async_save else 0.0
        return expected_overhead(interval, blocking, self.mtbf, self.restart + lag)

    def figures_at(self, interval: float) -> IntervalFigures:
        """All the figures for checkpointing every ``interval`` seconds of compute."""
        blocking = self.blocking_at(interval)
        overhead = self.overhead_at(interval)
        # Each `interval` of useful compute ends in one completed save; failures (when the MTBF
        # is known) take their share of the day and cut some saves short.
        useful = DAY if overhead is None else DAY * (1.0 - overhead.total)
        per_day = useful / (interval + (blocking or 0.0) if overhead is None else interval)
        return IntervalFigures(
            seconds=interval, blocking=blocking, overhead=overhead,
            checkpoints_per_day=per_day, bytes_per_day=per_day * self.size.training,
            files_per_day=per_day * self.files_per_checkpoint,
            inodes_per_day=per_day * self.inodes_per_checkpoint)

    def curve(self, points: int = 49) -> list[tuple[float, float]]:
        """Expected time lost against interval, log-spaced around the optimum.

        The range is a tenth to ten times Daly's interval, widened to take in ``--interval``.

        Args:
            points: Number of samples.

        Returns:
            ``(interval_seconds, overhead_total)`` pairs, or ``[]`` without an optimum.
        """
        lo, hi = self.curve_range()
        if self.daly is None or points < 2:
            return []
        out = []
        for i in range(points):
            tau = lo * (hi / lo) ** (i / (points - 1))
            over = self.overhead_at(tau)
            assert over is not None  # there is an optimum, so an MTBF and a bandwidth
            out.append((tau, over.total))
        return out

    def curve_range(self) -> tuple[float, float]:
        """The interval range of :meth:`curve`, in seconds (``(0, 0)`` without an optimum)."""
        if self.daly is None:
            return 0.0, 0.0
        lo, hi = self.daly.seconds / 10, self.daly.seconds * 10
        if self.current is not None:
            lo = min(lo, self.current.seconds / 1.5)
            hi = max(hi, self.current.seconds * 1.5)
        return lo, hi

    @property
    def steady_bytes(self) -> int | None:
        """Storage held by ``--keep`` training checkpoints."""
        return None if self.keep is None else self.keep * self.size.training

    @property
    def peak_bytes(self) -> int | None:
        """Storage while a new checkpoint is written and the oldest not yet deleted."""
        return None if self.keep is None else (self.keep + 1) * self.size.training

    @property
    def steady_files(self) -> int | None:
        """Files held by ``--keep`` checkpoints."""
        return None if self.keep is None else self.keep * self.files_per_checkpoint

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document body (see docs/json-schema.md)."""
        s = self.size
        m = self.measurement
        return {
            "source": "params" if s.path is None else "checkpoint",
            "path": None if s.path is None else str(s.path),
            "format": s.format,
            "parameters": s.parameters,
            "precision": s.precision,
            "optimizer": s.optimizer_name,
            "bytes_per_parameter": s.per_parameter.to_dict() if s.per_parameter else None,
            "sizes": {"training": s.training, "inference": s.inference, "weights": s.weights,
                      "master": s.master, "optimizer": s.optimizer, "other": s.other},
            "files_per_checkpoint": self.files_per_checkpoint,
            "inodes_per_checkpoint": self.inodes_per_checkpoint,
            "bandwidth": None if self.bandwidth is None else {
                "bytes_per_second": self.bandwidth,
                "source": "measured" if m else "given",
                "measured": m.to_dict() if m else None},
            "write_seconds": self.write_seconds,
            "async": self.async_save,
            "snapshot": None if not self.async_save else {
                "bytes_per_second_per_rank": self.snapshot_bandwidth,
                "ranks": self.files_per_checkpoint,
                "seconds": self.snapshot_seconds},
            "cost_seconds": self.cost,
            "mtbf": None if self.mtbf is None else {
                "seconds": self.mtbf, "source": "job" if self.gpus is None else "gpus",
                "gpus": self.gpus, "gpu_mtbf_seconds": self.gpu_mtbf},
            "restart_seconds": self.restart,
            "intervals": {name: None if f is None else f.to_dict() for name, f in
                          (("young", self.young), ("daly", self.daly),
                           ("current", self.current))},
            "retention": {"keep": self.keep, "steady_bytes": self.steady_bytes,
                          "peak_bytes": self.peak_bytes, "steady_files": self.steady_files},
            "curve": [{"interval_seconds": t, "overhead": o} for t, o in self.curve()],
            "notes": self.notes,
        }


def plan(*, params: int | None = None, precision: str | None = None,
         optimizer: str | None = None, from_path: str | Path | None = None,
         input_format: str | None = None, bandwidth: float | None = None,
         measure_dir: str | Path | None = None, measure_size: int | None = None,
         measure_streams: int | None = None, mtbf: float | None = None,
         gpus: int | None = None, gpu_mtbf: float | None = None, ranks: int | None = None,
         keep: int | None = None, async_save: bool = False,
         snapshot_bandwidth: float | None = None, interval: float | None = None,
         restart: float | None = None,
         on_progress: Callable[[int, int], None] | None = None) -> PlanResult:
    """Plan checkpointing for a run: size, write time, optimal interval, storage and files.

    Args:
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
        on_progress: Progress of the measurement, ``(bytes_written, total)``.

    Returns:
        The :class:`PlanResult`.

    Raises:
        UsageError: Missing, conflicting or non-positive inputs, or a checkpoint cost of at
            least twice the MTBF (where Daly's formula does not apply).
        CkptError: ``from_path`` cannot be read, or the measurement fails.
    """
    size = _size(params, precision, optimizer, from_path, input_format)
    if bandwidth is not None and measure_dir is not None:
        raise UsageError("give --bandwidth or --measure, not both")
    if measure_dir is None and (measure_size is not None or measure_streams is not None):
        raise UsageError("--measure-size and --measure-streams need --measure DIR")
    if mtbf is not None and (gpus is not None or gpu_mtbf is not None):
        raise UsageError("give --mtbf or --gpus with --gpu-mtbf, not both")
    if (gpus is None) != (gpu_mtbf is None):
        raise UsageError("--gpus and --gpu-mtbf go together (job MTBF = --gpu-mtbf / --gpus)")
    if snapshot_bandwidth is not None and not async_save:
        raise UsageError("--snapshot-bandwidth only matters with --async")
    for value, what in ((bandwidth, "--bandwidth"), (mtbf, "--mtbf"), (ranks, "--ranks"),
                        (keep, "--keep"), (snapshot_bandwidth, "--snapshot-bandwidth"),
                        (interval, "--interval")):
        if value is not None:
            _positive(value, what)
    if restart is not None and not (restart >= 0 and math.isfinite(restart)):
        raise UsageError(f"--restart cannot be negative, not {restart!r}")

    files = ranks if ranks is not None else size.files
    dirs = size.dirs or (1 if files > 1 else 0)
    result = PlanResult(size=size, files_per_checkpoint=files, inodes_per_checkpoint=files + dirs,
                        async_save=async_save, restart=restart or 0.0, keep=keep)
    if async_save:
        result.snapshot_bandwidth = snapshot_bandwidth or DEFAULT_SNAPSHOT_BANDWIDTH
    if measure_dir is not None:
        result.measurement = measure_bandwidth(
            measure_dir, measure_size or DEFAULT_MEASURE_SIZE,
            measure_streams or DEFAULT_MEASURE_STREAMS, on_progress)
        result.bandwidth = result.measurement.bytes_per_second
        result.notes.append("bandwidth measured from this machine alone; ranks on many nodes "
                            "may reach more in aggregate")
    else:
        result.bandwidth = bandwidth
    if gpus is not None and gpu_mtbf is not None:
        result.gpus, result.gpu_mtbf = gpus, gpu_mtbf
        result.mtbf = job_mtbf(gpu_mtbf, gpus)
    else:
        result.mtbf = mtbf
    _optimum(result)
    if interval is not None:
        result.current = result.figures_at(interval)
    if result.bandwidth is None:
        result.notes.append("give --bandwidth or --measure DIR for the write time and the "
                            "optimal interval")
    if result.mtbf is None:
        result.notes.append("give --mtbf, or --gpus with --gpu-mtbf, for the optimal interval "
                            "and the time lost")
    return result


def _size(params: int | None, precision: str | None, optimizer: str | None,
          from_path: str | Path | None, input_format: str | None) -> CheckpointSize:
    if (params is None) == (from_path is None):
        raise UsageError("give the model size with --params N or --from PATH (one of them)")
    if from_path is not None:
        if precision is not None or optimizer is not None:
            raise UsageError("--precision and --optimizer describe --params; --from reads the "
                             "real sizes from the checkpoint")
        return size_from_checkpoint(from_path, input_format)
    if input_format is not None:
        raise UsageError("--input-format applies to --from PATH")
    assert params is not None
    return size_from_params(params, precision or DEFAULT_PRECISION,
                            optimizer or DEFAULT_OPTIMIZER)


def _optimum(result: PlanResult) -> None:
    cost, mtbf, write = result.cost, result.mtbf, result.write_seconds
    if cost is None or mtbf is None or write is None:
        return
    if cost >= 2 * mtbf:
        what = "snapshot time" if result.async_save else "write time"
        raise UsageError(
            f"the checkpoint {what} ({cost:,.0f} s) is at least twice the MTBF ({mtbf:,.0f} s): "
            "Daly's formula does not apply there and the run would spend most of its time "
            "saving and redoing work; use faster storage, --async, or a more reliable job")
    young, daly = young_interval(cost, mtbf), daly_interval(cost, mtbf)
    if result.async_save and daly < write:
        # Past the write time the loss grows with the interval, and below it the saves queue
        # up behind each other, so the best feasible interval is the write time itself.
        result.notes.append("with --async the optimum is raised to the write time: a save must "
                            "reach storage before the next one starts")
        young, daly = max(young, write), max(daly, write)
    if result.async_save and write >= mtbf:
        result.notes.append("a checkpoint takes longer to reach storage than the MTBF: most "
                            "failures strike before the last save is safe")
    result.young = result.figures_at(young)
    result.daly = result.figures_at(daly)


def _one_of(names: tuple[str, ...]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1]


def _positive(value: float, what: str) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise UsageError(f"{what} must be positive, not {value!r}")
