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

from ckpt_cli.ops.stats import engine, plain
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
    r = run_stats(path, StatsOptions(no_cache=True, all_tensors=True, hist=True, **kw))
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
    assert handed == [2]  # 601 tensors: 600 small ones in one run, then the large one alone
    monkeypatch.setattr(plain, "SMALL", 0)  # no runs of plain tensors
    by_jobs = _doc(path, jobs=2)
    assert handed[-1] == 4  # 256 + 256 + 88 small jobs, then the large one alone
    monkeypatch.setattr(engine, "_SMALL_JOB", 0)  # every job alone, as before
    alone = _doc(path, jobs=2)
    assert handed[-1] == 601
    for doc in (batched, by_jobs, alone):
        doc.pop("read")  # seconds and rates
    assert len(batched["tensors"]) == 601 and batched["modules"]
    assert batched == by_jobs == alone
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

    opts = StatsOptions(no_cache=True)
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
        run_stats(path, StatsOptions(no_cache=True))
        assert not gc.isenabled()  # as it was
    finally:
        gc.enable()


@pytest.mark.parametrize("kernel", ["compiled", "numpy"])
def test_a_run_of_tiny_tensors_is_one_kernel_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    """Issue 46 item 3: a header of many tiny tensors costs one kernel call per run of them
    (per dtype), not one per tensor, with each tensor's figures what a call of its own
    gives; the numpy fallback (no compiled kernel) gives the same."""
    from ckpt_cli.tensors import moments

    moments._compiled.cache_clear()
    if kernel == "numpy":
        monkeypatch.setenv("CKPT_NO_COMPILED_MOMENTS", "1")
    elif moments.moments_kernel() != "compiled":
        pytest.skip("the compiled moments kernel is not built")
    rng = np.random.default_rng(5)
    tensors = {f"l.{i // 8}.p{i % 8}": rng.standard_normal(1 + i % 3).astype(
        np.float16 if i % 5 == 0 else np.float32) for i in range(3000)}
    tensors["l.4.p1"][0] = np.inf
    tensors["l.9.p3"] = np.zeros(0, np.float32)
    path = tmp_path / "tiny.safetensors"
    save_file(tensors, path)
    calls: list[int] = []
    real_run, real_piece = plain.run_moments, plain.piece_moments
    monkeypatch.setattr(plain, "run_moments",
                        lambda buf, dt, spans: calls.append(len(spans)) or real_run(buf, dt,
                                                                                    spans))
    monkeypatch.setattr(plain, "piece_moments",
                        lambda arr: calls.append(-1) or real_piece(arr))
    try:
        r = run_stats(path, StatsOptions(no_cache=True))
        assert sorted(calls) == [599, 2400]  # the F16 tensors, the F32 ones (l.9.p3: none)
        got = {t.name: t.moments for t in r.checkpoints[0].tensors}
        for name, values in tensors.items():
            want = piece_moments(values) if values.size else Moments()
            assert repr(got[name]) == repr(want), name
        assert got["l.4.p1"].posinf == 1
    finally:
        # The kernel choice is cached for the process: forget the numpy one only once the
        # variable is gone (piece_moments above chose again), or every later test in this
        # process computes with numpy and differs in the last bit from a fresh process.
        monkeypatch.delenv("CKPT_NO_COMPILED_MOMENTS", raising=False)
        moments._compiled.cache_clear()


@pytest.mark.parametrize("seed", range(4))
def test_bytes_read_count_each_byte_once_however_many_ranges(seed: int) -> None:
    """The bytes read are the union of the tensors' byte ranges, clipped to the file: many
    ranges are merged with numpy, and give what the range by range walk gives."""
    from ckpt_cli.model import CheckpointIndex, FileInfo, TensorInfo
    from ckpt_cli.ops.stats.extent import distinct_bytes

    rng = random.Random(seed)
    size = rng.choice([900, 5000])
    tensors = []
    for k in range(rng.choice([10, 300])):
        start, n = rng.randrange(0, 1000), rng.randrange(0, 40)
        tensors.append(TensorInfo(f"t{k}", "U8", (n,), n, file="a", offset=start))
    covered = set()
    for t in tensors:
        covered.update(range(min(t.offset or 0, size), min((t.offset or 0) + t.nbytes, size)))
    index = CheckpointIndex("safetensors", Path("/x"), Path("/x"),
                            files=[FileInfo("a", size, "weights")])
    assert distinct_bytes(index, tensors) == len(covered)
