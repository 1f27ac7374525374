"""``convert`` takes DeepSpeed ZeRO checkpoints, as ``consolidate`` does (issue 24, item 8):
the full weights are gathered from the partitions by the same machinery."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpt_cli.ops.consolidate import consolidate
from ckpt_cli.ops.convert import convert
from tests.conftest import requires_deepspeed, run_cli, third_party_quiet

pytestmark = [pytest.mark.requires_torch, requires_deepspeed]


@pytest.mark.parametrize("cfg", ["z1-fp32", "z2-fp32", "z3-fp32", "z2-bf16", "z3-bf16"])
def test_convert_of_a_zero_run_dir_equals_consolidate(ds_dir: Path, tmp_path: Path,
                                                      cfg: str) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    src = ds_dir / cfg  # the save dir with 'latest'
    out = tmp_path / "model.safetensors"
    r = run_cli("convert", src, "--to", "bf16", "-o", out)
    assert r.exit_code == 0, r.output
    assert "latest names global_step3" in r.stderr
    consolidate(src, tmp_path / "c.safetensors", to="bf16", max_shard_size=None)
    got, want = load_file(out), load_file(tmp_path / "c.safetensors")
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    # And against DeepSpeed's own reconstruction, cast with torch.
    with third_party_quiet(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        ref = get_fp32_state_dict_from_zero_checkpoint(str(src))
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v.to(torch.bfloat16)), k


def test_convert_of_a_zero_tag_json_and_options(ds_dir: Path, tmp_path: Path) -> None:
    tag = ds_dir / "z3-fp32" / "global_step3"
    doc = json.loads(run_cli("convert", tag, "--to", "fp16", "--keep-fp32", "1.*", "-o",
                             tmp_path / "m.safetensors", "--json").stdout)
    assert doc["source_format"] == "deepspeed"
    assert doc["metadata"]["ckpt.source_format"] == "deepspeed"
    assert doc["metadata"]["ckpt.step"] == "3"
    assert doc["casts"] == {"F32->F16": 5}  # the LayerNorm's two kept in FP32 by the glob
    dtypes = {t["name"]: t["dtype"] for t in doc["tensors"]}
    assert dtypes["1.weight"] == dtypes["1.bias"] == "F32" and dtypes["0.weight"] == "F16"
    assert any("optimizer moments" in n for n in doc["notes"])
    # --keep-optimizer keeps Adam's moments, uncast, beside the weights.
    r = convert(tag, tmp_path / "all.safetensors", to="bf16", keep_optimizer=True)
    moments = [n for n in r.tensors if n.startswith("optimizer.state.")]
    assert moments and all(r.tensors[n][0] == "F32" for n in moments)
    c = consolidate(tag, tmp_path / "c.safetensors", with_optimizer=True, max_shard_size=None)
    got, want = load_file(tmp_path / "all.safetensors"), load_file(tmp_path / "c.safetensors")
    assert set(got) == set(want) and c.tensors == len(r.tensors)
    for n in moments:
        assert torch.equal(got[n], want[n]), n
