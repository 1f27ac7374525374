"""``read_hf_trainer`` (issue 48): an HF Trainer ``checkpoint-N``'s training state equals what
Trainer itself restores from it: the optimizer Trainer builds (``create_optimizer``) loaded
from ``optimizer.pt`` by Trainer's own ``_load_optimizer_and_scheduler``, each parameter's
state looked up through ``model.named_parameters()``."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpt_cli.errors import CkptError, UnsupportedError
from ckpt_cli.ops.to_dcp.hf_trainer import read_hf_trainer
from ckpt_cli.ops.to_dcp.state import LazyTensor
from tests.conftest import third_party_quiet

pytestmark = [pytest.mark.requires_torch,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers is not installed")]


def _t(v: LazyTensor | float | int) -> torch.Tensor:
    if isinstance(v, LazyTensor):
        arr = v.load()
        assert arr.shape == v.shape
        return torch.from_numpy(np.array(arr, copy=True))  # 0-d stays 0-d
    return torch.tensor(v)


def _restored(ckpt: Path, tmp_path: Path) -> tuple[Any, Any]:
    """The model and the Trainer that resumed from ``ckpt`` (its optimizer and scheduler)."""
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

    with third_party_quiet():
        model = GPT2LMHeadModel.from_pretrained(ckpt)
        args = TrainingArguments(output_dir=str(tmp_path / "resume"), max_steps=4,
                                 per_device_train_batch_size=4, report_to=[], use_cpu=True,
                                 disable_tqdm=True)
        trainer = Trainer(model=model, args=args)
        trainer.create_optimizer_and_scheduler(num_training_steps=4)
        trainer._load_optimizer_and_scheduler(str(ckpt))
    return model, trainer


def _bits(a: torch.Tensor) -> torch.Tensor:
    return a.contiguous().view(torch.int32) if a.dtype == torch.float32 else a


def test_state_equals_what_trainer_restores(hf_trainer_dir: Path, tmp_path: Path) -> None:
    ckpt = hf_trainer_dir / "checkpoint-4"
    st = read_hf_trainer(ckpt)
    model, trainer = _restored(ckpt, tmp_path)
    opt = trainer.optimizer
    name_of = {id(p): n for n, p in model.named_parameters()}
    assert st.optimizer == type(opt).__name__ == "AdamW"
    assert len(st.param_groups) == len(opt.param_groups) == 2
    for ours, theirs in zip(st.param_groups, opt.param_groups, strict=True):
        assert ours["params"] == [name_of[id(p)] for p in theirs["params"]]
        assert {k: v for k, v in ours.items() if k != "params"} == {
            k: v for k, v in theirs.items() if k != "params"}
    assert len(st.optimizer_state) == len(opt.state) == len(name_of)
    for p, s in opt.state.items():
        mine = st.optimizer_state[name_of[id(p)]]
        assert set(mine) == set(s) == {"step", "exp_avg", "exp_avg_sq"}
        for k, v in s.items():
            assert torch.equal(_bits(_t(mine[k])), _bits(v)), (name_of[id(p)], k)
    sd = model.state_dict()
    assert set(sd) <= set(st.model)  # lm_head.weight too, tied to the embedding
    for k, v in sd.items():
        assert torch.equal(_bits(_t(st.model[k])), _bits(v)), k
    assert st.lr_scheduler == trainer.lr_scheduler.state_dict()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert st.step == state["global_step"] == 4
    assert st.extra["epoch"] == state["epoch"]
    assert "log_history" not in st.extra["trainer_state"]


def test_rng_states_are_carried(hf_trainer_dir: Path) -> None:
    ckpt = hf_trainer_dir / "checkpoint-4"
    st = read_hf_trainer(ckpt)
    with torch.serialization.safe_globals([np._core.multiarray._reconstruct, np.ndarray,
                                           np.dtype, np.dtypes.UInt32DType]):
        saved = torch.load(ckpt / "rng_state.pth", weights_only=True)
    assert st.rng is not None and set(st.rng) == set(saved)
    assert st.rng["python"] == saved["python"]
    assert st.rng["numpy"][0] == saved["numpy"][0]
    assert np.array_equal(st.rng["numpy"][1], saved["numpy"][1])
    assert st.rng["numpy"][2:] == saved["numpy"][2:]
    assert torch.equal(_t(st.rng["cpu"]), saved["cpu"])


def _copy(hf_trainer_dir: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "checkpoint-4"
    shutil.copytree(hf_trainer_dir / "checkpoint-4", dest)
    return dest


def _rewrite_optimizer(ckpt: Path, change: Any) -> None:
    osd = torch.load(ckpt / "optimizer.pt", weights_only=True)
    change(osd)
    torch.save(osd, ckpt / "optimizer.pt")


def test_no_config_is_refused_saying_why(hf_trainer_dir: Path, tmp_path: Path) -> None:
    ckpt = _copy(hf_trainer_dir, tmp_path)
    (ckpt / "config.json").unlink()
    with pytest.raises(CkptError, match=r"no config\.json.*cannot be known"):
        read_hf_trainer(ckpt)


def test_remote_code_is_refused(hf_trainer_dir: Path, tmp_path: Path) -> None:
    ckpt = _copy(hf_trainer_dir, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="remote code"):
        read_hf_trainer(ckpt)


def test_groups_that_are_not_trainers_are_refused(hf_trainer_dir: Path,
                                                  tmp_path: Path) -> None:
    ckpt = _copy(hf_trainer_dir, tmp_path)

    def regroup(osd: dict[str, Any]) -> None:  # one parameter moved to the other group
        moved = osd["param_groups"][0]["params"].pop()
        osd["param_groups"][1]["params"].insert(0, moved)
    _rewrite_optimizer(ckpt, regroup)
    with pytest.raises(CkptError, match="cannot be named"):
        read_hf_trainer(ckpt)


def test_ids_in_another_order_are_refused(hf_trainer_dir: Path, tmp_path: Path) -> None:
    ckpt = _copy(hf_trainer_dir, tmp_path)

    def swap(osd: dict[str, Any]) -> None:  # the embedding's state given to the next id
        s = osd["state"]
        s[0], s[1] = s[1], s[0]
    _rewrite_optimizer(ckpt, swap)
    with pytest.raises(CkptError, match="id order does not match"):
        read_hf_trainer(ckpt)


def test_an_unknown_optimizer_state_is_refused_naming_it(hf_trainer_dir: Path,
                                                         tmp_path: Path) -> None:
    ckpt = _copy(hf_trainer_dir, tmp_path)

    def factored(osd: dict[str, Any]) -> None:  # Adafactor-like keys
        for s in osd["state"].values():
            s["exp_avg_sq_row"] = s.pop("exp_avg_sq")
    _rewrite_optimizer(ckpt, factored)
    with pytest.raises(UnsupportedError, match="exp_avg_sq_row"):
        read_hf_trainer(ckpt)


class _Runs:
    """Pickles as a call of ``os.system``: what a hostile optimizer.pt would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        import os

        return os.system, (f"touch {self.marker}",)


def test_code_in_the_optimizer_file_never_runs(hf_trainer_dir: Path, tmp_path: Path) -> None:
    ckpt = _copy(hf_trainer_dir, tmp_path)
    marker = tmp_path / "ran"
    _rewrite_optimizer(ckpt, lambda osd: osd["param_groups"][0].update(hook=_Runs(marker)))
    with pytest.raises(UnsupportedError, match=r"param_groups\.hook is an object of class "
                                               r"(posix|os)\.system"):
        read_hf_trainer(ckpt)
    assert not marker.exists()


def test_a_damaged_tensor_record_is_refused(hf_trainer_dir: Path, tmp_path: Path) -> None:
    ckpt = _copy(hf_trainer_dir, tmp_path)
    raw = (ckpt / "optimizer.pt").read_bytes()
    (ckpt / "optimizer.pt").write_bytes(raw[: len(raw) * 2 // 3])  # truncated
    with pytest.raises(CkptError, match=r"optimizer\.pt"):
        read_hf_trainer(ckpt)


def test_pytorch_model_bin_weights(hf_trainer_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    ckpt = _copy(hf_trainer_dir, tmp_path)
    sd = load_file(ckpt / "model.safetensors")
    torch.save(sd, ckpt / "pytorch_model.bin")  # what save_safetensors=False writes
    (ckpt / "model.safetensors").unlink()
    st = read_hf_trainer(ckpt)
    for k, v in sd.items():
        assert torch.equal(_t(st.model[k]), v), k
    assert torch.equal(_t(st.model["lm_head.weight"]), sd["transformer.wte.weight"])


def test_per_rank_rng_states(hf_trainer_dir: Path, tmp_path: Path) -> None:
    ckpt = _copy(hf_trainer_dir, tmp_path)
    (ckpt / "rng_state.pth").rename(ckpt / "rng_state_0.pth")
    shutil.copy(ckpt / "rng_state_0.pth", ckpt / "rng_state_1.pth")
    st = read_hf_trainer(ckpt)
    assert st.rng is not None and set(st.rng) == {"rank0", "rank1"}
    assert st.rng["rank1"]["python"] == st.rng["rank0"]["python"]
    assert any("one state per rank (2 ranks)" in n for n in st.notes)


@pytest.mark.parametrize(("bad_id", "message"), [([0], "lists a list as a parameter id"),
                                                 (0, "parameter id 0 is listed twice")])
def test_malformed_parameter_ids_are_clear_errors(hf_trainer_dir: Path, tmp_path: Path,
                                                  bad_id: Any, message: str) -> None:
    ckpt = _copy(hf_trainer_dir, tmp_path)
    _rewrite_optimizer(ckpt, lambda osd: osd["param_groups"][1]["params"].append(bad_id))
    with pytest.raises(CkptError, match=message):
        read_hf_trainer(ckpt)


def test_a_deeply_nested_scheduler_state_is_refused(hf_trainer_dir: Path,
                                                    tmp_path: Path) -> None:
    ckpt = _copy(hf_trainer_dir, tmp_path)
    sched = torch.load(ckpt / "scheduler.pt", weights_only=True)
    deep: list[Any] = []
    for _ in range(100):
        deep = [deep]
    sched["extra"] = deep
    torch.save(sched, ckpt / "scheduler.pt")
    with pytest.raises(UnsupportedError, match="nests deeper"):
        read_hf_trainer(ckpt)


def test_a_deepspeed_trainer_checkpoint_points_at_its_tag(hf_trainer_dir: Path,
                                                          tmp_path: Path) -> None:
    ckpt = _copy(hf_trainer_dir, tmp_path)
    (ckpt / "optimizer.pt").unlink()
    (ckpt / "global_step4").mkdir()  # where Trainer's DeepSpeed integration saves it
    with pytest.raises(CkptError, match="restart the optimizer") as e:
        read_hf_trainer(ckpt)
    assert e.value.hint is not None and "global_step4/" in e.value.hint
