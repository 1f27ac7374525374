"""Every reader, on files written by the real libraries; values read back equal torch's."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_cli import dtypes
from ckpt_cli.errors import (
    CkptError,
    CorruptCheckpointError,
    UnknownFormatError,
)
from ckpt_cli.formats import detect, read_index
from ckpt_cli.tensors.source import iter_tensors
from tests.conftest import requires_deepspeed, run_cli, third_party_quiet
from tests.helpers.makers import (
    hf_sharded,
    megatron_legacy,
    tiny_state_dict,
    training_checkpoint,
)

pytestmark = pytest.mark.requires_torch

ALL_TORCH_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                    torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                    torch.float8_e5m2fnuz, torch.uint16, torch.uint32, torch.uint64]


def as_torch(arr: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Reinterpret ckpt's numpy values as a torch tensor of ``like``'s dtype (bit-exact)."""
    raw = torch.from_numpy(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).copy())
    return raw.view(like.dtype).reshape(like.shape)


def lookup(tree: object, name: str) -> torch.Tensor:
    """Find a flattened name in a nested state dict whose keys may themselves contain dots."""
    def walk(node: object, parts: list[str]) -> object:
        if not parts:
            return node
        for n in range(len(parts), 0, -1):
            key = ".".join(parts[:n])
            if isinstance(node, dict):
                for k in (key, int(key) if key.isdigit() else None):
                    if k is not None and k in node:
                        found = walk(node[k], parts[n:])
                        if found is not None:
                            return found
            elif isinstance(node, (list, tuple)) and n == 1 and key.isdigit():
                return walk(node[int(key)], parts[1:])
        return None

    found = walk(tree, name.split("."))
    assert isinstance(found, torch.Tensor), name
    return found


def all_dtype_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {}
    for d in ALL_TORCH_DTYPES:
        base = torch.randn(3, 5, generator=g) * 4
        out[str(d).removeprefix("torch.")] = base.to(d)
    return out


def test_safetensors_every_dtype_round_trips(tmp_path: Path) -> None:
    sd = all_dtype_tensors()
    path = tmp_path / "all.safetensors"
    save_file(sd, str(path), metadata={"step": "12", "format": "pt"})
    index = read_index(path)
    assert index.format == "safetensors"
    assert index.findings == []
    assert index.metadata["step"] == 12
    assert {t.dtype for t in index.tensors.values()} == {
        dtypes.from_torch_name(str(d)).code for d in ALL_TORCH_DTYPES}  # type: ignore[union-attr]
    for info, arr in iter_tensors(index):
        ref = sd[info.name]
        assert info.shape == tuple(ref.shape)
        assert info.nbytes == ref.numel() * ref.element_size()
        assert torch.equal(as_torch(arr, ref), ref), info.name


def test_torch_zip_views_ties_and_parameters(tmp_path: Path) -> None:
    emb = torch.randn(10, 4)
    w = torch.nn.Parameter(torch.randn(4, 3))
    obj = {"model": {"emb": emb, "head": emb, "row": emb[3], "wt": w.data.t(), "w": w,
                     "slice": emb[2:5, 1:3]},
           "optimizer": {"state": {0: {"exp_avg": torch.randn(4, 3), "step": torch.tensor(3.0)}},
                         "param_groups": [{"lr": 0.02, "params": [0]}]},
           "step": 7, "epoch": 1}
    path = tmp_path / "train.pt"
    torch.save(obj, path)
    index = read_index(path)
    assert index.format == "torch"
    assert index.metadata["step"] == 7 and index.metadata["lr"] == 0.02
    assert index.tensors["model.head"].storage == index.tensors["model.emb"].storage
    assert index.tensors["model.wt"].stride == (1, 3)
    assert index.tensors["optimizer.state.0.exp_avg"].group == "optimizer"
    assert index.tensors["model.w"].group == "model"
    for info, arr in iter_tensors(index):
        ref = lookup(obj, info.name)
        assert torch.equal(torch.from_numpy(arr), ref.detach()), info.name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float16])
def test_torch_zip_exotic_dtypes(tmp_path: Path, dtype: torch.dtype) -> None:
    t = (torch.randn(6, 2) * 3).to(dtype)
    torch.save({"t": t, "v": t[1:4]}, tmp_path / "x.pt")
    index = read_index(tmp_path / "x.pt")
    for info, arr in iter_tensors(index):
        ref = {"t": t, "v": t[1:4]}[info.name]
        assert torch.equal(as_torch(arr, ref), ref)


def test_legacy_torch_format(tmp_path: Path) -> None:
    ck = training_checkpoint()
    path = tmp_path / "legacy.pt"
    torch.save(ck, path, _use_new_zipfile_serialization=False)
    index = read_index(path)
    assert index.files[0].format == "torch-legacy"
    assert index.metadata["step"] == 100
    assert index.num_parameters == sum(v.numel() for v in ck["model"].values())
    for info, arr in iter_tensors(index):
        assert torch.equal(torch.from_numpy(arr), lookup(ck, info.name)), info.name


def test_groups_and_counts_of_a_training_checkpoint(tmp_path: Path) -> None:
    ck = training_checkpoint()
    torch.save(ck, tmp_path / "ck.pt")
    index = read_index(tmp_path / "ck.pt")
    model_bytes = sum(v.numel() * v.element_size() for v in ck["model"].values())
    opt_bytes = sum(v.numel() * v.element_size() for s in ck["optimizer"]["state"].values()
                    for v in s.values())
    assert index.bytes_by_group["model"] == model_bytes
    assert index.bytes_by_group["optimizer"] == opt_bytes
    assert index.metadata == {"step": 100, "epoch": 2, "lr": 0.001}


def test_buffers_are_their_own_group(tmp_path: Path) -> None:
    save_file(tiny_state_dict(), str(tmp_path / "m.safetensors"))
    index = read_index(tmp_path / "m.safetensors")
    assert index.tensors["layers.0.norm.running_mean"].group == "buffer"
    assert index.tensors["layers.0.norm.num_batches_tracked"].group == "buffer"
    assert index.tensors["embed.weight"].group == "model"


def test_hf_sharded_written_by_huggingface_hub(tmp_path: Path) -> None:
    sd = tiny_state_dict()
    hf_sharded(tmp_path, sd, max_shard_size=1200)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert detect(tmp_path).name == "hf-index"
    index = read_index(tmp_path)
    assert index.layout["shards"] > 1
    assert index.findings == []
    assert set(index.tensors) == set(sd)
    for info, arr in iter_tensors(index):
        assert torch.equal(as_torch(arr, sd[info.name]), sd[info.name])


def test_hf_index_missing_shard_and_escape(tmp_path: Path) -> None:
    hf_sharded(tmp_path, tiny_state_dict(), max_shard_size=1200)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    index = read_index(tmp_path)
    assert any(f.code == "missing-shard" and f.file == shard.name for f in index.findings)
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text('{"metadata": {}, "weight_map": {"a": "../../etc/passwd.safetensors"}}')
    with pytest.raises(CkptError, match="leaves the checkpoint directory"):
        read_index(tmp_path)


def test_dcp_written_by_four_processes(sample_run: Path) -> None:
    d = sample_run / "step_000400"
    assert detect(d).name == "dcp"
    index = read_index(d)
    assert index.layout["world_size"] == 4
    assert index.metadata["step"] == 400
    sharded = [t for t in index.tensors.values() if len(t.chunks) == 4]
    assert sharded, "FSDP2 should have split tensors across the 4 ranks"
    # Values equal what torch's own DCP loader assembles.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = d.parent.parent / "dcp_as_torch.pt"
    if not out.exists():
        dcp_to_torch_save(d, out)
    ref = torch.load(out, weights_only=False)
    assert dcp  # imported for the side effect of registering planners
    for info, arr in iter_tensors(index):
        assert torch.equal(torch.from_numpy(arr), lookup(ref, info.name)), info.name


def test_dcp_without_metadata_is_unfinished(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"
    (d / ".metadata").unlink()
    with pytest.raises(CorruptCheckpointError, match="save did not finish"):
        read_index(d)


def test_dcp_path_escape_refused(sample_copy: Path, tmp_path: Path) -> None:
    d = sample_copy / "step_000400"
    raw = (d / ".metadata").read_bytes()
    # Rewrite one relative_path so it points outside the directory (same length keeps the
    # pickle's framing valid).
    evil = raw.replace(b"__0_0.distcp", b"../../xx.dcp", 1)
    assert evil != raw and len(evil) == len(raw)
    (d / ".metadata").write_bytes(evil)
    with pytest.raises(CkptError, match="leaves the checkpoint directory"):
        read_index(d)


def test_torch_steps_of_the_sample(sample_run: Path) -> None:
    index = read_index(sample_run / "step_000100")
    assert index.format == "dir"
    assert index.metadata["step"] == 100
    assert index.bytes_by_group["optimizer"] > index.bytes_by_group["model"]
    tensors = index.tensors
    assert tensors["model.lm_head.weight"].storage == tensors["model.wte.weight"].storage


def test_lightning_checkpoint(lightning_dir: Path) -> None:
    ck = sorted(lightning_dir.glob("epoch=*-step=*.ckpt"))[-1]
    index = read_index(ck)
    assert index.flavor == "lightning"
    assert index.metadata["step"] == 4
    assert "pytorch-lightning_version" in index.metadata
    assert index.metadata["hyper_parameters"] == {"hidden": 8}
    assert index.tensors["state_dict.net.weight"].group == "model"
    assert any(t.group == "optimizer" for t in index.tensors.values())


def test_hf_trainer_checkpoint_dir(hf_trainer_dir: Path) -> None:
    d = hf_trainer_dir / "checkpoint-4"
    index = read_index(d)
    assert index.format == "dir" and index.flavor == "hf-trainer"
    assert index.metadata["step"] == 4
    roles = {f.role for f in index.files}
    assert {"weights", "optimizer", "scheduler", "rng", "args", "metadata"} <= roles
    assert index.bytes_by_group["optimizer"] > 0
    # training_args.bin is a full pickle of TrainingArguments: read as data, never executed.
    assert any(f.code == "non-allowlisted-global" and "TrainingArguments" in f.message
               for f in index.findings)


@requires_deepspeed
@pytest.mark.parametrize("cfg,stage", [("z1-fp32", 1), ("z2-fp32", 2), ("z3-fp32", 3),
                                       ("z2-bf16", 2), ("z3-bf16", 3)])
def test_deepspeed_layouts(ds_dir: Path, cfg: str, stage: int) -> None:
    tag = ds_dir / cfg / "global_step3"
    assert detect(tag).name == "deepspeed"
    index = read_index(tag)
    assert index.layout["zero_stage"] == stage
    assert index.layout["world_size"] == 2
    assert index.metadata["step"] == 3
    assert index.num_parameters == 7 * 13 + 13 + 13 + 13 + 13 * 5 + 5
    assert not [f for f in index.findings if f.severity == "error"]


@requires_deepspeed
@pytest.mark.parametrize("cfg", ["z3-fp32", "z3-bf16"])
def test_zero3_master_weights_count_as_model_weights(ds_dir: Path, cfg: str) -> None:
    tag = ds_dir / cfg / "global_step3"
    index = read_index(tag)
    params = 7 * 13 + 13 + 13 + 13 * 5 + 5 + 13
    master = index.layout["master_weights"]
    assert master["parameters"] == params and master["partitions"] == 2
    assert master["dtype"] == "F32" and master["consolidated_bytes"] == 4 * params
    # The flat partitions are padded to a multiple of the world size.
    assert master["elements"] == params + master["padding"] and master["elements"] % 2 == 0
    groups = index.bytes_by_group
    assert groups["model"] == master["bytes"] == 4 * master["elements"]
    assert groups["optimizer"] > 0 and index.num_parameters == params
    # Every rank's copy of the module's buffer is a buffer, not a weight.
    assert {t.group for n, t in index.tensors.items() if n.endswith("counter")} == {"buffer"}
    out = " ".join(run_cli("inspect", tag).stdout.split())  # rich wraps the row
    assert "F32 master weights in 2 flat partitions" in out
    assert f"{params} parameters, {4 * params} Bytes once consolidated" in out
    assert "master_weights" not in read_index(ds_dir / "z2-fp32" / "global_step3").layout


def test_megatron_legacy(tmp_path: Path) -> None:
    d = megatron_legacy(tmp_path, tp=2, pp=2)
    assert detect(d).name == "megatron"
    index = read_index(d)
    assert index.layout == {"tp": 2, "pp": 2, "ep": 1, "world_size": 4}
    assert index.metadata["step"] == 500
    assert index.metadata["args"]["tensor_model_parallel_size"] == 2
    assert not [f for f in index.findings if f.severity == "error"]
    shutil.rmtree(d / "mp_rank_01_001")
    index = read_index(d)
    assert any(f.code == "missing-rank" for f in index.findings)


@pytest.mark.parametrize("content,match", [
    (b"", "empty file"),
    (b"hello world, not a checkpoint", "unrecognised file"),
    (b"\x00" * 64, "unrecognised file"),
])
def test_garbage_files(tmp_path: Path, content: bytes, match: str) -> None:
    p = tmp_path / "x.safetensors"
    p.write_bytes(content)
    with pytest.raises(UnknownFormatError, match=match):
        read_index(p)


def test_truncated_torch_zip(tmp_path: Path) -> None:
    p = tmp_path / "t.pt"
    torch.save(training_checkpoint(), p)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated or was not fully written"):
        read_index(p)


def test_zip_central_directory_offset_damaged(tmp_path: Path) -> None:
    """Regression: a bad central-directory offset made zipfile hand back negative local-header
    offsets, and os.pread raised OSError (an internal error) instead of a corrupt-file error."""
    p = tmp_path / "t.pt"
    torch.save(training_checkpoint(), p)
    data = bytearray(p.read_bytes())
    eocd = data.rfind(b"PK\x06\x06")  # the ZIP64 end record torch writes
    data[eocd + 48] ^= 0x04  # its central-directory offset
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="outside the file"):
        read_index(p)


def test_truncated_legacy_torch_file(tmp_path: Path) -> None:
    """Regression: a legacy file cut inside its last storage's bytes read as whole."""
    p = tmp_path / "old.pt"
    torch.save({"a": torch.ones(100), "b": torch.zeros(100)}, p,
               _use_new_zipfile_serialization=False)
    p.write_bytes(p.read_bytes()[:-40])
    index = read_index(p)
    assert [f.code for f in index.findings if f.severity == "error"] == ["missing-storage"]


def test_truncated_safetensors_header_and_data(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    save_file(tiny_state_dict(), str(p))
    data = p.read_bytes()
    p.write_bytes(data[:-10])
    index = read_index(p)
    assert any(f.code == "truncated" for f in index.findings)
    p.write_bytes(data[:20])
    with pytest.raises(CkptError):
        read_index(p)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CkptError, match="no such file or directory"):
        read_index(tmp_path / "nope.pt")


def test_hf_hub_cache_symlinks_are_read(tmp_path: Path) -> None:
    """The hub cache links each shard of snapshots/<rev>/ to ../../blobs/<hash>."""
    (tmp_path / "plain").mkdir()
    hf_sharded(tmp_path / "plain", tiny_state_dict(), max_shard_size=1200)
    snap = tmp_path / "cache" / "snapshots" / "abc123"
    blobs = tmp_path / "cache" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in (tmp_path / "plain").iterdir():
        blob = blobs / f"{abs(hash(f.name)):x}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    index = read_index(snap)
    assert index.format == "hf-index" and index.findings == []
    assert len(index.tensors) == len(tiny_state_dict())


def test_a_tensor_in_two_shards_is_reported(tmp_path: Path) -> None:
    hf_sharded(tmp_path, tiny_state_dict(), max_shard_size=1200)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    first, second = load_file(shards[0]), load_file(shards[1])
    name = next(iter(first))
    second[name] = first[name]  # a stale copy left in another shard
    save_file(second, str(shards[1]), metadata={"format": "pt"})
    index = read_index(tmp_path)
    assert any(f.code == "duplicate-tensor" and f.location == name for f in index.findings)
    assert run_cli("validate", tmp_path).exit_code == 1


@pytest.mark.parametrize("fmt", ["dcp", "deepspeed", "megatron", "dir"])
def test_directory_format_forced_on_a_file(tmp_path: Path, fmt: str) -> None:
    p = tmp_path / "x.pt"
    torch.save({"a": torch.zeros(2)}, p)
    for argv in (("inspect", p, "-F", fmt), ("validate", p, "-F", fmt),
                 ("convert", p, "-F", fmt, "-o", tmp_path / "o"),
                 ("diff", p, p, "--input-format-a", fmt)):
        r = run_cli(*argv)
        assert r.exit_code == 2 and "is not a directory" in r.stderr, (argv, r.output)


def test_gpt2_parameters_are_counted_like_transformers(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    with third_party_quiet():
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                           n_positions=16))
    torch.save(model.state_dict(), tmp_path / "gpt2.pt")
    index = read_index(tmp_path / "gpt2.pt")
    assert index.tensors["transformer.h.0.attn.c_attn.bias"].group == "model"
    assert index.num_parameters == model.num_parameters()  # the tied head counts once


def test_hf_dir_with_both_weight_formats(tmp_path: Path) -> None:
    # Older save_pretrained outputs and hub repos hold model.safetensors and pytorch_model.bin.
    sd = tiny_state_dict()
    d = tmp_path / "hf"
    d.mkdir()
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    torch.save(sd, d / "pytorch_model.bin")
    (d / "config.json").write_text("{}")
    index = read_index(d)
    codes = [f.code for f in index.findings]
    assert "duplicate-weights" in codes and "duplicate-name" not in codes, codes
    assert sorted(index.tensors) == sorted(sd)
    out = tmp_path / "o.safetensors"
    assert run_cli("convert", d, "-o", out).exit_code == 0
    assert sorted(load_file(out)) == sorted(sd)


def test_tied_weights_count_once_everywhere(tmp_path: Path) -> None:
    emb = torch.randn(10, 4)
    torch.save({"embed.weight": emb, "head.weight": emb, "b": torch.zeros(3)}, tmp_path / "t.pt")
    index = read_index(tmp_path / "t.pt")
    assert index.num_parameters == 43 and index.params_by_dtype == {"F32": 43}
    assert index.bytes_by_group["model"] == 43 * 4 == index.total_bytes


def test_read_full_says_how_much_a_short_file_gave(tmp_path: Path) -> None:
    from ckpt_cli.storage import open_regular, read_full

    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(10)))
    fd = open_regular(p)
    try:
        buf = bytearray(4)
        assert read_full(fd, 3, memoryview(buf)) == 4 and bytes(buf) == bytes([3, 4, 5, 6])
        assert read_full(fd, 8, memoryview(bytearray(4))) == 2
    finally:
        os.close(fd)
