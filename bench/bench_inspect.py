"""Benchmark: ``ckpt inspect --json`` against the peer script a user would write.

Peer: ``torch.load(path, mmap=True, weights_only=True, map_location="cpu")`` and a walk that
counts parameters. Both run as fresh processes (import time included, as for a user).
Beside the big file's times: what ``inspect --json`` spends importing (``python -X importtime``:
all imports, and ckpt_cli's own modules' share) and how many ckpt_cli modules it and
``ckpt --help`` load; inspect should import no writer, no retention, no storage client.
Also: inspect of a DCP directory and of a run directory at growing file counts (the cost per
file must stay flat), and of a run directory of 20,000 small checkpoints (target: at most 2 s)
against a plain listing (scandir + stat of every entry) and, with
``CKPT_BENCH_BASELINE=/path/to/older/checkout``, that checkout's ckpt.

Run: python -m bench.bench_inspect [--quick | --many]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench import _common as bc

PEER = """
import sys, torch
sd = torch.load(sys.argv[1], mmap=True, weights_only=True, map_location="cpu")
def count(o):
    if isinstance(o, torch.Tensor):
        return o.numel()
    if isinstance(o, dict):
        return sum(count(v) for v in o.values())
    if isinstance(o, (list, tuple)):
        return sum(count(v) for v in o)
    return 0
print(count(sd["model"]))
"""


def bench_big_file(quick: bool) -> None:
    path = bc.train_checkpoint(**({"n_layers": 2, "dim": 512} if quick else {}))
    bc.warm(path)
    ours = bc.timed("ckpt inspect --json", bc.ckpt_argv("inspect", str(path), "--json"), repeat=3)
    peer = bc.timed("torch.load(mmap) + walk", [bc.PY, "-c", PEER, str(path)], repeat=3)
    ours_params = json.loads(ours.stdout)["num_parameters"]
    peer_params = int(peer.stdout.strip())
    bc.report(f"inspect of a {bc.human_bytes(path.stat().st_size)} torch training checkpoint", [
        ("ckpt inspect --json", f"{ours.seconds:.3f} s, peak RSS {bc.human_bytes(ours.peak_rss)}"),
        ("peer torch.load(mmap)+walk", f"{peer.seconds:.3f} s, peak RSS "
                                       f"{bc.human_bytes(peer.peak_rss)}"),
        ("speed-up (peer / ckpt)", f"{peer.seconds / ours.seconds:.1f}x  (target >= 8x)"),
        ("parameters (ckpt / peer)", f"{ours_params:,} / {peer_params:,}  "
                                     f"{'same' if ours_params == peer_params else 'DIFFERENT'}"),
        *import_rows(path),
    ])


def import_time(*args: str, repeat: int = 5) -> tuple[float, float, int]:
    """``python -X importtime -m ckpt_cli ARGS``: the median over ``repeat`` runs of the time
    spent importing (all top-level imports, cumulative) and of ckpt_cli's own modules' share
    (their self time), and how many ckpt_cli modules were imported."""
    totals, own, count = [], [], 0
    for _ in range(repeat):
        p = subprocess.run([bc.PY, "-X", "importtime", "-m", "ckpt_cli", *args], env=bc.child_env(),
                           capture_output=True, text=True, check=False)
        total = mine = 0
        modules = set()
        for line in p.stderr.splitlines():
            if not line.startswith("import time:") or "self [us]" in line:
                continue
            self_us, cumulative, raw = line[len("import time:"):].split("|")
            name = raw[1:]
            if not name.startswith(" "):  # a top-level import: its cumulative time counts
                total += int(cumulative)
            if name.strip().split(".")[0] == "ckpt_cli":
                mine += int(self_us)
                modules.add(name.strip())
        totals.append(total / 1e6)
        own.append(mine / 1e6)
        count = len(modules)
    return statistics.median(totals), statistics.median(own), count


HELP_MODULES = """
import runpy, sys
sys.argv = ["ckpt", "--help"]
try:
    runpy.run_module("ckpt_cli", run_name="__main__")
except SystemExit:
    pass
print(sum(1 for m in sys.modules if m == "ckpt_cli" or m.startswith("ckpt_cli.")),
      file=sys.stderr)
"""


def import_rows(path: Path) -> list[tuple[str, str]]:
    """Rows for :func:`report`: what ``inspect --json PATH`` and ``--help`` import."""
    total, own, count = import_time("inspect", "--json", str(path))
    p = subprocess.run([bc.PY, "-c", HELP_MODULES], env=bc.child_env(), capture_output=True,
                       text=True, check=False)
    help_count = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "?"
    return [("imports (-X importtime, median)", f"{total:.3f} s, of it ckpt_cli's own "
                                                f"{own:.3f} s; {count} ckpt_cli modules"),
            ("ckpt --help loads", f"{help_count} ckpt_cli modules")]


def _dcp_dir(n_files: int) -> Path:
    """A DCP checkpoint with ``n_files`` .distcp files (one file per item, as DCP writes with
    single_file_per_rank=False)."""
    out = bc.DATA / f"dcp_{n_files}"
    if not (out / ".metadata").exists():
        bc.in_subprocess("bench.bench_inspect.write_dcp", out, n_files)
    return out


def write_dcp(out: str, n_files: int) -> None:
    """Write the DCP checkpoint of :func:`_dcp_dir` (in a child process)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(64, 64, generator=g) for i in range(n_files)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(sd, storage_writer=FileSystemWriter(out, single_file_per_rank=False),
                 no_dist=True)


def _run_dir(n: int) -> Path:
    out = bc.DATA / f"run_{n}"
    if not (out / f"step_{n:06d}").exists():
        bc.in_subprocess("bench.bench_inspect.write_run", out, n)
    return out


def write_run(out_s: str, n: int) -> None:
    """Write the run directory of :func:`_run_dir` (in a child process)."""
    import torch

    out = Path(out_s)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for i in range(1, n + 1):
        d = out / f"step_{i:06d}"
        d.mkdir(exist_ok=True)
        torch.save({"model": {"w": torch.randn(128, 128, generator=g)}, "step": i},
                   d / "checkpoint.pt")


def bench_scaling() -> None:
    rows = []
    for label, make, sizes in (("DCP files", _dcp_dir, (64, 128, 256)),
                               ("run checkpoints", _run_dir, (25, 50, 100))):
        per = []
        for n in sizes:
            d = make(n)
            bc.warm(d)
            r = bc.timed(f"inspect {n}", bc.ckpt_argv("inspect", str(d), "--json"), repeat=3)
            per.append(r.seconds)
            rows.append((f"{label}: {n}", f"{r.seconds:.3f} s"))
        # Subtract the fixed start-up cost (the smallest run's time scaled) to see growth.
        growth = (per[-1] - per[0]) / (sizes[-1] - sizes[0]) * 1000
        rows.append((f"{label}: marginal cost", f"{growth:.2f} ms per file "
                     f"({per[-1] / per[0]:.2f}x time for {sizes[-1] / sizes[0]:.0f}x files)"))
    bc.report("inspect cost vs number of files (linear = constant marginal cost)", rows)


LISTING = """
import os, sys
n = 0
with os.scandir(sys.argv[1]) as it:
    for e in it:
        e.stat(follow_symlinks=False)
        n += 1
print(n)
"""


def bench_many_checkpoints(n: int = 20_000) -> None:
    d = bc.many_checkpoints(n)
    bc.warm(d)
    runs = {"plain listing (scandir+stat)": [bc.PY, "-c", LISTING, str(d)],
            "ckpt inspect": bc.ckpt_argv("inspect", str(d)),
            "ckpt inspect --json": bc.ckpt_argv("inspect", str(d), "--json")}
    baseline = os.environ.get("CKPT_BENCH_BASELINE")
    if baseline:
        # -P: not the current directory first on sys.path, so PYTHONPATH picks the checkout.
        runs["baseline ckpt inspect"] = [bc.PY, "-P", "-m", "ckpt_cli", "inspect", str(d)]
    results = {label: bc.timed(label, argv, repeat=3, env={"PYTHONPATH": baseline}
                               if label.startswith("baseline") and baseline else None)
               for label, argv in runs.items()}
    entries = len(json.loads(results["ckpt inspect --json"].stdout)["checkpoints"])
    rows = [(label, f"{r.seconds:.2f} s wall, {r.cpu_seconds:.2f} s CPU, peak RSS "
                    f"{bc.human_bytes(r.peak_rss)}"
             + (f", {r.stdout.count(chr(10)):,} lines" if label.endswith("inspect") else ""))
            for label, r in results.items()]
    rows.append(("entries in --json", f"{entries:,} (of {n:,})"))
    ours = results["ckpt inspect"]
    rows.append(("target", f"ckpt inspect <= 2 s: {'met' if ours.seconds <= 2 else 'MISSED'}"
                           f" (wall; CPU {ours.cpu_seconds:.2f} s: a busy machine inflates wall)"))
    bc.report(f"inspect of a run directory of {n:,} small checkpoints", rows)


def main() -> None:
    quick = "--quick" in sys.argv
    bc.DATA.mkdir(parents=True, exist_ok=True)
    if "--many" in sys.argv:  # only the 20,000-checkpoint run directory
        bench_many_checkpoints()
        return
    bench_big_file(quick)
    bench_scaling()
    bench_many_checkpoints(2_000 if quick else 20_000)


if __name__ == "__main__":
    main()
