"""``stats`` of many small tensors (issue 46 item 3): small tensors' jobs run in batches, one
hand-over to a worker thread per batch rather than per tensor, with the figures each job alone
gives; a tensor's histogram is kept as the bins its values span, with the full histogram, its
merges and its cached form what the full list gave.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckpt_cli.ops.stats import engine
from ckpt_cli.ops.stats import stats as run_stats
from ckpt_cli.ops.stats.options import StatsOptions
from ckpt_cli.ops.stats.result import figures
from ckpt_cli.tensors.moments import HIST_BINS, HIST_LO, Moments, piece_moments


def _mixed(path: Path) -> Path:
    rng = np.random.default_rng(0)
    tensors = {f"layers.{i}.w": rng.standard_normal(3 + i % 5).astype(np.float32)
               for i in range(600)}
    tensors["big.weight"] = rng.standard_normal(40_000).astype(np.float32)  # 160 KB: alone
    tensors["layers.7.w"][1] = np.nan
    tensors["layers.9.w"][:] = 0
    save_file(tensors, path)
    return path


def _doc(path: Path, **kw: Any) -> dict[str, Any]:
    r = run_stats(path, StatsOptions(cache=False, everything=True, hist=True, **kw))
    return json.loads(json.dumps(r.to_dict(), default=str))


def test_batched_jobs_give_the_figures_of_one_job_per_tensor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _mixed(tmp_path / "m.safetensors")
    handed: list[int] = []
    real = engine.run_bounded

    def counting(jobs: Any, costs: Any, **kw: Any) -> Any:
        handed.append(len(jobs))
        return real(jobs, costs, **kw)

    monkeypatch.setattr(engine, "run_bounded", counting)
    batched = _doc(path, jobs=2)
    assert handed == [4]  # 601 tensors: 256 + 256 + 88 small ones, then the large one alone
    monkeypatch.setattr(engine, "_SMALL_JOB", 0)  # every job alone, as before
    alone = _doc(path, jobs=2)
    assert handed[-1] == 601
    for doc in (batched, alone):
        doc.pop("read")  # seconds and rates
    assert len(batched["tensors"]) == 601 and batched["modules"]
    assert batched == alone
    assert batched["anomalies"] != []  # the NaN is found either way


def test_batches_keep_order_and_put_a_large_job_alone() -> None:
    small, large = 10, engine._SMALL_JOB
    sizes = [small] * 300 + [large] + [small] * 3 + [large, large]
    got = engine._batches(sizes)
    assert got == [(0, 256), (256, 300), (300, 301), (301, 304), (304, 305), (305, 306)]
    assert engine._batches([]) == []
    many = [engine._BATCH_BYTES // 4 - 1] * 9  # small ones, but 1 MiB together at most
    assert all(sum(many[a:b]) <= engine._BATCH_BYTES for a, b in engine._batches(many))


def _full(m: Moments) -> list[int]:
    return m.hist


@pytest.mark.parametrize("seed", range(5))
def test_compact_histograms_merge_as_full_ones(seed: int) -> None:
    rng = random.Random(seed)
    total = Moments()
    want = [0] * HIST_BINS
    for _ in range(12):
        scale = 2.0 ** rng.randint(-140, 120)
        values = np.array([rng.gauss(0, 1) * scale for _ in range(rng.randint(0, 6))],
                          dtype=np.float64)
        m = piece_moments(values)
        assert len(m.hist_bins) <= HIST_BINS and (not m.hist_bins or (
            m.hist_bins[0] and m.hist_bins[-1]))  # trimmed at both ends
        want = [a + b for a, b in zip(want, _full(m), strict=True)]
        total.merge(m)
        assert total.hist == want
        assert total.tiny == sum(want[:-53 + 150])
    back = Moments.from_list(total.to_list())
    assert back == total and back.hist == want
    lo = next((i for i, c in enumerate(want) if c), 0)
    hi = max((i for i, c in enumerate(want) if c), default=-1) + 1
    assert total.to_list()[11:13] == [lo, want[lo:hi]]  # the cache's form is unchanged
    assert figures(total, hist=True)["hist"] == {
        "first_binade": HIST_LO + lo if any(want) else None, "counts": want[lo:hi]}


def test_a_full_histogram_set_is_kept_compact() -> None:
    m = Moments()
    full = [0] * HIST_BINS
    full[40], full[44] = 3, 1
    m.hist = full
    assert (m.hist_lo, m.hist_bins) == (40, [3, 0, 0, 0, 1]) and m.hist == full
    m.hist = [0] * HIST_BINS
    assert (m.hist_lo, m.hist_bins) == (0, []) and m == Moments()
    with pytest.raises(ValueError, match="histogram bins"):
        m.hist = [0] * (HIST_BINS + 1)


def test_no_garbage_collection_while_it_builds_its_records(tmp_path: Path) -> None:
    """The cyclic collector stays paused while stats builds a record per tensor (each full
    collection walked all of them: a third of the CPU at 10^5 tensors), and is on after."""
    import gc

    path = tmp_path / "tiny.safetensors"
    save_file({f"l.{i // 8}.p{i % 8}": np.ones(1, np.float32) for i in range(20_000)}, path)
    collections: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    opts = StatsOptions(cache=False)
    gc.collect()
    gc.callbacks.append(seen)
    try:
        r = run_stats(path, opts)
    finally:
        gc.callbacks.remove(seen)
    assert len(r.checkpoints[0].tensors) == 20_000
    assert len(collections) <= 1  # the one once it is back on; before: hundreds
    assert gc.isenabled()
    gc.disable()
    try:
        run_stats(path, StatsOptions(cache=False))
        assert not gc.isenabled()  # as it was
    finally:
        gc.enable()
