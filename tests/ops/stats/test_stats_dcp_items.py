"""``stats`` of a DCP checkpoint of many small tensors (issue 46 item 3): their items are read
by runs and recognised from memory (``ops/stats/plain.py``, ``zipshape.ItemValues``). The
figures must be the engine's, tensor by tensor, and an item that is not what its layout
says (a flipped value, a flipped pickle byte) must be reported exactly as the engine reports
it, with the other tensors' figures intact."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from ckpt_cli.ops.stats import StatsOptions, plain, stats
from ckpt_cli.ops.stats.result import figures
from tests.helpers.damage import flip, flip_in_dcp_chunk

pytestmark = pytest.mark.requires_torch


def small_dcp(directory: Path) -> dict[str, torch.Tensor]:
    """A real DCP checkpoint of 60 small tensors of four dtypes and two shapes."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(7)
    sd: dict[str, torch.Tensor] = {}
    for i in range(60):
        dt = (torch.float32, torch.bfloat16, torch.float64, torch.int32)[i % 4]
        shape = (3,) if i % 3 else (2, 5)
        sd[f"layers.{i // 4}.p{i % 4}"] = (torch.randn(shape, generator=g) * 10).to(dt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP warns, then saves one rank
        dcp.save(sd, checkpoint_id=str(directory))
    return sd


def _doc(path: Path) -> dict[str, tuple[dict[str, object] | None, str | None]]:
    res = stats(path, StatsOptions(no_cache=True))
    return {t.name: (figures(t.moments) if t.moments is not None else None, t.error)
            for t in res.checkpoints[0].tensors}


def _engine_only(monkeypatch: pytest.MonkeyPatch, path: Path) -> dict[
        str, tuple[dict[str, object] | None, str | None]]:
    with monkeypatch.context() as m:
        m.setattr(plain, "_whole_item", lambda t: None)  # every item: the engine's path
        return _doc(path)


def test_items_read_by_runs_give_the_engines_figures(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    sd = small_dcp(tmp_path / "ckpt")
    taken: list[int] = []
    real = plain._run_items

    def counted(*a: object) -> int:
        run = a[2]
        taken.append(len(run.names) - len(run.rest))  # type: ignore[attr-defined]
        return real(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(plain, "_run_items", counted)
    fast = _doc(tmp_path / "ckpt")
    assert sum(taken) >= 55  # all but the items that taught the layouts
    assert fast == _engine_only(monkeypatch, tmp_path / "ckpt")
    for name, t in sd.items():  # and the float64 oracle
        got, err = fast[name]
        assert err is None and got is not None
        v = t.to(torch.float64).reshape(-1)
        assert got["numel"] == v.numel()
        assert got["min"] == v.min().item() and got["max"] == v.max().item()
        assert math.isclose(got["mean"], v.mean().item(), rel_tol=1e-12, abs_tol=1e-12)  # type: ignore[arg-type]
        assert math.isclose(got["l2"], v.norm().item(), rel_tol=1e-12)  # type: ignore[arg-type]


@pytest.mark.parametrize("where", ["value", "pickle"])
def test_a_damaged_item_is_reported_as_the_engine_reports_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    small_dcp(tmp_path / "ckpt")
    victim = "layers.9.p0"
    if where == "value":
        flip_in_dcp_chunk(tmp_path / "ckpt", victim, 0, at=4)
    else:  # a byte of the item's pickle: another layout of bytes, never trusted as known
        from ckpt_cli.formats import read_index

        c = read_index(tmp_path / "ckpt").tensors[victim].chunks[0]
        data = (tmp_path / "ckpt" / c.file).read_bytes()[c.offset:c.offset + c.length]
        at = data.index(b"data.pkl") + 60  # into the pickle's payload
        flip(tmp_path / "ckpt" / c.file, c.offset + at, 0x20)
    fast = _doc(tmp_path / "ckpt")
    slow = _engine_only(monkeypatch, tmp_path / "ckpt")
    assert fast == slow
    if where == "value":
        assert fast[victim][0] is None and "CRC-32" in (fast[victim][1] or "")
    assert sum(1 for f, e in fast.values() if f is not None and e is None) >= 59
