"""Benchmark: ``ckpt prune`` on a run directory of 2,000 checkpoints x 64 files.

Layout: ``step_NNNNNNN/`` directories, each a real torch.distributed.checkpoint save (``.metadata``
plus 63 ``__0_N.distcp`` files, written once by torch and copied), and a ``latest`` pointer.

- Planning: ``ckpt prune RUN --keep 1 --grace 0 --dry-run`` in a fresh process (target: under
  5 s). It lists and scans every checkpoint, checks completion markers and validates the newest.
- Deletion: ``ckpt prune COPY --keep 1 --grace 0 --yes`` (1,999 checkpoints go) against the peer,
  ``rm -rf`` of the same 1,999 directories of another copy (target: within 2x).

``--grace 0`` throughout, because the data was just written: the grace period would (rightly)
keep every checkpoint.

Deleting many small files is bound by the file system's metadata journal, so each deletion
starts from a copy flushed with ``sync`` and is followed by one. ``--scratch DIR`` puts the copies
elsewhere, e.g. on tmpfs (``/dev/shm``) to measure the tools' own cost without the disk.

Run: python -m bench.bench_prune [--quick] [--scratch DIR] [--rounds N]
     (--quick: 200 checkpoints; N rounds of each deletion, default 3)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench._common import DATA, ckpt_argv, in_subprocess, report, timed, warm

FILES_PER_CHECKPOINT = 64


def write_template(out: str) -> None:
    """One DCP checkpoint of 63 items saved one file per item (+ .metadata = 64 files)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(16, 16, generator=g)
          for i in range(FILES_PER_CHECKPOINT - 1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(sd, storage_writer=FileSystemWriter(out, single_file_per_rank=False),
                 no_dist=True)


def _master(n: int) -> Path:
    """The run directory with ``n`` checkpoints, made once and reused."""
    template = DATA / "prune_template"
    if not (template / ".metadata").exists():
        shutil.rmtree(template, ignore_errors=True)
        in_subprocess("bench.bench_prune.write_template", template)
    run = DATA / f"prune_run_{n}"
    last = run / f"step_{n * 100:07d}"
    if not (run / "latest").exists():
        print(f"[bench] writing {run} ...", file=sys.stderr)
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True)
        for i in range(1, n + 1):
            shutil.copytree(template, run / f"step_{i * 100:07d}")
        (run / "latest").write_text(last.name + "\n")
    return run


def _copy(master: Path, dest: Path) -> Path:
    """A fresh copy to delete from, flushed to disk: deleting files whose data and metadata are
    still in the page cache measures the write-back, not the deleter."""
    shutil.rmtree(dest, ignore_errors=True)
    subprocess.run(["cp", "-a", str(master), str(dest)], check=True)
    os.sync()
    return dest


def _arg(flag: str, default: str) -> str:
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default


def main() -> None:
    n = 200 if "--quick" in sys.argv else 2000
    scratch = Path(_arg("--scratch", str(DATA)))
    rounds = int(_arg("--rounds", "3"))
    DATA.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    master = _master(n)
    warm(master)
    files = n * FILES_PER_CHECKPOINT

    plan = timed("ckpt prune --dry-run", ckpt_argv("prune", str(master), "--keep", "1",
                                                   "--grace", "0", "--dry-run", "--json"),
                 repeat=3)
    doc = json.loads(plan.stdout)
    assert doc["summary"]["to_delete"] == n - 1, doc["summary"]

    # Rounds alternate which tool goes first, and each deletion starts from a synced copy and
    # is followed by a sync, so neither pays for the other's write-back. The fastest round of
    # each counts, as in bench._common.timed: on a shared machine, slower rounds measure the
    # neighbours.
    ours_times: list[float] = []
    rm_times: list[float] = []
    for r in range(rounds):
        for tool in (("ckpt", "rm") if r % 2 == 0 else ("rm", "ckpt")):
            work = _copy(master, scratch / f"prune_copy_{tool}")
            if tool == "ckpt":
                run = timed("ckpt prune --yes", ckpt_argv("prune", str(work), "--keep", "1",
                                                          "--grace", "0", "--yes", "--json"))
                done = json.loads(run.stdout)["summary"]
                assert done["deleted"] == n - 1 and done["failed"] == 0, done
                ours_times.append(run.seconds)
            else:
                victims = sorted(str(p) for p in work.glob("step_*"))[:-1]
                t0 = time.perf_counter()
                subprocess.run(["rm", "-rf", *victims], check=True)
                rm_times.append(time.perf_counter() - t0)
            shutil.rmtree(work)
            os.sync()
    ours, rm_seconds = min(ours_times), min(rm_times)
    deleting = max(ours - plan.seconds, 1e-9)
    deleted_files = (n - 1) * FILES_PER_CHECKPOINT
    report(f"prune of a run directory with {n:,} checkpoints x {FILES_PER_CHECKPOINT} files "
           f"({files:,} files); deletions in {scratch}, best of {rounds}", [
        ("plan (--dry-run), fresh process", f"{plan.seconds:.2f} s, peak RSS "
                                            f"{plan.peak_rss / 1e6:.0f} MB  (target < 5 s)"),
        ("prune --keep 1 --yes (plan + delete)", f"{ours:.2f} s for {n - 1:,} checkpoints  "
                                                 f"(rounds: {_secs(ours_times)})"),
        ("  of which deleting (minus the plan)", f"{deleting:.2f} s, "
                                                 f"{deleted_files / deleting:,.0f} files/s"),
        ("peer: rm -rf of the same directories", f"{rm_seconds:.2f} s, "
                                                 f"{deleted_files / rm_seconds:,.0f} files/s  "
                                                 f"(rounds: {_secs(rm_times)})"),
        ("ratio, deleting only / rm -rf", f"{deleting / rm_seconds:.2f}x  (target <= 2x)"),
        ("ratio, whole prune / rm -rf", f"{ours / rm_seconds:.2f}x"),
    ])


def _secs(times: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in times)


if __name__ == "__main__":
    main()
