"""``validate`` as a library: every check catches its defect, made on a real file.

Each test starts from a checkpoint written by the real library (torch, safetensors,
torch.distributed.checkpoint, huggingface_hub, Lightning, DeepSpeed) and damages it the way
a failure or a buggy writer would, then asserts the right check fails with the right code.
"""

from __future__ import annotations

import io
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

from tests.helpers import damage
from tests.helpers.makers import (
    training_checkpoint,
)
from tests.ops.validate.conftest import assert_clean, check_of, found, report

pytestmark = pytest.mark.requires_torch


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
