"""Hostile input to ``ckpt stats`` and to the writers that share its readers (issue 46): a
DCP ``.metadata`` declaring a tensor of 2^62 elements, written with torch's own DCP classes.
Each must end with an error naming the file and the problem, never a loop run to the declared
size or an internal error."""

from __future__ import annotations

import builtins
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_cli.ops.stats import StatsOptions, engine, stats
from tests.conftest import run_cli
from tests.helpers.damage import edit_dcp_metadata

pytestmark = pytest.mark.requires_torch

HUGE = 2**31  # [HUGE, HUGE]: 2^62 elements, 2^64 bytes of F32: past any file's offsets


def huge_dcp(directory: Path) -> Path:
    """A real DCP checkpoint whose ``.metadata`` then declares ``w`` as F32[2^31, 2^31]."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP warns, then saves one rank
        dcp.save({"w": torch.randn(4, 4), "b": torch.randn(4)}, checkpoint_id=str(directory))

    def grow(md: Any) -> None:
        tm = md.state_dict_metadata["w"]
        tm.size = torch.Size([HUGE, HUGE])
        for c in tm.chunks:
            c.sizes = torch.Size([HUGE, HUGE])

    edit_dcp_metadata(directory, grow)
    return directory


def _bounded_range(limit: int) -> Any:
    """``range`` for the engine's module, failing once more than ``limit`` values were
    taken from one loop: a loop run to a declared 2^62 elements fails this at once."""

    def counted(*args: int) -> Iterator[int]:
        for k, v in enumerate(builtins.range(*args)):
            if k >= limit:
                raise AssertionError(f"a loop ran past {limit:,} windows: {args}")
            yield v

    return counted


def test_stats_of_a_dcp_declaring_2_62_elements_ends(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    d = huge_dcp(tmp_path / "ckpt")
    monkeypatch.setattr(engine, "range", _bounded_range(1000), raising=False)
    res = stats(d, StatsOptions(no_cache=True))
    assert res.exit_code == 1
    [a] = res.anomalies
    assert a.kind == "unreadable" and "F32[2147483648, 2147483648]" in a.message
    assert res.bytes_read == 4 * 4  # what was there: b's values, not the 2^64 declared


def test_stats_cli_names_the_tensor_and_exits_1(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    d = huge_dcp(tmp_path / "ckpt")
    monkeypatch.setattr(engine, "range", _bounded_range(1000), raising=False)
    r = run_cli("stats", d, "--no-cache")
    assert r.exit_code == 1, r.stdout + r.stderr
    assert "unreadable" in r.stdout and "metadata says F32[2147483648, 2147483648]" in r.stdout


@pytest.mark.parametrize(("command", "output"), [("convert", "out.safetensors"),
                                                 ("convert", "out.pt"),
                                                 ("consolidate", "full")])
def test_writers_refuse_a_tensor_no_file_can_hold(tmp_path: Path, command: str,
                                                  output: str) -> None:
    d = huge_dcp(tmp_path / "ckpt")
    r = run_cli(command, d, "-o", tmp_path / output)
    assert r.exit_code == 2, r.stdout + r.stderr
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"{output}: tensor 'w' of shape [2147483648, 2147483648]" in err
    assert "more than a file can hold" in err
    assert not (tmp_path / output).exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary left either
