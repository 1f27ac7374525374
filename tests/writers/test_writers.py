"""The output writers (ckpt_cli/writers)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_cli import dtypes
from ckpt_cli.errors import DestinationExistsError, UsageError
from ckpt_cli.writers import OutTensor, write_checkpoint
from ckpt_cli.writers.plan import plan_shards
from ckpt_cli.writers.torchzip import TorchZipWriter

pytestmark = pytest.mark.requires_torch


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


# --- write_checkpoint end to end, read back by the real libraries ------------------------------

def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "a.weight": rng.standard_normal((4, 8)).astype(np.float32),
        "b.bias": np.arange(16, dtype=np.int64),
        "c.half": rng.standard_normal((3, 5)).astype(np.float16),
        "d.scalar": np.array(2.5, dtype=np.float64),
    }


def _bf16() -> np.ndarray:
    return np.arange(-6, 6, dtype=np.float32).reshape(3, 4).astype(dtypes.numpy_dtype("BF16"))


_CODES = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(np.float16): "F16",
          np.dtype(np.float64): "F64"}


def _out(values: dict[str, np.ndarray]) -> list[OutTensor]:
    return [OutTensor(name, _CODES[arr.dtype], tuple(arr.shape), lambda a=arr: a)
            for name, arr in values.items()]


def test_safetensors_file_reads_back_with_metadata(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.numpy import load_file

    values = _tensors()
    dest = tmp_path / "out.safetensors"
    res = write_checkpoint(dest, _out(values), metadata={"note": "hello"})
    got = load_file(str(dest))
    assert set(got) == set(values)
    for name, arr in values.items():
        assert got[name].dtype == arr.dtype and got[name].shape == arr.shape
        np.testing.assert_array_equal(got[name], arr)
    with safe_open(str(dest), framework="np") as f:
        meta = f.metadata()
    assert meta["note"] == "hello" and meta["format"] == "pt"
    assert res.tensors == 4 and res.tensor_bytes == sum(a.nbytes for a in values.values())
    assert res.files == [("out.safetensors", dest.stat().st_size)]
    assert res.index_file is None


def test_safetensors_bf16_reads_back_in_torch(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    arr = _bf16()
    dest = tmp_path / "bf.safetensors"
    write_checkpoint(dest, [OutTensor("w", "BF16", (3, 4), lambda: arr)])
    got = load_file(str(dest))["w"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.arange(-6, 6, dtype=torch.float32).reshape(3, 4)
                       .to(torch.bfloat16))


def test_torch_zip_file_reads_back_with_weights_only(tmp_path: Path) -> None:
    values = _tensors()
    bf = _bf16()
    out = [*_out(values), OutTensor("e.bf16", "BF16", (3, 4), lambda: bf)]
    dest = tmp_path / "out.pt"
    write_checkpoint(dest, out, fmt="pt")
    got = torch.load(dest, weights_only=True)
    assert list(got) == [*values, "e.bf16"]
    for name, arr in values.items():
        assert got[name].dtype == torch.from_numpy(arr).dtype
        assert torch.equal(got[name], torch.from_numpy(arr))
    assert got["e.bf16"].dtype == torch.bfloat16
    want = torch.arange(-6, 6, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
    assert torch.equal(got["e.bf16"], want)


def test_torch_zip_alias_shares_storage(tmp_path: Path) -> None:
    arr = np.arange(6, dtype=np.float32)
    dest = tmp_path / "tied.pt"
    write_checkpoint(dest, [OutTensor("emb", "F32", (6,), lambda: arr)], fmt="pt",
                     aliases={"head": "emb"})
    got = torch.load(dest, weights_only=True)
    assert torch.equal(got["head"], got["emb"])
    assert got["head"].untyped_storage().data_ptr() == got["emb"].untyped_storage().data_ptr()


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_sharded_directory_and_index(tmp_path: Path, fmt: str) -> None:
    rng = np.random.default_rng(1)
    values = {f"layer.{i}.w": rng.standard_normal((10, 10)).astype(np.float32)
              for i in range(7)}  # 400 bytes each
    dest = tmp_path / "model"
    res = write_checkpoint(dest, _out(values), fmt=fmt, max_shard_size=1000)
    plan = plan_shards([400] * 7, 1000)
    n = len(plan.files)
    assert n == 4  # 2+2+2+1
    stem, ext = ("model", ".safetensors") if fmt == "safetensors" else ("pytorch_model", ".bin")
    shards = [f"{stem}-{i:05d}-of-{n:05d}{ext}" for i in range(1, n + 1)]
    index_name = f"{stem}{ext}.index.json"
    assert sorted(p.name for p in dest.iterdir()) == sorted([*shards, index_name])
    assert res.index_file == index_name
    index = json.loads((dest / index_name).read_text())
    assert index["metadata"]["total_size"] == 7 * 400
    assert index["metadata"]["total_parameters"] == 7 * 100
    wm = index["weight_map"]
    assert sorted(wm) == sorted(values)  # every tensor exactly once
    assert set(wm.values()) == set(shards)
    seen: dict[str, np.ndarray] = {}
    for shard in shards:
        if fmt == "safetensors":
            from safetensors.numpy import load_file
            part = load_file(str(dest / shard))
        else:
            part = {k: v.numpy() for k, v in
                    torch.load(dest / shard, weights_only=True).items()}
        assert all(wm[k] == shard for k in part)
        assert not set(part) & set(seen)
        seen.update(part)
    assert set(seen) == set(values)
    for name, arr in values.items():
        np.testing.assert_array_equal(seen[name], arr)


def test_plan_shards_packs_in_order_and_isolates_oversize() -> None:
    plan = plan_shards([5, 5, 20, 1, 1], 10)
    assert plan.members == ((0, 1), (2,), (3, 4))
    assert plan.sizes == (10, 20, 2)
    assert plan.files == tuple(f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3))
    one = plan_shards([5, 5], None)
    assert one.files == ("model.safetensors",) and not one.sharded
    with pytest.raises(ValueError):
        plan_shards([1], 0)


def test_single_file_refuses_to_shard(tmp_path: Path) -> None:
    arr = np.zeros(100, dtype=np.float32)
    out = [OutTensor(f"t{i}", "F32", (100,), lambda: arr) for i in range(3)]
    with pytest.raises(UsageError):
        write_checkpoint(tmp_path / "x.safetensors", out, max_shard_size=500)
    assert list(tmp_path.iterdir()) == []


def _boom() -> np.ndarray:
    raise RuntimeError("loader failed")


@pytest.mark.parametrize("dest_name,fmt,shard", [("out.safetensors", "safetensors", None),
                                                 ("out.pt", "pt", None),
                                                 ("outdir", "safetensors", 500),
                                                 ("outdir", "pt", None)])
def test_failing_loader_leaves_nothing(tmp_path: Path, dest_name: str, fmt: str,
                                       shard: int | None) -> None:
    good = np.ones(100, dtype=np.float32)
    out = [OutTensor("t0", "F32", (100,), lambda: good),
           OutTensor("t1", "F32", (100,), lambda: good),
           OutTensor("t2", "F32", (100,), _boom)]
    with pytest.raises(RuntimeError, match="loader failed"):
        write_checkpoint(tmp_path / dest_name, out, fmt=fmt, max_shard_size=shard)
    assert list(tmp_path.iterdir()) == []  # no destination, no .ckpt-tmp- sibling


def test_wrong_shape_from_loader_is_refused(tmp_path: Path) -> None:
    arr = np.zeros(5, dtype=np.float32)
    with pytest.raises(ValueError, match="expected F32"):
        write_checkpoint(tmp_path / "x.safetensors", [OutTensor("t", "F32", (6,), lambda: arr)])
    assert list(tmp_path.iterdir()) == []


def test_pieces_are_streamed_in_order(tmp_path: Path) -> None:
    full = np.arange(1000, dtype=np.float32)

    def pieces() -> Iterator[np.ndarray]:
        for s in range(0, 1000, 300):
            yield full[s:s + 300]

    dest = tmp_path / "p.safetensors"
    seen: list[int] = []
    write_checkpoint(dest, [OutTensor("t", "F32", (1000,), _boom, pieces=pieces)],
                     on_progress=seen.append)
    from safetensors.numpy import load_file
    np.testing.assert_array_equal(load_file(str(dest))["t"], full)
    assert sum(seen) == 4000 and len(seen) == 4


def test_existing_destination_needs_overwrite(tmp_path: Path) -> None:
    dest = tmp_path / "x.safetensors"
    dest.write_bytes(b"old")
    arr = np.zeros(2, dtype=np.float32)
    with pytest.raises(DestinationExistsError):
        write_checkpoint(dest, [OutTensor("t", "F32", (2,), lambda: arr)])
    assert dest.read_bytes() == b"old"
    write_checkpoint(dest, [OutTensor("t", "F32", (2,), lambda: arr)], overwrite=True)
    assert dest.read_bytes() != b"old"


@pytest.mark.parametrize("dest_name", ["late.safetensors", "latedir"])
def test_destination_appears_only_when_complete(tmp_path: Path, dest_name: str) -> None:
    dest = tmp_path / dest_name
    arr = np.ones(100, dtype=np.float32)
    seen: list[bool] = []

    def last() -> np.ndarray:
        seen.append(dest.exists())
        return arr

    def check(tmp: Path) -> None:
        seen.append(dest.exists())
        assert ".ckpt-tmp-" in tmp.name and tmp.parent == tmp_path

    out = [OutTensor("a", "F32", (100,), lambda: arr), OutTensor("b", "F32", (100,), last)]
    write_checkpoint(dest, out, max_shard_size=400 if dest.suffix == "" else None,
                     before_commit=check)
    assert seen == [False, False]
    assert [p.name for p in tmp_path.iterdir()] == [dest_name]


def test_before_commit_failure_discards_the_output(tmp_path: Path) -> None:
    arr = np.ones(4, dtype=np.float32)

    def refuse(tmp: Path) -> None:
        raise RuntimeError("verification failed")

    with pytest.raises(RuntimeError, match="verification failed"):
        write_checkpoint(tmp_path / "d", [OutTensor("a", "F32", (4,), lambda: arr)],
                         before_commit=refuse)
    assert list(tmp_path.iterdir()) == []
