"""One progress contract for every op (issue 47): ``progress(phase, done, total)``
(:class:`ckpt_cli.progress.Progress`), passed as the keyword ``progress``; the Python API hands
the caller's ``on_progress`` through and the CLI has one adapter (``ProgressSink``)."""

from __future__ import annotations

import inspect
import itertools
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckpt_cli.progress import Progress, Tally
from tests.helpers.golden import safetensors_run

Calls = list[tuple[str, int, int]]


def _ops() -> dict[str, Callable[..., Any]]:
    from ckpt_cli.ops.consolidate import consolidate
    from ckpt_cli.ops.convert import convert
    from ckpt_cli.ops.diff import diff, diff_indexes
    from ckpt_cli.ops.plan import plan
    from ckpt_cli.ops.plan.measure import measure_bandwidth
    from ckpt_cli.ops.prune import prune
    from ckpt_cli.ops.prune.executor import execute
    from ckpt_cli.ops.sample import write_sample
    from ckpt_cli.ops.stats import stats
    from ckpt_cli.ops.validate import validate

    return {"validate": validate, "diff": diff, "diff_indexes": diff_indexes, "stats": stats,
            "convert": convert, "consolidate": consolidate, "prune": prune, "execute": execute,
            "plan": plan, "measure_bandwidth": measure_bandwidth, "write_sample": write_sample}


@pytest.mark.parametrize("name", sorted(_ops()))
def test_every_op_takes_the_one_progress_type(name: str) -> None:
    op = _ops()[name]
    param = inspect.signature(op).parameters.get("progress")
    assert param is not None, f"{name} has no progress parameter"
    assert param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD) and param.default is None
    hints = typing.get_type_hints(op)
    assert hints["progress"] == Progress | None, (name, hints["progress"])
    assert not [p for p in inspect.signature(op).parameters if p in ("on_progress", "on_start")]


def _tiny(path: Path, n: int = 3) -> Path:
    save_file({f"l{i}.weight": np.full((16, 8), i, dtype=np.float32) for i in range(n)},
              str(path))
    return path


def _check(calls: Calls, phase: str) -> None:
    """Every call names ``phase``; ``done`` never goes down and ends at ``total`` > 0."""
    assert calls, "no progress reported"
    assert {p for p, _, _ in calls} == {phase}, calls
    assert all(a[1] <= b[1] for a, b in itertools.pairwise(calls)), calls
    assert calls[-1][1] == calls[-1][2] > 0, calls


@pytest.mark.requires_torch
def test_convert_and_consolidate_report_writing(tmp_path: Path) -> None:
    from ckpt_cli.ops.consolidate import consolidate
    from ckpt_cli.ops.convert import convert

    src = _tiny(tmp_path / "m.safetensors")
    calls: Calls = []
    r = convert(src, tmp_path / "o.safetensors", to="fp16", progress=lambda *a: calls.append(a))
    _check(calls, "writing")
    assert calls[0] == ("writing", 0, calls[-1][2])  # the total comes first, before any byte
    assert r.casts == {"F32->F16": 3}

    ranks = tmp_path / "ranks"
    ranks.mkdir()
    import torch

    for rank in range(2):
        torch.save({"model": {f"l{rank}.weight": torch.ones(4, 4)}, "rank": rank},
                   ranks / f"rank_{rank}.pt")
    calls.clear()
    consolidate(ranks, tmp_path / "c.safetensors", max_shard_size=None,
                progress=lambda *a: calls.append(a))
    _check(calls, "writing")


def test_diff_reports_comparing(tmp_path: Path) -> None:
    from ckpt_cli.ops.diff import DiffOptions, diff

    a = _tiny(tmp_path / "a.safetensors")
    b = tmp_path / "b.safetensors"
    save_file({f"l{i}.weight": np.full((16, 8), i + (i == 2), dtype=np.float32)
               for i in range(3)}, str(b))
    calls: Calls = []
    r = diff(a, b, DiffOptions(), progress=lambda *a: calls.append(a))
    assert not r.equal
    _check(calls, "comparing")
    assert calls[-1][2] == 2 * 3 * 16 * 8 * 4


def test_prune_reports_deleting_apart_from_its_events(tmp_path: Path) -> None:
    from ckpt_cli.ops.prune import prune
    from ckpt_cli.ops.prune.retention import PrunePolicy

    run = safetensors_run(tmp_path)
    calls: Calls = []
    kinds: list[str] = []
    r = prune(run, PrunePolicy(keep=1, grace=0), progress=lambda *a: calls.append(a),
              on_event=lambda e: kinds.append(e.kind))
    assert r.ok and len(r.named("deleted")) == 3
    assert calls == [("deleting", 1, 3), ("deleting", 2, 3), ("deleting", 3, 3)]
    assert kinds[0] == "planned" and kinds.count("deleted") == 3


def test_the_api_passes_on_progress_through(tmp_path: Path) -> None:
    import ckpt_cli
    from ckpt_cli.api import _args

    assert _args.ProgressCallback is Progress
    assert not hasattr(_args, "Written") and not hasattr(_args, "phased")
    src = _tiny(tmp_path / "m.safetensors")
    calls: Calls = []
    ckpt_cli.convert(src, tmp_path / "o.safetensors", to="bf16",
                     on_progress=lambda *a: calls.append(a))
    _check(calls, "writing")
    calls.clear()
    ckpt_cli.diff(src, tmp_path / "o.safetensors",
                  on_progress=lambda *a: calls.append(a))
    _check(calls, "comparing")


class _Bar:
    """What ProgressSink uses of a rich Progress, recorded."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.n = 0

    def add_task(self, description: str, **kw: Any) -> int:
        self.n += 1
        self.log.append(("add", description, kw.get("total"), kw.get("completed", 0)))
        return self.n

    def remove_task(self, task: int) -> None:
        self.log.append(("remove", task))

    def reset(self, task: int, **kw: Any) -> None:
        self.log.append(("reset", task, kw.get("total")))

    def update(self, task: int, **kw: Any) -> None:
        self.log.append(("update", task, kw.get("completed"), kw.get("total")))


def test_the_cli_adapter_is_a_progress_with_a_bar_per_phase() -> None:
    from ckpt_cli.cli.progress import ProgressSink

    bar = _Bar()
    first = bar.add_task("validating", total=None)
    sink: Progress = ProgressSink(bar, first)
    sink("crc32", 0, 100)
    sink("crc32", 50, 100)
    sink("values", 0, 0)
    sink("crc32", 100, 100)
    sink("crc32", 0, 80)  # the phase again (the next checkpoint): the bar restarts
    assert bar.log[1:] == [("remove", 1), ("add", "crc32", 100, 0), ("update", 2, 50, 100),
                           ("add", "values", None, 0), ("update", 2, 100, 100),
                           ("reset", 2, 80)]
    ProgressSink()("writing", 1, 2)  # no bar (--quiet, --json, not a terminal): nothing


def test_tally_counts_increments() -> None:
    calls: Calls = []
    t = Tally(lambda *a: calls.append(a), "writing")
    t.start(10)
    t.advance(4)
    t.advance(6)
    assert calls == [("writing", 0, 10), ("writing", 4, 10), ("writing", 10, 10)]
    assert Tally.of(None, "writing") is None
