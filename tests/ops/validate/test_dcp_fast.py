"""DCP items of one layout, checked from memory: the same verdicts as the full checks.

A DCP checkpoint of many small tensors (saved by the real ``dcp.save``) is damaged one way
at a time in an item that is not the first of its layout (so ``validate``'s fast path,
``ops/validate/dcpfast.py``, meets it after learning the layout from a sound one). Each
damage must be found, and the findings must equal those of the full checks alone (the fast
path switched off): the full path is the oracle.
"""

from __future__ import annotations

import shutil
import struct
import zipfile
from collections.abc import Callable
from io import BytesIO
from pathlib import Path

import pytest
import torch

from ckpt_cli.formats import dcp as dcp_format
from ckpt_cli.formats import read_index, zipshape
from ckpt_cli.model import Chunk, Finding
from ckpt_cli.ops.validate import validate
from ckpt_cli.storage.reads import OpenFiles
from tests.conftest import third_party_quiet

pytestmark = pytest.mark.requires_torch

N = 12


@pytest.fixture(scope="module")
def small_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    out = tmp_path_factory.mktemp("dcpfast") / "ckpt"
    sd = {f"layers.{i}.w": torch.full((2,), float(i)) for i in range(N)}
    with third_party_quiet():
        dcp.save(sd, storage_writer=FileSystemWriter(str(out), single_file_per_rank=True),
                 no_dist=True)
    return out


def _findings(path: Path) -> tuple[list[Finding], list[str]]:
    r = validate(path).checkpoints[0]
    return r.findings, [f"{c.id}: {c.status}: {c.summary}" for c in r.checks]


def _both(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Finding], list[Finding]]:
    fast, fast_checks = _findings(path)
    with monkeypatch.context() as m:
        m.setattr(zipshape.Shapes, "match", lambda self, data: None)
        slow, slow_checks = _findings(path)
    assert fast == slow
    assert fast_checks == slow_checks  # record counts, bytes, item counts alike
    return fast, slow


def _item(path: Path, k: int) -> Chunk:
    """The k-th tensor's (only) chunk, by offset in its file."""
    chunks = sorted((c for t in read_index(path).tensors.values() for c in t.chunks),
                    key=lambda c: c.offset)
    return chunks[k]


def _zip(path: Path, c: Chunk) -> zipfile.ZipFile:
    data = (path / c.file).read_bytes()[c.offset:c.offset + c.length]
    return zipfile.ZipFile(BytesIO(data))


def _payload(path: Path, c: Chunk, suffix: str) -> int:
    """Absolute offset in the file of the payload of the item's record ending in suffix."""
    z = _zip(path, c)
    info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    raw = (path / c.file).read_bytes()
    head = c.offset + info.header_offset
    n, m = struct.unpack_from("<HH", raw, head + 26)
    return head + 30 + n + m


def _patch(path: Path, c: Chunk, at: int, new: bytes) -> None:
    f = path / c.file
    data = bytearray(f.read_bytes())
    data[at:at + len(new)] = new
    f.write_bytes(bytes(data))


def _central(path: Path, c: Chunk, suffix: str) -> int:
    """Absolute offset of the item's central directory entry of the record ending in suffix."""
    raw = (path / c.file).read_bytes()[c.offset:c.offset + c.length]
    name = next(i.filename for i in _zip(path, c).infolist()
                if i.filename.endswith(suffix)).encode()
    at = raw.index(b"PK\x01\x02")
    while raw[at + 46:at + 46 + struct.unpack_from("<H", raw, at + 28)[0]] != name:
        at += 46 + sum(struct.unpack_from("<HHH", raw, at + 28))
    return c.offset + at


def _damage_storage(path: Path, c: Chunk) -> None:
    at = _payload(path, c, "/data/0")
    _patch(path, c, at, bytes([(path / c.file).read_bytes()[at] ^ 0x10]))


def _damage_cd_crc(path: Path, c: Chunk) -> None:
    at = _central(path, c, "/data/0") + 16
    _patch(path, c, at, b"\x00\x00\x00\x00")


def _damage_pickle_global(path: Path, c: Chunk) -> None:
    at = _payload(path, c, "/data.pkl")
    raw = (path / c.file).read_bytes()
    _patch(path, c, raw.index(b"FloatStorage", at), b"FloatStorxge")


def _damage_pickle_call(path: Path, c: Chunk) -> None:
    at = _payload(path, c, "/data.pkl")
    raw = (path / c.file).read_bytes()  # the backward-hooks dict, built by a REDUCE
    old = b"collections\nOrderedDict\n"
    new = b"os\nsystem\n" + b"N0" * 7  # padded with no-ops (push None, pop) to the same length
    assert len(new) == len(old)
    _patch(path, c, raw.index(old, at), new)


def _damage_dtype(path: Path, c: Chunk) -> None:
    at = _payload(path, c, "/data.pkl")
    raw = (path / c.file).read_bytes()
    _patch(path, c, raw.index(b"FloatStorage", at), b"ShortStorage")


def _damage_local_name(path: Path, c: Chunk) -> None:
    z = _zip(path, c)
    info = next(i for i in z.infolist() if i.filename.endswith("/byteorder"))
    _patch(path, c, c.offset + info.header_offset + 30 + len(info.filename) - 1, b"X")


def _end_record_in_payload(path: Path, c: Chunk) -> None:
    _patch(path, c, _payload(path, c, "/data/0"), b"PK\x05\x06")


def _descriptor_crc(path: Path, c: Chunk) -> None:
    at = _payload(path, c, "/data/0") + 8  # the 8 bytes of two F32 values, then PK\x07\x08
    raw = (path / c.file).read_bytes()
    assert raw[at:at + 4] == b"PK\x07\x08"
    _patch(path, c, at + 4, bytes([raw[at + 4] ^ 1]))


DAMAGES: dict[str, tuple[Callable[[Path, Chunk], None], set[str]]] = {
    "storage-bytes": (_damage_storage, {"crc-mismatch"}),
    "central-crc": (_damage_cd_crc, {"zip-data-descriptor"}),
    "descriptor-crc": (_descriptor_crc, {"zip-data-descriptor"}),
    "pickle-global": (_damage_pickle_global, {"chunk-undecodable"}),
    "pickle-call": (_damage_pickle_call, {"unsafe-global", "crc-mismatch"}),
    "pickle-dtype": (_damage_dtype, {"chunk-undecodable"}),
    "local-name": (_damage_local_name, {"zip-local-header"}),
    "end-record-in-payload": (_end_record_in_payload, {"crc-mismatch"}),
}


def test_sound_small_items_validate_alike(small_dcp: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    fast, _ = _both(small_dcp, monkeypatch)
    assert [f for f in fast if f.severity != "info"] == []
    r = validate(small_dcp).checkpoints[0]
    crc = next(c for c in r.checks if c.id == "crc32")
    assert crc.summary.startswith(f"{N * 7:,} record(s)")  # seven records per torch.save zip


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_damage_in_a_known_layout_is_found_as_the_full_checks_find_it(
        name: str, small_dcp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(small_dcp, path)
    damage, codes = DAMAGES[name]
    c = _item(path, N // 2)
    damage(path, c)
    fast, _ = _both(path, monkeypatch)
    got = {f.code for f in fast if f.severity != "info"}
    assert codes <= got, (name, fast)
    assert all(f.file == c.file for f in fast if f.severity != "info")


def test_stats_reads_chunks_of_a_known_layout_as_parse_zip_does(
        small_dcp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = read_index(small_dcp)
    pairs = [(t, c) for t in index.tensors.values() for c in t.chunks]
    with OpenFiles() as files:
        def fd_of(rel: str) -> int:
            return files.open(small_dcp / rel)  # type: ignore[return-value]

        monkeypatch.setattr(zipshape, "_SHAPES", zipshape.Shapes())
        calls: list[int] = []
        full = zipshape.parse_zip
        monkeypatch.setattr(zipshape, "parse_zip",
                            lambda *a: calls.append(1) or full(*a))  # type: ignore[func-returns-value]
        fast = [dcp_format.locate_chunk(index, fd_of, t, c) for t, c in pairs]
        assert len(calls) == 1  # the first item taught the layout; the rest were matched
        monkeypatch.setattr(zipshape.Shapes, "match", lambda self, data: None)
        slow = [dcp_format.locate_chunk(index, fd_of, t, c) for t, c in pairs]
        assert len(calls) == 1 + len(pairs)
    assert fast == slow
