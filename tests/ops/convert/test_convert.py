"""``ckpt convert`` on real checkpoints: values, names, dtypes, sharding, safety."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpt_cli.errors import (
    CkptError,
    DestinationExistsError,
    UsageError,
)
from ckpt_cli.formats import read_index
from ckpt_cli.ops.convert import cast_array, convert
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.makers import tiny_state_dict

pytestmark = pytest.mark.requires_torch


def sha(path: Path) -> str:
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def test_training_checkpoint_to_fp16_safetensors(sample_run: Path, tmp_path: Path) -> None:
    src = sample_run / "step_000100"
    before = sha(src)
    out = tmp_path / "model.safetensors"
    r = run_cli("convert", src, "--to", "fp16", "-o", out)
    assert r.exit_code == 0, r.stderr
    assert sha(src) == before, "the input must not change"
    ref = torch.load(src / "checkpoint.pt", weights_only=True)["model"]
    got = load_file(out)
    # The tied output head is written once; safetensors metadata records the alias.
    assert set(got) == set(ref) - {"lm_head.weight"}
    for k, v in got.items():
        want = ref[k].half() if ref[k].is_floating_point() else ref[k]
        assert v.dtype == want.dtype and torch.equal(v, want), k
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["lm_head.weight"] == "wte.weight"
    assert meta["format"] == "pt" and meta["ckpt.source_format"] == "dir"
    assert meta["ckpt.step"] == "100" and "to=fp16" in meta["ckpt.conversion"]
    assert "dropped: optimizer 84, other 1" in meta["ckpt.conversion"]


def test_bf16_cast_is_bit_exact_with_torch() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(10_000, generator=g) * 1e3, torch.tensor(
        [0.0, -0.0, 1e-40, 3.4e38, -3.4e38, float("inf"), float("-inf"), 65504.0, 1.0 + 2**-8,
         1.0 + 3 * 2**-9])])
    ours = cast_array(x.numpy(), "BF16")
    theirs = x.to(torch.bfloat16)
    assert torch.equal(torch.from_numpy(ours.view(np.uint16).astype(np.int32)),
                       theirs.view(torch.int16).to(torch.int32) & 0xFFFF)
    ours16 = cast_array(x[:10_000].numpy() / 1e3, "F16")
    assert torch.equal(torch.from_numpy(ours16), (x[:10_000] / 1e3).half())


def test_fp16_overflow_refused_clamped_or_kept_fp32(tmp_path: Path) -> None:
    sd = tiny_state_dict()
    sd["layers.0.mlp.fc.weight"][0, :3] = torch.tensor([1e5, -7e4, 6e4])
    src = tmp_path / "in.safetensors"
    save_file(sd, str(src))
    out = tmp_path / "out.safetensors"
    r = run_cli("convert", src, "--to", "fp16", "-o", out)
    assert r.exit_code == 2
    assert "2 value(s) exceed FP16's range" in r.stderr and "layers.0.mlp.fc.weight" in r.stderr
    assert not out.exists() and not list(tmp_path.glob(".*ckpt-tmp*"))
    r = run_cli("convert", src, "--to", "fp16", "--clamp", "-o", out)
    assert r.exit_code == 0, r.stderr
    w = load_file(out)["layers.0.mlp.fc.weight"]
    assert w[0, :3].tolist() == [65504.0, -65504.0, 60000.0]
    out2 = tmp_path / "out2.safetensors"
    r = run_cli("convert", src, "--to", "fp16", "--keep-fp32", "*.fc.*", "-o", out2)
    assert r.exit_code == 0, r.stderr
    got = load_file(out2)
    assert got["layers.0.mlp.fc.weight"].dtype == torch.float32
    assert torch.equal(got["layers.0.mlp.fc.weight"], sd["layers.0.mlp.fc.weight"])
    assert got["embed.weight"].dtype == torch.float16
    assert got["layers.0.norm.num_batches_tracked"].dtype == torch.int64  # ints untouched


def test_lightning_and_wrapper_prefixes(lightning_dir: Path, tmp_path: Path) -> None:
    ck = sorted(lightning_dir.glob("epoch=*-step=*.ckpt"))[-1]
    r = convert(ck, tmp_path / "pl.safetensors")
    assert r.renamed == ["removed container prefix 'state_dict.'"]
    ref = torch.load(ck, weights_only=False)["state_dict"]
    got = load_file(tmp_path / "pl.safetensors")
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    # DDP + torch.compile wrappers are removed unless --keep-prefix.
    sd = {f"module._orig_mod.{k}": v for k, v in tiny_state_dict().items()}
    torch.save({"model": sd, "step": 3}, tmp_path / "ddp.pt")
    r = convert(tmp_path / "ddp.pt", tmp_path / "ddp.safetensors")
    assert set(load_file(tmp_path / "ddp.safetensors")) == set(tiny_state_dict())
    assert r.renamed[1:] == ["removed wrapper prefix 'module.'",
                             "removed wrapper prefix '_orig_mod.'"]
    convert(tmp_path / "ddp.pt", tmp_path / "kept.safetensors", keep_prefix=True)
    assert set(load_file(tmp_path / "kept.safetensors")) == set(sd)


def test_several_containers(tmp_path: Path) -> None:
    ema = {k: v + 1 for k, v in tiny_state_dict().items()}
    torch.save({"model": tiny_state_dict(), "ema": ema, "optimizer": {}}, tmp_path / "c.pt")
    r = convert(tmp_path / "c.pt", tmp_path / "a.safetensors")
    assert any("took 'model'" in n for n in r.notes)
    convert(tmp_path / "c.pt", tmp_path / "b.safetensors", container="ema")
    got = load_file(tmp_path / "b.safetensors")
    assert torch.equal(got["embed.weight"], ema["embed.weight"])
    with pytest.raises(UsageError, match=r"^container 'nope' not found") as e:
        convert(tmp_path / "c.pt", tmp_path / "c.safetensors", container="nope")
    assert e.value.param == "container"  # the CLI words it --container


def test_dcp_to_sharded_safetensors(sample_run: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = sample_run / "step_000400"
    out = tmp_path / "export"
    r = convert(src, out, to="bf16", max_shard_size=150_000)
    assert r.write.index_file == "model.safetensors.index.json"
    index = json.loads((out / r.write.index_file).read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == r.write.tensor_bytes
    with third_party_quiet():
        dcp_to_torch_save(src, tmp_path / "ref.pt")
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)["model"]
    for name, shard in index["weight_map"].items():
        got = load_file(out / shard)[name]
        assert torch.equal(got, ref[name].to(torch.bfloat16)), name
    assert read_index(out).findings == []


def test_pt_output_loads_with_torch(sample_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.pt"
    convert(sample_run / "step_000200", out, output_format="pt")
    for mmap in (False, True):
        sd = torch.load(out, weights_only=True, mmap=mmap)
        ref = torch.load(sample_run / "step_000200" / "checkpoint.pt", weights_only=True)["model"]
        assert sd.keys() == ref.keys()
        assert all(torch.equal(sd[k], ref[k]) for k in ref)
        # torch.save writes tied weights once; so does ckpt (one storage, two keys).
        assert sd["lm_head.weight"].data_ptr() == sd["wte.weight"].data_ptr()


def test_hf_trainer_checkpoint_loads_in_transformers(hf_trainer_dir: Path, tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    src = hf_trainer_dir / "checkpoint-4"
    out = tmp_path / "hf16"
    r = convert(src, out, to="fp16", max_shard_size=20_000)
    assert "config.json" in {n for n, _ in r.write.files}
    with third_party_quiet():
        ref = GPT2LMHeadModel.from_pretrained(src).eval()
        got = GPT2LMHeadModel.from_pretrained(out, dtype=torch.float16).eval()
    ids = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        a = ref(ids).logits
        b = got.float()(ids).logits
    assert torch.allclose(a, b, atol=5e-2, rtol=1e-2)
    sd = got.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()


def test_keep_optimizer_is_a_pure_format_change(sample_run: Path, tmp_path: Path) -> None:
    src = sample_run / "step_000100" / "checkpoint.pt"
    out = tmp_path / "all.safetensors"
    r = convert(src, out, keep_optimizer=True, to="bf16")
    index = read_index(src)
    got = load_file(out)
    assert set(got) | set(r.aliases) == {n for n, t in index.tensors.items() if t.kind == "dense"}
    assert got["optimizer.state.0.exp_avg"].dtype == torch.float32  # optimizer not cast
    assert got["model.wte.weight"].dtype == torch.bfloat16
    with safe_open(str(out), "pt") as f:
        objects = json.loads(f.metadata()["ckpt.objects"])
    assert objects["step"] == 100 and objects["optimizer.param_groups.0.weight_decay"] == 0.1


def test_refusals(sample_run: Path, sample_copy: Path, tmp_path: Path) -> None:
    (sample_copy / "latest").unlink()  # with it, convert reads the checkpoint it names
    r = run_cli("convert", sample_copy, "-o", tmp_path / "x")
    assert r.exit_code == 2 and "run directory" in r.stderr
    r = run_cli("convert", sample_run / "step_000100", "-o", sample_run / "step_000100" / "x")
    assert r.exit_code == 2 and "inside the input" in r.stderr
    r = run_cli("convert", sample_run / "step_000100", "--to", "int4", "-o", tmp_path / "x")
    assert r.exit_code == 2 and "--to must be" in r.stderr
    r = run_cli("convert", sample_run / "step_000100", "--max-shard-size", "lots",
                "-o", tmp_path / "x")
    assert r.exit_code == 2 and "--max-shard-size" in r.stderr
    r = run_cli("convert", sample_run / "step_000100", "--max-shard-size", "100KB",
                "-o", tmp_path / "one.safetensors")
    assert r.exit_code == 2 and "give -o a directory" in r.stderr
    out = tmp_path / "exists"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier export")
    with pytest.raises(DestinationExistsError):
        convert(sample_run / "step_000100", out)
    assert (out / "model.safetensors").read_bytes() == b"an earlier export"
    p = tmp_path / "garbage.pt"
    p.write_bytes(b"PK\x03\x04garbage")
    r = run_cli("convert", p, "-o", tmp_path / "g")
    assert r.exit_code == 2 and "garbage.pt" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "g").exists()


def test_truncated_input_leaves_no_output(tmp_path: Path) -> None:
    src = tmp_path / "in.safetensors"
    save_file(tiny_state_dict(), str(src))
    src.write_bytes(src.read_bytes()[:-64])
    with pytest.raises(CkptError):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_json_output(sample_run: Path, tmp_path: Path) -> None:
    r = run_cli("convert", sample_run / "step_000100", "--to", "bf16", "-o", tmp_path / "o",
                "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema_version"] == 1 and doc["command"] == "convert"
    assert doc["casts"] == {"F32->BF16": 29} and doc["aliases"] == {"lm_head.weight": "wte.weight"}
    assert doc["files"][0]["path"] == "model.safetensors" and doc["num_tensors"] == 29


def _big_input(tmp_path: Path) -> Path:
    src = tmp_path / "big.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({f"w{i}": torch.randn(2048, 2048, generator=g) for i in range(24)}, str(src))
    return src


# Runs `ckpt convert ARGS...` (the real CLI: its signal handling, atomic_dir, writers) with one
# change: once the first shard holds tensor data, the writer stops there, touches MARKER and
# waits to be signalled. The test signals only after seeing MARKER, so the signal always lands
# mid-write; polling for a shard and signalling at once used to race the commit (the whole
# write takes about a second, and a loaded machine can stall the test that long).
_PAUSED_CONVERT = """
import os, signal, sys, time
from pathlib import Path
import ckpt_cli.writers.files as writers

# Ctrl-C as at a terminal, even when the test runner was started with SIGINT ignored (a
# shell's background job): an ignored SIGINT is inherited, and Python keeps it ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
marker, real, calls = Path(sys.argv[1]), writers.write_all, [0]

def write_all(f, data):
    real(f, data)
    calls[0] += 1
    if calls[0] == 2:  # the first shard's header, then its first piece of tensor data
        marker.touch()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.01)
        os._exit(3)  # never signalled: fail without committing anything

writers.write_all = write_all
sys.argv = ["ckpt", "convert", *sys.argv[2:]]
from ckpt_cli.cli.app import main
main()
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_killed_mid_write_leaves_no_output(tmp_path: Path, sig: signal.Signals) -> None:
    src = _big_input(tmp_path)
    before = sha(src)
    out = tmp_path / "out"
    marker = tmp_path / "writing"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-c", _PAUSED_CONVERT, str(marker), str(src), "--to",
                          "fp16", "--max-shard-size", "20MB", "-o", str(out), "--quiet"],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not marker.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            _, err = p.communicate(timeout=60)
            pytest.fail(f"the conversion never started writing: {err.decode()}")
        time.sleep(0.005)
    # Mid-write, and held there until signalled: a temporary directory, a shard with data in
    # it, no output yet.
    (tmp,) = tmp_path.glob(".out.ckpt-tmp-*")
    assert any(f.stat().st_size > 0 for f in tmp.glob("*.safetensors")) and not out.exists()
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert not out.exists(), "a killed conversion must leave no output"
    assert sha(src) == before
    leftovers = list(tmp_path.glob(".out.ckpt-tmp-*"))
    if sig == signal.SIGKILL:
        # Nothing can clean up after SIGKILL; what remains is hidden and named as temporary.
        assert p.returncode == -signal.SIGKILL
        assert all(p.name.startswith(".") for p in leftovers)
    else:
        # 143 after SIGTERM, 130 after Ctrl-C (SIGINT), the conventional codes
        want = 143 if sig == signal.SIGTERM else 130
        assert p.returncode == want and leftovers == [], err.decode()


def test_convert_does_not_import_torch(tmp_path: Path) -> None:
    from tests.ops.inspect.test_inspect_cli import _imports_torch

    save_file(tiny_state_dict(), str(tmp_path / "m.safetensors"))
    imported, tail = _imports_torch("convert", str(tmp_path / "m.safetensors"), "--to", "bf16",
                                    "-o", str(tmp_path / "o.safetensors"))
    assert not imported and "EXIT=0" in tail, tail


@pytest.mark.parametrize("src_name,to", [("step_000100", "fp16"), ("step_000400", "bf16"),
                                         ("step_000300", "keep")])
def test_round_trip_proven_by_ckpt_diff(sample_run: Path, tmp_path: Path, src_name: str,
                                        to: str) -> None:
    src = sample_run / src_name
    out = tmp_path / "out"
    r = run_cli("convert", src, "--to", to, "--max-shard-size", "200KB", "-o", out)
    assert r.exit_code == 0, r.stderr
    d = run_cli("diff", src, out, "--json")
    assert d.exit_code == 0, d.stdout + d.stderr
    doc = json.loads(d.stdout)
    assert doc["equal"] is True
    statuses = {t["status"] for t in doc["tensors"]}
    assert statuses <= {"identical", "within_tolerance"}
    if to != "keep":
        assert "within_tolerance" in statuses  # casts are rounding, judged with FP16/BF16 ulps
    # A value changed after conversion is caught.
    shard = sorted(out.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert run_cli("diff", src, out).exit_code == 1
