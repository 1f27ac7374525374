"""torch zip files (formats/torchfile): geometry, damage and dtypes."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpt_cli.errors import CorruptCheckpointError
from ckpt_cli.formats import read_index
from ckpt_cli.ops.convert import convert
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.damage import flip_in_entry, replace_pickle

pytestmark = pytest.mark.requires_torch


def test_negative_storage_offset_is_damage(tmp_path: Path) -> None:
    p = tmp_path / "neg.pt"
    torch.save({"w": torch.arange(4.0)}, p)
    with zipfile.ZipFile(p) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    # storage_offset is the BININT1 0 right after the BINPERSID of the storage tuple.
    i = pkl.index(b"Q") + 1
    assert pkl[i:i + 2] == b"K\x00"
    replace_pickle(p, pkl[:i] + b"J\xfe\xff\xff\xff" + pkl[i + 2:])  # BININT -2
    index = read_index(p)
    assert [f.code for f in index.findings if f.severity == "error"] == ["bad-tensor"]
    with pytest.raises(CorruptCheckpointError, match="storage offset -2"):
        convert(p, tmp_path / "out.safetensors")


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
    flip_in_entry(src, f"data/{t.storage.key}", 40)
    r = run_cli("convert", src, "-o", tmp_path / "o.safetensors")
    assert r.exit_code == 2 and "CRC-32" in r.stderr, r.output
    assert not (tmp_path / "o.safetensors").exists()


def test_many_views_of_a_damaged_storage_read_it_once(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt_cli.tensors.source import TensorSource

    base = torch.randn(256, 64)
    src = tmp_path / "slices.pt"
    torch.save({f"s{i}": base[i] for i in range(256)}, src)
    index = read_index(src)
    storage = index.tensors["s0"].storage
    assert storage is not None
    flip_in_entry(src, f"data/{storage.key}", 10)
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


def test_skip_data_files_are_refused(tmp_path: Path) -> None:
    # torch.serialization.skip_data() writes the structure but not the bytes (CRC 0 among
    # real checksums): converting it would ship zeros.
    src = tmp_path / "skip.pt"
    with torch.serialization.skip_data():
        torch.save({"a": torch.randn(300, 40)}, src)
    r = run_cli("convert", src, "-o", tmp_path / "o.safetensors")
    assert r.exit_code == 2 and "CRC-32" in r.stderr, r.output


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
