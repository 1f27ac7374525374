"""Distributed checkpoints (formats/dcp): ranks, chunks and their checks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ckpt_cli.errors import CkptError
from ckpt_cli.formats import read_index
from ckpt_cli.ops.convert import convert
from tests.conftest import run_cli
from tests.helpers import damage


def test_truncated_rank_file_stops_convert(sample_copy: Path, tmp_path: Path) -> None:
    d = sample_copy / "step_000400"
    (d / "__3_0.distcp").write_bytes((d / "__3_0.distcp").read_bytes()[:100])
    with pytest.raises(CkptError, match=r"__3_0\.distcp"):
        convert(d, tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


def test_chunks_that_do_not_tile_are_damage() -> None:
    from ckpt_cli.formats.dcp import tiling_problems

    whole = [((0, 0), (2, 4)), ((2, 0), (2, 4))]
    assert tiling_problems((4, 4), whole) == []
    assert "a gap" in tiling_problems((4, 4), whole[:1])[0]
    assert "overlap" in tiling_problems((4, 4), [*whole, ((1, 0), (2, 4))])[-1]
    assert "outside" in tiling_problems((4, 4), [((3, 0), (2, 4))])[0]
    # One chunk: the whole tensor (the shortcut) or not.
    assert tiling_problems((4, 4), [((0, 0), (4, 4))]) == []
    assert tiling_problems((), [((), ())]) == []
    assert tiling_problems((0, 4), [((0, 0), (0, 4))]) == []
    assert "a gap" in tiling_problems((4, 4), [((0, 0), (4, 3))])[0]
    assert "outside" in tiling_problems((4, 4), [((0, 0), (5, 4))])[0]
    assert "dimensions" in tiling_problems((4, 4), [((0,), (4,))])[0]


def test_consolidate_refuses_a_dcp_chunk_that_fails_its_crc(sample_copy: Path,
                                                            tmp_path: Path) -> None:
    d = sample_copy / "step_000400"
    file = damage.flip_in_dcp_chunk(d, "model.wte.weight", 1)
    r = run_cli("consolidate", d, "-o", tmp_path / "out", "--verify")
    assert r.exit_code == 2 and "CRC-32" in r.stderr and file in r.stderr, r.output
    assert not (tmp_path / "out").exists()


def test_a_stray_distcp_file_is_not_a_rank(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"
    shutil.copy(d / "__0_0.distcp", d / "__9_0.distcp")
    layout = read_index(d).layout
    assert layout["world_size"] == 4 and layout["ranks"] == [0, 1, 2, 3]


def test_row_chunks_only_for_a_split_along_the_first_dimension() -> None:
    from ckpt_cli.formats.dcp import row_chunks
    from ckpt_cli.model import Chunk, TensorInfo

    def tensor(*chunks: tuple[tuple[int, int], tuple[int, int]]) -> TensorInfo:
        cs = [Chunk(o, s, "__0_0.distcp", 16 * i, 16) for i, (o, s) in enumerate(chunks)]
        return TensorInfo("w", "F32", (4, 3), 48, chunks=cs)

    located: list[int] = []

    def locate(c: Chunk) -> TensorInfo:
        located.append(c.offsets[0])
        return TensorInfo("w", "F32", c.sizes, 4 * c.sizes[0] * c.sizes[1], file=c.file,
                          offset=c.offset)

    rows = tensor(((2, 0), (2, 3)), ((0, 0), (2, 3)))  # stored out of order
    subs = row_chunks(rows, locate)
    assert subs is not None and [s.offset for s in subs] == [16, 0] and located == [0, 2]
    located.clear()
    assert row_chunks(tensor(((0, 0), (4, 2)), ((0, 2), (4, 1))), locate) is None  # columns
    assert row_chunks(tensor(((0, 0), (2, 3)),), locate) is None  # rows missing
    assert located == []  # decided from the metadata, no embedded zip parsed
