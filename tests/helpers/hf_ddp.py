"""Run under torchrun: a 2-process DDP (gloo, CPU) HF Trainer run with ``CkptVerifyCallback``.

Usage: torchrun --standalone --nproc-per-node 2 tests/helpers/hf_ddp.py OUT STEPS
       [--break-at STEP] [--stop-on-bad] [--slow-rng-rank RANK] [--each-node]
       [--break-node NODE]

``--break-at`` truncates that checkpoint's model.safetensors on rank 0 right after Trainer
wrote it (a save gone wrong). ``--slow-rng-rank`` makes that rank finish writing its
``rng_state_R.pth`` late (a rank slower than rank 0 to finish its part of a save: it waits
until rank 0's ``on_save`` has begun, then half a second more). ``--each-node`` runs with
``save_on_each_node=True`` and ``OUT/node-G`` as output dir of node G (torchrun's
``GROUP_RANK``: two torchrun agents on one machine act as two nodes with their own disks);
``--break-at`` then breaks the copy of node ``--break-node`` (default 0). Each rank writes
``rank-R.json`` into its output dir: the steps it ended at, the entries its callback recorded
and the checkpoints it saw at each save.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    warnings.simplefilter("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_DISABLED", "true")
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("steps", type=int)
    ap.add_argument("--break-at", type=int)
    ap.add_argument("--stop-on-bad", action="store_true")
    ap.add_argument("--slow-rng-rank", type=int)
    ap.add_argument("--each-node", action="store_true")
    ap.add_argument("--break-node", type=int, default=0)
    ns = ap.parse_args()

    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from ckpt_cli.integrations.hf import CkptVerifyCallback
    from tests.helpers.makers import tiny_lm_data

    node = int(os.environ.get("GROUP_RANK", "0"))
    out: Path = ns.out / f"node-{node}" if ns.each_node else ns.out
    rank = int(os.environ["RANK"])
    started = out / ".rank0-on-save-{}"  # rank 0 marks that its on_save began for a step

    class Break(TrainerCallback):  # type: ignore[misc]
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            if state.is_world_process_zero:
                (out / f".rank0-on-save-{state.global_step}").touch()
            if args.should_save and node == ns.break_node:
                if state.global_step == ns.break_at:
                    f = out / f"checkpoint-{state.global_step}" / "model.safetensors"
                    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            return control

    saw: dict[int, list[str]] = {}

    class Probe(TrainerCallback):  # type: ignore[misc]
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            saw[state.global_step] = sorted(p.name for p in out.glob("checkpoint-*"))
            return control

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2))
    args = TrainingArguments(output_dir=str(out), max_steps=ns.steps, save_steps=2,
                             save_total_limit=1, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="steps", disable_tqdm=True,
                             ddp_backend="gloo", ddp_timeout=120, logging_strategy="no",
                             save_on_each_node=ns.each_node)
    verify = CkptVerifyCallback(stop_on_bad=ns.stop_on_bad)
    trainer = Trainer(model=model, args=args, train_dataset=tiny_lm_data(),
                      callbacks=[Break(), verify, Probe()])
    if ns.slow_rng_rank == rank:
        real = trainer._save_rng_state

        def slow(output_dir: str) -> None:
            # Finish this rank's part of the save only once rank 0 has moved on to on_save
            # (or after 20 s: a hang guard when something keeps rank 0 from getting there).
            step = int(Path(output_dir).name.split("-")[-1])
            deadline = time.monotonic() + 20
            while (not Path(str(started).format(step)).exists()
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            time.sleep(0.5)  # and give rank 0 time to verify, if nothing makes it wait
            real(output_dir)

        trainer._save_rng_state = slow  # type: ignore[method-assign]
    trainer.train()
    doc = {"rank": rank, "global_step": trainer.state.global_step,
           "entries": [[e.path, e.verdict] for e in verify.entries],
           "saw": {str(k): v for k, v in saw.items()}}
    (out / f"rank-{rank}.json").write_text(json.dumps(doc))
    # Leave the world together: a rank that exits while the other still holds the gloo group
    # can abort in the group's destructor ("terminate called without an active exception").
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
