"""The size model, Young and Daly, the overhead model (``ckpt_cli.ops.plan.cadence``), ``--measure``
(``ckpt_cli.ops.plan.measure``) and ``ckpt_cli.ops.plan``."""

from __future__ import annotations

import errno
import math
import os
import random
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.ops.plan import measure as M
from ckpt_cli.ops.plan import plan, size_from_checkpoint
from ckpt_cli.ops.plan.cadence import (
    bytes_per_parameter,
    daly_interval,
    expected_overhead,
    job_mtbf,
    size_from_params,
    young_interval,
)
from ckpt_cli.ops.plan.measure import measure_bandwidth
from ckpt_cli.render.plan import plan_dict

HOUR = 3600.0


# --- bytes per parameter ---------------------------------------------------------------------

@pytest.mark.parametrize("precision,optimizer,weights,master,state", [
    ("fp32", "adam", 4, 0, 8), ("fp32", "adamw", 4, 0, 8), ("fp32", "sgd", 4, 0, 4),
    ("fp32", "adafactor", 4, 0, 0),
    ("bf16", "adam", 2, 0, 4), ("bf16", "adamw", 2, 0, 4), ("bf16", "sgd", 2, 0, 2),
    ("bf16", "adafactor", 2, 0, 0),
    ("mixed", "adam", 2, 4, 8), ("mixed", "adamw", 2, 4, 8), ("mixed", "sgd", 2, 4, 4),
    ("mixed", "adafactor", 2, 4, 0),
])
def test_bytes_per_parameter_table(precision: str, optimizer: str, weights: int, master: int,
                                   state: int) -> None:
    b = bytes_per_parameter(precision, optimizer)
    assert (b.weights, b.master, b.optimizer) == (weights, master, state)
    assert b.training == weights + master + state
    assert b.inference == weights


def test_mixed_adam_is_the_zero_paper_16_bytes_minus_gradients() -> None:
    # ZeRO (Rajbhandari et al.) counts 2 + 2 + 12 = 16 bytes/param in memory for mixed-precision
    # Adam; gradients (2) are not saved, so a checkpoint holds 14.
    assert bytes_per_parameter("mixed", "adam").training == 16 - 2


def test_worked_example_size_175b_fp32_adam() -> None:
    s = size_from_params(175_000_000_000, "fp32", "adam")
    assert s.weights == 700e9  # 4 bytes x 175B
    assert s.optimizer == 1.4e12  # Adam m and v, 4 bytes each
    assert s.master == 0 and s.other == 0
    assert s.training == 2.1e12 and s.inference == 700e9
    assert (s.files, s.dirs) == (1, 0)


@pytest.mark.parametrize("precision,optimizer", [("fp16", "adam"), ("mixed", "lion"),
                                                 ("FP32", "adam")])
def test_unknown_precision_or_optimizer(precision: str, optimizer: str) -> None:
    with pytest.raises(UsageError, match="must be"):
        bytes_per_parameter(precision, optimizer)


# --- Young and Daly --------------------------------------------------------------------------

def test_young_worked_example() -> None:
    # The example: sqrt(2 x 250 s x 14400 s) = 2683 s, about 45 minutes.
    assert young_interval(250, 4 * HOUR) == pytest.approx(2683.28, abs=0.01)
    assert young_interval(250, 4 * HOUR) / 60 == pytest.approx(44.72, abs=0.01)
    # And at the 210 s that 2.1 TB at 10 GB/s really takes: sqrt(6,048,000) = 2459.27 s.
    assert young_interval(210, 4 * HOUR) == pytest.approx(2459.27, abs=0.01)


@pytest.mark.parametrize("mtbf_min,cost_min,expected_min", [
    # Daly (FGCS 2006), figures 3-5: delta = 5 min and M = 24 h, 6 h, 15 min give 117 min,
    # 57 min and 9.1 min. Hand-computed to two decimals from the published formula.
    (24 * 60, 5, 116.69), (6 * 60, 5, 56.71), (15, 5, 9.14),
])
def test_daly_published_examples(mtbf_min: float, cost_min: float, expected_min: float) -> None:
    assert daly_interval(cost_min * 60, mtbf_min * 60) / 60 == pytest.approx(expected_min,
                                                                              abs=0.01)


def test_daly_worked_example() -> None:
    # sqrt(2 C M) = 2459.27; sqrt(C/2M) = 0.085391; 2459.27 x (1 + 0.028464 + 0.000810) - 210.
    assert daly_interval(210, 4 * HOUR) == pytest.approx(2321.26, abs=0.01)
    assert daly_interval(250, 4 * HOUR) == pytest.approx(2519.21, abs=0.01)


def test_daly_at_and_beyond_two_mtbf_is_the_mtbf() -> None:
    assert daly_interval(2 * HOUR, HOUR) == HOUR
    assert daly_interval(5 * HOUR, HOUR) == HOUR
    # Just below the boundary the published series gives 8M/9, not M (the formula is piecewise).
    assert daly_interval(2 * HOUR * (1 - 1e-12), HOUR) == pytest.approx(8 * HOUR / 9)


@pytest.mark.parametrize("func", [young_interval, daly_interval])
@pytest.mark.parametrize("cost,mtbf", [(0, HOUR), (-1, HOUR), (10, 0), (10, -HOUR),
                                       (math.nan, HOUR), (10, math.inf)])
def test_intervals_refuse_non_positive(func, cost: float, mtbf: float) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match="must be positive"):
        func(cost, mtbf)


def _lambert_w0(z: float) -> float:
    """Principal branch of Lambert W on (-1/e, 0), by Halley's iteration."""
    w = -0.5
    for _ in range(60):
        ew = math.exp(w)
        f = w * ew - z
        w -= f / (ew * (w + 1) - (w + 2) * f / (2 * w + 2))
    return w


@pytest.mark.parametrize("ratio", [1e-4, 1e-3, 0.01, 0.05, 0.1])
def test_daly_is_the_optimum_of_the_overhead_model(ratio: float) -> None:
    # The model's exact optimum solves e^((tau+C)/M) (1 - tau/M) = 1, i.e.
    # tau = M (1 + W0(-e^(-1 - C/M))). Daly's series approximates it to well under 0.1 % for
    # C <= M/10, and Young is above it.
    mtbf = 4 * HOUR
    cost = ratio * mtbf
    exact = mtbf * (1 + _lambert_w0(-math.exp(-1 - cost / mtbf)))
    assert daly_interval(cost, mtbf) == pytest.approx(exact, rel=1e-3)
    assert young_interval(cost, mtbf) > exact
    best = expected_overhead(exact, cost, mtbf).total
    for tau in (exact * 0.9, exact * 1.1):
        assert expected_overhead(tau, cost, mtbf).total > best


@given(st.floats(1e-3, 1e6), st.floats(1.0, 1e9))
def test_daly_is_below_young_and_positive(cost: float, mtbf: float) -> None:
    if cost >= 2 * mtbf:
        assert daly_interval(cost, mtbf) == mtbf
    else:
        assert 0 < daly_interval(cost, mtbf) < young_interval(cost, mtbf)


# --- expected overhead -------------------------------------------------------------------------

def test_overhead_hand_computed() -> None:
    # tau = 2321.26, C = 210, M = 14400: a period takes 14400 (e^(2531.26/14400) - 1)
    # = 2767.0 s of wall time, so 2321.26 / 2767.0 = 83.89 % is useful; checkpoints take
    # 210 / 2767.0 = 7.59 % and failures the remaining 8.53 %.
    o = expected_overhead(2321.26, 210, 14400)
    assert o.total == pytest.approx(0.1612, abs=1e-4)
    assert o.checkpointing == pytest.approx(0.0759, abs=1e-4)
    assert o.failures == pytest.approx(0.0853, abs=1e-4)
    assert o.total == pytest.approx(o.checkpointing + o.failures)


def test_overhead_without_failures_is_the_checkpoint_share() -> None:
    o = expected_overhead(1800, 200, 1e15)
    assert o.checkpointing == pytest.approx(200 / 2000)
    assert o.failures == pytest.approx(0, abs=1e-9)


def test_overhead_first_order_is_youngs_cost_function() -> None:
    # For C, tau << M the loss is C/tau + tau/(2M) to first order: what Young minimised.
    tau, cost, mtbf = 600.0, 6.0, 1e6
    first_order = cost / tau + tau / (2 * mtbf)
    assert expected_overhead(tau, cost, mtbf).total == pytest.approx(first_order, rel=0.02)


def test_overhead_restart_scales_the_useful_time_by_e_to_the_minus_r_over_m() -> None:
    base = expected_overhead(2000, 100, 100 * HOUR).total
    with_restart = expected_overhead(2000, 100, 100 * HOUR, restart=HOUR).total
    # Each period costs e^(R/M) times as much wall time: useful time shrinks by e^(-0.01).
    assert 1 - with_restart == pytest.approx((1 - base) * math.exp(-0.01))
    assert with_restart - base == pytest.approx(0.0095, abs=1e-4)  # about R/M of the rest


def test_overhead_of_absurd_intervals_saturates() -> None:
    o = expected_overhead(1e9, 10, 60)
    assert (o.total, o.checkpointing, o.failures) == (1.0, 0.0, 1.0)


def _simulate(tau: float, mtbf: float, *, cost: float = 0.0, restart: float = 0.0,
              snapshot: float | None = None, write: float = 0.0, work: float = 3e7,
              seed: int = 7) -> float:
    """Fraction of wall time lost in a simulated run with Poisson failures.

    Synchronous (``snapshot`` None): periods of ``tau`` compute then ``cost`` saving. Async:
    ``snapshot`` blocks (plus any wait for the previous write), the save becomes safe ``write``
    seconds later. After a failure the run restarts (``restart``, which can fail too) from the
    last safe save.
    """
    rng = random.Random(seed)
    t = safe = progress = 0.0
    pending: tuple[float, float] | None = None  # (progress saved, when it is safe)
    fail = rng.expovariate(1 / mtbf)
    while safe < work:
        block = cost if snapshot is None else snapshot + max(0.0, write - tau)
        if t + tau + block <= fail:
            t += tau + block
            progress += tau
            if pending is not None and pending[1] <= t:
                safe = pending[0]
            pending = (progress, t + (write if snapshot is not None else 0.0))
            if pending[1] <= t:
                safe, pending = progress, None
        else:
            if pending is not None and pending[1] <= fail:
                safe = pending[0]
            t, progress, pending = fail, safe, None
            while True:
                fail = t + rng.expovariate(1 / mtbf)
                if t + restart <= fail:
                    t += restart
                    break
                t = fail
    return (t - safe) / t


@pytest.mark.parametrize("tau,cost,restart", [(2321.26, 210, 0), (600, 210, 600),
                                              (7200, 210, 0), (300, 600, 300)])
def test_overhead_matches_a_simulated_run(tau: float, cost: float, restart: float) -> None:
    simulated = _simulate(tau, 4 * HOUR, cost=cost, restart=restart)
    assert expected_overhead(tau, cost, 4 * HOUR, restart).total == pytest.approx(simulated,
                                                                                 abs=0.01)


@pytest.mark.parametrize("tau,snapshot,write", [(2000, 20, 210), (600, 20, 1000),
                                                (3000, 30, 2000)])
def test_async_overhead_matches_a_simulated_run(tau: float, snapshot: float,
                                                write: float) -> None:
    # One bf16 parameter (2 bytes), with rates such that the write takes `write` seconds and
    # the snapshot `snapshot` seconds.
    r = plan(params=1, bandwidth=2 / write, async_save=True, snapshot_bandwidth=2 / snapshot,
             mtbf=4 * HOUR, precision="bf16", optimizer="adafactor")
    assert (r.write_seconds, r.snapshot_seconds) == pytest.approx((write, snapshot))
    over = r.overhead_at(tau)
    assert over is not None
    simulated = _simulate(tau, 4 * HOUR, snapshot=snapshot, write=write)
    assert over.total == pytest.approx(simulated, abs=0.01)


def test_job_mtbf() -> None:
    assert job_mtbf(5 * 365 * 86400, 1024) == pytest.approx(153984.375)
    with pytest.raises(UsageError):
        job_mtbf(HOUR, 0)


# --- plan() ------------------------------------------------------------------------------------

def test_plan_worked_example() -> None:
    r = plan(params=175_000_000_000, precision="fp32", optimizer="adam", bandwidth=10e9,
             mtbf=4 * HOUR, interval=1800, keep=3)
    assert r.size.training == 2.1e12
    assert r.write_seconds == pytest.approx(210)
    assert r.cost == pytest.approx(210)
    assert r.young is not None and r.daly is not None and r.current is not None
    assert r.young.seconds == pytest.approx(2459.27, abs=0.01)
    assert r.daly.seconds == pytest.approx(2321.26, abs=0.01)
    assert r.daly.overhead is not None and r.current.overhead is not None
    assert r.daly.overhead.total == pytest.approx(0.1612, abs=1e-4)
    # 30 minutes checkpoints more often than the optimum and loses more.
    assert r.current.overhead.total > r.daly.overhead.total
    assert r.current.overhead.checkpointing > r.daly.overhead.checkpointing
    # Saves per day: useful compute per day over the interval.
    per_day = 86400 * (1 - r.daly.overhead.total) / r.daly.seconds
    assert r.daly.checkpoints_per_day == pytest.approx(per_day)
    assert r.daly.bytes_per_day == pytest.approx(per_day * 2.1e12)
    assert r.daly.files_per_day == pytest.approx(per_day)
    assert (r.steady_bytes, r.peak_bytes, r.steady_files) == (6.3e12, 8.4e12, 3)
    assert r.notes == []


def test_plan_without_failure_rate_or_bandwidth_gives_what_it_can() -> None:
    r = plan(params=7_000_000_000, interval=3600, ranks=8)
    assert r.size.training == 98e9  # mixed + AdamW by default: 14 bytes/param
    assert r.young is None and r.daly is None and r.write_seconds is None
    assert r.current is not None and r.current.overhead is None
    assert r.current.checkpoints_per_day == 24
    assert r.current.files_per_day == 24 * 8
    assert r.inodes_per_checkpoint == 9  # 8 files in one directory
    assert any("`bandwidth`" in n for n in r.notes) and any("`mtbf`" in n for n in r.notes)
    assert r.curve() == []


def test_plan_gpus_and_restart() -> None:
    r = plan(params=1_000_000_000, bandwidth=1e9, gpus=1024, gpu_mtbf=5 * 365 * 86400.0,
             restart=600)
    assert r.mtbf == pytest.approx(153984.375)
    assert r.daly is not None and r.daly.overhead is not None
    no_restart = plan(params=1_000_000_000, bandwidth=1e9, mtbf=153984.375, restart=0)
    assert no_restart.daly is not None and no_restart.daly.overhead is not None
    # The restart does not move the optimum, it only adds to the time lost.
    assert r.daly.seconds == pytest.approx(no_restart.daly.seconds)
    assert r.daly.overhead.total > no_restart.daly.overhead.total


def test_plan_async_blocks_only_for_the_snapshot() -> None:
    r = plan(params=175_000_000_000, precision="fp32", optimizer="adam", bandwidth=10e9,
             mtbf=4 * HOUR, async_save=True, ranks=64, interval=120)
    assert r.snapshot_seconds == pytest.approx(2.1e12 / (10e9 * 64))
    assert r.cost == r.snapshot_seconds
    assert r.daly is not None and r.young is not None and r.current is not None
    assert r.daly.seconds == pytest.approx(daly_interval(r.snapshot_seconds, 4 * HOUR))
    assert r.daly.blocking == pytest.approx(r.snapshot_seconds)
    # A 2-minute interval is shorter than the 210 s write: training waits for it.
    assert r.current.blocking == pytest.approx(r.snapshot_seconds + 210 - 120)
    sync = plan(params=175_000_000_000, precision="fp32", optimizer="adam", bandwidth=10e9,
                mtbf=4 * HOUR)
    assert sync.daly is not None and sync.daly.overhead is not None
    assert r.daly.overhead is not None
    assert r.daly.overhead.total < sync.daly.overhead.total


def test_plan_async_optimum_is_raised_to_the_write_time() -> None:
    # Snapshot 0.1 s -> Daly ~ 54 s, but a save takes 500 s to reach storage.
    r = plan(params=50_000_000_000, precision="bf16", optimizer="sgd", bandwidth=0.4e9,
             mtbf=4 * HOUR, async_save=True, snapshot_bandwidth=2e12)
    assert r.write_seconds == pytest.approx(500)
    assert r.young is not None and r.daly is not None
    assert r.daly.seconds == pytest.approx(500) and r.young.seconds == pytest.approx(500)
    assert any("raised to the write time" in n for n in r.notes)
    assert r.daly.overhead is not None
    for tau in (400, 600):
        over = r.overhead_at(tau)
        assert over is not None and over.total > r.daly.overhead.total


def test_plan_refuses_cost_of_two_mtbf() -> None:
    with pytest.raises(UsageError, match=r"at least twice the MTBF.*Daly"):
        plan(params=7_000_000_000, bandwidth=10e6, mtbf=HOUR)  # 98 GB at 10 MB/s: 9800 s
    # With --async the snapshot is the cost, so the same storage is acceptable.
    r = plan(params=7_000_000_000, bandwidth=10e6, mtbf=3 * HOUR, async_save=True)
    assert r.daly is not None


@pytest.mark.parametrize("kwargs,fragment,params", [
    ({}, "params N or from_path PATH", ("params", "from_path")),
    ({"params": 1, "from_path": "x"}, "params N or from_path PATH", ("params", "from_path")),
    ({"from_path": "x", "precision": "fp32"}, "precision and optimizer",
     ("precision", "optimizer", "params", "from_path")),
    ({"params": 1, "input_format": "dcp"}, "input_format applies to from_path",
     ("input_format", "from_path")),
    ({"params": 1, "bandwidth": 1.0, "measure_dir": "."}, "not both", ("bandwidth", "measure_dir")),
    ({"params": 1, "measure_size": 10}, "need measure_dir",
     ("measure_size", "measure_streams", "measure_dir")),
    ({"params": 1, "mtbf": 1.0, "gpus": 2, "gpu_mtbf": 1.0}, "not both",
     ("mtbf", "gpus", "gpu_mtbf")),
    ({"params": 1, "gpus": 2}, "go together", ("gpus", "gpu_mtbf")),
    ({"params": 1, "gpu_mtbf": 5.0}, "go together", ("gpus", "gpu_mtbf")),
    ({"params": 1, "snapshot_bandwidth": 1e9}, "only matters with async_save",
     ("snapshot_bandwidth", "async_save")),
    ({"params": 0}, "^params must be positive", ("params",)),
    ({"params": 1, "bandwidth": -1.0}, "^bandwidth must be positive", ("bandwidth",)),
    ({"params": 1, "interval": 0.0}, "^interval must be positive", ("interval",)),
    ({"params": 1, "keep": 0}, "^keep must be positive", ("keep",)),
    ({"params": 1, "ranks": -2}, "^ranks must be positive", ("ranks",)),
    ({"params": 1, "restart": -1.0}, "^restart cannot be negative", ("restart",)),
])
def test_plan_bad_combinations(kwargs: dict, fragment: str,  # type: ignore[type-arg]
                               params: tuple[str, ...]) -> None:
    # The library names its parameters (the CLI words them as flags: test_plan_cli.py).
    with pytest.raises(UsageError, match=fragment) as e:
        plan(**kwargs)
    assert e.value.params == params


def test_curve_brackets_the_optimum_and_the_interval() -> None:
    r = plan(params=175_000_000_000, precision="fp32", optimizer="adam", bandwidth=10e9,
             mtbf=4 * HOUR, interval=20 * HOUR)
    assert r.daly is not None
    curve = r.curve(31)
    taus = [t for t, _ in curve]
    assert taus == sorted(taus) and len(curve) == 31
    assert taus[0] == pytest.approx(r.daly.seconds / 10)
    assert taus[-1] == pytest.approx(20 * HOUR * 1.5)
    lowest = min(curve, key=lambda p: p[1])
    assert lowest[1] >= r.daly.overhead.total - 1e-12  # type: ignore[union-attr]


# --- --from ------------------------------------------------------------------------------------

def test_size_from_a_checkpoint(sample_run: Path) -> None:
    from ckpt_cli.formats import read_index

    index = read_index(sample_run / "step_000400")
    s = size_from_checkpoint(sample_run / "step_000400")
    groups = index.bytes_by_group
    assert s.training == index.file_bytes
    assert s.weights == groups["model"] and s.optimizer == groups["optimizer"]
    assert s.inference == groups["model"] + groups["buffer"]
    assert s.other == index.file_bytes - groups["model"] - groups["optimizer"]
    assert s.master is None and s.per_parameter is None
    assert s.files == 5 and s.dirs == 1  # 4 rank files + .metadata, in one directory
    assert s.format == "dcp" and s.parameters == index.num_parameters


def test_size_from_a_run_directory_uses_its_latest_checkpoint(sample_run: Path) -> None:
    s = size_from_checkpoint(sample_run)
    assert s.path == sample_run / "step_000400"
    r = plan(from_path=sample_run, bandwidth=1e6, mtbf=HOUR, ranks=4)
    assert r.files_per_checkpoint == 4 and r.inodes_per_checkpoint == 5


def test_size_from_a_single_file(sample_run: Path) -> None:
    s = size_from_checkpoint(sample_run / "step_000100" / "checkpoint.pt")
    assert (s.files, s.dirs) == (1, 0) and s.format == "torch"
    assert s.optimizer > s.weights > 0


def test_size_from_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CkptError, match="no such file"):
        size_from_checkpoint(tmp_path / "nope")


# --- --measure ---------------------------------------------------------------------------------

def test_measure_writes_fsyncs_and_removes(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_size)
        real_fsync(fd)

    monkeypatch.setattr(M.os, "fsync", fsync)
    seen: list[tuple[str, int, int]] = []
    m = measure_bandwidth(tmp_path, size=3 << 20, streams=3,
                          progress=lambda *a: seen.append(a))
    assert (m.bytes, m.streams, m.path) == (3 << 20, 3, tmp_path)
    assert m.seconds > 0 and m.bytes_per_second == m.bytes / m.seconds
    assert synced == [3 << 20]  # the whole file, fsynced once
    assert seen[0] == ("measuring", 0, 3 << 20) and seen[-1] == ("measuring", 3 << 20, 3 << 20)
    assert list(tmp_path.iterdir()) == []


def test_measure_uses_fewer_streams_for_tiny_sizes(tmp_path: Path) -> None:
    m = measure_bandwidth(tmp_path, size=100_000, streams=8)
    assert m.streams == 1 and m.bytes == 100_000
    assert list(tmp_path.iterdir()) == []


def test_measure_removes_the_file_on_ctrl_c(tmp_path: Path) -> None:
    before = threading.active_count()
    found: list[tuple[str, int]] = []

    def interrupt(_phase: str, done: int, total: int) -> None:
        if done:
            found.extend((p.name, p.stat().st_size) for p in tmp_path.iterdir())
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        measure_bandwidth(tmp_path, size=64 << 20, streams=4, progress=interrupt)
    # The test file was there, hidden and named so that validate/prune report a leftover...
    assert len(found) == 1 and found[0][0].startswith(".ckpt-plan-measure.ckpt-tmp-")
    # ... and is gone, with every writer thread stopped.
    assert list(tmp_path.iterdir()) == []
    assert threading.active_count() == before


def test_measure_write_error_is_reported_and_cleaned_up(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(M.os, "pwrite", full)
    with pytest.raises(CkptError, match="No space left on device"):
        measure_bandwidth(tmp_path, size=1 << 20, streams=2)
    assert list(tmp_path.iterdir()) == []


def test_measure_checks_free_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(M.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    with pytest.raises(UsageError, match="only 1,000 are free"):
        measure_bandwidth(tmp_path, size=1 << 20)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_measure_needs_a_directory(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "x"
    if kind == "file":
        target.write_text("x")
    with pytest.raises(CkptError, match="not a directory" if kind == "file"
                       else "no such directory"):
        measure_bandwidth(target, size=1 << 20)


@pytest.mark.parametrize("size,streams,fragment,param", [
    (0, 1, "^measure_size must be positive", "measure_size"),
    (1 << 20, 0, "^measure_streams must be", "measure_streams"),
    (1 << 20, 1000, "^measure_streams must be at most 256", "measure_streams")])
def test_measure_bad_arguments(tmp_path: Path, size: int, streams: int, fragment: str,
                               param: str) -> None:
    with pytest.raises(UsageError, match=fragment) as e:
        measure_bandwidth(tmp_path, size=size, streams=streams)
    assert e.value.param == param


def test_plan_with_measure(tmp_path: Path) -> None:
    r = plan(params=1_000_000, measure_dir=tmp_path, measure_size=1 << 20, measure_streams=2,
             mtbf=HOUR)
    assert r.measurement is not None and r.bandwidth == r.measurement.bytes_per_second
    assert r.write_seconds == pytest.approx(r.size.training / r.bandwidth)
    assert r.daly is not None
    assert plan_dict(r)["bandwidth"]["source"] == "measured"
    assert list(tmp_path.iterdir()) == []
