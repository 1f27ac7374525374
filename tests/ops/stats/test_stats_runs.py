"""``stats`` reads a batch of small tensors by runs of adjacent byte ranges, one positioned
read per run (``ckpt_cli/ops/stats/batch.py``): the figures, updates and errors must be those
of one read per tensor, on files written by safetensors, on a hand-made file whose tensors are
not aligned to their item size, and on truncated files, which must never be read past the end.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from ckpt_cli.ops.stats import batch, engine
from ckpt_cli.ops.stats import stats as run_stats
from ckpt_cli.ops.stats.options import StatsOptions
from ckpt_cli.storage import access
from ckpt_cli.tensors.source import TensorSource


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    kinds = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int64, np.int8,
             np.uint8, np.bool_]
    for i in range(160):
        kind = kinds[i % len(kinds)]
        values = rng.standard_normal(1 + i % 7) * 3
        out[f"layers.{i // 4}.p{i % 4}.weight"] = values.astype(kind)
    out["layers.2.p0.weight"][0] = np.nan
    out["layers.4.p0.weight"][:] = np.inf
    out["layers.6.p0.weight"] = np.zeros(0, np.float32)
    out["big.weight"] = rng.standard_normal(30_000).astype(np.float32)  # 120 KB: alone
    return out


def _doc(path: Path, **kw: Any) -> dict[str, Any]:
    r = run_stats(path, StatsOptions(no_cache=True, all_tensors=True, hist=True, jobs=2, **kw))
    doc = json.loads(json.dumps(r.to_dict(), default=str))
    doc.pop("read")  # seconds and rates
    for c in doc.get("checkpoints", [doc]):
        c.pop("read", None)
    return doc


def _one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every job through engine._run, one read per tensor (the reading before runs): no
    plain runs (ckpt_cli/ops/stats/plain.py), no batch runs."""
    monkeypatch.setattr(engine, "take_plain",
                        lambda works, *args: ([set() for _ in works], []))
    monkeypatch.setattr(engine, "run_batch",
                        lambda *args: list(range(args[-2], args[-1])))


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Record every positioned read of tensor bytes, checking it lies within its file."""
    seen: list[tuple[str, int, int]] = []
    real = TensorSource.read_into

    def spy(self: TensorSource, rel: str, offset: int, out: memoryview) -> None:
        seen.append((rel, offset, len(out)))
        assert offset + len(out) <= access.size_of(self._fd(rel)), "read past the file's end"
        real(self, rel, offset, out)

    monkeypatch.setattr(TensorSource, "read_into", spy)
    return seen


def test_runs_give_the_figures_of_one_read_per_tensor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.safetensors"
    save_file(_tensors(0), path)
    reads = _reads(monkeypatch)
    by_runs = _doc(path)
    runs = len(reads)
    with monkeypatch.context() as m:
        _one_by_one(m)
        alone = _doc(path)
    assert len(reads) - runs >= 160  # one read per non-empty tensor before
    assert runs <= 4  # the batches' runs, and the large tensor's read
    assert len(by_runs["tensors"]) == 161
    assert by_runs == alone
    nan = next(t for t in by_runs["tensors"] if t["name"] == "layers.2.p0.weight")
    assert nan["nan"] == 1


def test_runs_give_the_updates_of_one_read_per_tensor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "run").mkdir()
    for step in (100, 200, 300):
        tensors = _tensors(step)
        if step == 300:
            tensors["layers.2.p1.weight"][0] = np.nan  # an update that is not finite
        save_file(tensors, tmp_path / "run" / f"step_{step}.safetensors")
    reads = _reads(monkeypatch)
    by_runs = _doc(tmp_path / "run")
    runs = len(reads)
    with monkeypatch.context() as m:
        _one_by_one(m)
        alone = _doc(tmp_path / "run")
    assert runs * 10 < len(reads) - runs
    assert [c["name"] for c in by_runs["checkpoints"]] == [
        "step_100.safetensors", "step_200.safetensors", "step_300.safetensors"]
    assert sum(m.get("update_l2") is not None for m in by_runs["checkpoints"][2]["modules"]) > 30
    assert by_runs == alone


def test_tensors_not_aligned_to_their_item_size(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hand-made header (safetensors itself aligns): F32 and F64 values at odd offsets."""
    values = [np.array([1, 2, 3], np.uint8), np.array([1.5, -2.25], np.float32),
              np.array([3.0, np.pi], np.float64), np.array([7], np.uint8),
              np.array([0.1, 1e30, -4.0], np.float32)]
    codes = {"uint8": "U8", "float32": "F32", "float64": "F64"}
    header: dict[str, Any] = {}
    data = b""
    for i, v in enumerate(values):
        header[f"m.t{i}"] = {"dtype": codes[v.dtype.name], "shape": list(v.shape),
                             "data_offsets": [len(data), len(data) + v.nbytes]}
        data += v.tobytes()
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    by_runs = _doc(path)
    with monkeypatch.context() as m:
        _one_by_one(m)
        alone = _doc(path)
    assert by_runs == alone
    got = {t["name"]: t for t in by_runs["tensors"]}
    assert got["m.t2"]["max"] == np.pi and got["m.t4"]["max"] == np.float32(1e30)
    assert not any(t.get("error") for t in by_runs["tensors"])


@pytest.mark.parametrize("cut", [1, 50, 333])
def test_a_truncated_file_reports_what_it_cannot_read_and_reads_within_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: int) -> None:
    path = tmp_path / "t.safetensors"
    tensors = _tensors(1)
    del tensors["big.weight"]
    save_file(tensors, path)
    os.truncate(path, path.stat().st_size - cut)
    reads = _reads(monkeypatch)
    by_runs = _doc(path)
    with monkeypatch.context() as m:
        _one_by_one(m)
        alone = _doc(path)
    assert reads  # every read within the file (the spy's assertion)
    assert by_runs == alone
    unreadable = [t["name"] for t in by_runs["tensors"] if t.get("error")]
    assert unreadable and all("the file has" in t["error"] for t in by_runs["tensors"]
                              if t.get("error"))
    assert len(unreadable) < len(tensors) - 50  # the tensors before the cut are read
    kinds = [a["kind"] for a in by_runs["anomalies"]]
    assert kinds.count("unreadable") == len(unreadable)


@pytest.mark.parametrize("shrink", ["plain", "batch"])
def test_a_run_whose_read_fails_goes_back_to_one_read_per_tensor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shrink: str) -> None:
    """The file shrinks between the size check and the read: the run's tensors are read
    one by one, and each reports its own error."""
    path = tmp_path / "s.safetensors"
    tensors = _tensors(2)
    del tensors["big.weight"]
    save_file(tensors, path)
    expected = _doc(path)
    real = engine.run_plain
    shrunk: list[int] = []

    def shrink_first(*args: Any) -> Any:
        if not shrunk:
            shrunk.append(path.stat().st_size)
            os.truncate(path, shrunk[0] - 100)
        return real(*args)

    if shrink == "plain":
        monkeypatch.setattr(engine, "run_plain", shrink_first)
    else:  # the batch path's runs (several checkpoints' tensors read in lockstep)
        monkeypatch.setattr(engine, "take_plain",
                            lambda works, *args: ([set() for _ in works], []))
        real = batch._read_runs
        monkeypatch.setattr(batch, "_read_runs", shrink_first)
    got = _doc(path)
    assert shrunk
    errors = [t["name"] for t in got["tensors"] if t.get("error")]
    assert errors and all(t in {x["name"] for x in expected["tensors"]} for t in errors)
    same = [t for t in got["tensors"] if not t.get("error")]
    assert same == [t for t in expected["tensors"] if t["name"] not in errors]
