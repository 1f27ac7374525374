"""``convert`` takes DeepSpeed ZeRO checkpoints, as ``consolidate`` does (issue 24, item 8):
the full weights are gathered from the partitions by the same machinery."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckpt_cli.ops.consolidate import consolidate
from ckpt_cli.ops.convert import convert
from tests.conftest import requires_deepspeed, run_cli, third_party_quiet

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

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


def test_convert_of_one_zero3_rank_file_is_refused(ds_dir: Path, tmp_path: Path) -> None:
    # One rank's ZeRO-3 model states hold empty placeholders for the weights: converting it
    # would write shape-[0] tensors. Refused, pointing at what convert does gather.
    tag = ds_dir / "z3-fp32" / "global_step3"
    rank = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    out = tmp_path / "x.safetensors"
    r = run_cli("convert", rank, "--to", "fp16", "-o", out)
    assert r.exit_code == 2, r.output
    assert not out.exists()
    assert "Traceback" not in r.output and "ZeRO-3" in r.stderr
    assert str(tag) in r.stderr
    # consolidate's hint does not send the user to that conversion either.
    r = run_cli("consolidate", rank, "-o", out)
    assert r.exit_code == 2, r.output
    assert f"ckpt convert {rank}" not in r.stderr and f"ckpt consolidate {tag}" in r.stderr
    # ZeRO-1/2's single model-states file holds the full weights: still converted.
    z2 = ds_dir / "z2-fp32" / "global_step3" / "mp_rank_00_model_states.pt"
    r = run_cli("convert", z2, "--to", "fp16", "-o", tmp_path / "z2.safetensors")
    assert r.exit_code == 0, r.output
    assert all(v.numel() > 0 for v in load_file(tmp_path / "z2.safetensors").values())


def test_conversion_metadata_spells_to_as_the_option(ds_dir: Path, tmp_path: Path) -> None:
    src = ds_dir / "z2-fp32"
    a = convert(src, tmp_path / "a.safetensors", to="fp16")
    consolidate(src, tmp_path / "b.safetensors", to="fp16", max_shard_size=None)
    assert "to=fp16" in a.metadata["ckpt.conversion"]
    with safe_open(tmp_path / "b.safetensors", "np") as f:
        meta = f.metadata()
    assert "to=fp16" in meta["ckpt.conversion"], meta


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_convert_of_a_trainer_deepspeed_checkpoint_copies_its_hf_files(
        ds_dir: Path, tmp_path: Path) -> None:
    # HF Trainer + DeepSpeed: config.json, generation_config.json and the tokenizer files lie
    # beside `latest` and global_stepN/, not in the tag directory the weights come from.
    from transformers import GenerationConfig, GPT2Config

    ckpt = tmp_path / "checkpoint-3"
    shutil.copytree(ds_dir / "z2-fp32", ckpt)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    cfg.torch_dtype = torch.float32
    with third_party_quiet():
        cfg.save_pretrained(ckpt)
        GenerationConfig(max_new_tokens=4).save_pretrained(ckpt)
    (ckpt / "tokenizer_config.json").write_text('{"model_max_length": 32}\n')
    before = json.loads((ckpt / "config.json").read_text())
    assert before.get("dtype", before.get("torch_dtype")) == "float32"
    out = tmp_path / "out"
    r = run_cli("convert", ckpt, "--to", "fp16", "-o", out)
    assert r.exit_code == 0, r.output
    assert {p.name for p in out.iterdir()} >= {"model.safetensors", "config.json",
                                               "generation_config.json",
                                               "tokenizer_config.json"}
    after = json.loads((out / "config.json").read_text())
    assert after.get("dtype", after.get("torch_dtype")) == "float16"
    assert "Config: config.json dtype float32 -> float16" in r.stdout
