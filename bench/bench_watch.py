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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--scratch", type=Path, default=None)
    ap.add_argument("--idle-passes", type=int, default=10)
    a = ap.parse_args()
    from ckpt_cli.watch import Watcher, WatchOptions

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
        report(f"ckpt watch, {a.n} DCP checkpoints", rows)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
