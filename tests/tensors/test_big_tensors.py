"""Tensors larger than the memory budget: read, cast, checked and written piece by piece.

Most tests shrink the piece size (``ckpt_cli.storage.reads.PIECE_BYTES``) so that small real files
stream in many pieces; one slow test converts a 1.25 GiB tensor under an address-space limit
(``RLIMIT_AS``) that a whole-tensor copy cannot fit in.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from ckpt_cli.errors import CkptError, CorruptCheckpointError
from ckpt_cli.formats import read_index
from ckpt_cli.ops.consolidate import consolidate
from ckpt_cli.ops.convert import convert
from ckpt_cli.ops.diff import diff
from ckpt_cli.storage import reads
from ckpt_cli.tensors.source import TensorSource
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]
PIECE = 4096


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pieces of 4 KiB, and a record of every whole-tensor read larger than a piece."""
    monkeypatch.setattr(reads, "PIECE_BYTES", PIECE)
    whole: list[int] = []
    read = TensorSource.read

    def spy(self: TensorSource, t: Any, *, mapped: bool = False) -> np.ndarray:
        if t.nbytes > PIECE:
            whole.append(t.nbytes)
        return read(self, t, mapped=mapped)

    monkeypatch.setattr(TensorSource, "read", spy)
    return whole


def _values(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * 100


def _get(path: Path, name: str) -> np.ndarray:
    with safe_open(str(path), "np") as f:
        return f.get_tensor(name)  # type: ignore[no-any-return]


def test_convert_streams_a_large_tensor_bit_exact(tmp_path: Path,
                                                  small_pieces: list[int]) -> None:
    w = _values(30_001).reshape(30_001, 1)  # 117 pieces, the last one short
    src = tmp_path / "big.safetensors"
    save_file({"w": w, "b": np.arange(7, dtype=np.int64)}, str(src))
    for to, dt in (("fp16", np.float16), ("bf16", ml_dtypes.bfloat16), ("keep", np.float32)):
        out = tmp_path / f"{to}.safetensors"
        convert(src, out, to=to)
        got = _get(out, "w")
        assert got.dtype == dt and got.shape == w.shape
        assert got.tobytes() == w.astype(dt).tobytes(), to
        assert _get(out, "b").tolist() == list(range(7))
    assert small_pieces == []  # no tensor was read whole


def test_fp16_overflow_is_found_in_a_later_piece(tmp_path: Path,
                                                 small_pieces: list[int]) -> None:
    w = _values(20_000)
    w[-3] = 1e6  # in the last piece only
    w[5] = -np.inf  # infinities stay infinite, and are no overflow
    src = tmp_path / "big.safetensors"
    save_file({"w": w}, str(src))
    with pytest.raises(CkptError, match=r"1 value\(s\) exceed FP16's range.*w \(1\)"):
        convert(src, tmp_path / "o.safetensors", to="fp16")
    assert not (tmp_path / "o.safetensors").exists()
    r = convert(src, tmp_path / "c.safetensors", to="fp16", clamp=True)
    assert r.overflow == {"w": 1}
    got = _get(tmp_path / "c.safetensors", "w")
    assert got[-3] == 65504 and got[5] == -np.inf
    want = np.clip(w, -65504, 65504)
    want[5] = -np.inf
    assert got.tobytes() == want.astype(np.float16).tobytes()
    assert small_pieces == []


@pytest.mark.requires_torch
def test_torch_zip_in_pieces_round_trip_and_crc(tmp_path: Path,
                                                small_pieces: list[int]) -> None:
    import torch

    w = torch.from_numpy(_values(10_000).reshape(100, 100))
    src = tmp_path / "m.pt"
    torch.save({"w": w, "t": w[:, :50].t()}, src)  # a strided view is read whole
    convert(src, tmp_path / "o.pt", to="bf16")
    got = torch.load(tmp_path / "o.pt", weights_only=True)
    assert torch.equal(got["w"], w.to(torch.bfloat16))
    assert torch.equal(got["t"], w[:, :50].t().to(torch.bfloat16))
    # One flipped byte in the middle of the storage: the running CRC over the pieces sees it.
    data = bytearray(src.read_bytes())
    raw = w.numpy().tobytes()
    at = bytes(data).index(raw[:64]) + len(raw) // 2
    data[at] ^= 0x40
    src.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="CRC-32"):
        convert(src, tmp_path / "bad.safetensors", to="fp16")
    assert not (tmp_path / "bad.safetensors").exists()


@pytest.mark.requires_torch
@pytest.mark.parametrize("where", [0.01, 0.5, 0.99])
def test_a_pieces_crc_runs_on_the_cast_threads_and_finds_a_flipped_byte(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: float) -> None:
    """A piece's CRC-32 is split over the cast threads and recombined (crc32_combine): the
    output is the same, and a byte flipped in any block still fails the check."""
    import torch

    from ckpt_cli.tensors import cast

    if reads.crc32_combine(1, 2, 3) is None:  # pragma: no cover - zlib without ISA-L
        pytest.skip("no crc32_combine: CRCs run on one thread")
    monkeypatch.setattr(reads, "PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(reads, "CRC_BLOCK", 4096)
    monkeypatch.setattr(cast, "cast_threads", lambda: 4)
    blocks: list[int] = []
    real = reads.crc32

    def spy(data: memoryview, value: int = 0) -> int:
        if threading.current_thread().name.startswith(cast.CAST_THREAD):
            blocks.append(len(data))
        return real(data, value)

    monkeypatch.setattr(reads, "crc32", spy)
    w = torch.from_numpy(_values(100_000).reshape(1000, 100))  # 400 KB: 7 pieces
    src = tmp_path / "m.pt"
    torch.save({"w": w}, src)
    convert(src, tmp_path / "o.safetensors", to="fp16")
    assert _get(tmp_path / "o.safetensors", "w").tobytes() == w.half().numpy().tobytes()
    # The six whole pieces each in four blocks of 16 KiB; the short last one on one thread.
    assert blocks == [16 << 10] * 24
    data = bytearray(src.read_bytes())
    raw = w.numpy().tobytes()
    data[bytes(data).index(raw[:64]) + int(len(raw) * where)] ^= 0x01
    src.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="CRC-32"):
        convert(src, tmp_path / "bad.safetensors", to="fp16")
    assert not (tmp_path / "bad.safetensors").exists()


@pytest.mark.requires_torch
def test_dcp_row_chunks_stream_in_convert_consolidate_and_diff(
        sample_run: Path, tmp_path: Path, small_pieces: list[int]) -> None:
    dcp = sample_run / "step_000400"
    index = read_index(dcp)
    rows = [t for t in index.tensors.values() if len(t.chunks) > 1 and t.nbytes > PIECE
            and t.group == "model"
            and all(c.offsets[1:] == (0,) * (len(t.shape) - 1) for c in t.chunks)]
    assert rows, "the sample DCP checkpoint has row-sharded tensors above a piece"
    with TensorSource(index) as src:
        want = {t.name: src._read_chunks(t) for t in rows}  # the whole-tensor assembly
    small_pieces.clear()
    convert(dcp, tmp_path / "c.safetensors", to="bf16")
    consolidate(dcp, tmp_path / "d.safetensors", to="fp16", verify=True, manifest=False)
    r = diff(dcp, sample_run / "step_000400" / ".." / "step_000400")  # same dir: no reads
    assert r.same_checkpoint and r.equal
    assert not set(small_pieces) & {t.nbytes for t in rows}  # none of them read whole
    with safe_open(str(tmp_path / "c.safetensors"), "np") as f:
        names = set(f.keys())
    for t in rows:
        name = t.name.removeprefix("model.")
        assert name in names, (name, sorted(names)[:5])
        assert _get(tmp_path / "c.safetensors", name).tobytes() == \
            want[t.name].astype(ml_dtypes.bfloat16).tobytes()
        assert _get(tmp_path / "d.safetensors", name).tobytes() == \
            want[t.name].astype(np.float16).tobytes()


def test_memory_error_names_the_tensor_and_budget(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "m.safetensors"
    save_file({"emb": _values(1000), "b": np.zeros(3, dtype=np.float32)}, str(src))

    from ckpt_cli.tensors import cast

    # The module (the package also has a function named build).
    convert_op = importlib.import_module("ckpt_cli.ops.convert.build")

    real = cast.cast_array

    def no_memory(arr: np.ndarray, dst: str, **k: Any) -> np.ndarray:
        if k["name"] == "emb":
            raise MemoryError("Unable to allocate 8.00 GiB for an array")
        return real(arr, dst, **k)

    monkeypatch.setattr(convert_op, "cast_array", no_memory)  # whole-tensor loads
    monkeypatch.setattr(cast, "cast_array", no_memory)  # piece_caster
    r = run_cli("convert", src, "-o", tmp_path / "o.safetensors", "--to", "fp16")
    assert r.exit_code == 2, r.output
    first = r.stderr.splitlines()[0]
    assert first.startswith("ckpt: error: out of memory on tensor 'emb'"), r.stderr
    assert "budget of about 256 MiB" in first and "internal error" not in r.stderr
    assert not (tmp_path / "o.safetensors").exists()
    r = run_cli("convert", src, "-o", tmp_path / "o.safetensors", "--to", "fp16", "--json")
    assert r.exit_code == 2 and json.loads(r.stdout)["error"]["kind"] == "memory"


def test_diff_of_a_checkpoint_with_itself_reads_nothing(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    a = tmp_path / "a.safetensors"
    save_file({"w": _values(100), "b": np.arange(3, dtype=np.int32)}, str(a))
    (tmp_path / "link.safetensors").symlink_to(a)
    os.link(a, tmp_path / "hard.safetensors")
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(a.read_bytes())

    def no_reads(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("values were read")

    with monkeypatch.context() as m:
        m.setattr(TensorSource, "read_into", no_reads)
        m.setattr(TensorSource, "read", no_reads)
        for other, why in ((a, "same path"), (tmp_path / "." / "a.safetensors", "same path"),
                           (tmp_path / "link.safetensors", "inode"),
                           (tmp_path / "hard.safetensors", "inode")):
            r = diff(a, other)
            assert r.equal and r.same_checkpoint and why in r.same_checkpoint
            assert [t.status for t in r.tensors] == ["identical", "identical"]
            assert all(t.reason == r.same_checkpoint and t.stats is None for t in r.tensors)
        # Equal content in another file is not the same checkpoint: its values are read.
        with pytest.raises(AssertionError, match="values were read"):
            diff(a, copy)
    r = diff(a, copy)
    assert r.equal and r.same_checkpoint is None
    assert all(t.stats is not None for t in r.tensors)
    out = run_cli("diff", a, tmp_path / "hard.safetensors")
    assert out.exit_code == 0 and "not read: A and B are the same file" in out.stdout
    doc = json.loads(run_cli("diff", a, a, "--json").stdout)
    assert "same path" in doc["same_checkpoint"] and doc["equal"]
    assert json.loads(run_cli("diff", a, copy, "--json").stdout)["same_checkpoint"] is None


@pytest.mark.requires_torch
def test_diff_with_itself_still_skips_what_has_no_data(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "meta.pt"
    torch.save({"w": torch.ones(3), "m": torch.empty(2, device="meta")}, path)
    r = diff(path, path)
    assert r.same_checkpoint
    status = {t.name_a: (t.status, t.reason) for t in r.tensors}
    assert status["w"] == ("identical", r.same_checkpoint)
    assert status["m"][0] == "skipped" and "meta" in (status["m"][1] or "")


# --- under an address-space limit ---------------------------------------------------------------

ROWS, COLS = 20_480, 16_384  # float32: 1.25 GiB
LIMIT = 1 << 30


def _limited(limit: int) -> Any:
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return preexec


def _ckpt(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "ckpt_cli", *map(str, args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1200,
                          preexec_fn=_limited(LIMIT))


@pytest.mark.slow
@pytest.mark.requires_torch
def test_convert_tensor_larger_than_the_address_space_limit(tmp_path: Path) -> None:
    """A 1.25 GiB tensor under a 1 GiB ``RLIMIT_AS``: less than the tensor itself.

    Measured (VmPeak): ``python -m ckpt_cli convert`` of a 4 MiB file peaks at about 365 MiB
    of address space (numpy, the cast thread pool's stacks and malloc arenas; torch, which
    reserves much more, is only imported above 1e9 elements to cast, and not here). Converting
    this file to FP16 peaked at 2.35 GiB before streaming (the source mapped whole plus the
    whole FP16 output) and at 560 MiB with 64 MiB pieces (420 MiB to a .pt without a cast).
    A 1 GiB limit leaves no room for any whole-tensor buffer yet a margin of ~450 MiB for
    the streamed run. The file is 1.25 GiB, so the test stays within CI disk and time.
    """
    import torch

    n = ROWS * COLS
    w = np.random.default_rng(0).standard_normal(n, dtype=np.float32).reshape(ROWS, COLS)
    w[-1, -1] = 7e4  # beyond FP16's range, in the very last piece
    src = tmp_path / "big.safetensors"
    save_file({"emb": w}, str(src))
    del w
    # The limit is meaningful: one whole-tensor buffer does not fit under it (a plain
    # interpreter with numpy needs far less than ckpt's baseline, so this is conservative).
    probe = subprocess.run([sys.executable, "-c", f"import numpy; numpy.empty({n * 4}, "
                            "dtype=numpy.uint8).fill(1)"], capture_output=True, text=True,
                           preexec_fn=_limited(LIMIT))
    assert probe.returncode != 0 and "MemoryError" in probe.stderr

    refused = _ckpt("convert", src, "-o", tmp_path / "r.safetensors", "--to", "fp16")
    assert refused.returncode == 2 and "exceed FP16's range" in refused.stderr, refused.stderr
    out = tmp_path / "o.safetensors"
    r = _ckpt("convert", src, "-o", out, "--to", "fp16", "--clamp")
    assert r.returncode == 0, r.stderr
    pt = tmp_path / "o.pt"
    r = _ckpt("convert", src, "-o", pt)  # the torch zip writer, no cast
    assert r.returncode == 0, r.stderr

    step = 1024
    with safe_open(str(src), "np") as fs, safe_open(str(out), "np") as fo:
        a, b = fs.get_slice("emb"), fo.get_slice("emb")
        assert b.get_shape() == [ROWS, COLS] and b.get_dtype() == "F16"
        for i in range(0, ROWS, step):
            ref = a[i:i + step]
            want = np.clip(ref, -65504, 65504).astype(np.float16)
            assert np.array_equal(b[i:i + step].view(np.uint16), want.view(np.uint16)), i
    sd = torch.load(pt, weights_only=True, mmap=True)
    with safe_open(str(src), "np") as fs:
        a = fs.get_slice("emb")
        for i in range(0, ROWS, step):
            assert np.array_equal(sd["emb"][i:i + step].numpy(), a[i:i + step]), i
