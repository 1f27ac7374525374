"""``read_deepspeed`` (issue 48): a ZeRO 1/2/3 checkpoint's training state equals what
DeepSpeed itself restores from it. Each checkpoint of ``ds_view_dir`` was loaded into a fresh
engine at world 2, which saved every trainable parameter's full FP32 master weight and Adam
moments (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``), the step, the
groups' learning rates and the scheduler's state; the weights and buffers are also compared
with ``zero_to_fp32``'s. Every comparison is bit for bit."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_cli.errors import CkptError, UnsupportedError
from ckpt_cli.ops.to_dcp.deepspeed import read_deepspeed
from ckpt_cli.ops.to_dcp.state import LazyTensor
from tests.conftest import DS_VIEW_CONFIGS, requires_deepspeed, third_party_quiet

pytestmark = [pytest.mark.requires_torch, requires_deepspeed]

ADAM_CONFIGS = [c for c in DS_VIEW_CONFIGS if "sgd" not in c]


def _bits(t: LazyTensor) -> torch.Tensor:
    arr = t.load()
    assert arr.shape == t.shape and t.dtype == "F32"
    return torch.from_numpy(np.ascontiguousarray(arr)).view(torch.int32)


def _zero_to_fp32(save_dir: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with third_party_quiet(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(save_dir)))


@pytest.mark.parametrize("cfg", ADAM_CONFIGS)
def test_state_equals_what_deepspeed_restores(ds_view_dir: Path, cfg: str) -> None:
    view = torch.load(ds_view_dir / f"{cfg}.view.pt", weights_only=True)
    st = read_deepspeed(ds_view_dir / cfg)
    trainable = list(view["params"])
    if "groups" in cfg:  # matrices (decay 0.1), then vectors (0.0), as ds_train groups them
        assert [g["params"] for g in st.param_groups] == [
            [n for n in trainable if view["params"][n].dim() > 1],
            [n for n in trainable if view["params"][n].dim() <= 1]]
        assert [g["weight_decay"] for g in st.param_groups] == [0.1, 0.0]
    else:
        assert [n for g in st.param_groups for n in g["params"]] == trainable
    assert sorted(st.optimizer_state) == sorted(trainable)
    for n in trainable:
        assert torch.equal(_bits(st.model[n]), view["params"][n].view(torch.int32)), n
        for m in ("exp_avg", "exp_avg_sq"):
            got = st.optimizer_state[n][m]
            assert isinstance(got, LazyTensor)
            assert torch.equal(_bits(got), view[m][n].view(torch.int32)), (n, m)
        step = st.optimizer_state[n]["step"]
        assert float(step.load() if isinstance(step, LazyTensor) else step) == view["step"]
    full = _zero_to_fp32(ds_view_dir / cfg)
    assert set(full) <= set(st.model)  # every weight and buffer zero_to_fp32 gives
    for k, v in full.items():
        assert torch.equal(_bits(st.model[k]), v.view(torch.int32)), k
    assert st.step == view["step"] == 3
    assert [g["lr"] for g in st.param_groups] == view["lr"]
    assert st.lr_scheduler == view["lr_scheduler"]
    assert ("sched" in cfg) == (st.lr_scheduler is not None)
    if "sched" in cfg:
        assert st.extra["lr_scheduler_config"]["type"] == "WarmupLR"
        assert any("DeepSpeed's WarmupLR state" in n for n in st.notes)
    assert st.optimizer == "AdamW"
    assert st.param_groups[0]["betas"] == (0.9, 0.999)
    assert st.extra["zero_stage"] == int(cfg[1]) and st.extra["world_size"] == 2
    dropped = [n for n in st.notes if "BF16 copies dropped" in n]
    assert len(dropped) == ("bf16" in cfg)


def test_frozen_parameters_are_weights_without_optimizer_state(ds_view_dir: Path) -> None:
    st = read_deepspeed(ds_view_dir / "z2-fp32+frozen+view")
    assert {"1.weight", "1.bias"} <= set(st.model)
    assert not {"1.weight", "1.bias"} & set(st.optimizer_state)
    assert not {"1.weight", "1.bias"} & {n for g in st.param_groups for n in g["params"]}


def test_a_tag_directory_reads_as_its_save_directory(ds_view_dir: Path) -> None:
    save = ds_view_dir / "z3-fp32+view"
    tag = save / (save / "latest").read_text().strip()
    a, b = read_deepspeed(save), read_deepspeed(tag)
    assert a.param_groups == b.param_groups and list(a.model) == list(b.model)
    n = a.param_groups[0]["params"][0]
    assert np.array_equal(a.optimizer_state[n]["exp_avg"].load(),  # type: ignore[union-attr]
                          b.optimizer_state[n]["exp_avg"].load())  # type: ignore[union-attr]


def test_a_non_adam_optimizer_is_refused_naming_its_state(ds_view_dir: Path) -> None:
    with pytest.raises(UnsupportedError, match="momentum_buffer") as e:
        read_deepspeed(ds_view_dir / "z2-fp32+sgd")
    assert "restart the optimizer" in str(e.value)


def _copy(ds_view_dir: Path, cfg: str, tmp_path: Path) -> Path:
    dest = tmp_path / cfg
    shutil.copytree(ds_view_dir / cfg, dest)
    return dest / (dest / "latest").read_text().strip()


def test_a_missing_rank_file_is_a_clear_error(ds_view_dir: Path, tmp_path: Path) -> None:
    tag = _copy(ds_view_dir, "z2-fp32+sched+view", tmp_path)
    next(tag.glob("*zero_pp_rank_1_*optim_states.pt")).unlink()
    with pytest.raises(CkptError, match="rank"):
        read_deepspeed(tag)


def test_damaged_partition_bytes_fail_when_loaded(ds_view_dir: Path, tmp_path: Path) -> None:
    tag = _copy(ds_view_dir, "z2-fp32+sched+view", tmp_path)
    st = read_deepspeed(tag)
    n = st.param_groups[0]["params"][-1]
    want = st.optimizer_state[n]["exp_avg"].load()  # type: ignore[union-attr]
    needle = np.ascontiguousarray(want).tobytes()[-8:]
    hits = [(f, raw, at) for f in sorted(tag.glob("*optim_states.pt"))
            if (at := (raw := bytearray(f.read_bytes())).find(needle)) > 0]
    assert len(hits) == 1
    f, raw, at = hits[0]
    raw[at] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(CkptError, match="CRC-32"):
        read_deepspeed(tag).optimizer_state[n]["exp_avg"].load()  # type: ignore[union-attr]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_buffer_is_restored_to_fp32(tmp_path: Path,
                                                     dtype: torch.dtype) -> None:
    from ckpt_cli.formats.zero import ParamPlan, Piece, PieceReader
    from ckpt_cli.ops.to_dcp.deepspeed import _lazy

    values = torch.tensor([1.5, -2.25, 3.0e-3, 65504.0, 1.0e-6], dtype=dtype)
    raw = tmp_path / "buffer.bin"
    raw.write_bytes(values.view(torch.int16).numpy().tobytes())
    code = "BF16" if dtype == torch.bfloat16 else "F16"
    lt = _lazy(PieceReader(), ParamPlan("b", code, (5,), [Piece(raw, 0, 5)], "buffer"),
               to_f32=True)
    assert lt.dtype == "F32"
    assert torch.equal(torch.from_numpy(lt.load()), values.float())
