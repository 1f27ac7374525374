"""``validate`` as a library: every check catches its defect, made on a real file.

Each test starts from a checkpoint written by the real library (torch, safetensors,
torch.distributed.checkpoint, huggingface_hub, Lightning, DeepSpeed) and damages it the way
a failure or a buggy writer would, then asserts the right check fails with the right code.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.formats import read_index
from ckpt_cli.model import Finding
from ckpt_cli.ops.validate import parse_require, validate
from ckpt_cli.ops.validate.layoutcheck import directory_pointers
from ckpt_cli.ops.validate.result import CHECKS, CheckpointReport
from tests.conftest import requires_deepspeed, run_cli, third_party_quiet
from tests.helpers import damage
from tests.helpers.makers import (
    hf_sharded,
    megatron_legacy,
    save_training_checkpoint,
    tiny_state_dict,
    training_checkpoint,
)

pytestmark = pytest.mark.requires_torch


def report(path: Path, **kw: Any) -> CheckpointReport:
    result = validate(path, **kw)
    assert result.kind == "checkpoint"
    return result.checkpoints[0]


def found(r: CheckpointReport, code: str, severity: str | None = "error") -> list[Finding]:
    """Findings with ``code`` (and ``severity``), checking they sit in a failing check."""
    out = [f for f in r.findings if f.code == code
           and (severity is None or f.severity == severity)]
    for f in out:
        owner = next(c for c in r.checks if f in c.findings)
        assert owner.status in {"error": ("fail",), "warning": ("warn", "fail"),
                                "info": ("pass", "warn", "fail")}[f.severity], (owner, f)
    return out


def check_of(r: CheckpointReport, code: str) -> str:
    return next(c.id for c in r.checks for f in c.findings if f.code == code)


def assert_clean(r: CheckpointReport) -> None:
    assert r.valid, [f for f in r.findings if f.severity == "error"]
    assert r.warnings == 0, [f for f in r.findings if f.severity == "warning"]
    assert all(c.id in CHECKS for c in r.checks)


# -- safetensors -------------------------------------------------------------------------------


@pytest.fixture
def st_file(tmp_path: Path) -> Path:
    p = tmp_path / "model.safetensors"
    save_file(tiny_state_dict(), str(p), metadata={"format": "pt"})
    return p


def test_valid_safetensors_passes_every_check(st_file: Path) -> None:
    r = report(st_file)
    assert_clean(r)
    ids = [c.id for c in r.checks]
    assert ids[:3] == ["readable", "complete", "safetensors-header"]
    assert r.check("crc32") is None  # safetensors has no checksums to verify
    assert r.check("manifest").status == "skip"  # type: ignore[union-attr]


def test_safetensors_truncated(st_file: Path) -> None:
    damage.truncate(st_file, -5)
    r = report(st_file)
    assert found(r, "truncated") and check_of(r, "truncated") == "safetensors-header"
    assert not r.valid


def test_safetensors_trailing_garbage(st_file: Path) -> None:
    damage.append(st_file, b"\x00" * 16)
    r = report(st_file)
    assert found(r, "trailing-bytes")


def test_safetensors_header_length_past_the_file(st_file: Path) -> None:
    with open(st_file, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))
    r = report(st_file)  # content no longer looks like safetensors; the name says it should
    message = found(r, "unreadable")[0].message
    assert "header length field is implausible" in message  # named, never echoed
    assert str(1 << 40) not in message.replace(",", "")


def test_safetensors_header_not_json(st_file: Path) -> None:
    damage.flip(st_file, 9, 0x20)  # inside the JSON text
    r = report(st_file)
    assert found(r, "unreadable") and "JSON" in found(r, "unreadable")[0].message


@pytest.mark.parametrize("edit,code", [
    (lambda h: h["embed.weight"].update(dtype="F31"), "unknown-dtype"),
    (lambda h: h["embed.weight"].update(shape=[32, 9]), "size-mismatch"),
    (lambda h: h["head.weight"].update(data_offsets=[0, 128]), "overlap"),
    (lambda h: h.pop("head.weight"), "gap"),
])
def test_safetensors_header_edits(st_file: Path, edit: Any, code: str) -> None:
    damage.edit_safetensors_header(st_file, edit)
    r = report(st_file)
    assert found(r, code), r.findings
    assert check_of(r, code) == "safetensors-header"


def test_safetensors_duplicate_key(st_file: Path) -> None:
    raw = st_file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8:8 + n].rstrip()
    entry = b'"head.weight":'
    i = header.index(entry)
    j = header.index(b"}", i) + 1
    dup = header[:-1] + b"," + header[i:j] + b"}"
    dup += b" " * (-len(dup) % 8)
    st_file.write_bytes(struct.pack("<Q", len(dup)) + dup + raw[8 + n:])
    r = report(st_file)
    assert found(r, "duplicate-key")


# -- torch zip ---------------------------------------------------------------------------------


@pytest.fixture
def pt_file(tmp_path: Path) -> Path:
    return save_training_checkpoint(tmp_path / "train.pt")


def test_valid_torch_file(pt_file: Path) -> None:
    r = report(pt_file)
    assert_clean(r)
    assert r.check("crc32").status == "pass"  # type: ignore[union-attr]
    assert r.bytes_read > 0 and r.step == 100


def test_bit_flip_in_tensor_bytes_fails_crc(pt_file: Path) -> None:
    off, size = damage.zip_payload(pt_file, "data/2")
    damage.flip(pt_file, off + size // 2, 0x10)
    r = report(pt_file)
    bad = found(r, "crc-mismatch")
    assert len(bad) == 1 and check_of(r, "crc-mismatch") == "crc32"
    assert bad[0].location is not None and bad[0].location.endswith("data/2")
    assert "storage of" in bad[0].message  # names the tensor the bytes belong to
    # --quick reads no data and so cannot see it.
    quick = report(pt_file, quick=True)
    assert quick.valid and quick.check("crc32").status == "skip"  # type: ignore[union-attr]


def test_truncated_torch_file(pt_file: Path) -> None:
    damage.truncate(pt_file, pt_file.stat().st_size // 2)
    r = report(pt_file)
    assert found(r, "unreadable") and "central directory" in found(r, "unreadable")[0].message
    assert r.check("complete") is not None


def test_trailing_bytes_after_zip(pt_file: Path) -> None:
    damage.append(pt_file, b"garbage!" * 10)
    r = report(pt_file)
    assert found(r, "zip-trailing-bytes") and check_of(r, "zip-trailing-bytes") == "zip-structure"


def test_local_header_name_differs(pt_file: Path) -> None:
    off, _ = damage.zip_payload(pt_file, "data/1")
    with open(pt_file, "rb") as f:
        data = f.read()
    name_at = data.rfind(b"data/1", 0, off)
    damage.flip(pt_file, name_at + 5, 0x02)  # "data/1" -> "data/3" in the local header only
    r = report(pt_file)
    assert found(r, "zip-local-header")


def test_central_directory_offset_damaged(pt_file: Path) -> None:
    size = pt_file.stat().st_size
    data = pt_file.read_bytes()
    eocd = data.rfind(b"PK\x06\x06")  # the ZIP64 end record torch writes
    damage.flip(pt_file, eocd + 48, 0x04)  # its central-directory offset
    assert pt_file.stat().st_size == size
    r = report(pt_file)
    assert not r.valid
    assert {f.code for f in r.findings} & {"zip-central-directory", "unreadable"}


def test_data_descriptor_disagrees(pt_file: Path) -> None:
    off, size = damage.zip_payload(pt_file, "data/0")
    damage.flip(pt_file, off + size + 4)  # the CRC inside the PK\x07\x08 descriptor
    r = report(pt_file)
    assert found(r, "zip-data-descriptor")


@pytest.mark.parametrize("new_name,code,check", [
    ("9", "missing-storage", "storages"),  # the pickle's storage 1 is gone
    ("0", "zip-duplicate-name", "zip-structure"),  # two records called data/0
])
def test_renamed_storage_record(tmp_path: Path, new_name: str, code: str, check: str) -> None:
    p = tmp_path / "m.pt"
    torch.save({"a": torch.arange(10.0), "b": torch.ones(3)}, p)
    data = bytearray(p.read_bytes())
    # Rename record data/1 in both its local header and the central directory.
    for i in [j for j in range(len(data)) if data.startswith(b"m/data/1", j)]:
        data[i + 7] = ord(new_name)
    p.write_bytes(bytes(data))
    r = report(p)
    assert found(r, code) and check_of(r, code) == check


@pytest.mark.parametrize("numel,code", [
    (3, "view-out-of-bounds"),  # the view [2:10] no longer fits in 3 elements
    (12, "short-storage"),  # the 40-byte record cannot hold 12 floats
])
def test_storage_size_in_the_pickle(tmp_path: Path, numel: int, code: str) -> None:
    p = tmp_path / "v.pt"
    base = torch.arange(10.0)
    torch.save({"v": base[2:]}, p)
    # The storage id ('storage', FloatStorage, '0', 'cpu', 10) ends with BININT1 10.
    damage.replace_in_zip_pickle(p, b"cpuq\x06K\nt", b"cpuq\x06K" + bytes([numel]) + b"t")
    r = report(p)
    assert found(r, code) and check_of(r, code) == "storages"
    assert found(r, "crc-mismatch")  # data.pkl's own bytes changed too


def test_record_size_past_the_central_directory(pt_file: Path) -> None:
    import zipfile

    with zipfile.ZipFile(pt_file) as zf:
        position = [i.filename for i in zf.infolist()].index("train/data/0")
    data = bytearray(pt_file.read_bytes())
    entry = data.find(b"PK\x01\x02")  # the central directory's first entry
    for _ in range(position):
        entry = data.find(b"PK\x01\x02", entry + 4)
    data[entry + 20:entry + 24] = (10**8).to_bytes(4, "little")  # data/0's compressed size
    pt_file.write_bytes(bytes(data))
    r = report(pt_file)
    bad = found(r, "zip-out-of-bounds")
    assert [f.location for f in bad] == ["train/data/0"]
    assert check_of(r, "zip-out-of-bounds") == "zip-structure"


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > /dev/null",))


def test_pickle_that_would_run_code(tmp_path: Path) -> None:
    p = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(2)}, "payload": _Evil()}, p)
    r = report(p)
    bad = found(r, "unsafe-global")
    assert bad and "system" in bad[0].message and check_of(r, "unsafe-global") == "pickle-safety"


def test_legacy_stream_payload_outside_the_main_pickle(tmp_path: Path) -> None:
    # torch.load unpickles sys_info too: a payload there runs as surely as in the main pickle.
    p = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, p, _use_new_zipfile_serialization=False)
    assert_clean(report(p))  # the real stream: sys_info and the key list are plain data
    data = p.read_bytes()
    f = io.BytesIO(data)
    for _ in range(2):
        pickletools.dis(f, out=io.StringIO())
    start = f.tell()
    pickletools.dis(f, out=io.StringIO())
    hostile = {"protocol_version": 1001, "little_endian": True, "x": _Evil()}
    p.write_bytes(data[:start] + pickle.dumps(hostile, protocol=2) + data[f.tell():])
    r = report(p)
    bad = found(r, "unsafe-global")
    assert bad and "sys_info" in bad[0].message and check_of(r, "unsafe-global") == "pickle-safety"
    assert not r.valid


def test_torchscript_shaped_zip(tmp_path: Path) -> None:
    p = tmp_path / "ts.pt"
    torch.save({"w": torch.ones(2)}, p)
    with zipfile.ZipFile(p) as zf:
        entries = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    entries["ts/code/__torch__.py"] = b"def forward(self, x):\n    return x\n"
    entries["ts/constants.pkl"] = pickle.dumps((_Evil(),), protocol=2)
    with zipfile.ZipFile(p, "w", zipfile.ZIP_STORED) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    r = report(p)
    assert found(r, "torchscript-archive") and check_of(r, "torchscript-archive") == "pickle-safety"
    bad = found(r, "unsafe-global")
    assert bad and "constants.pkl" in bad[0].message
    assert next(c for c in r.checks if c.id == "pickle-safety").summary.startswith(
        "a TorchScript archive")


def test_crc_disabled_is_a_note(tmp_path: Path) -> None:
    p = tmp_path / "nocrc.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.randn(4, 4)}, p)
    finally:
        torch.serialization.set_crc32_options(True)
    r = report(p)
    assert r.valid and found(r, "crc-disabled", "info")


def test_legacy_torch_file_has_no_checksums(tmp_path: Path) -> None:
    p = tmp_path / "old.pt"
    torch.save(training_checkpoint(), p, _use_new_zipfile_serialization=False)
    r = report(p)
    assert r.valid
    assert r.check("crc32").status == "skip"  # type: ignore[union-attr]
    assert "legacy" in r.check("crc32").summary  # type: ignore[union-attr]


# -- HF sharded --------------------------------------------------------------------------------


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    out = tmp_path / "export"
    out.mkdir()
    sd = {f"layer.{i}.weight": torch.randn(64, 64) for i in range(4)}
    hf_sharded(out, sd, max_shard_size=40_000)  # 16 KB tensors: two shards of two
    return out


def _index(d: Path) -> tuple[Path, dict[str, Any]]:
    import json

    p = d / "model.safetensors.index.json"
    return p, json.loads(p.read_text())


def test_valid_shards(shards: Path) -> None:
    r = report(shards)
    assert_clean(r)
    assert r.check("shard-index").status == "pass"  # type: ignore[union-attr]


def test_missing_shard(shards: Path) -> None:
    next(shards.glob("model-00002-*.safetensors")).unlink()
    r = report(shards)
    assert found(r, "missing-shard") and check_of(r, "missing-shard") == "shard-index"


def test_damaged_shard(shards: Path) -> None:
    damage.truncate(next(shards.glob("model-00002-*.safetensors")), -10)
    r = report(shards)
    assert not r.valid and found(r, "truncated")


@pytest.mark.parametrize("edit,code", [
    (lambda ix: ix["weight_map"].update({"layer.0.weight": ix["weight_map"]["layer.3.weight"],
                                         "layer.3.weight": ix["weight_map"]["layer.0.weight"]}),
     "wrong-shard"),
    (lambda ix: ix["weight_map"].pop("layer.1.weight"), "unindexed-tensor"),
    (lambda ix: ix["weight_map"].update({"layer.9.weight": ix["weight_map"]["layer.3.weight"]}),
     "missing-tensor"),
])
def test_index_disagrees_with_shards(shards: Path, edit: Any, code: str) -> None:
    import json

    p, ix = _index(shards)
    edit(ix)
    p.write_text(json.dumps(ix))
    r = report(shards)
    assert found(r, code) and check_of(r, code) == "shard-index"


def test_stray_file_beside_the_shards(shards: Path) -> None:
    shutil.copy(next(shards.glob("model-00001-*.safetensors")), shards / "model.safetensors")
    r = report(shards)
    assert [f.file for f in found(r, "unindexed-file", "warning")] == ["model.safetensors"]
    assert check_of(r, "unindexed-file") == "shard-index"


def test_index_total_size(shards: Path) -> None:
    import json

    p, ix = _index(shards)
    ix["metadata"]["total_size"] += 4
    p.write_text(json.dumps(ix))
    r = report(shards)
    assert found(r, "total-size", "warning") and r.valid


def test_index_shard_path_escapes(shards: Path) -> None:
    import json

    p, ix = _index(shards)
    ix["weight_map"]["layer.0.weight"] = "../../etc/passwd.safetensors"
    p.write_text(json.dumps(ix))
    r = report(shards)
    assert found(r, "unreadable") and "leaves" in found(r, "unreadable")[0].message


# -- DCP ---------------------------------------------------------------------------------------


def test_valid_dcp(sample_run: Path) -> None:
    r = report(sample_run / "step_000400")
    assert_clean(r)
    for cid in ("dcp-storage", "dcp-tiling", "dcp-chunks", "zip-structure", "crc32"):
        assert r.check(cid).status == "pass", cid  # type: ignore[union-attr]


def test_dcp_metadata_is_parsed_once(sample_copy: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """validate checks where items lie with the storage map the reader parsed (kept only
    while it runs); a .metadata changed since is parsed again."""
    from ckpt_cli.formats import dcp

    d = sample_copy / "step_000400"
    parsed: list[Path] = []
    real = dcp.parse_metadata

    def spy(path: Path) -> Any:
        parsed.append(path)
        return real(path)

    monkeypatch.setattr(dcp, "parse_metadata", spy)
    r = report(d)
    assert_clean(r)
    assert r.check("dcp-storage").status == "pass"  # type: ignore[union-attr]
    assert parsed == [d / ".metadata"]
    assert dcp._KEPT.get() is None  # nothing kept after it
    with dcp.keep_storage_maps():
        read_index(d)
        st = (d / ".metadata").stat()
        os.utime(d / ".metadata", ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
        again = dcp.storage_of(d, d / ".metadata")
    assert len(parsed) == 3 and again == dcp.storage_of(d, d / ".metadata")


def test_dcp_truncated_file(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"
    damage.truncate(d / "__2_0.distcp", -100)
    r = report(d)
    assert found(r, "chunk-out-of-bounds") or found(r, "item-out-of-bounds")
    assert not r.valid


def test_dcp_missing_file(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"
    (d / "__1_0.distcp").unlink()
    r = report(d)
    assert found(r, "missing-file") and check_of(r, "missing-file") == "dcp-storage"


def test_dcp_no_metadata(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"
    (d / ".metadata").unlink()
    r = report(d)
    assert found(r, "unreadable") and "did not finish" in found(r, "unreadable")[0].message


def test_dcp_bit_flip_in_chunk(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"
    f = d / "__3_0.distcp"
    damage.flip(f, f.stat().st_size // 2, 0x40)
    r = report(d)
    errors = [f for f in r.findings if f.severity == "error"]
    assert errors and {f.file for f in errors} == {"__3_0.distcp"}


def test_dcp_bit_flip_in_chunk_data_is_a_crc_error(sample_copy: Path) -> None:
    from ckpt_cli.formats import read_index

    d = sample_copy / "step_000400"
    t = read_index(d).tensors["model.wte.weight"]
    c = t.chunks[1]
    damage.flip(d / c.file, c.offset + c.length // 2, 0x01)  # in the middle of 32 KB of data
    r = report(d)
    bad = found(r, "crc-mismatch")
    assert len(bad) == 1 and bad[0].file == c.file
    assert bad[0].location is not None and "model.wte.weight@[128, 0]" in bad[0].location


def test_dcp_tiling_gap(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"

    def drop_last_chunk(md: Any) -> None:
        tm = md.state_dict_metadata["model.wte.weight"]
        gone = tm.chunks.pop()
        key = next(k for k in md.storage_data if k.fqn == "model.wte.weight"
                   and tuple(k.offset) == tuple(gone.offsets))
        del md.storage_data[key]

    damage.edit_dcp_metadata(d, drop_last_chunk)
    r = report(d)
    bad = found(r, "chunk-tiling")
    assert len(bad) == 1 and bad[0].location == "model.wte.weight"
    assert "8,192 of 32,768 elements are in no chunk" in bad[0].message
    assert found(r, "item-gap", "warning")  # its bytes are now in no item


def test_dcp_tiling_overlap(sample_copy: Path) -> None:
    import torch.distributed.checkpoint.metadata as m

    d = sample_copy / "step_000400"

    def shift_chunk(md: Any) -> None:
        tm = md.state_dict_metadata["model.wte.weight"]
        old = tm.chunks[1]
        new_off = torch.Size([old.offsets[0] - 1, 0])
        tm.chunks[1] = m.ChunkStorageMetadata(new_off, old.sizes)
        key = next(k for k in md.storage_data if k.fqn == "model.wte.weight"
                   and tuple(k.offset) == tuple(old.offsets))
        md.storage_data[m.MetadataIndex("model.wte.weight", new_off)] = md.storage_data.pop(key)

    damage.edit_dcp_metadata(d, shift_chunk)
    r = report(d)
    msgs = " ".join(f.message for f in found(r, "chunk-tiling"))
    assert "more than one chunk" in msgs and "in no chunk" in msgs


def test_dcp_chunk_holds_the_wrong_tensor(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"

    def swap(md: Any) -> None:
        a = next(k for k in md.storage_data if k.fqn == "model.wte.weight")
        b = next(k for k in md.storage_data if k.fqn == "model.wpe.weight")
        md.storage_data[a], md.storage_data[b] = md.storage_data[b], md.storage_data[a]

    damage.edit_dcp_metadata(d, swap)
    r = report(d)
    bad = found(r, "chunk-undecodable")
    assert {f.location for f in bad} == {"model.wte.weight@[0, 0]", "model.wpe.weight@[0, 0]"}
    assert check_of(r, "chunk-undecodable") == "dcp-chunks"


def test_dcp_path_escape(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"

    def escape(md: Any) -> None:
        k = next(iter(md.storage_data))
        md.storage_data[k].relative_path = "../step_000100/checkpoint.pt"

    damage.edit_dcp_metadata(d, escape)
    r = report(d)
    assert found(r, "unreadable") and "leaves the checkpoint" in found(r, "unreadable")[0].message


def test_dcp_unreferenced_file_and_appended_bytes(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"
    shutil.copy(d / "__0_0.distcp", d / "__7_0.distcp")
    damage.append(d / "__1_0.distcp", b"\x00" * 64)
    r = report(d)
    assert r.valid
    assert [f.file for f in found(r, "unreferenced-file", "warning")] == ["__7_0.distcp"]
    assert [f.file for f in found(r, "item-gap", "warning")] == ["__1_0.distcp"]


# -- DeepSpeed and Megatron --------------------------------------------------------------------


@pytest.fixture
def ds_copy(ds_dir: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "ds"
    shutil.copytree(ds_dir, dest)
    return dest


@requires_deepspeed
@pytest.mark.parametrize("config", ["z1-fp32", "z2-fp32", "z3-fp32", "z2-bf16", "z3-bf16"])
def test_valid_deepspeed(ds_dir: Path, config: str) -> None:
    result = validate(ds_dir / config)
    assert result.kind == "run" and result.valid
    r = result.checkpoints[0]
    assert r.format == "deepspeed" and r.errors == 0
    assert r.check("rank-files").status == "pass"  # type: ignore[union-attr]
    assert "with optimizer state" in r.check("resumable").summary  # type: ignore[union-attr]
    assert result.run_checks[0].summary == "latest -> global_step3"


@requires_deepspeed
def test_deepspeed_missing_rank_file(ds_copy: Path) -> None:
    tag = ds_copy / "z3-fp32" / "global_step3"
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    r = report(tag)
    assert sorted(f.file for f in found(r, "missing-rank-file")) == [  # type: ignore[type-var]
        "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert check_of(r, "missing-rank-file") == "rank-files"


@requires_deepspeed
def test_deepspeed_world_size_mismatch(ds_copy: Path) -> None:
    tag = ds_copy / "z2-fp32" / "global_step3"
    # The model states say dp_world_size 2 (BININT1 2 after its memo); make it 3.
    p = tag / "mp_rank_00_model_states.pt"
    off, size = damage.zip_payload(p, "data.pkl")
    data = bytearray(p.read_bytes())
    i = data.find(b"dp_world_size", off, off + size) + len(b"dp_world_size")
    j = data.find(b"K\x02", i, i + 8)
    data[j + 1] = 3
    p.write_bytes(bytes(data))
    r = report(tag)
    assert any("partitioned 2 ways but dp_world_size is 3" in f.message
               for f in found(r, "world-size"))
    assert [f.file for f in found(r, "missing-rank-file")] == [
        "zero_pp_rank_2_mp_rank_00_optim_states.pt"]


@requires_deepspeed
def test_deepspeed_mixed_optimizer_files(ds_copy: Path) -> None:
    tag = ds_copy / "z2-fp32" / "global_step3"
    src = ds_copy / "z2-bf16" / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shutil.copy(src, tag)
    r = report(tag)
    assert found(r, "mixed-optimizer-files")


@requires_deepspeed
def test_deepspeed_latest_points_nowhere(ds_copy: Path) -> None:
    run = ds_copy / "z1-fp32"
    (run / "latest").write_text("global_step9")
    result = validate(run)
    assert not result.valid
    bad = [f for f in result.run_checks[0].findings if f.code == "dangling-pointer"]
    assert bad and bad[0].severity == "error" and "global_step9" in bad[0].message
    # Validating the tag directory alone looks at the pointer beside it too.
    r = report(run / "global_step3")
    assert found(r, "dangling-pointer") and check_of(r, "dangling-pointer") == "latest-pointer"


@requires_deepspeed
def test_deepspeed_truncated_rank_file(ds_copy: Path) -> None:
    tag = ds_copy / "z3-bf16" / "global_step3"
    damage.truncate(tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", 1000)
    r = report(tag)
    assert not r.valid and found(r, "bad-file")


def test_valid_megatron(tmp_path: Path) -> None:
    d = megatron_legacy(tmp_path / "meg", tp=2, pp=2)
    r = report(d)
    assert_clean(r)
    assert r.check("latest-pointer").summary == (  # type: ignore[union-attr]
        "../latest_checkpointed_iteration.txt -> iter_0000500")


def test_megatron_missing_rank(tmp_path: Path) -> None:
    d = megatron_legacy(tmp_path / "meg", tp=2, pp=2)
    shutil.rmtree(d / "mp_rank_01_001")
    r = report(d)
    assert found(r, "missing-rank") and check_of(r, "missing-rank") == "rank-files"


def test_megatron_rank_without_its_file(tmp_path: Path) -> None:
    d = megatron_legacy(tmp_path / "meg", tp=2)
    (d / "mp_rank_01" / "model_optim_rng.pt").unlink()
    r = report(d)
    assert found(r, "missing-file") and check_of(r, "missing-file") == "rank-files"


def test_megatron_distrib_optim_on_some_ranks(tmp_path: Path) -> None:
    d = megatron_legacy(tmp_path / "meg", tp=2)
    torch.save({"param_state": {"0": torch.zeros(4)}}, d / "mp_rank_00" / "distrib_optim.pt")
    r = report(d)
    assert [f.file for f in found(r, "missing-rank-file")] == ["mp_rank_01/distrib_optim.pt"]


def test_megatron_tracker_file(tmp_path: Path) -> None:
    d = megatron_legacy(tmp_path / "meg", tp=1)
    tracker = d.parent / "latest_checkpointed_iteration.txt"
    tracker.write_text("600")
    r = report(d)
    assert "iter_0000600" in found(r, "dangling-pointer")[0].message
    tracker.write_text("soon")
    assert found(report(d), "bad-pointer")


def test_pointer_spellings_agree_with_the_run_listing(sample_copy: Path) -> None:
    """validate and the run listing (prune, inspect) read a pointer with one parser."""
    from ckpt_cli.runs import read_pointers

    latest = sample_copy / "latest"
    for text, ok in (("step_000300", True), ("./step_000300/", True),
                     ("step_000300/model.pt", True), (f"{sample_copy}/step_000300", True),
                     ("../elsewhere/step_000300", False), ("step_999", False)):
        latest.write_text(text)
        pointers, _ = read_pointers(sample_copy)
        findings, named = directory_pointers(sample_copy)
        assert (pointers.get("latest") == "step_000300") is ok, text
        assert (named == ["latest -> step_000300"]) is ok, (text, findings)
        assert [f.code for f in findings] == ([] if ok else ["dangling-pointer"]), text
    latest.write_bytes(b"\0" * 16)  # zero-filled by a crash
    findings, named = directory_pointers(sample_copy)
    assert [f.code for f in findings] == ["bad-pointer"] and named == []


def test_megatron_wrong_iteration(tmp_path: Path) -> None:
    d = megatron_legacy(tmp_path / "meg", tp=1)
    moved = d.rename(d.parent / "iter_0000400")
    (moved.parent / "latest_checkpointed_iteration.txt").write_text("400")
    r = report(moved)
    assert "holds iteration 500 but sits in iter_0000400" in found(r, "wrong-iteration")[0].message


# -- training state ----------------------------------------------------------------------------


def test_step_without_optimizer_is_flagged(tmp_path: Path) -> None:
    p = tmp_path / "weights.pt"
    torch.save({"model": tiny_state_dict(), "step": 70}, p)
    r = report(p)
    assert r.valid and found(r, "no-optimizer", "warning")
    strict = report(p, require="optimizer,step")
    assert not strict.valid and found(strict, "missing-optimizer")
    assert check_of(strict, "missing-optimizer") == "resumable"


def test_require_step(st_file: Path, pt_file: Path) -> None:
    assert found(report(st_file, require=["step"]), "missing-step")
    assert report(pt_file, require="optimizer,step").valid
    r = report(st_file)
    assert r.check("resumable").summary == "no training step recorded (weights only)"  # type: ignore[union-attr]


def test_parse_require() -> None:
    assert parse_require(" step , optimizer,step") == ("optimizer", "step")
    assert parse_require(None) == ()
    with pytest.raises(UsageError, match="unknown requirement 'rng'"):
        parse_require("rng")


def test_lightning_weights_only_checkpoint(tmp_path: Path) -> None:
    import lightning as L

    class Mod(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch: Any, _i: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()  # type: ignore[no-any-return]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters())

    with third_party_quiet():
        trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)),
                                           batch_size=4)
        trainer.fit(Mod(), data)
        trainer.save_checkpoint(tmp_path / "w.ckpt", weights_only=True)
        trainer.save_checkpoint(tmp_path / "full.ckpt")
    assert found(report(tmp_path / "w.ckpt"), "no-optimizer", "warning")
    assert report(tmp_path / "full.ckpt", require="optimizer,step").valid


def test_hf_trainer_checkpoint(hf_trainer_dir: Path, tmp_path: Path) -> None:
    r = report(hf_trainer_dir / "checkpoint-4", require="optimizer,step")
    assert r.valid and r.step == 4
    d = tmp_path / "checkpoint-4"
    shutil.copytree(hf_trainer_dir / "checkpoint-4", d)
    (d / "trainer_state.json").unlink()  # HF writes it last: the save did not finish
    r = report(d)
    assert found(r, "incomplete") and check_of(r, "incomplete") == "complete"


# -- values ------------------------------------------------------------------------------------


def test_values(tmp_path: Path) -> None:
    w = torch.randn(8, 8)
    w[1, 2] = float("nan")
    opt = torch.randn(8)
    opt[3] = float("inf")
    var = torch.ones(4)
    var[0] = float("inf")
    sd = {"model": {"w": w, "zero": torch.zeros(4), "ok": torch.ones(3), "ids": torch.arange(4),
                    "causal_mask": torch.full((2, 2), float("-inf")), "bn.running_var": var,
                    "half": torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)},
          "optimizer": {"state": {0: {"exp_avg": opt}}, "param_groups": []}, "step": 3}
    p = tmp_path / "v.pt"
    torch.save(sd, p)
    assert report(p).check("values").status == "skip"  # type: ignore[union-attr]
    r = report(p, values=True)
    by = {(f.code, f.location): f.severity for f in r.findings
          if f.code in ("nan", "inf", "all-zero")}
    assert by == {("nan", "model.w"): "error",
                  ("nan", "model.half"): "error",  # bf16, decoded without torch
                  ("inf", "optimizer.state.0.exp_avg"): "error",
                  ("all-zero", "model.zero"): "warning",
                  ("inf", "model.bn.running_var"): "warning",  # +inf in a buffer
                  ("inf", "model.causal_mask"): "info"}  # -inf in a mask buffer: on purpose
    nan = next(f for f in r.findings if f.code == "nan" and f.location == "model.w")
    assert nan.message == "1 of 64 values are NaN" and nan.file == "v.pt"
    assert check_of(r, "nan") == "values" and not r.valid


def test_values_of_a_dcp_checkpoint(sample_run: Path) -> None:
    r = report(sample_run / "step_000400", values=True)
    assert r.valid
    notes = [f for f in r.findings if f.code == "inf"]
    assert [(f.severity, f.location) for f in notes] == [("info", "model.causal_mask")]
    assert "114 floating tensor(s)" in r.check("values").summary  # type: ignore[union-attr]


# -- manifest, leftovers, run directories -------------------------------------------------------


def test_manifest_round_trip_and_bit_rot(shards: Path) -> None:
    r = report(shards, write_manifest=True)
    assert r.valid and r.manifest is not None and r.manifest.action == "written"
    assert (shards / "ckpt-manifest.json").is_file()
    assert r.manifest.files == 3 and r.manifest.bytes > 0  # the index and two shards
    again = report(shards)
    assert again.manifest is not None and again.manifest.action == "verified"
    assert again.check("manifest").status == "pass"  # type: ignore[union-attr]
    shard = next(shards.glob("model-00001-*.safetensors"))
    damage.flip(shard, shard.stat().st_size - 3)  # in tensor data: nothing else can see it
    r = report(shards)
    assert [f.file for f in found(r, "manifest-changed")] == [shard.name]
    assert check_of(r, "manifest-changed") == "manifest"
    assert r.manifest is not None and r.manifest.changed == [shard.name]


def test_manifest_names_missing_resized_and_extra_files(shards: Path) -> None:
    report(shards, write_manifest=True)
    files = sorted(shards.glob("model-*.safetensors"))
    files[0].unlink()
    damage.truncate(files[1], -8)
    (shards / "notes.txt").write_text("added later")
    r = report(shards)
    assert [f.file for f in found(r, "manifest-missing")] == [files[0].name]
    assert [f.file for f in found(r, "manifest-size")] == [files[1].name]
    assert [f.file for f in found(r, "manifest-extra", "warning")] == ["notes.txt"]


def test_manifest_not_written_for_invalid_checkpoint(pt_file: Path) -> None:
    damage.append(pt_file, b"x" * 8)
    r = report(pt_file, write_manifest=True)
    assert found(r, "manifest-not-written")
    assert not (pt_file.parent / "train.pt.ckpt-manifest.json").exists()


def test_manifest_of_a_single_file_with_other_checksums(pt_file: Path) -> None:
    for algo in ("sha256", "blake3"):
        r = report(pt_file, write_manifest=True, manifest_algorithm=algo)
        assert r.manifest is not None and r.manifest.algorithm == algo
        assert r.manifest.action == "written"
    mf = pt_file.parent / "train.pt.ckpt-manifest.json"
    assert '"algorithm": "blake3"' in mf.read_text()
    damage.flip(pt_file, 100)
    assert found(report(pt_file), "manifest-changed")


def test_unreadable_manifest(pt_file: Path) -> None:
    (pt_file.parent / "train.pt.ckpt-manifest.json").write_text('{"ckpt_manifest": 1}')
    r = report(pt_file)
    assert found(r, "bad-manifest") and r.manifest is not None
    assert r.manifest.action == "unreadable"


def test_manifest_verified_even_when_unreadable(pt_file: Path) -> None:
    report(pt_file, write_manifest=True)
    damage.truncate(pt_file, 1000)
    r = report(pt_file)
    assert found(r, "unreadable") and found(r, "manifest-size")


def test_leftovers(sample_copy: Path) -> None:
    (sample_copy / ".step_000500.ckpt-tmp-0123abcd").mkdir()
    (sample_copy / "step_000400" / ".x.ckpt-tmp-99").write_bytes(b"")
    result = validate(sample_copy)
    left = [f for f in result.run_checks[1].findings if f.code == "leftover"]
    assert [f.file for f in left] == [".step_000500.ckpt-tmp-0123abcd"]
    assert left[0].severity == "warning"
    r = next(c for c in result.checkpoints if c.name == "step_000400")
    assert [f.file for f in found(r, "leftover", "warning")] == [".x.ckpt-tmp-99"]
    assert result.valid and result.exit_code() == 0 and result.exit_code(strict=True) == 1


def test_run_directory_one_report_each(sample_copy: Path) -> None:
    damage.truncate(sample_copy / "step_000200" / "checkpoint.pt", 5000)
    result = validate(sample_copy)
    assert [r.name for r in result.checkpoints] == ["step_000100", "step_000200",
                                                    "step_000300", "step_000400"]
    assert [r.valid for r in result.checkpoints] == [True, False, True, True]
    assert not result.valid and result.exit_code() == 1
    latest = validate(sample_copy, latest=True)
    assert [r.name for r in latest.checkpoints] == ["step_000400"] and latest.valid


def test_latest_needs_a_run_directory(pt_file: Path) -> None:
    with pytest.raises(UsageError, match=": latest needs a run directory") as e:
        validate(pt_file, latest=True)
    assert e.value.param == "latest"


def test_unrecognisable_input_is_an_error_not_a_finding(tmp_path: Path) -> None:
    p = tmp_path / "notes.txt"
    p.write_text("hello")
    with pytest.raises(CkptError, match="unrecognised file"):
        validate(p)
    with pytest.raises(CkptError, match="no such file"):
        validate(tmp_path / "missing.pt")


def test_dcp_items_overlap(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"

    def overlap(md: Any) -> None:  # point the chunk at row 384 into the bytes of row 0's
        rows = {k.offset[0]: md.storage_data[k] for k in md.storage_data
                if k.fqn == "model.wte.weight"}
        rows[384].relative_path, rows[384].offset = rows[0].relative_path, rows[0].offset + 10

    damage.edit_dcp_metadata(d, overlap)
    r = report(d)
    assert found(r, "item-overlap") and check_of(r, "item-overlap") == "dcp-storage"
    # ... and the bytes there are no zip of their own.
    assert any(f.location and f.location.startswith("model.wte.weight@[384, 0]")
               for f in r.findings if f.severity == "error" and f.code.startswith("zip-"))


def test_dcp_object_item_past_the_end(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"

    def stretch(md: Any) -> None:
        k = next(k for k in md.storage_data if k.fqn == "step")
        md.storage_data[k].length = 10**9

    damage.edit_dcp_metadata(d, stretch)
    r = report(d)
    bad = found(r, "item-out-of-bounds")
    assert [f.location for f in bad] == ["step"] and check_of(r, "item-out-of-bounds") == (
        "dcp-storage")


def test_progress_is_reported(pt_file: Path) -> None:
    calls: list[tuple[str, int, int]] = []
    validate(pt_file, values=True, write_manifest=True,
             progress=lambda label, done, total: calls.append((label, done, total)))
    labels = {c[0] for c in calls}
    assert {"train.pt: CRC-32", "train.pt: values", "train.pt: hashing"} <= labels, labels
    for label in labels:
        mine = [c for c in calls if c[0] == label]
        assert mine[0][1] == 0 and mine[-1][1] == mine[-1][2] > 0, mine
        assert [c[1] for c in mine] == sorted(c[1] for c in mine)


def test_validate_writes_nothing_unless_asked(sample_copy: Path) -> None:
    def snapshot() -> dict[str, tuple[int, int]]:
        return {str(p.relative_to(sample_copy)): (p.stat().st_size, p.stat().st_mtime_ns)
                for p in sample_copy.rglob("*")}

    before = snapshot()
    validate(sample_copy, values=True)
    validate(sample_copy / "step_000400", values=True)
    assert snapshot() == before
    validate(sample_copy, write_manifest=True)
    after = snapshot()
    added = sorted(set(after) - set(before))
    assert added == [f"step_000{n}00/ckpt-manifest.json" for n in range(1, 5)]
    files = {k for k in before if (sample_copy / k).is_file()}  # directories gained a file
    assert {k: after[k] for k in files} == {k: before[k] for k in files}


def test_dcp_object_item_that_does_not_unpickle(sample_copy: Path) -> None:
    from ckpt_cli.formats import dcp

    d = sample_copy / "step_000400"
    fields, _ = dcp.parse_metadata(d / ".metadata")
    rel, off, length, _ = dcp.storage_map(fields["storage_data"], d, d / ".metadata")[
        ("step", None)]
    item = (d / rel).read_bytes()[off:off + length]
    start = item.find(b"\x80\x02", item.find(b"data.pkl"))  # data.pkl's PROTO opcode
    assert start > 0
    damage.flip(d / rel, off + start, 0x01)  # PROTO 0x80 -> 0x81: not a pickle any more
    r = report(d)
    assert [f.location for f in found(r, "bad-item")] == ["step"]
    assert check_of(r, "bad-item") == "dcp-chunks"


@pytest.mark.parametrize("victim", ["optimizer.pt", "model.safetensors", "scheduler.pt"])
def test_empty_file_in_a_checkpoint_directory(hf_trainer_dir: Path, tmp_path: Path,
                                              victim: str) -> None:
    """A file the save created but never wrote (a full disk, a killed job) must not pass."""
    d = tmp_path / "checkpoint-4"
    shutil.copytree(hf_trainer_dir / "checkpoint-4", d)
    (d / victim).write_bytes(b"")
    r = report(d)
    assert not r.valid, r.findings


def test_dcp_nested_in_a_checkpoint_directory(sample_run: Path, tmp_path: Path) -> None:
    """Accelerate's FSDP layout: loose files beside DCP directories (pytorch_model_fsdp_0/).

    (Detection takes a directory holding a DCP directory for a run; --input-format dir reads
    it as one checkpoint.)
    """
    d = tmp_path / "checkpoint_3"
    d.mkdir()
    torch.save({"last_epoch": 3, "_step_count": 4}, d / "scheduler.pt")
    shutil.copytree(sample_run / "step_000400", d / "pytorch_model_fsdp_0")
    assert_clean(report(d, fmt="dir"))
    nested = d / "pytorch_model_fsdp_0"
    damage.edit_dcp_metadata(nested, lambda md: md.state_dict_metadata[
        "model.wpe.weight"].chunks.pop(0))
    chunk = next(iter(sorted(nested.glob("__*.distcp"))))
    damage.flip(chunk, chunk.stat().st_size // 3)
    r = report(d, fmt="dir")
    assert found(r, "chunk-tiling")
    assert any(f.file and f.file.startswith("pytorch_model_fsdp_0/")
               for f in r.findings if f.severity == "error")


def test_run_directory_pointer_that_is_not_an_iteration(tmp_path: Path) -> None:
    megatron_legacy(tmp_path / "meg", tp=1)
    (tmp_path / "meg" / "latest_checkpointed_iteration.txt").write_text("iter_500\n")
    result = validate(tmp_path / "meg")
    (pointer,) = [c for c in result.run_checks if c.id == "latest-pointer"]
    assert [(f.code, f.file) for f in pointer.findings] == [
        ("bad-pointer", "latest_checkpointed_iteration.txt")]
    assert not result.valid


def test_lightning_last_symlink(lightning_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "pl"
    shutil.copytree(lightning_dir, d, symlinks=True)
    result = validate(d)
    assert result.valid and len(result.checkpoints) == 3
    (d / "last.ckpt").unlink()
    (d / "last.ckpt").symlink_to("epoch=0-step=6.ckpt")
    result = validate(d)
    (pointer,) = [c for c in result.run_checks if c.id == "latest-pointer"]
    assert [(f.code, f.file) for f in pointer.findings] == [("dangling-pointer", "last.ckpt")]


@requires_deepspeed
def test_deepspeed_checkpoints_pass_strict_validation(ds_dir: Path) -> None:
    for name in ("z1-fp32", "z3-bf16"):
        r = run_cli("validate", ds_dir / name, "--latest", "--strict")
        assert r.exit_code == 0, (name, r.output)


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
