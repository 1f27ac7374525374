"""The bounded pipeline (``--max-memory``): peak memory stays within the budget plus the largest
tensor, measured for real in a fresh process, and the outputs do not depend on the budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckpt_cli.errors import UsageError
from ckpt_cli.ops.consolidate import consolidate
from ckpt_cli.storage import reads
from ckpt_cli.storage.reads import MIN_MEMORY, Meter, memory_budget, run_bounded
from ckpt_cli.writers import OutTensor
from ckpt_cli.writers.pipeline import Prefetch
from tests.conftest import run_cli

MiB = 1 << 20
BUDGET = MIN_MEMORY  # 64 MiB: the smallest budget, so the checkpoints below dwarf it
BIG = 96 * MiB  # the largest tensor: bigger than the budget
SLACK = 40 * MiB  # interpreter, thread stacks, cast blocks' temporaries, allocator slop

# Runs one ops call in a fresh process and reports how far its resident memory rose above
# what it was just before the call (the peak is reset through /proc/self/clear_refs).
_CHILD = r"""
import json, sys
from pathlib import Path

def status():
    d = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(d["VmRSS"].split()[0]) * 1024, int(d["VmHWM"].split()[0]) * 1024

op, args, budget = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
from ckpt_cli.ops.convert import convert
from ckpt_cli.ops.diff import DiffOptions, diff
from ckpt_cli.ops.validate import validate
import numpy  # noqa: F401
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before, _ = status()
if op == "convert":
    convert(args[0], args[1], to="fp16", overwrite=True, max_memory=budget)
    out = None
elif op == "validate":
    r = validate(args[0], values=True, max_memory=budget)
    c = r.checkpoints[0]
    out = [[k.id, k.status, [f.code for f in k.findings]] for k in c.checks]
else:
    r = diff(args[0], args[1], DiffOptions(max_memory=budget))
    out = [[t.name, t.status, t.stats.max_abs if t.stats else None] for t in r.tensors]
_, peak = status()
print(json.dumps({"rise": peak - before, "out": out}))
"""

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                                reason="needs Linux /proc to measure peak memory")


def _run(op: str, *args: Path, budget: int | None) -> dict[str, object]:
    env = {**os.environ, "CKPT_NO_TORCH_CAST": "1", "PYTHONPATH": str(Path.cwd())}
    p = subprocess.run([sys.executable, "-c", _CHILD, op, json.dumps([str(a) for a in args]),
                        json.dumps(budget)], capture_output=True, text=True, env=env,
                       check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    got: dict[str, object] = json.loads(p.stdout.strip().splitlines()[-1])
    return got


@pytest.fixture(scope="module")
def big_safetensors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~480 MB of FP32, 7.5x the budget: 12 tensors of 32 MB and one of 96 MB, written by
    safetensors itself."""
    g = np.random.default_rng(0)
    tensors = {f"layers.{i}.weight": g.standard_normal(8 * MiB, dtype=np.float32)
               for i in range(12)}
    tensors["embed.weight"] = g.standard_normal((BIG // 4 // 1024, 1024), dtype=np.float32)
    path = tmp_path_factory.mktemp("big") / "model.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.fixture(scope="module")
def big_torch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The same shape of checkpoint written by torch.save (a zip with CRC-32s)."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(8 * MiB, generator=g) for i in range(12)}
    sd["embed.weight"] = torch.randn(BIG // 4 // 1024, 1024, generator=g)
    sd["layers.3.weight"][7] = float("nan")  # a finding, so outputs have something to show
    path = tmp_path_factory.mktemp("bigpt") / "train.pt"
    torch.save({"model": sd}, path)
    yield path


def test_convert_peak_memory_and_bytes(big_safetensors: Path, tmp_path: Path) -> None:
    small = _run("convert", big_safetensors, tmp_path / "a.safetensors", budget=BUDGET)
    assert int(small["rise"]) <= BUDGET + BIG + SLACK, small  # type: ignore[call-overload]
    default = _run("convert", big_safetensors, tmp_path / "b.safetensors", budget=None)
    # Generous budget, more in flight: still bounded (256 MiB + the largest tensor).
    assert int(default["rise"]) <= reads.MEMORY_BUDGET + BIG + SLACK  # type: ignore
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


@pytest.mark.requires_torch
def test_validate_values_peak_memory(big_torch: Path) -> None:
    small = _run("validate", big_torch, budget=BUDGET)
    assert int(small["rise"]) <= BUDGET + BIG + SLACK, small  # type: ignore[call-overload]
    default = _run("validate", big_torch, budget=None)
    assert small["out"] == default["out"]
    values = next(c for c in small["out"] if c[0] == "values")  # type: ignore[union-attr]
    assert values[1] == "fail" and values[2] == ["nan"]


@pytest.mark.requires_torch
def test_diff_peak_memory(big_safetensors: Path, big_torch: Path) -> None:
    small = _run("diff", big_safetensors, big_torch, budget=BUDGET)
    # Both sides stream in blocks: far below the budget, however large the tensors.
    assert int(small["rise"]) <= BUDGET + SLACK, small  # type: ignore[call-overload]
    default = _run("diff", big_safetensors, big_torch, budget=None)
    assert small["out"] == default["out"]
    assert {s for _, s, _ in small["out"]} == {"changed"}  # type: ignore[misc]


def test_consolidate_bytes_do_not_depend_on_budget(tmp_path: Path) -> None:
    g = np.random.default_rng(1)
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for r in range(2):
        save_file({f"r{r}.w{i}": g.standard_normal(3 * MiB, dtype=np.float32)
                   for i in range(4)}, str(ranks / f"rank{r}.safetensors"))
    consolidate(ranks, tmp_path / "a", to="bf16", max_memory=BUDGET)
    consolidate(ranks, tmp_path / "b", to="bf16")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in files:
        if name != "ckpt-manifest.json":  # it records when it was written
            assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


# --- the pieces of the pipeline -------------------------------------------------------------

def _pieces(n: int, size: int, log: list[str]) -> OutTensor:
    def pieces() -> Iterator[np.ndarray]:
        for k in range(n):
            log.append(f"made {k}")
            yield np.full(size, k, np.uint8)
    return OutTensor("t", "U8", (n * size,), lambda: np.empty(0), pieces)


def test_prefetch_runs_ahead_within_budget() -> None:
    log: list[str] = []
    t = _pieces(20, 1000, log)
    with Prefetch([t], budget=4000) as pre:
        it = pre.pieces(0)
        first = next(it)
        time.sleep(0.3)  # the producer runs ahead as far as the budget allows, no further
        assert log == [f"made {k}" for k in range(4)]
        got = [first, *it]
        assert pre.peak <= 4000
    assert [int(p[0]) for p in got] == list(range(20))


def test_prefetch_piece_larger_than_budget_goes_alone() -> None:
    log: list[str] = []
    t = _pieces(3, 5000, log)
    with Prefetch([t], budget=4000) as pre:
        it = pre.pieces(0)
        next(it)
        time.sleep(0.2)
        assert log == ["made 0"]  # the next waits until this one is written
        assert len(list(it)) == 2
        assert pre.peak == 5000


def test_run_bounded_keeps_to_the_budget_and_raises_the_first_failure() -> None:
    lock = threading.Lock()
    held, peak = [0], [0]

    def job(i: int, cost: int, fail: bool = False):  # type: ignore[no-untyped-def]
        def run(meter: Meter) -> int:
            with lock:
                held[0] += cost
                peak[0] = max(peak[0], held[0])
            time.sleep(0.02 * (5 - i % 5))
            with lock:
                held[0] -= cost
            if fail:
                raise ValueError(f"job {i}")
            meter.add(cost)
            return i
        return run

    costs = [30, 30, 30, 100, 10, 10, 30]
    out = run_bounded([job(i, c) for i, c in enumerate(costs)], costs, budget=60, threads=4,
                      total=sum(costs), label="x")
    assert out == list(range(len(costs)))
    assert peak[0] <= 100  # 60, or the one job larger than the budget, alone
    jobs = [job(i, 10, fail=i in (2, 3)) for i in range(6)]
    with pytest.raises(ValueError, match="job 2"):  # job 3 fails first, job 2 is reported
        run_bounded(jobs, [10] * 6, budget=100, threads=4, total=60, label="x")


def test_too_small_budget_is_a_usage_error(big_safetensors: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="at least 64MiB"):
        memory_budget(MIN_MEMORY - 1)
    assert memory_budget(None) == reads.MEMORY_BUDGET
    for args in (["convert", big_safetensors, "-o", tmp_path / "x.safetensors"],
                 ["consolidate", tmp_path, "-o", tmp_path / "y"],
                 ["validate", big_safetensors],
                 ["diff", big_safetensors, big_safetensors]):
        r = run_cli(*args, "--max-memory", "16MB")
        assert r.exit_code == 2, (args, r.output)
        assert "--max-memory must be at least 64MiB" in r.output
    assert not (tmp_path / "x.safetensors").exists()
