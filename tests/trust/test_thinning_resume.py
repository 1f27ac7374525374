"""A run resumed from a thinned checkpoint follows its learning-rate schedule: thinning keeps each
optimizer's hyperparameters (``param_groups``) and drops only its per-parameter state, so the
real training loops (Lightning, HF Trainer) resume at the LR the unthinned checkpoint gives
(issue 45 item 2: a thinned Lightning resume ran at twice the LR, the fresh optimizer's
``param_groups`` carrying the initial one)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import run_cli, third_party_quiet
from tests.helpers.makers import tiny_lm_data

pytestmark = pytest.mark.requires_torch


def _lightning_module(schedule: str) -> Any:
    from tests.helpers.lightning_parts import tiny_module

    def optimizers(params: Any) -> Any:
        opt = torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.9), weight_decay=0.01)
        sched: Any
        if schedule == "step":
            sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
        else:
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return tiny_module(optimizers)


def _lightning_fit(out: Path, schedule: str, steps: int, ckpt: Path | None = None
                   ) -> list[float]:
    """Train (or resume from ``ckpt``) to ``steps`` steps, saving every 2; the LR of each step
    run."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    lrs: list[float] = []

    class Record(Callback):
        def on_train_batch_start(self, trainer: Any, *_a: Any) -> None:
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    data = torch.utils.data.TensorDataset(torch.randn(64, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    ck = ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1, save_last=False,
                         filename="{step}")
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=[ck, Record()],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    torch.manual_seed(0)
    with third_party_quiet():
        trainer.fit(_lightning_module(schedule), loader,
                    ckpt_path=str(ckpt) if ckpt else None)
    return lrs


def _age(run: Path) -> None:
    for p in [*run.rglob("*"), run]:
        os.utime(p, (1_600_000_000, 1_600_000_000))


@pytest.mark.parametrize("to", [None, "bf16"])
@pytest.mark.parametrize("schedule", ["step", "cosine"])
def test_a_thinned_lightning_checkpoint_resumes_on_its_schedule(tmp_path: Path, schedule: str,
                                                               to: str | None) -> None:
    run = tmp_path / "run"
    _lightning_fit(run, schedule, 8)
    name = "step=4.ckpt"
    whole = tmp_path / "whole.ckpt"
    shutil.copy2(run / name, whole)
    _age(run)
    extra = ["--thin-to", to] if to else []
    r = run_cli("prune", run, "--thin-after", "1", *extra, "--grace", "0", "--yes")
    assert r.exit_code == 0, r.output
    want = _lightning_fit(tmp_path / "a", schedule, 10, whole)
    got = _lightning_fit(tmp_path / "b", schedule, 10, run / name)
    assert len(want) == 6 and want[0] != 0.01  # resumed mid-schedule
    print(f"Lightning {schedule} {to}: LR per resumed step {got}")
    assert got == want
    thin = torch.load(run / name, weights_only=True)
    orig = torch.load(whole, weights_only=True)
    # The per-parameter state is gone, the hyperparameters stay.
    assert [o["state"] for o in thin["optimizer_states"]] == [{}]
    assert orig["optimizer_states"][0]["state"]
    assert thin["optimizer_states"][0]["param_groups"] == orig["optimizer_states"][0][
        "param_groups"]
    assert os.path.getsize(run / name) < os.path.getsize(whole)


def _hf_fit(out: Path, schedule: str, steps: int, resume: Path | None = None) -> list[float]:
    """A tiny GPT-2 trained (or resumed from ``resume``) by transformers' Trainer to ``steps``
    steps, saving every 2; the LR of each step run, as the optimizer held it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    lrs: list[float] = []

    class Record(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            lrs.append(kw["optimizer"].param_groups[0]["lr"])

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2))
    args = TrainingArguments(output_dir=str(out), max_steps=steps, save_steps=2,
                             per_device_train_batch_size=4, report_to=[], use_cpu=True,
                             save_strategy="steps", disable_tqdm=True, learning_rate=1e-3,
                             lr_scheduler_type=schedule, warmup_steps=3, weight_decay=0.1,
                             logging_steps=100)
    trainer = Trainer(model=model, args=args, train_dataset=tiny_lm_data(),
                      callbacks=[Record()])
    with third_party_quiet():
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return lrs


@pytest.mark.parametrize("to", [None, "bf16"])
@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_thinned_hf_trainer_checkpoint_resumes_on_its_schedule(tmp_path: Path, schedule: str,
                                                                to: str | None) -> None:
    run = tmp_path / "run"
    _hf_fit(run, schedule, 6)
    whole = tmp_path / "whole" / "checkpoint-2"
    shutil.copytree(run / "checkpoint-2", whole)
    _age(run)
    extra = ["--thin-to", to] if to else []
    r = run_cli("prune", run, "--thin-after", "1", *extra, "--grace", "0", "--yes")
    assert r.exit_code == 0, r.output
    thin = run / "checkpoint-2"
    want = _hf_fit(tmp_path / "a", schedule, 8, whole)
    got = _hf_fit(tmp_path / "b", schedule, 8, thin)
    assert len(want) == 6 and want[0] not in (0.0, 1e-3)  # resumed mid-schedule
    print(f"HF {schedule} {to}: LR per resumed step {got}")
    assert got == want
    assert (thin / "optimizer.pt").stat().st_size < (whole / "optimizer.pt").stat().st_size
    opt = torch.load(thin / "optimizer.pt", weights_only=True)
    assert opt["state"] == {}
    assert opt["param_groups"] == torch.load(whole / "optimizer.pt",
                                             weights_only=True)["param_groups"]


def _dcp_fit(run: Path, steps: range, resume: Path | None = None) -> list[float]:
    """A plain DCP training loop with StepLR(2, 0.5): model, Adam, scheduler and step saved by
    ``dcp.save`` every 2 steps; resumed with ``dcp.load`` into a fresh model's, optimizer's and
    scheduler's state dicts, as a loop loads its own checkpoint. The LR of each step run."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    with third_party_quiet():
        if resume is not None:
            state = {"model": model.state_dict(), "optim": opt.state_dict(),
                     "sched": sched.state_dict()}
            dcp.load(state, checkpoint_id=str(resume), no_dist=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            sched.load_state_dict(state["sched"])
        lrs = []
        for step in steps:
            lrs.append(opt.param_groups[0]["lr"])
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            if step % 2 == 0:
                dcp.save({"model": model.state_dict(), "optim": opt.state_dict(),
                          "sched": sched.state_dict(), "step": step},
                         checkpoint_id=str(run / f"step_{step:06d}"), no_dist=True)
    return lrs


@pytest.mark.parametrize("to", [None, "bf16"])
def test_a_thinned_dcp_checkpoint_resumes_on_its_schedule(tmp_path: Path, to: str | None
                                                          ) -> None:
    from ckpt_cli.formats import read_index

    run = tmp_path / "run"
    _dcp_fit(run, range(1, 7))
    whole = tmp_path / "whole"
    shutil.copytree(run / "step_000004", whole)
    _age(run)
    extra = ["--thin-to", to] if to else []
    r = run_cli("prune", run, "--thin-after", "1", *extra, "--grace", "0", "--yes")
    assert r.exit_code == 0, r.output
    names = set(read_index(run / "step_000004").tensors)
    assert not [n for n in names if n.startswith("optim.state.")]
    assert [n for n in read_index(whole).tensors if n.startswith("optim.state.")]
    want = _dcp_fit(tmp_path / "a", range(5, 11), whole)
    got = _dcp_fit(tmp_path / "b", range(5, 11), run / "step_000004")
    assert want[0] == 0.0025  # resumed mid-schedule
    print(f"DCP StepLR {to}: LR per resumed step {got}")
    assert got == want
