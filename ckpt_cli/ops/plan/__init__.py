"""``plan``: how big a checkpoint is, how long it stalls training, how often to save, and what
the retention policy costs in bytes and files.

The arithmetic is :mod:`ckpt_cli.ops.plan.cadence` (its docstring states the model), the
``--measure`` benchmark :mod:`ckpt_cli.ops.plan.measure`; this module checks the inputs, reads a
``--from`` checkpoint's sizes and puts the figures together in a
:class:`~ckpt_cli.ops.plan.result.PlanResult`.
"""

from __future__ import annotations

import math
from pathlib import Path, PurePosixPath
from typing import Any

from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.ops import options_of
from ckpt_cli.ops.inspect import InspectOptions, inspect
from ckpt_cli.ops.plan.cadence import (
    DEFAULT_OPTIMIZER,
    DEFAULT_PRECISION,
    DEFAULT_SNAPSHOT_BANDWIDTH,
    CheckpointSize,
    daly_interval,
    job_mtbf,
    size_from_params,
    young_interval,
)
from ckpt_cli.ops.plan.measure import (
    DEFAULT_MEASURE_SIZE,
    DEFAULT_MEASURE_STREAMS,
    measure_bandwidth,
)
from ckpt_cli.ops.plan.options import PlanOptions
from ckpt_cli.ops.plan.result import PlanResult
from ckpt_cli.progress import Progress
from ckpt_cli.units import format_duration, require_positive


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

    result = inspect(path, InspectOptions(input_format=fmt))  # type: ignore[arg-type]
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


def plan(options: PlanOptions | None = None, *,
         progress: Progress | None = None, **fields: Any) -> PlanResult:
    """Plan checkpointing for a run: size, write time, optimal interval, storage and files.

    Args:
        options: The run to plan for (:class:`PlanOptions`; default: its defaults).
        progress: Progress of the measurement, ``("measuring", bytes_written, total)``
            (:class:`ckpt_cli.progress.Progress`).
        **fields: :class:`PlanOptions` fields, instead of ``options`` (see
            :func:`ckpt_cli.ops.options_of`).

    Returns:
        The :class:`PlanResult`.

    Raises:
        UsageError: Missing, conflicting or non-positive inputs, or a checkpoint cost of at
            least twice the MTBF (where Daly's formula does not apply).
        CkptError: ``from_path`` cannot be read, or the measurement fails.
    """
    opts = options_of(PlanOptions, options, fields)
    size = _size(opts.params, opts.precision, opts.optimizer, opts.from_path, opts.input_format)
    if opts.bandwidth is not None and opts.measure_dir is not None:
        raise UsageError("give bandwidth or measure_dir, not both",
                         param=("bandwidth", "measure_dir"))
    if opts.measure_dir is None and (opts.measure_size is not None
                                     or opts.measure_streams is not None):
        raise UsageError("measure_size and measure_streams need measure_dir DIR",
                         param=("measure_size", "measure_streams", "measure_dir"))
    if opts.mtbf is not None and (opts.gpus is not None or opts.gpu_mtbf is not None):
        raise UsageError("give mtbf or gpus with gpu_mtbf, not both",
                         param=("mtbf", "gpus", "gpu_mtbf"))
    if (opts.gpus is None) != (opts.gpu_mtbf is None):
        raise UsageError("gpus and gpu_mtbf go together (job MTBF = gpu_mtbf / gpus)",
                         param=("gpus", "gpu_mtbf"))
    if opts.snapshot_bandwidth is not None and not opts.async_save:
        raise UsageError("snapshot_bandwidth only matters with async_save",
                         param=("snapshot_bandwidth", "async_save"))
    for value, what in ((opts.bandwidth, "bandwidth"), (opts.mtbf, "mtbf"),
                        (opts.ranks, "ranks"), (opts.keep, "keep"),
                        (opts.snapshot_bandwidth, "snapshot_bandwidth"),
                        (opts.interval, "interval")):
        if value is not None:
            require_positive(value, what, param=True)
    if opts.thin_to is not None and opts.thin_to != "bf16":
        raise UsageError(f"thin_to must be bf16, not {opts.thin_to!r}", param="thin_to")
    if opts.thin_to is not None and opts.thin_after is None:
        raise UsageError("thin_to is used only with thin_after N", param=("thin_to", "thin_after"))
    if opts.thin_after is not None:
        require_positive(opts.thin_after, "thin_after", param=True)
    if opts.restart is not None and not (opts.restart >= 0 and math.isfinite(opts.restart)):
        raise UsageError(f"restart cannot be negative, not {opts.restart!r}", param="restart")

    files = opts.ranks if opts.ranks is not None else size.files
    dirs = size.dirs or (1 if files > 1 else 0)
    result = PlanResult(size=size, files_per_checkpoint=files, inodes_per_checkpoint=files + dirs,
                        async_save=opts.async_save, restart=opts.restart or 0.0, keep=opts.keep,
                        thin_after=opts.thin_after, thin_to=opts.thin_to)
    if opts.async_save:
        result.snapshot_bandwidth = opts.snapshot_bandwidth or DEFAULT_SNAPSHOT_BANDWIDTH
    if opts.measure_dir is not None:
        result.measurement = measure_bandwidth(
            opts.measure_dir, opts.measure_size or DEFAULT_MEASURE_SIZE,
            opts.measure_streams or DEFAULT_MEASURE_STREAMS, progress)
        result.bandwidth = result.measurement.bytes_per_second
        result.notes.append("bandwidth measured from this machine alone; ranks on many nodes "
                            "may reach more in aggregate")
    else:
        result.bandwidth = opts.bandwidth
    if opts.gpus is not None and opts.gpu_mtbf is not None:
        result.gpus, result.gpu_mtbf = opts.gpus, opts.gpu_mtbf
        result.mtbf = job_mtbf(opts.gpu_mtbf, opts.gpus)
    else:
        result.mtbf = opts.mtbf
    _optimum(result)
    if opts.interval is not None:
        result.current = result.figures_at(opts.interval)
    if result.bandwidth is None:
        result.notes.append("give `bandwidth` or `measure_dir` for the write time and the "
                            "optimal interval")
    if result.mtbf is None:
        result.notes.append("give `mtbf`, or `gpus` with `gpu_mtbf`, for the optimal interval "
                            "and the time lost")
    return result


def _size(params: int | None, precision: str | None, optimizer: str | None,
          from_path: str | Path | None, input_format: str | None) -> CheckpointSize:
    if (params is None) == (from_path is None):
        raise UsageError("give the model size with params N or from_path PATH (one of them)",
                         param=("params", "from_path"))
    if from_path is not None:
        if precision is not None or optimizer is not None:
            raise UsageError("precision and optimizer describe params; from_path reads the "
                             "real sizes from the checkpoint",
                             param=("precision", "optimizer", "params", "from_path"))
        return size_from_checkpoint(from_path, input_format)
    if input_format is not None:
        raise UsageError("input_format applies to from_path PATH",
                         param=("input_format", "from_path"))
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
            f"the checkpoint {what} ({format_duration(cost)}) is at least twice the MTBF "
            f"({format_duration(mtbf)}): "
            "Daly's formula does not apply there and the run would spend most of its time "
            "saving and redoing work; use faster storage, async_save, or a more reliable job",
            param="async_save")
    young, daly = young_interval(cost, mtbf), daly_interval(cost, mtbf)
    if result.async_save and daly < write:
        # Past the write time the loss grows with the interval, and below it the saves queue
        # up behind each other, so the best feasible interval is the write time itself.
        result.notes.append("with `async_save` the optimum is raised to the write time: a save "
                            "must reach storage before the next one starts")
        young, daly = max(young, write), max(daly, write)
    if result.async_save and write >= mtbf:
        result.notes.append("a checkpoint takes longer to reach storage than the MTBF: most "
                            "failures strike before the last save is safe")
    result.young = result.figures_at(young)
    result.daly = result.figures_at(daly)
