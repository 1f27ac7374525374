"""``ckpt convert``: hostile and odd sources (named on stderr and in JSON, CRC failures, names
that occur twice, containers and prefixes), destinations it must not replace, and the JSON
output.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_cli.errors import (
    UnsupportedError,
    UsageError,
)
from ckpt_cli.formats import read_index
from ckpt_cli.ops.consolidate import consolidate
from ckpt_cli.ops.convert import convert
from tests.conftest import Golden, run_cli
from tests.helpers.damage import flip_in_entry
from tests.helpers.golden import safetensors_run, stable
from tests.helpers.makers import hf_sharded, tiny_state_dict

pytestmark = pytest.mark.requires_torch


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
        convert(src, tmp_path / "x.safetensors", output_format="pt")


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
