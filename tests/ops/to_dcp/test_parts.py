"""``convert --to dcp --part K/N`` (issue 48): N processes each write their share of the
``.distcp`` files; the last to finish (or ``--finalize``) merges them and writes ``.metadata``.
The merged directory loads through ``dcp.load`` exactly as a one-process output does."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.requires_torch

torch = pytest.importorskip("torch")

from tests.helpers import fsdp_resume as fr  # noqa: E402
from tests.helpers.loads import dcp_dir  # noqa: E402


@pytest.fixture(scope="module")
def train_pt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fr.save_training_dict(tmp_path_factory.mktemp("parts-src") / "train.pt")



def _same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        bits = [bytes(t.reshape(-1).contiguous().view(torch.uint8).numpy()) for t in (a, b)]
        assert bits[0] == bits[1], where
    else:
        assert a == b, where


def _part(cli: Callable[..., Any], src: Path, out: Path, spec: str, *more: str,
          code: int = 0) -> dict[str, Any]:
    r = cli("convert", src, "--to", "dcp", "-o", out, "--part", spec, *more, "--json")
    assert r.exit_code == code, r.output
    doc: dict[str, Any] = json.loads(r.stdout) if code == 0 else {}
    return doc


@pytest.mark.parametrize("layout", ["torchtitan", "recipe"])
def test_three_parts_load_as_one_process_output(train_pt: Path, tmp_path: Path,
                                                cli: Callable[..., Any], layout: str) -> None:
    whole = tmp_path / "whole"
    assert cli("convert", train_pt, "--to", "dcp", "--dcp-layout", layout, "-o",
               whole).exit_code == 0
    out = tmp_path / "out"
    staging = tmp_path / ".out.ckpt-tmp-parts"
    first = _part(cli, train_pt, out, "1/3", "--dcp-layout", layout)
    assert first["part"]["waiting_for"] == [2, 3] and not first["part"]["finalized"]
    assert not out.exists() and staging.is_dir()
    _part(cli, train_pt, out, "3/3", "--dcp-layout", layout)
    last = _part(cli, train_pt, out, "2/3", "--dcp-layout", layout)
    assert last["part"]["finalized_here"] and not staging.exists()
    # As a 3-rank save names its files, and .metadata for the whole.
    names = sorted(p.name for p in out.iterdir())
    assert names == [".metadata", "__0_00.distcp", "__1_00.distcp", "__2_00.distcp"], names
    assert [f["path"] for f in last["files"]][-1] == ".metadata"
    _same(dcp_dir(whole), dcp_dir(out))
    assert cli("validate", out, "--require", "optimizer,step").exit_code == 0
    d = cli("diff", train_pt, out, "--all-tensors")
    assert d.exit_code == 0, d.output


def test_finalize_names_the_missing_part(train_pt: Path, tmp_path: Path,
                                         cli: Callable[..., Any]) -> None:
    out = tmp_path / "out"
    _part(cli, train_pt, out, "2/2")
    r = cli("convert", train_pt, "--to", "dcp", "-o", out, "--finalize")
    assert r.exit_code == 2 and "part 1 of 2 not done" in r.stderr, r.output
    assert "Traceback" not in r.output and not out.exists()
    # Another plan (the other layout) does not mix with the staged one.
    r = cli("convert", train_pt, "--to", "dcp", "--dcp-layout", "recipe", "-o", out,
            "--part", "1/2")
    assert r.exit_code == 2 and "different plan" in r.stderr, r.output
    _part(cli, train_pt, out, "1/2")
    assert (out / ".metadata").is_file()
    # Done: an existing output is replaced only with --force.
    r = cli("convert", train_pt, "--to", "dcp", "-o", out, "--part", "1/2")
    assert r.exit_code == 2 and "exists" in r.stderr


def test_a_damaged_part_is_not_merged(train_pt: Path, tmp_path: Path,
                                      cli: Callable[..., Any]) -> None:
    out = tmp_path / "out"
    _part(cli, train_pt, out, "1/2")
    staged = tmp_path / ".out.ckpt-tmp-parts" / "part-00001" / "__0_00.distcp"
    staged.write_bytes(staged.read_bytes()[:-10])
    r = cli("convert", train_pt, "--to", "dcp", "-o", out, "--part", "2/2")
    assert r.exit_code == 2 and "part 1 did not write what the plan gives" in r.stderr, r.output
    assert "not the size its receipt gives" in r.stderr and not out.exists()
    _part(cli, train_pt, out, "1/2")  # rerun the damaged part: it finalizes
    assert (out / ".metadata").is_file()


def test_more_parts_than_tensors(train_pt: Path, tmp_path: Path) -> None:
    import ckpt_cli
    from ckpt_cli.parts import Part

    out = tmp_path / "out"
    results = [ckpt_cli.convert(train_pt, out, to="dcp", part=Part(k, 30))
               for k in range(1, 31)]
    assert results[-1].write.part is not None and results[-1].write.part.finalized_here
    # 26 tensors (25 and torchtitan's step), one a part, the plain values with part 1:
    # parts 27-29 wrote nothing, part 30 only the merged output.
    assert [k for k, r in enumerate(results[:-1], 1) if r.write.files] == list(range(1, 27))
    whole = tmp_path / "whole"
    ckpt_cli.convert(train_pt, whole, to="dcp")
    _same(dcp_dir(whole), dcp_dir(out))


def test_object_storage_output_is_refused(train_pt: Path, tmp_path: Path,
                                          cli: Callable[..., Any]) -> None:
    r = cli("convert", train_pt, "--to", "dcp", "-o", "s3://bucket/out", "--part", "1/2")
    assert r.exit_code == 2 and "part needs a local (shared) output directory" in r.stderr
