"""The integrity manifest module, used by ``validate`` now and by ``consolidate`` later."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import xxhash
from safetensors.torch import save_file

from ckpt_cli.errors import CorruptCheckpointError, UsageError
from ckpt_cli.manifest import (
    MANIFEST_NAME,
    Manifest,
    checkpoint_files,
    compute_manifest,
    manifest_path,
    new_hasher,
    read_manifest,
    verify_manifest,
    write_manifest,
)
from tests.helpers import damage
from tests.helpers.makers import hf_sharded, tiny_state_dict

pytestmark = pytest.mark.requires_torch


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    import torch

    d = tmp_path / "export"
    d.mkdir()
    hf_sharded(d, {f"w{i}": torch.randn(40, 40) for i in range(3)}, max_shard_size=10_000)
    (d / "sub").mkdir()
    (d / "sub" / "config.json").write_text("{}")
    return d


def test_write_and_verify_round_trip(ckpt: Path) -> None:
    dest, m, stats = write_manifest(ckpt, jobs=2)
    assert dest == ckpt / MANIFEST_NAME and dest.is_file()
    assert stats is not None and stats.files == len(m.files) and stats.bytes == m.total_bytes
    assert "sub/config.json" in m.files and MANIFEST_NAME not in m.files
    assert sorted(m.files) == checkpoint_files(ckpt)
    doc = json.loads(dest.read_text())
    assert doc["ckpt_manifest"] == 1 and doc["algorithm"] == "xxh3_128"
    assert [e["path"] for e in doc["files"]] == sorted(m.files)
    v = verify_manifest(ckpt)
    assert v is not None and v.ok and v.findings(MANIFEST_NAME) == []
    assert list(ckpt.glob(".*ckpt-tmp*")) == []


def test_digests_are_the_standard_ones(ckpt: Path) -> None:
    """xxh3_128 equals xxh128sum's digest and sha256 equals sha256sum's: tools can cross-check."""
    shard = next(ckpt.glob("*.safetensors"))
    data = shard.read_bytes()
    m, _ = compute_manifest(ckpt)
    assert m.files[shard.name].digest == xxhash.xxh3_128(data).hexdigest()
    m, _ = compute_manifest(ckpt, algorithm="sha256")
    assert m.files[shard.name].digest == hashlib.sha256(data).hexdigest()


def test_verify_names_each_discrepancy(ckpt: Path) -> None:
    write_manifest(ckpt)
    shards = sorted(ckpt.glob("model-*.safetensors"))
    damage.flip(shards[0], 200)
    damage.truncate(shards[1], -1)
    (ckpt / "sub" / "config.json").unlink()
    (ckpt / "sub" / "new.bin").write_bytes(b"1")
    (ckpt / ".x.ckpt-tmp-1").write_bytes(b"ignored")  # ckpt's own temporaries are not files
    v = verify_manifest(ckpt)
    assert v is not None and not v.ok
    assert v.changed == [shards[0].name]
    assert v.resized == [(shards[1].name, shards[1].stat().st_size + 1,
                          shards[1].stat().st_size)]
    assert v.missing == ["sub/config.json"] and v.extra == ["sub/new.bin"]
    codes = [(f.code, f.file, f.severity) for f in v.findings(MANIFEST_NAME)]
    assert codes == [("manifest-changed", shards[0].name, "error"),
                     ("manifest-size", shards[1].name, "error"),
                     ("manifest-missing", "sub/config.json", "error"),
                     ("manifest-extra", "sub/new.bin", "warning")]


def test_single_file_checkpoint(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    save_file(tiny_state_dict(), str(p))
    assert manifest_path(p) == tmp_path / "m.safetensors.ckpt-manifest.json"
    assert checkpoint_files(p) == ["m.safetensors"]
    write_manifest(p, algorithm="blake3")
    m = read_manifest(p)
    assert m is not None and m.algorithm == "blake3" and list(m.files) == ["m.safetensors"]
    v = verify_manifest(p)
    assert v is not None and v.ok and v.stats.bytes == p.stat().st_size
    other = tmp_path / "other.safetensors"
    save_file(tiny_state_dict(), str(other))
    assert verify_manifest(other) is None  # no manifest: nothing to verify


def test_writer_fills_a_manifest_itself(tmp_path: Path) -> None:
    """What ``consolidate`` will do: hash while writing, then save the manifest."""
    d = tmp_path / "out"
    d.mkdir()
    m = Manifest("sha256")
    for name, payload in (("a.bin", b"abc"), ("b.bin", b"")):
        h = new_hasher("sha256")
        h.update(payload)
        (d / name).write_bytes(payload)
        m.add(name, len(payload), h.hexdigest())
    write_manifest(d, manifest=m)
    v = verify_manifest(d)
    assert v is not None and v.ok
    assert v.stats.files == 2


@pytest.mark.parametrize("doc,fragment", [
    ("not json", "not valid JSON"),
    ("[]", "not a ckpt manifest"),
    ('{"ckpt_manifest": 2, "algorithm": "xxh3_128", "files": []}', "newer than this ckpt"),
    ('{"ckpt_manifest": 1, "algorithm": "md5", "files": []}', "unknown manifest checksum"),
    ('{"ckpt_manifest": 1, "algorithm": "sha256", "files": [{"path": "a", "size": 1, '
     '"digest": "00"}]}', "malformed manifest entry"),
    # Not hex digits, though int(s, 16) reads them: a prefix, an underscore, a space.
    *[('{"ckpt_manifest": 1, "algorithm": "xxh3_128", "files": [{"path": "a", "size": 1, '
       f'"digest": "{d}"}}]}}', "malformed manifest entry")
      for d in ("0x" + "0" * 30, "0_" + "0" * 30, " " + "0" * 31)],
    ('{"ckpt_manifest": 1, "algorithm": "xxh3_128", "files": [{"path": "../x", "size": 1, '
     f'"digest": "{"0" * 32}"}}]}}', "not a path inside the checkpoint"),
    ('{"ckpt_manifest": 1, "algorithm": "xxh3_128", "files": [{"path": "/etc/passwd", '
     f'"size": 1, "digest": "{"0" * 32}"}}]}}', "not a path inside the checkpoint"),
])
def test_malformed_manifests_are_refused(tmp_path: Path, doc: str, fragment: str) -> None:
    (tmp_path / MANIFEST_NAME).write_text(doc)
    with pytest.raises(CorruptCheckpointError, match=fragment):
        read_manifest(tmp_path)


def test_unknown_algorithm_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="unknown checksum 'md5'"):
        compute_manifest(tmp_path, algorithm="md5")


def test_a_directory_deleted_while_hashed_gets_no_sibling_manifest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A concurrent prune may delete the checkpoint while its manifest is computed: the write
    must fail, not leave ``step_4.ckpt-manifest.json`` beside where the directory was."""
    import shutil

    from ckpt_cli import manifest as m
    from ckpt_cli.errors import CkptError

    ckpt = tmp_path / "step_4"
    ckpt.mkdir()
    (ckpt / "model.bin").write_bytes(b"x" * 100)
    real = m.compute_manifest

    def compute_then_vanish(*a: object, **kw: object) -> object:
        out = real(*a, **kw)  # type: ignore[arg-type]
        shutil.rmtree(ckpt)
        return out

    monkeypatch.setattr(m, "compute_manifest", compute_then_vanish)
    with pytest.raises(CkptError, match="does not exist"):
        m.write_manifest(ckpt)
    assert list(tmp_path.iterdir()) == []



def test_a_large_file_read_ahead_by_spare_threads(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A file of READ_AHEAD_MIN or more, with threads to spare, is copied ahead of its digest by
    several threads: same digests, and a byte changed in its last chunk is still found."""
    import random
    import threading

    from ckpt_cli import manifest as manifest_mod
    from ckpt_cli.storage import reads

    # Sizes scaled down (64 MiB -> 1 MiB, 8 MiB chunks -> 256 KiB): the same code paths.
    monkeypatch.setattr(manifest_mod, "READ_AHEAD_MIN", 1 << 20)
    monkeypatch.setattr(reads, "READ_AHEAD_CHUNK", 256 << 10)
    d = tmp_path / "export"
    d.mkdir()
    big = d / "model.safetensors"
    big.write_bytes(random.Random(7).randbytes((1 << 20) + 3 * (256 << 10) + 5))
    (d / "config.json").write_text("{}")
    data = big.read_bytes()
    seen: set[str] = set()
    real = reads.read_ahead

    def spy(*a, **k):  # type: ignore[no-untyped-def]
        seen.add(f"readers={k['readers']}")
        for v in real(*a, **k):
            seen.update(t.name for t in threading.enumerate())
            yield v

    monkeypatch.setattr(manifest_mod, "read_ahead", spy)
    got, _ = manifest_mod.hash_files(d, ["model.safetensors", "config.json"], jobs=3)
    monkeypatch.setattr(manifest_mod, "read_ahead", real)
    assert got["model.safetensors"].digest == xxhash.xxh3_128(data).hexdigest()
    assert got["model.safetensors"].size == len(data)
    assert {"readers=3", "readers=1"} <= seen  # the big file: 3 readers; config.json: 1
    assert any(n.startswith("ckpt-readahead") for n in seen)
    m, _ = compute_manifest(d, algorithm="sha256", jobs=2)
    assert m.files["model.safetensors"].digest == hashlib.sha256(data).hexdigest()
    write_manifest(d, jobs=2)
    with big.open("r+b") as f:
        f.seek(len(data) - 3)
        f.write(bytes([data[-3] ^ 1]))
    v = verify_manifest(d, jobs=2)
    assert v is not None and not v.ok and v.findings("model.safetensors")
    with big.open("r+b") as f:
        f.truncate(len(data) - (256 << 10))
    v = verify_manifest(d, jobs=2)
    assert v is not None and not v.ok and v.findings("model.safetensors")
