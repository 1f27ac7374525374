"""The HF Trainer and Lightning runs of the resume proofs (issue 48), and their recipes for the
FSDP2 loop of :mod:`tests.helpers.fsdp_resume`.

Each framework trains from a fixed start on data in a fixed order, saves its own checkpoint
after ``K0`` steps, then continues from it (``resume_from_checkpoint`` / ``ckpt_path``),
recording through callbacks the param groups (with FQNs) it restored, the LRs of every step
(one per group) and the parameters and optimizer state (by FQN) after every step. The recipe
(:data:`HF`, :data:`LIGHTNING`) builds the same model, param groups, schedule and per-rank loss
for the FSDP2 run.

- HF Trainer: a tiny GPT-2 from a config (no download, no dropout), Trainer's own optimizer
  (``adamw_torch_fused``, the default) with its two groups (weight decay on the matrices, none
  on biases and LayerNorms: interleaved FQNs), ``linear`` warmup-then-decay schedule, a
  sequential sampler, gradient clipping off (``max_grad_norm=0``).
- Lightning: ``fsdp_resume.tiny_model`` under ``self.net``, AdamW in two groups with their own
  ``lr`` and ``weight_decay`` (the first Linear; the rest), the warmup ``LambdaLR`` stepped
  every batch; an epoch is ``K0`` batches in order, so the checkpoint ends an epoch and the
  continuation's data is the FSDP2 run's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tests.helpers import fsdp_resume as fr

HF_K0, HF_K = 4, 5
HF_BATCH = 8
HF_WARMUP = 3
HF_LR, HF_WD = 1e-2, 0.1
PL_K0, PL_K = 4, 5


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Parameters (the state dict) and the optimizer state by FQN, copied."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": {name_of[id(p)]: {k: v.detach().clone() if torch.is_tensor(v) else v
                                       for k, v in s.items()} for p, s in opt.state.items()}}


def named_groups(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's param groups with FQNs in ``params``."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [name_of[id(p)] for p in g["params"]]} for g in opt.param_groups]


# -- HF Trainer --------------------------------------------------------------------------------

def hf_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def hf_model() -> torch.nn.Module:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(hf_config())


def hf_tokens() -> torch.Tensor:
    """Every step's batch: rows ``s*HF_BATCH..`` are step ``s``'s sequences."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 64, ((HF_K0 + HF_K) * HF_BATCH, 16), generator=g)


def hf_loss(model: torch.nn.Module, step: int, world: int = 1, rank: int = 0) -> torch.Tensor:
    """The loss Trainer computes, on rank ``rank``'s rows of step ``step``'s batch.

    Trainer passes the model ``num_items_in_batch``, the labels it counts: ``labels[..., 1:]``
    only when the model's ``loss_type`` maps to the causal-LM loss. GPT-2's ``loss_type`` is
    None, so Trainer (5.24) counts every label, 16 a row, while the loss sums the 15 shifted
    ones: its loss is 15/16 of the mean. The same count here, or the gradients differ by that
    factor (measured) and Adam's moments with them."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    n = HF_BATCH // world
    x = hf_tokens()[step * HF_BATCH + rank * n: step * HF_BATCH + (rank + 1) * n]
    shifts = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
    counted = (x[:, 1:] if shifts else x).ne(-100).sum()
    out = model(input_ids=x, labels=x, num_items_in_batch=counted)
    loss: torch.Tensor = out.loss
    return loss


def hf_optimizer(model: torch.nn.Module, placeholder: bool = False) -> torch.optim.Optimizer:
    """Trainer's groups (its own decay rule) with its hyperparameters, fused as its default."""
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    named = list(model.named_parameters())
    hp = {"lr": HF_LR, "betas": (0.9, 0.999), "eps": 1e-8}
    groups = [([p for n, p in named if n in decay], {**hp, "weight_decay": HF_WD}),
              ([p for n, p in named if n not in decay], {**hp, "weight_decay": 0.0})]
    return fr.adamw(groups, placeholder, **({} if placeholder else {"fused": True}))


def hf_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    from transformers import get_linear_schedule_with_warmup

    sched: torch.optim.lr_scheduler.LRScheduler = get_linear_schedule_with_warmup(
        opt, HF_WARMUP, HF_K0 + HF_K)
    return sched


HF = fr.Recipe(hf_model, hf_optimizer, hf_scheduler, hf_loss)


def _hf_trainer(out: Path, callbacks: list[Any]) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import Trainer, TrainingArguments

    tokens = hf_tokens()
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(
        output_dir=str(out), max_steps=HF_K0 + HF_K, per_device_train_batch_size=HF_BATCH,
        learning_rate=HF_LR, weight_decay=HF_WD, warmup_steps=HF_WARMUP,
        lr_scheduler_type="linear", max_grad_norm=0.0, train_sampling_strategy="sequential",
        save_strategy="steps", save_steps=HF_K0, logging_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    return Trainer(model=hf_model(), args=args, train_dataset=data,  # type: ignore[arg-type]
                   callbacks=callbacks)


def hf_source(out: Path) -> Path:
    """Trainer's ``checkpoint-HF_K0`` (it stops there, the schedule planned for K0 + K)."""
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step >= HF_K0:
                control.should_training_stop = True

    _hf_trainer(out, [Stop()]).train()
    return out / f"checkpoint-{HF_K0}"


def hf_continue(ckpt: Path, out: Path) -> dict[str, Any]:
    """Trainer continuing from its own checkpoint: the LRs of each step, the state after each
    step (``trace``), the last of them, and the groups it restored."""
    from transformers import TrainerCallback

    lrs: list[list[float]] = []
    trace: list[dict[str, Any]] = []
    groups: list[dict[str, Any]] = []

    class Record(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            groups.extend(named_groups(kw["model"], kw["optimizer"]))

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            lrs.append([float(g["lr"]) for g in kw["optimizer"].param_groups])

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            trace.append(_snapshot(kw["model"], kw["optimizer"].optimizer))

    trainer = _hf_trainer(out, [Record()])
    trainer.train(resume_from_checkpoint=str(ckpt))
    return {**trace[-1], "trace": trace, "lrs": lrs, "groups": groups}


# -- Lightning ---------------------------------------------------------------------------------

PL_GROUPS = ({"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1},
             {"lr": 5e-3, "betas": (0.9, 0.99), "weight_decay": 0.0})


def pl_optimizer(model: torch.nn.Module, placeholder: bool = False) -> torch.optim.Optimizer:
    """Two groups: the first Linear (``0.*``), and the rest, each with its LR and decay."""
    named = list(model.named_parameters())
    first = [p for n, p in named if n.startswith("0.")]
    rest = [p for n, p in named if not n.startswith("0.")]
    return fr.adamw([(first, PL_GROUPS[0]), (rest, PL_GROUPS[1])], placeholder)


def pl_loss(model: torch.nn.Module, step: int, world: int = 1, rank: int = 0) -> torch.Tensor:
    """An epoch is ``PL_K0`` batches in order: step ``s`` trains on batch ``s % PL_K0``."""
    return fr.mse(model, step % PL_K0, world, rank)


LIGHTNING = fr.Recipe(fr.tiny_model, pl_optimizer, fr.make_scheduler, pl_loss)


def _pl_module(record: dict[str, Any] | None = None) -> Any:
    import lightning as L

    class Mod(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = fr.tiny_model()

        def training_step(self, batch: Any, _i: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = pl_optimizer(self.net)
            sched = fr.make_scheduler(opt)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_train_start(self) -> None:
            if record is not None:
                record["groups"] = named_groups(self.net, self.trainer.optimizers[0])

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if record is not None:
                opt = self.trainer.optimizers[0]
                record["lrs"].append([float(g["lr"]) for g in opt.param_groups])

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if record is not None:
                record["trace"].append(_snapshot(self.net, self.trainer.optimizers[0]))

    return Mod()


def _pl_fit(module: Any, steps: int, ckpt: Path | None = None, save_to: Path | None = None
            ) -> Any:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    xs, ys = zip(*(fr.batch(s) for s in range(PL_K0)), strict=True)
    data = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    loader = torch.utils.data.DataLoader(data, batch_size=fr.GLOBAL_BATCH, shuffle=False)
    saves = [] if save_to is None else [
        ModelCheckpoint(dirpath=save_to, every_n_train_steps=PL_K0, filename="{step}")]
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(saves), callbacks=saves)
    trainer.fit(module, loader, ckpt_path=str(ckpt) if ckpt is not None else None)
    return trainer


def pl_source(out: Path) -> Path:
    """The ``.ckpt`` ``ModelCheckpoint(every_n_train_steps=PL_K0)`` saves after one epoch.

    Saved from the training-batch hook, it resumes at the next epoch's first batch. A
    ``trainer.save_checkpoint`` after ``fit`` returned (or an epoch-end save) resumes with
    one more batch of the finished epoch, the data restarted: batch 0 twice (measured with
    Lightning 2.6)."""
    _pl_fit(_pl_module(), PL_K0, save_to=out)
    return out / f"step={PL_K0}.ckpt"


def pl_continue(ckpt: Path) -> dict[str, Any]:
    """Lightning continuing from its own ``.ckpt`` (as :func:`hf_continue`)."""
    record: dict[str, Any] = {"lrs": [], "trace": []}
    module = _pl_module(record)
    _pl_fit(module, PL_K0 + PL_K, ckpt)
    return {**record["trace"][-1], **record}
