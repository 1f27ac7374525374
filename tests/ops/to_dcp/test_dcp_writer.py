"""The DCP writer without torch (issue 48's speed): what it writes is what ``dcp.save`` writes.

The ``.metadata`` unpickles to the ``Metadata`` torch's own save gives the same state dict
(every field but the ids), each item is a ``torch.save`` archive whose ``data.pkl`` is torch's
byte for byte and which ``torch.load(weights_only=True)`` and ``dcp.load`` read back, ZIP64
archives included; tensors stream in pieces within the memory budget; and writing imports no
torch.
"""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.requires_torch

torch = pytest.importorskip("torch")

from ckpt_cli.ops.to_dcp import zipitem  # noqa: E402
from ckpt_cli.ops.to_dcp.state import LazyTensor  # noqa: E402
from ckpt_cli.ops.to_dcp.writer import write_dcp  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def _values() -> dict[str, Any]:
    g = np.random.default_rng(0)
    return {
        "w": g.standard_normal((6, 5)).astype(np.float32),
        "opt": {"state": {"w": {"step": np.asarray(7.0, np.float32),
                                "exp_avg": g.standard_normal((6, 5)).astype(np.float32)}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"],
                                  "amsgrad": False, "name": None}]},
        "emb": g.standard_normal((40, 8)).astype(np.float16),
        "ids": np.arange(12, dtype=np.int64).reshape(3, 4),
        "empty": np.zeros((0, 3), np.float32),
        "train_state": {"step": np.asarray(5, np.int32), "epoch": 2},
        "rng": [np.arange(16, dtype=np.uint8), {"seed": 3}],
        "lr_scheduler": {"last_epoch": 3, "_last_lr": [0.1]},
    }


def _lazy(tree: Any, pieces: bool = False) -> Any:
    if isinstance(tree, np.ndarray):
        a = tree

        def gen() -> Iterator[np.ndarray]:
            flat = a.reshape(-1)
            for i in range(0, max(flat.size, 1), 7):
                yield flat[i:i + 7]

        return LazyTensor(str({"float32": "F32", "float16": "F16", "int64": "I64",
                               "int32": "I32", "uint8": "U8"}[a.dtype.name]),
                          tuple(a.shape), lambda: a, gen if pieces else None)
    if isinstance(tree, dict):
        return {k: _lazy(v, pieces) for k, v in tree.items()}
    if isinstance(tree, list) and any(isinstance(v, (np.ndarray, dict)) for v in tree):
        return [_lazy(v, pieces) for v in tree]
    return tree


def _torch(tree: Any) -> Any:
    if isinstance(tree, np.ndarray):  # fresh strides: numpy's of an empty array are 0
        src = torch.from_numpy(tree.copy())
        return torch.empty(src.shape, dtype=src.dtype).copy_(src)
    if isinstance(tree, dict):
        return {k: _torch(v) for k, v in tree.items()}
    if isinstance(tree, list) and any(isinstance(v, (np.ndarray, dict)) for v in tree):
        return [_torch(v) for v in tree]
    return tree


def _torch_save(tree: dict[str, Any], out: Path) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_torch(tree), storage_writer=FileSystemWriter(
            str(out), single_file_per_rank=True, sync_files=False, thread_count=1),
            no_dist=True)
    return pickle.loads((out / ".metadata").read_bytes())


@pytest.mark.parametrize("pieces", [False, True])
def test_metadata_is_dcp_saves(tmp_path: Path, pieces: bool) -> None:
    values = _values()
    res = write_dcp(_lazy(values, pieces), tmp_path / "ours", bucket_bytes=1 << 30)
    ours = pickle.loads((tmp_path / "ours" / ".metadata").read_bytes())
    theirs = _torch_save(values, tmp_path / "theirs")
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.planner_data == theirs.planner_data
    assert ours.version == theirs.version
    assert list(ours.storage_data) == list(theirs.storage_data)  # keys, in the order written
    assert [k.index for k in ours.storage_data] == [k.index for k in theirs.storage_data]
    assert type(ours.storage_meta) is type(theirs.storage_meta)
    assert ours.storage_meta.load_id is None and ours.storage_meta.modules == []
    assert len(ours.storage_meta.save_id) == 36
    assert res.tensors == sum(1 for v in theirs.state_dict_metadata.values()
                              if hasattr(v, "chunks"))
    # Each item: its range is a torch.save archive of the value, data.pkl as torch's.
    for key, info in ours.storage_data.items():
        raw = (tmp_path / "ours" / info.relative_path).read_bytes()
        item = raw[info.offset:info.offset + info.length]
        zf = zipfile.ZipFile(io.BytesIO(item))
        assert zf.testzip() is None  # every CRC-32 right
        ref = theirs.storage_data[key]
        ref_raw = (tmp_path / "theirs" / ref.relative_path).read_bytes()
        ref_item = ref_raw[ref.offset:ref.offset + ref.length]
        ref_zf = zipfile.ZipFile(io.BytesIO(ref_item))
        assert zf.namelist() == ref_zf.namelist()
        for name in zf.namelist():
            if not name.endswith("serialization_id"):
                assert zf.read(name) == ref_zf.read(name), (key.fqn, name)
        for i in zf.infolist():  # payloads 64-byte aligned in the archive, as torch's
            assert (i.header_offset + 30 + len(i.filename) + len(
                _local_extra(item, i.header_offset))) % 64 == 0


def _local_extra(item: bytes, at: int) -> bytes:
    name_len, extra_len = int.from_bytes(item[at + 26:at + 28], "little"), int.from_bytes(
        item[at + 28:at + 30], "little")
    return item[at + 30 + name_len:at + 30 + name_len + extra_len]


def test_dcp_load_reads_it_back(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    values = _values()
    write_dcp(_lazy(values, pieces=True), tmp_path / "o", bucket_bytes=256)
    target = _torch(values)

    def zero(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return torch.zeros_like(t)
        if isinstance(t, dict):
            return {k: zero(v) for k, v in t.items()}
        return [zero(v) for v in t] if isinstance(t, list) else t

    got = zero(target)
    got["opt"]["param_groups"][0]["lr"] = 0.0
    got["train_state"]["epoch"] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, checkpoint_id=str(tmp_path / "o"), no_dist=True)
    assert got["opt"]["param_groups"] == target["opt"]["param_groups"]
    assert got["train_state"]["epoch"] == 2 and got["lr_scheduler"] == values["lr_scheduler"]
    for path in (("w",), ("emb",), ("ids",), ("opt", "state", "w", "exp_avg"),
                 ("opt", "state", "w", "step"), ("train_state", "step"), ("rng", 0)):
        a, b = got, target
        for p in path:
            a, b = a[p], b[p]
        assert a.dtype == b.dtype and torch.equal(a, b), path


def test_zip64_archives_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizes and offsets past 4 GiB take ZIP64 fields: forced here with a tiny limit."""
    monkeypatch.setattr(zipitem, "LIMIT", 100)
    arr = np.arange(300, dtype=np.float32)
    out = bytearray()
    z = zipitem.ItemZip(out.extend)
    zipitem.tensor_header(z, "F32", (300,), arr.nbytes)
    z.data(memoryview(arr).cast("B"))
    z.end()
    z.finish()
    raw = bytes(out)
    assert b"PK\x06\x06" in raw and b"PK\x06\x07" in raw  # zip64 end record and locator
    assert zipfile.ZipFile(io.BytesIO(raw)).testzip() is None
    t = torch.load(io.BytesIO(raw), weights_only=True)
    assert torch.equal(t, torch.from_numpy(arr))


def test_a_record_shorter_than_declared_is_refused() -> None:
    z = zipitem.ItemZip(lambda mv: None)
    z.begin("data/0", 8)
    z.data(memoryview(b"1234"))
    with pytest.raises(ValueError, match="4 bytes written, 8 declared"):
        z.end()


def test_pieces_stream_within_the_budget(tmp_path: Path) -> None:
    """A tensor with pieces is never loaded whole."""
    big = np.arange(1 << 16, dtype=np.float32)

    def load() -> np.ndarray:
        raise AssertionError("loaded whole")

    def pieces() -> Iterator[np.ndarray]:
        for i in range(0, big.size, 4096):
            yield big[i:i + 4096]

    write_dcp({"big": LazyTensor("F32", big.shape, load, pieces)}, tmp_path / "o",
              max_memory=1)
    import torch.distributed.checkpoint as dcp

    got = {"big": torch.zeros(big.size)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, checkpoint_id=str(tmp_path / "o"), no_dist=True)
    assert torch.equal(got["big"], torch.from_numpy(big))


def test_a_piece_of_another_dtype_is_refused(tmp_path: Path) -> None:
    from ckpt_cli.errors import CorruptCheckpointError

    lz = LazyTensor("F32", (4,), lambda: np.zeros(4, np.float32),
                    lambda: iter([np.zeros(4, np.float64)]))
    with pytest.raises(CorruptCheckpointError, match="w: read float64, expected F32"):
        write_dcp({"w": lz}, tmp_path / "out")
    assert not list(tmp_path.iterdir())


def test_writing_imports_no_torch(tmp_path: Path) -> None:
    code = ("import sys, numpy as np\n"
            "from ckpt_cli.ops.to_dcp.state import LazyTensor\n"
            "from ckpt_cli.ops.to_dcp.writer import write_dcp\n"
            "a = np.ones((3, 3), np.float32)\n"
            f"write_dcp({{'w': LazyTensor('F32', (3, 3), lambda: a), 'step': 3}}, "
            f"__import__('pathlib').Path({str(tmp_path / 'o')!r}))\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    assert (tmp_path / "o" / ".metadata").is_file()


def _from_torch_file(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    from ckpt_cli.ops.to_dcp.torch_dict import read_torch
    from ckpt_cli.ops.to_dcp.writer import layout_state

    model = torch.nn.Linear(64, 32)
    src = tmp_path / "train.pt"
    torch.save({"model": model.state_dict(), "step": 4}, src)
    return src, layout_state(read_torch(src), "recipe")


def test_the_sources_checksum_is_the_archives(tmp_path: Path) -> None:
    """A torch file's tensors carry their storage entry's CRC-32 (checked as they are read),
    which the archives take: every one is right."""
    _, tree = _from_torch_file(tmp_path)
    assert all(v.crc is not None for v in tree["model"].values())
    write_dcp(tree, tmp_path / "o")
    md = pickle.loads((tmp_path / "o" / ".metadata").read_bytes())
    for info in md.storage_data.values():
        raw = (tmp_path / "o" / info.relative_path).read_bytes()
        zf = zipfile.ZipFile(io.BytesIO(raw[info.offset:info.offset + info.length]))
        assert zf.testzip() is None


def test_damaged_source_bytes_fail_the_write(tmp_path: Path) -> None:
    from ckpt_cli.errors import CorruptCheckpointError

    src, _ = _from_torch_file(tmp_path)
    raw = bytearray(src.read_bytes())
    zf = zipfile.ZipFile(io.BytesIO(bytes(raw)))
    entry = next(i for i in zf.infolist() if i.filename.endswith("data/0"))
    at = entry.header_offset + 30 + len(entry.filename) + len(
        _local_extra(bytes(raw), entry.header_offset)) + 5
    raw[at] ^= 0xFF
    src.write_bytes(bytes(raw))
    from ckpt_cli.ops.to_dcp.torch_dict import read_torch
    from ckpt_cli.ops.to_dcp.writer import layout_state

    tree = layout_state(read_torch(src), "recipe")
    with pytest.raises(CorruptCheckpointError, match="CRC-32"):
        write_dcp(tree, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_a_value_that_is_not_plain_data_is_refused(tmp_path: Path) -> None:
    from ckpt_cli.errors import UnsupportedError

    lz = LazyTensor("F32", (2,), lambda: np.zeros(2, np.float32))
    with pytest.raises(UnsupportedError, match="pair: a value DCP cannot hold"):
        write_dcp({"pair": (lz, 1)}, tmp_path / "out")  # a tuple is a leaf, as DCP has it
    assert not list(tmp_path.iterdir())
