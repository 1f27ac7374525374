"""The output's kind follows its name: a known extension is a file, no extension a directory,
and an extension ckpt does not write is refused (issue 24, item 11)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import save_file

from ckpt_cli.formats import read_index
from tests.conftest import run_cli
from tests.helpers.makers import hf_sharded, tiny_state_dict

pytestmark = pytest.mark.requires_torch


@pytest.fixture
def src(tmp_path: Path) -> Path:
    path = tmp_path / "m.safetensors"
    save_file(tiny_state_dict(), str(path))
    return path


@pytest.mark.parametrize("command", ["convert", "consolidate"])
@pytest.mark.parametrize("name", ["out/model.safetenors", "out/x.txt", "model.onnx", "m.h5"])
def test_unknown_extension_is_refused(src: Path, tmp_path: Path, command: str,
                                      name: str) -> None:
    source = src if command == "convert" else _shards(tmp_path)
    out = tmp_path / name
    r = run_cli(command, source, "-o", out)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "unknown output extension" in lines[0] and out.suffix in lines[0]
    assert ".safetensors, .pt, .pth, .bin or .ckpt" in lines[0]
    assert not out.exists() and not out.parent.joinpath("model.safetensors").exists()
    assert "Traceback" not in r.output


@pytest.mark.parametrize("name", ["checkpoint-1.5", "step_0001.00", "export", "run.my_run"])
def test_names_without_an_extension_are_directories(src: Path, tmp_path: Path,
                                                    name: str) -> None:
    out = tmp_path / name
    r = run_cli("convert", src, "--to", "fp16", "-o", out)
    assert r.exit_code == 0, r.output
    assert (out / "model.safetensors").is_file()
    assert read_index(out / "model.safetensors").tensors["head.weight"].dtype == "F16"


def test_a_trailing_slash_or_an_existing_directory_says_directory(src: Path,
                                                                  tmp_path: Path) -> None:
    r = run_cli("convert", src, "-o", f"{tmp_path / 'export.v2'}/")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "export.v2" / "model.safetensors").is_file()
    existing = tmp_path / "model.final"
    existing.mkdir()
    r = run_cli("consolidate", _shards(tmp_path), "-o", existing)
    assert r.exit_code == 0, r.output
    assert (existing / "model.safetensors").is_file()
    # A file name that ends in a slash is contradictory: refused, nothing written.
    r = run_cli("convert", src, "-o", f"{tmp_path / 'y.safetensors'}/")
    assert r.exit_code == 2 and "ends in '/'" in r.stderr, r.output
    assert not (tmp_path / "y.safetensors").exists()


def _shards(tmp_path: Path) -> Path:
    d = tmp_path / "shards"
    if not d.exists():
        d.mkdir()
        hf_sharded(d, tiny_state_dict(), max_shard_size=1200)
    return d


def test_an_upper_case_extension_and_a_directory_named_like_a_file_are_refused_clearly(
        tmp_path: Path) -> None:
    import torch

    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(2)}, src)
    r = run_cli("convert", src, "-o", tmp_path / "x.PT")
    assert r.exit_code == 2 and "lower case" in r.output and "'.pt'" in r.output, r.output
    (tmp_path / "taken.safetensors").mkdir()
    r = run_cli("convert", src, "-o", tmp_path / "taken.safetensors", "--overwrite")
    assert r.exit_code == 2 and "an existing directory" in r.output, r.output
    assert not (tmp_path / "x.PT").exists() and not any((tmp_path / "taken.safetensors").iterdir())


@pytest.mark.parametrize("command", ["convert", "consolidate"])
def test_a_ckpt_name_is_a_torch_file(src: Path, tmp_path: Path, command: str) -> None:
    # Lightning's extension: a torch file, as torch.load reads it.
    import torch

    source = src if command == "convert" else _shards(tmp_path)
    out = tmp_path / "model.ckpt"
    r = run_cli(command, source, "-o", out)
    assert r.exit_code == 0, r.output
    assert out.is_file()
    loaded = torch.load(out, weights_only=True)
    assert set(loaded) == set(tiny_state_dict())
    assert torch.equal(loaded["head.weight"], tiny_state_dict()["head.weight"])
    assert run_cli("validate", out).exit_code == 0
    # --format safetensors contradicts the name: refused, as for .pt.
    r = run_cli(command, source, "-o", tmp_path / "other.ckpt", "--format", "safetensors")
    assert r.exit_code == 2 and "does not match the file name" in r.stderr
