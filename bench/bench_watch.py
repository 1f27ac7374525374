"""Benchmark: ``ckpt watch``'s CPU cost, idle and per checkpoint verified.

Layout: a run directory of N (default 1,000) ``step_NNNNNNN/`` checkpoints, each a real
torch.distributed.checkpoint save (``.metadata`` + one ``.distcp`` file, written once by torch
and copied), and a ``latest`` pointer.

Measured in this process with :func:`time.process_time` (CPU seconds, user + system):

- first pass: every checkpoint verified (structure check, manifest written, ledger line):
  CPU per checkpoint verified; also with ``--crc``.
- idle pass: nothing changed (what a sidecar does every ``--interval``): CPU per pass, and the
  share of one core that is at the default 5 s interval.
- restart: a new watcher's first pass over the verified run (ledger read, each checkpoint's
  sizes re-checked against its manifest, nothing validated again).
- ``--wake events`` (when the optional watchfiles package is installed): the CPU and time to
  start watching the run (one inotify watch per directory), the CPU of waiting 10 s with
  nothing changing (next to polling's sleep), and how long after a new checkpoint is renamed
  into the run the wait returns (polling: up to ``--interval``, 2.5 s on average at 5 s).

Run: python -m bench.bench_watch [--n N] [--scratch DIR]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import warnings
from pathlib import Path

from bench._common import report


def _template(dest: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = {"model": {f"layer{i}.weight": torch.randn(64, 64) for i in range(8)}, "step": 1}
        dcp.save(sd, checkpoint_id=str(dest))


def _cpu(fn: object) -> tuple[float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    fn()  # type: ignore[operator]
    return time.process_time() - c0, time.perf_counter() - w0


def _events(run: Path, tpl: Path, n: int) -> list[tuple[str, str]]:
    """``--wake events`` figures on the verified run (none without watchfiles)."""
    import threading

    try:
        from ckpt_cli.ops.watch.wake import EventWaker
    except ImportError:
        return []
    try:
        import watchfiles  # noqa: F401
    except ImportError:
        return [("--wake events", "not measured: watchfiles is not installed")]
    rows = []
    box: list[EventWaker] = []
    cpu, wall = _cpu(lambda: box.append(EventWaker(run)))
    waker = box[0]
    try:
        rows.append((f"--wake events: start watching {n} checkpoints",
                     f"{cpu * 1e3:.0f} ms CPU, {wall * 1e3:.0f} ms wall"))
        cpu, wall = _cpu(lambda: waker.wait(10.0))
        rows.append(("--wake events: waiting 10 s, nothing changing",
                     f"{cpu * 1e3:.1f} ms CPU ({cpu / wall * 100:.2f} % of a core)"))
        stage = run.parent / "staged"
        lat = []

        def land(dest: Path, t0: list[float]) -> None:
            time.sleep(0.5)
            t0.append(time.perf_counter())
            stage.rename(dest)  # a save committing by rename

        for i in range(5):
            shutil.copytree(tpl, stage)
            t0: list[float] = []
            th = threading.Thread(target=land, args=(run / f"step_{n + 1 + i:07d}", t0))
            th.start()
            waker.wait(30.0)
            woke = time.perf_counter()
            th.join()
            lat.append(woke - t0[0])
        lat.sort()
        rows.append(("--wake events: a save renamed into the run to wake-up (median of 5)",
                     f"{lat[2] * 1e3:.0f} ms (polling: up to --interval)"))
    finally:
        waker.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--scratch", type=Path, default=None)
    ap.add_argument("--idle-passes", type=int, default=10)
    a = ap.parse_args()
    from ckpt_cli.ops.watch import Watcher, WatchOptions

    base = Path(tempfile.mkdtemp(prefix="bench-watch-", dir=a.scratch))
    try:
        tpl = base / "template"
        _template(tpl)
        rows: list[tuple[str, str]] = []
        for crc in (False, True):
            run = base / ("run-crc" if crc else "run")
            run.mkdir()
            for i in range(1, a.n + 1):
                shutil.copytree(tpl, run / f"step_{i:07d}")
            (run / "latest").write_text(f"step_{a.n:07d}\n")
            opts = WatchOptions(crc=crc, settle=0)
            w = Watcher(run, opts, lambda _e: None)
            cpu, wall = _cpu(w.run_pass)
            label = "--crc" if crc else "structure"
            rows.append((f"first pass, {a.n} verified ({label})",
                         f"{cpu:.2f} s CPU, {wall:.2f} s wall; "
                         f"{cpu / a.n * 1e3:.1f} ms CPU per checkpoint"))
            if crc:
                break
            idle = [_cpu(w.run_pass) for _ in range(a.idle_passes)]
            cpu_idle = sorted(c for c, _ in idle)[len(idle) // 2]
            wall_idle = sorted(x for _, x in idle)[len(idle) // 2]
            rows.append((f"idle pass over {a.n} (median of {a.idle_passes})",
                         f"{cpu_idle * 1e3:.0f} ms CPU, {wall_idle * 1e3:.0f} ms wall; "
                         f"{cpu_idle / 5 * 100:.1f} % of a core at --interval 5s"))
            fresh = Watcher(run, opts, lambda _e: None)
            cpu, wall = _cpu(fresh.run_pass)
            rows.append((f"restart: first pass of a new watcher over {a.n} verified",
                         f"{cpu:.2f} s CPU, {wall:.2f} s wall (nothing validated again)"))
        rows += _events(base / "run", tpl, a.n)
        report(f"ckpt watch, {a.n} DCP checkpoints", rows)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
