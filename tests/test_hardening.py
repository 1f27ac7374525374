"""Regression tests for problems found in review: hostile or damaged inputs and risky outputs."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_cli.errors import CkptError, CorruptCheckpointError, UnsupportedError, UsageError
from ckpt_cli.formats import read_index
from ckpt_cli.formats.unpickler import classify_global, safe_load
from ckpt_cli.ops.consolidate import consolidate
from ckpt_cli.ops.convert import convert
from ckpt_cli.writers.torchzip import TorchZipWriter
from tests.conftest import requires_deepspeed, run_cli
from tests.helpers.makers import hf_sharded, tiny_state_dict


def _replace_pickle(path: Path, data: bytes) -> None:
    with zipfile.ZipFile(path) as zf:
        entries = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    entries[next(n for n in entries if n.endswith("data.pkl"))] = data
    with zipfile.ZipFile(path, "w") as zf:
        for name, payload in entries.items():
            zf.writestr(name, payload)


# --- the safe unpickler ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["torch.storage._load_from_bytes",
                                  "torch.fx.graph_module._forward_from_src",
                                  "torch.utils.cpp_extension.load_inline",
                                  "torch.hub.load_state_dict_from_url",
                                  "numpy.distutils.exec_command.exec_command",
                                  "__builtin__.setattr", "__builtin__.globals"])
def test_code_execution_gadgets_are_dangerous(name: str) -> None:
    assert classify_global(name) == "dangerous"


def test_shared_lists_do_not_explode(tmp_path: Path) -> None:
    """A 'billion laughs' pickle: 40 levels of [a, a] describe 2**40 leaves in a few bytes."""
    node: list[object] = [1]
    for _ in range(40):
        node = [node, node]
    p = tmp_path / "laughs.pt"
    torch.save({"w": torch.ones(1)}, p)
    _replace_pickle(p, pickle.dumps({"w": 1, "x": node}, protocol=2))
    t0 = time.monotonic()
    read_index(p)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("module", [b"builtins", b"__builtin__"])
def test_bytearray_of_a_huge_size_is_refused(module: bytes) -> None:
    # bytearray(2**30): a real bytearray pickles as its text, never as a size.
    crafted = b"\x80\x02c" + module + b"\nbytearray\nJ\x00\x00\x00\x40\x85R."
    with pytest.raises(pickle.UnpicklingError):
        safe_load(crafted)
    assert safe_load(pickle.dumps(bytearray(b"ab"), protocol=2)).obj == bytearray(b"ab")


def test_a_pickle_cannot_change_the_standins() -> None:
    from ckpt_cli.formats import unpickler

    # GLOBAL an allowlisted rebuild function, then BUILD it with slot state that would set
    # its __defaults__ for every later file read in this process.
    crafted = (b"\x80\x02ctorch._utils\n_rebuild_meta_tensor_no_storage\n"
               b"N}X\x0c\x00\x00\x00__defaults__\x88\x85s\x86b.")
    with pytest.raises(pickle.UnpicklingError):
        safe_load(crafted)
    assert unpickler._rebuild_meta.__defaults__ == (False,)


# --- torch files whose geometry lies ------------------------------------------------------------

def test_negative_storage_offset_is_damage(tmp_path: Path) -> None:
    p = tmp_path / "neg.pt"
    torch.save({"w": torch.arange(4.0)}, p)
    with zipfile.ZipFile(p) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    # storage_offset is the BININT1 0 right after the BINPERSID of the storage tuple.
    i = pkl.index(b"Q") + 1
    assert pkl[i:i + 2] == b"K\x00"
    _replace_pickle(p, pkl[:i] + b"J\xfe\xff\xff\xff" + pkl[i + 2:])  # BININT -2
    index = read_index(p)
    assert [f.code for f in index.findings if f.severity == "error"] == ["bad-tensor"]
    with pytest.raises(CorruptCheckpointError, match="storage offset -2"):
        convert(p, tmp_path / "out.safetensors")


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


# --- outputs --------------------------------------------------------------------------------------

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


class _ShortRaw(io.RawIOBase):
    """A file whose every write stores at most 1000 bytes, like a >2 GiB write on Linux."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return len(self.data)

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0 and pos <= len(self.data):
            self._pos = pos
            return pos
        return len(self.data)

    def write(self, b: object) -> int:
        chunk = bytes(memoryview(b)[:1000])  # type: ignore[arg-type]
        pos = getattr(self, "_pos", len(self.data))
        self.data[pos:pos + len(chunk)] = chunk
        self._pos = pos + len(chunk)
        return len(chunk)


def test_torch_zip_survives_short_writes() -> None:
    raw = _ShortRaw()
    f = io.BufferedWriter(raw)
    t = torch.arange(5000, dtype=torch.float32)
    zw = TorchZipWriter(f, [("t", "F32", (5000,))])  # type: ignore[arg-type]
    zw.write_tensor(memoryview(t.numpy().tobytes()))
    zw.close()
    f.flush()
    got = torch.load(io.BytesIO(bytes(raw.data)), weights_only=True)
    assert torch.equal(got["t"], t)


# --- readers -------------------------------------------------------------------------------------

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


def test_bad_header_types_are_clean_errors(tmp_path: Path) -> None:
    hdr = json.dumps({"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}).encode()
    hdr += b" " * (-len(hdr) % 8)
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 8)
    # inspect describes what it can and warns; validate fails it; convert refuses it.
    for cmd, code in ((["inspect", p], 0), (["validate", p], 1),
                      (["convert", p, "-o", tmp_path / "o"], 2)):
        r = run_cli(*cmd)
        assert r.exit_code == code and "Traceback" not in r.stderr, (cmd, r.stderr)
        assert "unknown dtype" in r.stdout + r.stderr, cmd


@requires_deepspeed
def test_deepspeed_latest_naming_itself(ds_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "ds"
    shutil.copytree(ds_dir / "z2-fp32", src)
    for bad in (".", "..", "global_step3/../.."):
        (src / "latest").write_text(bad)
        r = run_cli("consolidate", src, "-o", tmp_path / "o")
        assert r.exit_code == 2 and "Traceback" not in r.stderr and "latest" in r.stderr


@requires_deepspeed
def test_zero1_frozen_parameters_are_kept(ds_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    r = consolidate(ds_dir / "z1-fp32+frozen", out, max_shard_size=None)
    got = load_file(out)
    assert {"1.weight", "1.bias"} <= set(got)  # the frozen LayerNorm, from module
    assert any("frozen parameter" in n for n in r.notes)
    r2 = consolidate(ds_dir / "z2-fp32+frozen", tmp_path / "o2.safetensors", max_shard_size=None)
    got2 = load_file(tmp_path / "o2.safetensors")
    assert {"1.weight", "1.bias"} <= set(got2) and not r2.notes[:-1]
    assert torch.equal(got["1.weight"], got2["1.weight"])  # ones: LayerNorm's initial weight
