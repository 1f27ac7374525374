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
from tests.conftest import requires_deepspeed, run_cli, third_party_quiet
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
    notes = tmp_path / "notes.txt"  # no weight suffix: the output would be a directory
    notes.write_text("keep me")
    r = run_cli("convert", src, "-o", notes, "--force")
    assert r.exit_code == 2 and "is a file" in r.stderr and "notes.txt" in r.stderr, r.output
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


# --- a shard the index names is missing or empty: never a smaller model -------------------------

@pytest.mark.parametrize("damage", ["missing", "empty"])
def test_hf_shard_missing_or_empty_is_refused_everywhere(sample_copy: Path, tmp_path: Path,
                                                         damage: str) -> None:
    export = sample_copy / "export"
    shard = sorted(export.glob("model-*.safetensors"))[-1]
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(b"")
    for argv in (("convert", export, "-o", tmp_path / "c.safetensors"),
                 ("convert", export, "--to", "fp16", "-o", tmp_path / "c"),
                 ("consolidate", export, "-o", tmp_path / "k")):
        r = run_cli(*argv)
        assert r.exit_code == 2, (argv, r.output)
        assert shard.name in r.stderr and "Traceback" not in r.stderr
    assert not [p for p in tmp_path.iterdir() if p.name != "run"]
    healthy = sample_copy / "step_000300"
    for argv in (("diff", export, healthy), ("diff", "--structure-only", export, healthy),
                 ("diff", healthy, export)):
        r = run_cli(*argv)
        assert r.exit_code == 2 and shard.name in r.stderr, (argv, r.output)


def test_consolidate_reshards_an_hf_export_by_its_index(sample_run: Path, tmp_path: Path) -> None:
    export = sample_run / "export"
    r = run_cli("consolidate", export, "--max-shard-size", "0", "-o", tmp_path / "one",
                "--verify", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["kind"] == "hf-index"
    assert [f for f in os.listdir(tmp_path / "one") if f.endswith(".safetensors")] == [
        "model.safetensors"]
    want = {k: v for p in export.glob("*.safetensors") for k, v in load_file(p).items()}
    got = load_file(tmp_path / "one" / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_sample_overwrite_replaces_only_a_sample(tmp_path: Path) -> None:
    d = tmp_path / "sm"
    d.mkdir()
    (d / "thesis.tex").write_text("four years of work")
    (d / "latest").write_text("step_000400\n")
    r = run_cli("sample", d, "--overwrite")
    assert r.exit_code == 2 and "thesis.tex" in r.stderr and "not a sample run" in r.stderr
    assert (d / "thesis.tex").read_text() == "four years of work"


@pytest.mark.parametrize("fmt", ["dcp", "deepspeed", "megatron", "dir"])
def test_directory_format_forced_on_a_file(tmp_path: Path, fmt: str) -> None:
    p = tmp_path / "x.pt"
    torch.save({"a": torch.zeros(2)}, p)
    for argv in (("inspect", p, "-F", fmt), ("validate", p, "-F", fmt),
                 ("convert", p, "-F", fmt, "-o", tmp_path / "o"),
                 ("diff", p, p, "--input-format-a", fmt)):
        r = run_cli(*argv)
        assert r.exit_code == 2 and "is not a directory" in r.stderr, (argv, r.output)


def test_tensors_with_python_attributes_are_allowlisted(tmp_path: Path) -> None:
    """DeepSpeed's optimizer state pickles tensors via _rebuild_from_type_v2(.., torch.Tensor)."""
    t = torch.zeros(3)
    t.ds_id = 5  # type: ignore[attr-defined]
    p = torch.nn.Parameter(torch.ones(2))
    p.extra = "x"  # type: ignore[attr-defined]
    f = tmp_path / "attr.pt"
    torch.save({"t": t, "p": p}, f)
    assert classify_global("torch.Tensor") == "allowed"
    index = read_index(f)
    assert {n: x.shape for n, x in index.tensors.items()} == {"t": (3,), "p": (2,)}
    assert not index.findings
    r = run_cli("validate", f, "--strict")
    assert r.exit_code == 0, r.output
    # The class is an argument there; a pickle that calls it does not unpickle.
    evil = (b"\x80\x02ctorch\nTensor\nq\x00)Rq\x01.")
    with pytest.raises(Exception, match="not callable"):
        safe_load(io.BytesIO(evil))


@requires_deepspeed
def test_deepspeed_checkpoints_pass_strict_validation(ds_dir: Path) -> None:
    for name in ("z1-fp32", "z3-bf16"):
        r = run_cli("validate", ds_dir / name, "--latest", "--strict")
        assert r.exit_code == 0, (name, r.output)


# --- damaged bytes are never laundered into a fresh, valid-looking output ----------------------

def _flip_in_entry(path: Path, suffix: str, at: int) -> None:
    """Flip one bit of byte ``at`` of a zip record's payload."""
    with zipfile.ZipFile(path) as zf:
        e = next(i for i in zf.infolist() if i.filename.endswith(suffix))
    data = bytearray(path.read_bytes())
    # The payload follows the local header, whose extra field (torch's alignment padding)
    # need not match the central directory's.
    name_len, extra_len = struct.unpack_from("<HH", data, e.header_offset + 26)
    assert 0 <= at < e.file_size
    data[e.header_offset + 30 + name_len + extra_len + at] ^= 1
    path.write_bytes(bytes(data))


def test_convert_refuses_bytes_that_fail_their_crc(tmp_path: Path) -> None:
    src = tmp_path / "a.pt"
    torch.save({"model": {"w": torch.randn(1000, 100), "b": torch.randn(100)}}, src)
    key = next(k for k, v in read_index(src).tensors.items() if v.shape == (1000, 100))
    storage = read_index(src).tensors[key].storage
    assert storage is not None
    _flip_in_entry(src, f"data/{storage.key}", 5000)
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


@pytest.mark.parametrize("kind", ["slice", "transpose", "strided-part"])
def test_views_of_a_damaged_storage_are_refused(tmp_path: Path, kind: str) -> None:
    # A view of part of a storage, and a strided view, are checked against the whole entry.
    base = torch.randn(400, 50)
    views = {"slice": base[100:200], "transpose": base.t(), "strided-part": base[200:, :10].t()}
    view = views[kind]
    src = tmp_path / "v.pt"
    torch.save({"v": view}, src)
    t = read_index(src).tensors["v"]
    assert t.storage is not None
    assert (t.offset != t.storage.start) if kind == "slice" else (t.stride is not None)
    assert (t.offset == t.storage.start) == (kind == "transpose")
    # Damage bytes of the storage that the view itself does not cover (rows 0-99 of base).
    _flip_in_entry(src, f"data/{t.storage.key}", 40)
    r = run_cli("convert", src, "-o", tmp_path / "o.safetensors")
    assert r.exit_code == 2 and "CRC-32" in r.stderr, r.output
    assert not (tmp_path / "o.safetensors").exists()


def test_many_views_of_a_damaged_storage_read_it_once(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt_cli.tensors import TensorSource

    base = torch.randn(256, 64)
    src = tmp_path / "slices.pt"
    torch.save({f"s{i}": base[i] for i in range(256)}, src)
    index = read_index(src)
    storage = index.tensors["s0"].storage
    assert storage is not None
    _flip_in_entry(src, f"data/{storage.key}", 10)
    index = read_index(src)
    calls: list[int] = []
    real = TensorSource._crc_of

    def counting(self: TensorSource, rel: str, offset: int, length: int) -> int:
        calls.append(length)
        return real(self, rel, offset, length)

    monkeypatch.setattr(TensorSource, "_crc_of", counting)
    failed = 0
    with TensorSource(index) as ts:
        for t in index.tensors.values():
            with pytest.raises(CorruptCheckpointError, match="CRC-32"):
                ts.read(t)
            failed += 1
    assert failed == 256 and calls == [base.nbytes]


@requires_deepspeed
def test_consolidate_refuses_damaged_zero_partitions(ds_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "z1"
    shutil.copytree(ds_dir / "z1-fp32", run)
    tag = run / (run / "latest").read_text().strip()
    optim = sorted(tag.glob("*optim_states.pt"))[0]
    with zipfile.ZipFile(optim) as zf:  # damage every record: the FP32 partition is one
        records = [i for i in zf.infolist() if "/data/" in i.filename and i.file_size]
    for rec in records:
        _flip_in_entry(optim, rec.filename, rec.file_size // 2)
    r = run_cli("consolidate", run, "-o", tmp_path / "out.safetensors")
    assert r.exit_code == 2 and "CRC-32" in r.stderr and optim.name in r.stderr, r.output
    assert not (tmp_path / "out.safetensors").exists()


def test_consolidate_refuses_a_dcp_chunk_that_fails_its_crc(sample_copy: Path,
                                                            tmp_path: Path) -> None:
    from ckpt_cli.tensors import TensorSource

    d = sample_copy / "step_000400"
    index = read_index(d)
    t = index.tensors["model.wte.weight"]
    with TensorSource(index) as src:
        sub = src.locate_chunk(t, t.chunks[1])
    assert sub.file is not None and sub.offset is not None
    data = bytearray((d / sub.file).read_bytes())
    data[sub.offset + 100] ^= 4
    (d / sub.file).write_bytes(bytes(data))
    r = run_cli("consolidate", d, "-o", tmp_path / "out", "--verify")
    assert r.exit_code == 2 and "CRC-32" in r.stderr and sub.file in r.stderr, r.output
    assert not (tmp_path / "out").exists()


@requires_deepspeed
def test_consolidate_names_a_latest_that_points_nowhere(ds_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "z1"
    shutil.copytree(ds_dir / "z1-fp32", run)
    (run / "latest").write_text("global_step99")
    r = run_cli("consolidate", run, "-o", tmp_path / "out")
    assert r.exit_code == 2 and "global_step99" in r.stderr and "latest" in r.stderr, r.output


def test_consolidate_of_a_run_directory_says_so(sample_copy: Path, tmp_path: Path) -> None:
    # With a `latest` pointer the checkpoint it names is merged, and the choice is said.
    r = run_cli("consolidate", sample_copy, "-o", tmp_path / "out")
    assert r.exit_code == 0 and "latest names step_000400" in r.stderr, r.output
    (sample_copy / "latest").unlink()
    r = run_cli("consolidate", sample_copy, "-o", tmp_path / "out2")
    assert r.exit_code == 2 and "is a run directory" in r.stderr, r.output


def test_a_stray_distcp_file_is_not_a_rank(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"
    shutil.copy(d / "__0_0.distcp", d / "__9_0.distcp")
    layout = read_index(d).layout
    assert layout["world_size"] == 4 and layout["ranks"] == [0, 1, 2, 3]


def test_checkpoints_nested_in_a_final_model_directory_are_pointed_out(
        hf_trainer_dir: Path, tmp_path: Path) -> None:
    """trainer.save_model() puts the final model beside checkpoint-N/: say they are there."""
    out = tmp_path / "out"
    shutil.copytree(hf_trainer_dir, out)
    for name in ("model.safetensors", "config.json", "trainer_state.json"):
        shutil.copy(out / "checkpoint-4" / name, out / name)
    index = read_index(out)
    nested = [f for f in index.findings if f.code == "nested-checkpoints"]
    assert len(nested) == 1 and "checkpoint-2, checkpoint-4" in nested[0].message
    # validate covers them, each in turn, beside the final model (so no hint to name them).
    r = run_cli("validate", out, "--json")
    doc = json.loads(r.stdout)
    assert [c["name"] for c in doc["checkpoints"]] == ["checkpoint-2", "checkpoint-4", "out"]
    assert "nested-checkpoints" not in r.stdout
    # Each checkpoint itself has none.
    assert not [f for f in read_index(out / "checkpoint-4").findings
                if f.code == "nested-checkpoints"]


def test_generator_and_dataloader_state_are_not_code(tmp_path: Path) -> None:
    # torch.save of a torch.Generator or a DataLoader: data torch's weights_only loader
    # refuses, but nothing that runs code; a warning, not an invalid checkpoint.
    src = tmp_path / "rng.pt"
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(6.0)),
                                         batch_size=2, shuffle=True)
    torch.save({"model": {"w": torch.randn(4, 4)}, "gen": torch.Generator().manual_seed(3),
                "loader": loader}, src)
    r = run_cli("validate", src, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["valid"], r.output
    found = {(f["code"], f["location"]) for f in doc["checkpoints"][0]["findings"]}
    assert not any(code == "unsafe-global" for code, _ in found), found
    assert ("non-allowlisted-global", "torch._C.Generator") in found
    assert ("unknown-global", "torch.utils.data.dataloader.DataLoader") in found
    assert classify_global("torch._C.Generator") == "benign"
    for gadget in ("torch._C._jit_script_compile", "numpy.memmap", "numpy.lib.npyio.load",
                   "torch.fx.graph_module.reduce_graph_module",
                   # unpickles bytes it is given, writes files, views raw memory, reads files
                   "torch.utils.data.datapipes.utils.decoder.basichandlers",
                   "torch.utils.data.datapipes.gen_pyi.gen_from_template",
                   "numpy.lib.stride_tricks.as_strided", "numpy._core.multiarray.fromfile",
                   "numpy.rec.fromfile", "numpy.ndarray.tofile", "pathlib.Path.write_text"):
        assert classify_global(gadget) == "dangerous", gadget
    # Callables under packages whose data classes are benign are not benign themselves.
    for callable_ in ("transformers.AutoModel.from_pretrained", "transformers.pipeline",
                      "deepspeed.launcher.runner.main"):
        assert classify_global(callable_) == "unknown", callable_
    for data in ("deepspeed.utils.tensor_fragment.fragment_address", "datetime.datetime",
                 "transformers.training_args.TrainingArguments", "pathlib.PosixPath"):
        assert classify_global(data) == "benign", data


def test_a_datapipe_gadget_makes_a_checkpoint_invalid(tmp_path: Path) -> None:
    # A pickle that calls a torch.utils.data decoder on embedded pickle bytes runs them under
    # torch.load(weights_only=False); ckpt must call it dangerous, not just unknown.
    class Gadget:
        def __reduce__(self) -> tuple[object, ...]:
            from torch.utils.data.datapipes.utils.decoder import basichandlers
            return (basichandlers, ("pickle", b"not executed"))

    src = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(2)}, "x": Gadget()}, src)
    r = run_cli("validate", src)
    assert r.exit_code == 1 and "INVALID" in r.output, r.output


@requires_deepspeed
def test_consolidate_prefers_zero_shards_to_a_16bit_hf_export(ds_dir: Path,
                                                              tmp_path: Path) -> None:
    # HF Trainer + DeepSpeed saves the ZeRO shards (FP32 master weights) and a 16-bit HF
    # export with an index side by side: the shards are what consolidate must merge.
    from ckpt_cli.ops.consolidate import detect_kind

    run = tmp_path / "checkpoint-2"
    shutil.copytree(ds_dir / "z1-fp32", run)
    hf_sharded(run, {k: v.half() for k, v in tiny_state_dict().items()}, max_shard_size=600)
    assert (run / "model.safetensors.index.json").is_file()
    assert detect_kind(run) == "deepspeed"
    # Without the FP32 partitions (stage 0, or deleted to save space) the export is what
    # there is; likewise when `latest` names a tag that was deleted.
    tag = run / (run / "latest").read_text().strip()
    for p in tag.glob("*optim_states.pt"):
        p.unlink()
    assert detect_kind(run) == "hf-index"
    shutil.rmtree(tag)
    assert detect_kind(run) == "hf-index"
    r = run_cli("consolidate", run, "-o", tmp_path / "o.safetensors")
    assert r.exit_code == 0 and "hf-index" in r.output, r.output
    plain = tmp_path / "export"
    plain.mkdir()
    hf_sharded(plain, tiny_state_dict(), max_shard_size=1200)
    assert detect_kind(plain) == "hf-index"


def test_expanded_tensors_are_read(tmp_path: Path) -> None:
    # Stride-0 views (HF's position_ids buffer: arange(n).expand(1, -1)) cover fewer bytes
    # than their logical size: the reader must not demand the logical size from the file.
    sd = {"position_ids": torch.arange(512).expand((1, -1)),
          "z": torch.linspace(0, 1, 3).expand(100_000, 3), "w": torch.randn(4, 4)}
    src = tmp_path / "exp.pt"
    torch.save(sd, src)
    assert src.stat().st_size < 100_000 * 3 * 4
    r = run_cli("validate", src, "--values", "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and not any(
        f["code"] == "values-unread" or "not examined" in f["message"]
        for f in doc["checkpoints"][0]["findings"]), r.output
    out = tmp_path / "exp.safetensors"
    assert run_cli("convert", src, "-o", out).exit_code == 0
    got = load_file(out)
    for k, v in sd.items():
        assert torch.equal(got[k], v.contiguous()), k
    assert run_cli("diff", src, out).exit_code == 0


@pytest.mark.parametrize("header_len", [640, 896, 1152, 1408])
def test_safetensors_whose_length_bytes_look_like_a_pickle(tmp_path: Path,
                                                           header_len: int) -> None:
    # Header lengths 0x0280, 0x0380, 0x0480, 0x0580 start the file with \x80\x02..\x05, a
    # pickle protocol header; the file is still a safetensors file.
    path = tmp_path / "m.safetensors"
    for n in range(header_len):
        save_file({"w": torch.ones(4, 4)}, str(path), metadata={"note": "x" * n})
        if struct.unpack("<Q", path.read_bytes()[:8])[0] >= header_len:
            break
    assert struct.unpack("<Q", path.read_bytes()[:8])[0] == header_len
    assert read_index(path).format == "safetensors"
    r = run_cli("convert", path, "-o", tmp_path / "o.safetensors")
    assert r.exit_code == 0, r.output
    assert torch.equal(load_file(tmp_path / "o.safetensors")["w"], torch.ones(4, 4))


# --- what a real-file edge-case hunt found ------------------------------------------------------

def test_torch_only_dtypes_are_described_and_refused_not_truncated(tmp_path: Path) -> None:
    src = tmp_path / "c32.pt"
    with third_party_quiet():  # "ComplexHalf support is experimental"
        c = torch.tensor([1 + 2j, 3 - 4j, 0.5 + 0j], dtype=torch.complex32)
    torch.save({"c": c, "b16": torch.tensor([1, 2, 3], dtype=torch.int16).view(torch.bits16),
                "w": torch.ones(2)}, src)
    index = read_index(src)
    got = {n: (t.dtype, t.shape, t.nbytes) for n, t in index.tensors.items()}
    assert got["c"] == ("C32", (3,), 12) and got["b16"] == ("BITS16", (3,), 6)
    for out in ("o.safetensors", "o.pt"):
        r = run_cli("convert", src, "-o", tmp_path / out)
        assert r.exit_code == 2 and "C32" in r.stderr, r.output
    assert run_cli("diff", src, src).exit_code == 0
    other = tmp_path / "c32b.pt"
    with third_party_quiet():
        torch.save({"c": c * 2, "b16": torch.tensor([1, 2, 3], dtype=torch.int16).view(
            torch.bits16), "w": torch.ones(2)}, other)
    r = run_cli("diff", src, other)
    assert r.exit_code == 1 and "1 changed (1 compared byte for byte)" in r.output, r.output
    assert "elements differ" not in r.output


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


def test_skip_data_files_are_refused(tmp_path: Path) -> None:
    # torch.serialization.skip_data() writes the structure but not the bytes (CRC 0 among
    # real checksums): converting it would ship zeros.
    src = tmp_path / "skip.pt"
    with torch.serialization.skip_data():
        torch.save({"a": torch.randn(300, 40)}, src)
    r = run_cli("convert", src, "-o", tmp_path / "o.safetensors")
    assert r.exit_code == 2 and "CRC-32" in r.stderr, r.output


def test_gpt2_parameters_are_counted_like_transformers(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    with third_party_quiet():
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                           n_positions=16))
    torch.save(model.state_dict(), tmp_path / "gpt2.pt")
    index = read_index(tmp_path / "gpt2.pt")
    assert index.tensors["transformer.h.0.attn.c_attn.bias"].group == "model"
    assert index.num_parameters == model.num_parameters()  # the tied head counts once


def test_meta_quantized_and_sparse_tensors(tmp_path: Path) -> None:
    src = tmp_path / "kinds.pt"
    with third_party_quiet():  # torch deprecates its quantized dtypes
        q = torch.quantize_per_tensor(torch.randn(4), 0.1, 10, torch.quint8)
        qc = torch.quantize_per_channel(torch.randn(2, 3), torch.tensor([0.1, 0.2]),
                                        torch.tensor([1, 2]), 0, torch.qint8)
        torch.save({"q": q, "qc": qc, "sp": torch.randn(2, 3).to_sparse(), "w": torch.ones(2),
                    "m": torch.empty(3, 4, device="meta")}, src)
    index = read_index(src)
    shapes = {n: (t.kind, t.shape) for n, t in index.tensors.items()}
    assert shapes == {"q": ("quantized", (4,)), "qc": ("quantized", (2, 3)),
                      "sp": ("sparse", (2, 3)), "w": ("dense", (2,)), "m": ("meta", (3, 4))}
    assert index.tensors["m"].nbytes == 0
    codes = {(f.code, f.location) for f in index.findings}
    assert ("tensor-kind", "m") in codes
    assert not any(c in ("unreferenced-storage", "unknown-global") for c, _ in codes), codes
    r = run_cli("convert", src, "-o", tmp_path / "o.safetensors")
    assert r.exit_code == 2 and "cannot convert" in r.stderr and "meta" in r.stderr, r.output


# --- --json on failure: one error document on stdout --------------------------------------------

def _failing_args(command: str, tmp: Path) -> tuple[list[str | Path], str, str | None]:
    """Arguments that make ``command`` fail with exit 2, the error kind and the path named."""
    missing = tmp / "nonexist.pt"
    good = tmp / "good.safetensors"
    save_file(tiny_state_dict(), str(good))
    c128 = tmp / "c128.pt"
    torch.save({"c": torch.ones(3, dtype=torch.complex128)}, c128)
    other = tmp / "notes"
    other.mkdir()
    (other / "notes.txt").write_text("not a checkpoint")
    return {
        "inspect": (["inspect", missing], "error", str(missing)),
        "validate": (["validate", missing], "error", str(missing)),
        "diff": (["diff", good, missing], "error", str(missing)),
        "convert": (["convert", c128, "-o", tmp / "x.safetensors"], "unsupported", None),
        "consolidate": (["consolidate", missing, "-o", tmp / "out"], "error", str(missing)),
        "prune": (["prune", other, "--keep", "1", "--yes"], "usage", str(other)),
        "plan": (["plan"], "usage", None),
        "sample": (["sample", other], "destination-exists", str(other)),
    }[command]


@pytest.mark.parametrize("command", ["inspect", "validate", "diff", "convert", "consolidate",
                                     "prune", "plan", "sample"])
def test_json_failure_prints_one_error_document(command: str, tmp_path: Path) -> None:
    args, kind, path = _failing_args(command, tmp_path)
    r = run_cli(*args, "--json")
    assert r.exit_code == 2, r.output
    doc = json.loads(r.stdout)  # exactly one document: json.loads refuses trailing data
    assert doc["schema_version"] == 1 and doc["command"] == command
    assert doc["exit_code"] == 2
    err = doc["error"]
    assert set(err) == {"kind", "message", "path", "side", "hint", "text"}
    assert err["kind"] == kind and err["path"] == path
    # The one-line error on stderr is unchanged, and the document says the same.
    first = r.stderr.splitlines()[0]
    assert first == f"ckpt: error: {err['text']}", r.stderr
    assert err["text"].endswith(err["message"])
    if err["hint"] is not None:
        assert f"hint: {err['hint']}" in r.stderr
    assert err["side"] == ("B" if command == "diff" else None)
    # Without --json stdout stays empty.
    r = run_cli(*args)
    assert r.exit_code == 2 and r.stdout == "", r.stdout


def test_json_interrupt_and_internal_error_documents(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import ckpt_cli.ops.inspect

    good = tmp_path / "good.safetensors"
    save_file(tiny_state_dict(), str(good))

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_cli.ops.inspect, "inspect", interrupted)
    r = run_cli("inspect", good, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 130 and doc["exit_code"] == 130, r.output
    assert doc["command"] == "inspect" and doc["error"]["kind"] == "interrupted"
    assert r.stderr.strip() == "ckpt: interrupted"

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(ckpt_cli.ops.inspect, "inspect", broken)
    monkeypatch.delenv("CKPT_DEBUG", raising=False)
    r = run_cli("inspect", good, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 101 and doc["exit_code"] == 101, r.output
    assert doc["error"]["kind"] == "internal" and doc["error"]["message"] == "RuntimeError: boom"


def test_json_error_after_the_document_prints_no_second_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckpt_cli.cli.inspect

    good = tmp_path / "good.safetensors"
    save_file(tiny_state_dict(), str(good))
    real = ckpt_cli.cli.inspect._emit_json

    def emit_then_fail(result: object) -> None:
        real(result)
        raise CkptError("failed after the document was printed")

    monkeypatch.setattr(ckpt_cli.cli.inspect, "_emit_json", emit_then_fail)
    r = run_cli("inspect", good, "--json")
    assert r.exit_code == 2 and "failed after" in r.stderr
    doc = json.loads(r.stdout)
    assert doc["command"] == "inspect" and "error" not in doc


@requires_deepspeed
@pytest.mark.parametrize("cfg", ["z3-fp32", "z3-bf16"])
def test_diff_refuses_zero3_placeholders(ds_dir: Path, tmp_path: Path, cfg: str) -> None:
    # ZeRO-3 model states hold [0]-shaped placeholders (once per rank): compared as stored, a
    # checkpoint differed from its own consolidation, and two ZeRO-3 steps looked equal.
    tag = ds_dir / cfg / "global_step3"
    out = tmp_path / "full.safetensors"
    assert run_cli("consolidate", tag, "-o", out).exit_code == 0
    for side, args in (("A", (tag, out)), ("B", (out, tag))):
        for extra in ((), ("--structure-only",), ("--all",)):
            r = run_cli("diff", *args, *extra)
            assert r.exit_code == 2 and r.stdout == "", r.output
            lines = r.stderr.strip().splitlines()
            assert lines[0].startswith(f"ckpt: error: {side}: {tag}: DeepSpeed ZeRO-3"), r.stderr
            assert len(lines) == 2 and lines[1].startswith("hint: consolidate it first")
            assert f"ckpt consolidate {tag}" in lines[1]
    r = run_cli("diff", tag, ds_dir / "z3-fp32" / "global_step3", "--json")
    err = json.loads(r.stdout)["error"]
    assert r.exit_code == 2 and err["kind"] == "unsupported" and err["side"] == "A"
    # The library API refuses too.
    from ckpt_cli.ops.diff import diff

    with pytest.raises(UnsupportedError, match="ZeRO-3"):
        diff(out, tag)


@requires_deepspeed
@pytest.mark.parametrize("cfg", ["z1-fp32", "z2-fp32", "z2-bf16", "z1-fp32+frozen"])
def test_diff_of_zero12_against_its_consolidation_is_equal(ds_dir: Path, tmp_path: Path,
                                                          cfg: str) -> None:
    # ZeRO 1/2 keep the whole module in the model states: compared as stored, as before.
    tag = ds_dir / cfg / "global_step3"
    out = tmp_path / "full.safetensors"
    assert run_cli("consolidate", tag, "-o", out).exit_code == 0
    r = run_cli("diff", tag, out, "--no-metadata", "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["equal"], r.output
    assert doc["summary"]["common"] == 7 and not doc["only_in_a"] and not doc["only_in_b"]



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


def test_machine_limits_are_errors_not_bugs(capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    import typer

    from ckpt_cli.cli.errors import handled

    with pytest.raises(typer.Exit) as exc, handled():
        raise OSError(errno.ENAMETOOLONG, "File name too long", "/very/long/path")
    assert exc.value.exit_code == 2
    assert capsys.readouterr().err.strip() == "ckpt: error: /very/long/path: File name too long"
    with pytest.raises(typer.Exit) as exc, handled():
        raise OSError(errno.EBADF, "Bad file descriptor")  # a bug of ours: internal error
    assert exc.value.exit_code == 101
