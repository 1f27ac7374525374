"""What ``plan`` returns: the figures at each interval and :class:`PlanResult`, with the Young/Daly
arithmetic that evaluates any interval (``overhead_at``, ``curve``), shown by
``ckpt_cli.render.plan``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckpt_cli.documents import Documented
from ckpt_cli.ops.plan.cadence import DAY, expected_overhead
from ckpt_cli.optionspec import Caller, word

if TYPE_CHECKING:
    from ckpt_cli.ops.plan.cadence import CheckpointSize, Overhead
    from ckpt_cli.ops.plan.measure import Measurement



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
class PlanResult(Documented):
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
        notes: Plain-words remarks on the figures (assumptions, what is missing); options
            named neutrally, between backticks (:func:`ckpt_cli.optionspec.word`).
        caller: Whom ``to_dict()`` names options for in ``notes``: ``python``
            (``measure_dir``) or ``cli`` (``--measure-dir``, set by ``ckpt plan``).
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
    thin_after: int | None = None
    thin_to: str | None = None
    young: IntervalFigures | None = None
    daly: IntervalFigures | None = None
    current: IntervalFigures | None = None
    notes: list[str] = field(default_factory=list)
    caller: Caller = "python"

    command = "plan"

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
    def kept_whole(self) -> int | None:
        """How many of the ``--keep`` checkpoints stay whole: all, or with ``--thin-after N``
        the newest N (the others are held at :attr:`thinned_bytes`)."""
        if self.keep is None:
            return None
        return self.keep if self.thin_after is None else min(self.keep, self.thin_after)

    @property
    def steady_bytes(self) -> int | None:
        """Storage held by ``--keep`` training checkpoints (thinned ones at their thinned
        size)."""
        whole = self.kept_whole
        if self.keep is None or whole is None:
            return None
        return whole * self.size.training + (self.keep - whole) * (self.thinned_bytes or 0)

    @property
    def peak_bytes(self) -> int | None:
        """Storage while a new checkpoint is written and the oldest not yet deleted."""
        steady = self.steady_bytes
        return None if steady is None else steady + self.size.training

    @property
    def thinned_bytes(self) -> int | None:
        """Bytes of one checkpoint thinned by ``prune --thin-after`` (None without it): the
        weights and metadata without optimizer state or fp32 master copy; with ``--thin-to
        bf16`` the weights at 2 bytes per parameter."""
        if self.thin_after is None:
            return None
        s = self.size
        if self.thin_to == "bf16" and s.parameters:
            return 2 * s.parameters + s.other
        return max(0, s.training - s.optimizer - (s.master or 0))

    def thinning_day(self) -> dict[str, float] | None:
        """Storage added per day of training without thinning and with it, at the interval in
        use (``--interval``, else Daly's optimum); None without ``--thin-after`` or an
        interval."""
        figures = self.current or self.daly
        thinned = self.thinned_bytes
        if figures is None or thinned is None or self.thin_after is None:
            return None
        n = figures.checkpoints_per_day
        whole = min(float(self.thin_after), n)
        return {"interval_seconds": figures.seconds, "checkpoints_per_day": n,
                "bytes_per_day_whole": n * self.size.training,
                "bytes_per_day_thinned": whole * self.size.training + (n - whole) * thinned}

    @property
    def steady_files(self) -> int | None:
        """Files held by ``--keep`` checkpoints."""
        return None if self.keep is None else self.keep * self.files_per_checkpoint

    def json_body(self) -> dict[str, Any]:
        """The ``plan --json`` document without ``schema_version`` and ``command``."""
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
            "retention": {"keep": self.keep, "kept_whole": self.kept_whole,
                          "steady_bytes": self.steady_bytes,
                          "peak_bytes": self.peak_bytes, "steady_files": self.steady_files},
            "thinning": None if self.thin_after is None else {
                "thin_after": self.thin_after, "thin_to": self.thin_to,
                "thinned_bytes": self.thinned_bytes, "per_day": self.thinning_day()},
            "curve": [{"interval_seconds": t, "overhead": o} for t, o in self.curve()],
            "notes": [word(n, self.caller) for n in self.notes],
        }
