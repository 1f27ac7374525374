"""Checkpoints written by the real libraries, for tests and benchmarks.

torch, safetensors, torch.distributed.checkpoint, huggingface_hub, transformers, lightning and
deepspeed write these; nothing here imitates a format by hand, except Megatron's legacy layout,
whose library cannot run on a CPU-only machine: that one is written with torch.save in the
exact key layout Megatron-LM's checkpointing.py uses.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HELPERS = Path(__file__).parent


def tiny_state_dict(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A small transformer-like state dict with a buffer and an integer tensor."""
    g = torch.Generator().manual_seed(seed)
    sd = {
        "embed.weight": torch.randn(32, 8, generator=g),
        "layers.0.attn.q_proj.weight": torch.randn(8, 8, generator=g),
        "layers.0.attn.q_proj.bias": torch.randn(8, generator=g),
        "layers.0.mlp.fc.weight": torch.randn(16, 8, generator=g),
        "layers.0.norm.weight": torch.ones(8),
        "layers.0.norm.running_mean": torch.zeros(8),
        "layers.0.norm.num_batches_tracked": torch.tensor(7),
        "head.weight": torch.randn(4, 8, generator=g),
    }
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}


def training_checkpoint(seed: int = 0, step: int = 100) -> dict[str, Any]:
    """A hand-written-loop training checkpoint: model + AdamW state + step/epoch/lr."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
            "epoch": 2, "lr": 1e-3}


def save_training_checkpoint(path: Path) -> Path:
    """:func:`training_checkpoint` written by ``torch.save`` to ``path``; returns ``path``."""
    torch.save(training_checkpoint(), path)
    return path


def hf_sharded(out: Path, sd: dict[str, torch.Tensor], max_shard_size: int) -> None:
    """Shard with huggingface_hub's own writer (model-0000i-of-0000n + index)."""
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(sd, out, max_shard_size=max_shard_size)


def tiny_llama(out: Path, intermediate_size: int = 400) -> Path:
    """A tiny Llama saved by transformers in FP32 to ``out``: 256-wide attention (whole
    128-blocks), an MLP ``intermediate_size`` wide (400: partial 128-blocks), untied lm_head
    320x256. Returns ``out``."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=256,
                                   intermediate_size=intermediate_size, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def tiny_llama_shaped(out: Path, hidden: int, intermediate: int, heads: int,
                      kv_heads: int) -> Path:
    """A tiny 2-layer Llama saved by transformers in FP32 with the given widths (head dim
    ``hidden // heads``; k/v projections ``kv_heads * head_dim`` rows), untied 320-token
    vocabulary. Returns ``out``."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=hidden,
                                   intermediate_size=intermediate, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def tiny_neox(out: Path) -> Path:
    """A tiny 2-layer GPT-NeoX saved by transformers in FP32: embeddings ``gpt_neox.embed_in``,
    output head ``embed_out``, fused ``query_key_value``. Returns ``out``."""
    import transformers

    cfg = transformers.GPTNeoXConfig(vocab_size=320, hidden_size=256, intermediate_size=512,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(cfg).save_pretrained(out)
    return out


def tiny_lm_data() -> Any:
    """32 token sequences of length 16 over a 64-token vocabulary (inputs are labels): what the
    tiny GPT-2 Trainer runs of the tests train on."""

    class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = (torch.arange(16) + i) % 64
            return {"input_ids": ids, "labels": ids}

    return Data()


def hf_trainer_run(out: Path, steps: int = 4, save_steps: int = 2, *,
                   evaluate: bool = False, final: bool = False) -> Path:
    """Train a tiny GPT-2 with transformers' Trainer; returns the output directory.

    With ``evaluate``, it evaluates at every save and tracks the best checkpoint by eval_loss
    (``best_model_checkpoint`` in trainer_state.json, eval_loss in its log_history). With
    ``final``, ``trainer.save_model()`` and ``save_state()`` put the final model into the
    output directory itself, beside its ``checkpoint-N/``.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_DISABLED", "true")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2))

    extra: dict[str, Any] = {}
    if evaluate:
        extra = {"eval_strategy": "steps", "eval_steps": save_steps,
                 "metric_for_best_model": "eval_loss", "greater_is_better": False,
                 "per_device_eval_batch_size": 4}
    args = TrainingArguments(output_dir=str(out), max_steps=steps, save_steps=save_steps,
                             per_device_train_batch_size=4, logging_steps=1, report_to=[],
                             use_cpu=True, save_strategy="steps", disable_tqdm=True, **extra)
    trainer = Trainer(model=model, args=args, train_dataset=tiny_lm_data(),
                      eval_dataset=tiny_lm_data() if evaluate else None)
    trainer.train()
    if final:
        trainer.save_model()
        trainer.save_state()
    return out


def lightning_run(out: Path, steps: int = 4, every: int = 2, *, filename: str = "{epoch}-{step}",
                  save_last: bool | str = True, norm: bool = False, sgd: bool = False,
                  scheduler: bool = False) -> Path:
    """Train a tiny LightningModule, keeping every checkpoint and last.ckpt.

    ``filename`` is ModelCheckpoint's template (``"{epoch}-{step}-{train_loss:.4f}"`` puts the
    metric in the name); ``save_last="link"`` makes last.ckpt a symlink. ``norm`` appends a
    BatchNorm1d (float buffers beside the parameters); ``sgd`` trains with SGD and momentum
    instead of Adam; ``scheduler`` adds a StepLR stepped every batch.
    """
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Mod(L.LightningModule):
        def __init__(self, hidden: int = 8) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net: torch.nn.Module = torch.nn.Linear(4, hidden)
            if norm:
                self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden),
                                               torch.nn.BatchNorm1d(hidden),
                                               torch.nn.Linear(hidden, 2))

        def training_step(self, batch: Any, _i: int) -> torch.Tensor:
            loss = self.net(batch[0]).pow(2).mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            opt: torch.optim.Optimizer = (
                torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9) if sgd
                else torch.optim.Adam(self.parameters(), lr=0.01))
            if not scheduler:
                return opt
            step = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": step, "interval": "step"}}

    data = torch.utils.data.TensorDataset(torch.randn(16, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    ck = ModelCheckpoint(dirpath=out, every_n_train_steps=every, save_top_k=-1,
                         save_last=save_last,
                         filename=filename)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=[ck],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    torch.manual_seed(0)
    trainer.fit(Mod(), loader)
    return out


def _clear_stale_extension_locks(age: float = 600.0) -> None:
    """Remove torch's C++-extension build locks older than ``age`` seconds.

    DeepSpeed builds its CPU communication op through ``torch.utils.cpp_extension``, whose
    lock file (``FileBaton``) a killed build leaves behind; every later start then waits on it
    forever (a test run interrupted mid-build hung the next one for its whole timeout). A build
    takes about a minute, so a lock ten minutes old is stale.
    """
    import contextlib
    import time

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR")
                or Path.home() / ".cache" / "torch_extensions")
    for lock in root.glob("*/*/lock"):
        with contextlib.suppress(OSError):
            if time.time() - lock.stat().st_mtime > age:
                lock.unlink()


def deepspeed_checkpoints(out: Path, configs: list[str]) -> Path:
    """Run DeepSpeed ZeRO on CPU (2 processes) for each config, e.g. ``z2-fp32``."""
    _clear_stale_extension_locks()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(HELPERS / "ds_train.py"), str(out), *configs]
    # One retry: DeepSpeed builds its CPU communication op on first use, and a gloo
    # rendezvous can time out on a loaded 2-core machine; a second failure is real and its
    # stderr is shown (a bare CalledProcessError says nothing about why).
    for attempt in (1, 2):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                           check=False)
        if r.returncode == 0:
            return out
        if attempt == 2:
            raise AssertionError(f"ds_train.py {' '.join(configs)} failed twice (exit "
                                 f"{r.returncode}):\n{r.stderr[-4000:]}")
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    return out


def megatron_legacy(out: Path, tp: int = 2, pp: int = 1, iteration: int = 500) -> Path:
    """A Megatron-LM legacy iteration directory (torch.save in Megatron's key layout)."""
    d = out / f"iter_{iteration:07d}"
    args = argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              num_layers=2, hidden_size=8, iteration=iteration)
    for t in range(tp):
        for p in range(pp):
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
            (d / name).mkdir(parents=True)
            g = torch.Generator().manual_seed(t * 10 + p)
            model = {"language_model": {"embedding": {"word_embeddings": {
                "weight": torch.randn(16 // tp, 8, generator=g)}},
                "encoder": {"layers.0.mlp.dense_h_to_4h.weight": torch.randn(32 // tp, 8,
                                                                              generator=g)}}}
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                        "model": model,
                        # Adam's state as torch < 1.12 saved it (an int step per parameter):
                        # an empty "state" would be no optimizer state at all.
                        "optimizer": {"optimizer": {"state": {0: {"step": 3}},
                                                    "param_groups": [{"lr": 1e-4,
                                                                      "params": [0]}]}},
                        "rng_state": [{"random_rng_state": (3, (1, 2), None)}],
                        "num_floating_point_operations_so_far": 12345},
                       d / name / "model_optim_rng.pt")
    (out / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return d
