"""``ckpt convert`` on real checkpoints: values, names, dtypes, sharding, safety."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpt_cli.errors import (
    CkptError,
    DestinationExistsError,
    UnsupportedError,
    UsageError,
)
from ckpt_cli.formats import read_index
from ckpt_cli.ops.consolidate import consolidate
from ckpt_cli.ops.convert import cast_array, convert
from tests.conftest import Golden, run_cli, third_party_quiet
from tests.helpers.damage import flip_in_entry
from tests.helpers.golden import safetensors_run, stable
from tests.helpers.makers import hf_sharded, tiny_state_dict

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
    convert(sample_run / "step_000200", out, fmt="pt")
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



class _Hostile:
    """Pickles as ``os.system(<cmd>)``; ckpt must never run it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_hostile_source_is_named_on_stderr_and_in_json(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    src = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(3)}, "payload": _Hostile(marker)}, src)
    out = tmp_path / "out.safetensors"
    r = run_cli("convert", src, "-o", out, "--quiet")
    assert r.exit_code == 0, r.stderr
    assert not marker.exists()
    assert torch.equal(load_file(out)["w"], torch.ones(3))
    qual = next(q for q in ("posix.system", "os.system") if q in r.stderr)
    assert (f"warning: {src} references {qual}; its tensors were extracted without running "
            "it; treat the source as hostile") in r.stderr
    r = run_cli("convert", src, "-o", tmp_path / "out2.safetensors", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [(w["code"], w["severity"], w["location"]) for w in doc["warnings"]] == [
        ("hostile-source", "warning", qual)]
    assert "treat the source as hostile" in r.stderr


def test_clean_source_has_no_hostile_warning(tmp_path: Path) -> None:
    src = tmp_path / "clean.pt"
    torch.save({"model": {"w": torch.ones(3)}, "step": 3}, src)
    res = convert(src, tmp_path / "out.safetensors")
    assert res.warnings == []


def test_torchscript_shaped_source_is_named_hostile(tmp_path: Path) -> None:
    import zipfile

    marker = tmp_path / "pwned"
    src = tmp_path / "ts.pt"
    torch.save({"w": torch.ones(2)}, src)
    with zipfile.ZipFile(src) as zf:
        entries = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    entries["ts/code/__torch__.py"] = b"def forward(self, x):\n    return x\n"
    entries["ts/constants.pkl"] = pickle.dumps((_Hostile(marker),), protocol=2)
    with zipfile.ZipFile(src, "w", zipfile.ZIP_STORED) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    res = convert(src, tmp_path / "out.safetensors")
    assert not marker.exists()
    assert [w.code for w in res.warnings] == ["hostile-source"]
    assert "is a TorchScript archive" in res.warnings[0].message
    assert "system" in res.warnings[0].message


def sample_dir_with_shards(tmp_path: Path) -> Path:
    d = tmp_path / "shards"
    d.mkdir()
    hf_sharded(d, tiny_state_dict(), max_shard_size=2000)
    return d


def test_force_does_not_wipe_a_directory_of_other_files(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    save_file(tiny_state_dict(), str(src))
    out = tmp_path / "out"
    (out / "photos").mkdir(parents=True)
    (out / "photos" / "cat.jpg").write_bytes(b"meow")
    r = run_cli("convert", src, "-o", out, "--force")
    assert r.exit_code == 2 and "holds more than checkpoint files" in r.stderr
    assert (out / "photos" / "cat.jpg").read_bytes() == b"meow"
    shutil.rmtree(out / "photos")
    convert(src, out)  # an empty directory holds nothing to lose: no --force needed
    assert (out / "model.safetensors").is_file()
    assert run_cli("convert", src, "-o", out).exit_code == 2  # now it holds an output
    assert run_cli("convert", src, "-o", out, "--force").exit_code == 0
    # Text and JSON files are not checkpoint files just because of their suffix.
    for precious in ("notes.txt", "results.json"):
        (out / precious).write_text("keep me")
        r = run_cli("convert", src, "-o", out, "--force")
        assert r.exit_code == 2 and precious in r.stderr
        assert (out / precious).read_text() == "keep me"
        (out / precious).unlink()
    # What ckpt itself writes there (shards, index, manifest, config) may be replaced.
    r = run_cli("consolidate", sample_dir_with_shards(tmp_path), "--max-shard-size", "1KB",
                "-o", out, "--force")
    assert r.exit_code == 0, r.output
    (out / "config.json").write_text("{}")
    assert run_cli("convert", src, "-o", out, "--force").exit_code == 0
    # Checkpoints ckpt never writes into a directory are not its to replace.
    for other in ("__0_0.distcp", ".metadata", "last.ckpt", "model_optim_rng.pt", "train.bin",
                  "adapter_model.safetensors"):
        (out / other).write_bytes(b"precious")
        r = run_cli("convert", src, "-o", out, "--force")
        assert r.exit_code == 2 and other in r.stderr, r.output
        assert (out / other).read_bytes() == b"precious"
        (out / other).unlink()


def test_force_does_not_replace_a_file_with_a_directory(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    save_file(tiny_state_dict(), str(src))
    notes = tmp_path / "NOTES"  # no extension: the output would be a directory
    notes.write_text("keep me")
    r = run_cli("convert", src, "-o", notes, "--force")
    assert r.exit_code == 2 and "is a file" in r.stderr and "NOTES" in r.stderr, r.output
    assert notes.read_text() == "keep me"


def test_output_cannot_be_an_input_shard(tmp_path: Path) -> None:
    (tmp_path / "exp").mkdir()
    hf_sharded(tmp_path / "exp", tiny_state_dict(), max_shard_size=1200)
    shard = sorted((tmp_path / "exp").glob("model-*.safetensors"))[0]
    before = shard.read_bytes()
    with pytest.raises(UsageError, match="would overwrite the input file"):
        convert(tmp_path / "exp" / "model.safetensors.index.json", shard, overwrite=True)
    assert shard.read_bytes() == before


def test_format_follows_the_file_name(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    save_file(tiny_state_dict(), str(src))
    convert(src, tmp_path / "model.pt")
    assert torch.load(tmp_path / "model.pt", weights_only=True).keys() == tiny_state_dict().keys()
    with pytest.raises(UsageError, match="does not match the file name"):
        convert(src, tmp_path / "x.safetensors", fmt="pt")


def test_dtypes_the_output_cannot_hold(tmp_path: Path) -> None:
    torch.save({"c": torch.ones(3, dtype=torch.complex128)}, tmp_path / "c.pt")
    with pytest.raises(UnsupportedError, match="safetensors cannot hold C128"):
        convert(tmp_path / "c.pt", tmp_path / "c.safetensors")
    convert(tmp_path / "c.pt", tmp_path / "c_out.pt")  # torch can
    got = torch.load(tmp_path / "c_out.pt", weights_only=True)
    assert torch.equal(got["c"], torch.ones(3, dtype=torch.complex128))


def test_replacing_a_file_drops_its_stale_manifest(sample_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "one.safetensors"
    consolidate(sample_run / "step_000400", out, max_shard_size=None)
    assert (tmp_path / "one.safetensors.ckpt-manifest.json").is_file()
    convert(sample_run / "step_000100", out, overwrite=True)
    assert not (tmp_path / "one.safetensors.ckpt-manifest.json").exists()
    assert run_cli("validate", out).exit_code == 0


def test_convert_refuses_bytes_that_fail_their_crc(tmp_path: Path) -> None:
    src = tmp_path / "a.pt"
    torch.save({"model": {"w": torch.randn(1000, 100), "b": torch.randn(100)}}, src)
    key = next(k for k, v in read_index(src).tensors.items() if v.shape == (1000, 100))
    storage = read_index(src).tensors[key].storage
    assert storage is not None
    flip_in_entry(src, f"data/{storage.key}", 5000)
    for to, ext in (("keep", "safetensors"), ("fp16", "safetensors"), ("keep", "pt")):
        out = tmp_path / f"o-{to}.{ext}"
        r = run_cli("convert", src, "--to", to, "-o", out)
        assert r.exit_code == 2 and "CRC-32" in r.stderr and "a.pt" in r.stderr, r.output
        assert not out.exists()


def test_files_saved_with_crc_turned_off_convert(tmp_path: Path) -> None:
    # torch.serialization.set_crc32_options(False) records CRC 0: no checksum, not a mismatch.
    src = tmp_path / "nocrc.pt"
    sd = {"w": torch.randn(300, 40), "b": torch.randn(40)}
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(sd, src)
    finally:
        torch.serialization.set_crc32_options(True)
    with zipfile.ZipFile(src) as zf:
        assert {i.CRC for i in zf.infolist() if "/data/" in i.filename} == {0}
    out = tmp_path / "o.safetensors"
    r = run_cli("convert", src, "-o", out)
    assert r.exit_code == 0, r.output
    got = load_file(out)
    assert torch.equal(got["w"], sd["w"]) and torch.equal(got["b"], sd["b"])


def test_convert_keeps_model_tensors_outside_containers(tmp_path: Path) -> None:
    enc, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    src = tmp_path / "eh.pt"
    torch.save({"encoder": enc.state_dict(), "head.weight": head.weight.data,
                "head.bias": head.bias.data}, src)
    out = tmp_path / "eh.safetensors"
    assert run_cli("convert", src, "-o", out).exit_code == 0
    assert sorted(load_file(out)) == ["encoder.bias", "encoder.weight", "head.bias",
                                      "head.weight"]
    # Submodules of a pickled nn.Module are parts of one model, not alternatives.
    model = torch.nn.Sequential()
    model.add_module("body", torch.nn.Linear(3, 3))
    model.add_module("lm_head", torch.nn.Linear(3, 2))
    torch.save(model, tmp_path / "module.pt")
    out = tmp_path / "module.safetensors"
    r = run_cli("convert", tmp_path / "module.pt", "-o", out)
    assert r.exit_code == 0, r.output
    assert sorted(load_file(out)) == ["body.bias", "body.weight", "lm_head.bias",
                                      "lm_head.weight"]


def test_nested_wrapper_prefixes_are_all_stripped(tmp_path: Path) -> None:
    lin = torch.nn.Linear(3, 3)
    src = tmp_path / "cd.pt"  # torch.compile(DDP(model)).state_dict()
    torch.save({"model": {"_orig_mod.module." + k: v for k, v in lin.state_dict().items()}}, src)
    out = tmp_path / "cd.safetensors"
    assert run_cli("convert", src, "-o", out).exit_code == 0
    assert sorted(load_file(out)) == ["bias", "weight"]


def test_convert_refuses_names_that_occur_twice(tmp_path: Path) -> None:
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for r in range(2):
        torch.save({"l1.w": torch.full((2,), float(r)), "l2.w": torch.ones(2)},
                   ranks / f"rank_{r}.pt")
    found = {f.code for f in read_index(ranks).findings}
    assert "duplicate-name" in found
    for extra in ((), ("--keep-optimizer",)):
        r = run_cli("convert", ranks, "-o", tmp_path / "o.safetensors", *extra)
        assert r.exit_code == 2 and "occur twice" in r.stderr and "one at a time" in r.stderr
    assert not (tmp_path / "o.safetensors").exists()
    # One warning per file, however many names it shares.
    dups = [f for f in read_index(ranks).findings if f.code == "duplicate-name"]
    assert len(dups) == 1 and dups[0].file == "rank_1.pt" and "2 tensor name(s)" in dups[0].message
    # safetensors files in one directory too.
    st = tmp_path / "st"
    st.mkdir()
    save_file({"a.w": torch.ones(2)}, str(st / "x.safetensors"))
    save_file({"a.w": torch.zeros(2)}, str(st / "y.safetensors"))
    assert [f.code for f in read_index(st).findings] == ["duplicate-name"]
    assert run_cli("convert", st, "-o", tmp_path / "st.safetensors").exit_code == 2


def test_scalars_beside_a_state_dict_do_not_keep_its_prefix(tmp_path: Path) -> None:
    # The PyTorch tutorial's "general checkpoint": a loss tensor beside model_state_dict.
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    torch.save({"epoch": 5, "model_state_dict": net.state_dict(), "optimizer_state_dict": {},
                "loss": torch.tensor(0.3), "step": torch.tensor(100)}, tmp_path / "t.pt")
    out = tmp_path / "t.safetensors"
    assert run_cli("convert", tmp_path / "t.pt", "-o", out).exit_code == 0
    assert sorted(load_file(out)) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    # torchtitan: the model's weights at the top level, the step under train_state.
    torch.save({**net.state_dict(), "train_state": {"step": torch.tensor(7)}},
               tmp_path / "titan.pt")
    out = tmp_path / "titan.safetensors"
    assert run_cli("convert", tmp_path / "titan.pt", "-o", out).exit_code == 0
    assert sorted(load_file(out)) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_a_left_out_container_may_hold_tensors_ckpt_cannot_write(tmp_path: Path) -> None:
    src = tmp_path / "m.pt"
    torch.save({"model": {"w": torch.ones(2)}, "ema": {"w": torch.empty(2, device="meta")}},
               src)
    for extra in ((), ("--container", "model")):
        out = tmp_path / f"o{len(extra)}.safetensors"
        r = run_cli("convert", src, "-o", out, *extra)
        assert r.exit_code == 0, r.output
        assert list(load_file(out)) == ["w"]


def test_fp64_clamp_rounds_once(tmp_path: Path) -> None:
    import numpy as np

    x = 1 + 2**-11 + 2**-40  # rounds to 1.0 through FP32, to 1 + 2**-10 directly
    src = tmp_path / "f64.pt"
    torch.save({"w": torch.tensor([x, 1e6, 1e39, -1e300], dtype=torch.float64),
                "v": torch.tensor([x], dtype=torch.float64)}, src)
    out = tmp_path / "o.safetensors"
    r = run_cli("convert", src, "--to", "fp16", "--clamp", "-o", out)
    assert r.exit_code == 0, r.output
    got = load_file(out)
    assert got["w"][0].item() == got["v"][0].item() == 1 + 2**-10
    assert got["w"][1:].tolist() == [65504.0, 65504.0, -65504.0]
    assert np.isfinite(got["w"].float().numpy()).all()


def test_golden_json(tmp_path: Path, golden: Golden, monkeypatch: pytest.MonkeyPatch) -> None:
    """``convert --json`` is a contract: a byte-exact input gives the same report."""
    run = safetensors_run(tmp_path)
    # Relative paths: the source path is recorded in the file, so an absolute one would make
    # the output's size depend on where pytest puts tmp_path.
    monkeypatch.chdir(tmp_path)
    src = run.relative_to(tmp_path) / "step_000300" / "model.safetensors"
    r = run_cli("convert", src, "-o", "out.pt", "--to", "fp16", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    # A torch zip holds a random serialization id (as torch's own files do), whose decimal
    # length varies: the file's size is checked against the disk instead of the golden file.
    (entry,) = doc["files"]
    assert entry["bytes"] == (tmp_path / "out.pt").stat().st_size
    entry["bytes"] = "<varies>"
    golden("convert_to_pt.json", doc, stable(tmp_path))
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert got["w"].dtype == torch.float16 and got["b"].dtype == torch.int64
