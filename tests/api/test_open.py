"""``ckpt_cli.open``: every tensor of every format ckpt reads comes back bit-equal to what the
format's own loader gives (torch.load, safetensors, torch.distributed.checkpoint), slices read
the rows asked for, FP8 dequantizes as torch would, and what reading found travels with it."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckpt_cli
from ckpt_cli.api.checkpoint import Checkpoint

pytestmark = pytest.mark.requires_torch


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A loaded state dict as ckpt names its tensors: key paths joined with dots."""
    import torch

    out: dict[str, Any] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix[:-1]] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}{k}."))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flat(v, f"{prefix}{i}."))
    return out


def same_bits(ck: Checkpoint, expected: dict[str, Any]) -> int:
    """Every tensor of ``ck`` (numpy and torch) equals its loader's, bit for bit; how many."""
    import torch

    names = ck.keys()
    assert names and set(names) <= set(expected), sorted(set(names) - set(expected))[:5]
    for name in names:
        want = expected[name].detach().contiguous()
        got = ck.read(name, framework="torch")
        assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), name
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), name
        arr = ck.read(name)
        assert isinstance(arr, np.ndarray) and arr.shape == tuple(want.shape)
        assert arr.tobytes() == want.numpy().tobytes() if want.dtype != torch.bfloat16 else \
            arr.tobytes() == want.view(torch.int16).numpy().tobytes()
    return len(names)


def test_torch_file_and_its_slices(sample_run: Path) -> None:
    import torch

    path = sample_run / "step_000100" / "checkpoint.pt"
    with ckpt_cli.open(path) as ck:
        assert (ck.format, ck.step, ck.step_source) == ("torch", 100, "metadata")
        assert ck.ok and not [f for f in ck.findings if f.severity == "error"]
        n = same_bits(ck, flat(torch.load(path, weights_only=True)))
        assert n == len(ck) and len(ck.tensors(group="optimizer")) > 0
        full = ck.read("model.wte.weight")
        assert np.array_equal(ck.read_slice("model.wte.weight", 3, 9), full[3:9])
        assert np.array_equal(ck.read_slice("model.wte.weight", -2, 10**9), full[-2:])
        assert ck.read_slice("model.wte.weight", 5, 2).shape == (0, full.shape[1])


def test_dcp_checkpoint_of_four_ranks(sample_run: Path, tmp_path: Path) -> None:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = sample_run / "step_000400"
    dcp_to_torch_save(src, tmp_path / "whole.pt")  # torch's own reader of DCP
    with ckpt_cli.open(src) as ck:
        assert ck.format == "dcp" and ck.step == 400
        assert same_bits(ck, flat(torch.load(tmp_path / "whole.pt", weights_only=False))) > 10


def test_sharded_safetensors_export(sample_run: Path) -> None:
    from safetensors.torch import load_file

    out = sample_run / "export"
    expected: dict[str, Any] = {}
    for shard in sorted(out.glob("*.safetensors")):
        expected.update(load_file(shard))
    with ckpt_cli.open(out) as ck:
        assert ck.format == "hf-index" and len(ck.files) >= 3
        assert same_bits(ck, expected) == len(expected)


def test_single_safetensors_in_bf16(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    p = tmp_path / "m.safetensors"
    save_file({"a.weight": torch.randn(7, 5).to(torch.bfloat16), "b": torch.arange(6),
               "c": torch.tensor(3.5, dtype=torch.float16)}, str(p))
    with ckpt_cli.open(p) as ck:
        assert same_bits(ck, load_file(p)) == 3
        entries = {t.name: t for t in ck.tensors()}
        assert entries["a.weight"] == ckpt_cli.TensorEntry("a.weight", "BF16", (7, 5), "model")
        with pytest.raises(ValueError, match="0-d"):
            ck.read_slice("c", 0, 1)
        with pytest.raises(KeyError, match="nope"):
            ck.read("nope")


def test_lightning_checkpoint(lightning_dir: Path) -> None:
    import torch

    path = lightning_dir / "last.ckpt"
    with ckpt_cli.open(path) as ck:
        assert ck.flavor == "lightning"
        assert same_bits(ck, flat(torch.load(path, weights_only=False))) > 4


def test_megatron_rank_files(tmp_path: Path) -> None:
    import torch

    from tests.helpers.makers import megatron_legacy

    root = megatron_legacy(tmp_path / "meg", tp=2)
    with ckpt_cli.open(root) as ck:
        assert ck.format == "megatron"
        expected: dict[str, Any] = {}
        for f in ck.files:
            if f.path.endswith(".pt"):
                rank = f.path.split("/")[-2]
                for k, v in flat(torch.load(root / f.path, weights_only=False)).items():
                    expected[f"{rank}.{k}"] = v
                    expected.setdefault(k, v)
        assert same_bits(ck, expected) > 0


@pytest.mark.slow
def test_deepspeed_zero2_bf16_every_rank_file(ds_dir: Path) -> None:
    """Model states by their module names; each rank's optimizer file under its own stem, as
    ``ckpt inspect`` lists them (the flat FP32 partitions and Adam moments as stored)."""
    import torch

    step = ds_dir / "z2-bf16" / "global_step3"
    expected: dict[str, Any] = {}
    for f in sorted(step.glob("*.pt")):
        tree = torch.load(f, weights_only=False, map_location="cpu")
        prefix = "" if f.name.startswith("mp_rank_") else f"{f.stem}."
        expected.update({prefix + k: v for k, v in flat(tree).items()})
    with ckpt_cli.open(step) as ck:
        assert (ck.format, ck.step) == ("deepspeed", 3)
        assert len(ck.tensors(group="optimizer")) >= 6
        assert same_bits(ck, expected) == len(ck)


def test_fp8_dequantized_as_torch_computes_it(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    torch.manual_seed(1)
    src = tmp_path / "m.safetensors"
    save_file({"layer.weight": torch.randn(256, 128).to(torch.bfloat16),
               "norm.weight": torch.ones(128, dtype=torch.bfloat16)}, str(src))
    out = tmp_path / "fp8"
    ckpt_cli.convert(src, out, to="fp8", fp8_layout="channel")
    stored = load_file(next(out.glob("*.safetensors")))
    scale_name = next(n for n in stored if n.startswith("layer.weight_scale"))
    want = stored["layer.weight"].float() * stored[scale_name].float()
    with ckpt_cli.open(out) as ck:
        got = ck.read("layer.weight", framework="torch", dequantize=True)
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert ck.read("layer.weight").dtype.name == "float8_e4m3fn"  # as stored
        norm = ck.read("norm.weight", dequantize=True)  # not FP8: as stored
        assert norm.dtype.name == "bfloat16" and norm.tobytes() == stored["norm.weight"].view(
            torch.int16).numpy().tobytes()


class _RunsCode:
    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, ("echo pwned > /dev/null",))


def test_a_hostile_pickle_opens_without_running_and_says_so(tmp_path: Path) -> None:
    import torch

    p = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(2)}, "hook": _RunsCode()}, p)
    with ckpt_cli.open(p) as ck:
        assert not ck.ok
        assert any(f.code == "unsafe-global" and "system" in (f.location or "")
                   for f in ck.findings), ck.findings
        assert np.array_equal(ck.read("model.w"), np.ones(2, np.float32))
    with ckpt_cli.open(p, allow_global="posix.system") as ck:
        assert ck.ok


def test_a_run_follows_its_pointer_or_names_its_newest(sample_run: Path,
                                                       hf_trainer_dir: Path) -> None:
    with ckpt_cli.open(sample_run) as ck:  # its `latest` names step_000400
        assert ck.path.endswith("step_000400") and ck.format == "dcp"
    with pytest.raises(ValueError, match="a run directory") as e:
        ckpt_cli.open(hf_trainer_dir)  # no pointer: which checkpoint is meant?
    assert "checkpoint-4" in (e.value.hint or "")
    with pytest.raises(FileNotFoundError):
        ckpt_cli.open(sample_run / "nope")


def test_pickle_is_never_used_to_read(sample_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Values come from the bytes: a tripwire on pickle.load/loads is never hit."""
    def tripped(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("pickle.load called")

    monkeypatch.setattr(pickle, "load", tripped)
    monkeypatch.setattr(pickle, "loads", tripped)
    with ckpt_cli.open(sample_run / "step_000200" / "checkpoint.pt") as ck:
        for name in ck.keys():
            ck.read(name)
