"""Benchmark: ``resume-path``'s default check on a run of 1,000 verified checkpoints, this tree
against an older one (issue 45: no more than 1.5x the tree before the inode-change time joined
the stamp; issue 37 allowed 2x the tree before the ledger's stamps).

The run: 1,000 small torch checkpoints (``step_NNNNN.pt``: a model, its Adam state, the step),
each verified by ``ckpt watch`` (manifest and ledger line), written once with this tree (an
older tree reads the same ledger: the fields it does not know are ignored). Each tree is timed
two ways, interleaved round by round: ``choose()`` in one process (the check itself, 20 calls
after a warm-up, median), and ``ckpt resume-path RUN`` as a fresh process (import included,
median of the rounds). Cases: the newest checkpoint intact (what resume-path does nearly
always), the newest ten damaged after their verdict (a byte flipped in place: the default
check hashes each changed file and passes over them), and the newest ten damaged with their
modification times put back (``touch -r``: size, mtime and inode as recorded; only the
inode-change time tells, and a tree before issue 45 offers the newest, damaged).

Run: python -m bench.bench_resume [--baseline-rev REV] [--rounds N]
(REV defaults to 566afa1, the tree before issue 45; it is extracted with ``git archive``.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import _common as bc

CHOOSE = """
import statistics, sys, time
import ckpt_cli
assert ckpt_cli.__file__.startswith(sys.argv[2]), ckpt_cli.__file__
from ckpt_cli.resume import choose
run = sys.argv[1]
first = choose(run)
times = []
for _ in range(20):
    t0 = time.perf_counter()
    choose(run)
    times.append(time.perf_counter() - t0)
print(statistics.median(times), first.path if first else None)
"""


def _make_run(run: Path, n: int) -> None:
    bc.in_subprocess("bench.bench_resume._write_run", str(run), n)


def _write_run(where: str, n: int) -> None:
    import torch

    from ckpt_cli.ops.watch import Watcher, WatchOptions

    run = Path(where)
    run.mkdir(parents=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    for i in range(1, n + 1):
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": i},
                   run / f"step_{i:05d}.pt")
    old = time.time() - 3600
    for p in run.iterdir():
        os.utime(p, (old, old))
    Watcher(run, WatchOptions(settle=0), lambda _e: None).run_pass()


def _watch_once(where: str) -> None:
    from ckpt_cli.ops.watch import Watcher, WatchOptions

    Watcher(Path(where), WatchOptions(settle=0), lambda _e: None).run_pass()


def _tree(rev: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(bc.ROOT), "archive", rev, "ckpt_cli"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _choose_seconds(tree: Path, run: Path) -> tuple[float, str]:
    env = bc.child_env({"PYTHONPATH": str(tree)})
    # cwd: ``python -c`` puts it first on the path, before PYTHONPATH
    out = subprocess.run([bc.PY, "-c", CHOOSE, str(run), str(tree)], env=env, cwd=tree,
                         capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), Path(out[1]).name


def _cli_seconds(tree: Path, run: Path) -> float:
    env = bc.child_env({"PYTHONPATH": str(tree)})
    t0 = time.perf_counter()
    subprocess.run([bc.PY, "-m", "ckpt_cli", "resume-path", str(run)], env=env, cwd=tree,
                   capture_output=True, check=False)
    return time.perf_counter() - t0


def _flip(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline-rev", default="566afa1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-n", type=int, default=1000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        work = Path(tmp)
        run = work / "run"
        _make_run(run, a.n)
        trees = {"before": _tree(a.baseline_rev, work / "before"), "this": bc.ROOT}
        damaged = work / "damaged"
        shutil.copytree(run, damaged)
        hidden = work / "hidden"
        shutil.copytree(run, hidden)
        for d in (damaged, hidden):
            # A pass over each copy, as a watcher restarted there would make: its files' new
            # stamps (inodes) recorded, so only the damage below counts as a change.
            bc.in_subprocess("bench.bench_resume._watch_once", str(d))
        for i in range(a.n - 9, a.n + 1):
            _flip(damaged / f"step_{i:05d}.pt")
            p = hidden / f"step_{i:05d}.pt"
            st = p.stat()
            _flip(p)
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        rows: list[tuple[str, str]] = []
        for case, where in (("intact", run), ("newest 10 damaged", damaged),
                            ("newest 10 damaged, mtime put back", hidden)):
            choose: dict[str, list[float]] = {k: [] for k in trees}
            cli: dict[str, list[float]] = {k: [] for k in trees}
            picked: dict[str, str] = {}
            for _ in range(a.rounds):
                for label, tree in trees.items():
                    s, picked[label] = _choose_seconds(tree, where)
                    choose[label].append(s)
                    cli[label].append(_cli_seconds(tree, where))
            for label in trees:
                rows.append((f"{case}: {label} choose()",
                             f"{statistics.median(choose[label]) * 1e3:.1f} ms "
                             f"-> {picked[label]}"))
                rows.append((f"{case}: {label} ckpt resume-path",
                             f"{statistics.median(cli[label]) * 1e3:.0f} ms"))
            ratio = statistics.median(choose["this"]) / statistics.median(choose["before"])
            ratio_cli = statistics.median(cli["this"]) / statistics.median(cli["before"])
            rows.append((f"{case}: this / before", f"choose() {ratio:.2f}x, "
                         f"resume-path {ratio_cli:.2f}x"))
        bc.report(f"resume-path on a run of {a.n} verified checkpoints "
                  f"(before = {a.baseline_rev})", rows)


if __name__ == "__main__":
    sys.exit(main())
