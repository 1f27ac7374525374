"""Run under torchrun: a 2-process DDP (gloo, CPU) Lightning run with ``VerifiedModelCheckpoint``.

Usage: torchrun --standalone --nproc-per-node 2 tests/helpers/lightning_ddp.py OUT STEPS
       [--break-at STEP]

``--break-at`` truncates that step's file on rank 0 right after Lightning wrote it (a save gone
wrong). Each rank writes ``OUT/../rank-R.json``: its global step, the entries its callback
recorded, and the files it saw in OUT after each save.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    warnings.simplefilter("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("steps", type=int)
    ap.add_argument("--break-at", type=int)
    ns = ap.parse_args()

    from lightning.pytorch.callbacks import Callback

    from ckpt_cli.integrations.lightning import VerifiedModelCheckpoint
    from tests.helpers.lightning_parts import fit_tiny, save_breaker

    out: Path = ns.out
    saw: dict[int, list[str]] = {}

    # Damages the ``--break-at`` file on rank 0 right after Lightning wrote it.
    brk = save_breaker(lambda trainer, _f: trainer.is_global_zero
                       and trainer.global_step == ns.break_at)

    class Seen(Callback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: Any, *_a: Any) -> None:
            if out.is_dir():
                saw[trainer.global_step] = sorted(p.name for p in out.iterdir())

    ck = VerifiedModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=1,
                                 filename="{step}")
    trainer = fit_tiny([brk, Seen(), ck], steps=ns.steps, samples=64, devices=2,
                       strategy="ddp")
    rank = int(os.environ["RANK"])
    doc = {"rank": rank, "global_step": trainer.global_step,
           "entries": [[e.path, e.verdict] for e in ck.entries],
           "saw": {str(k): v for k, v in saw.items()}}
    (out.parent / f"rank-{rank}.json").write_text(json.dumps(doc))
    # Leave the world together: a rank that exits while the other still holds the gloo group
    # can abort in the group's destructor ("terminate called without an active exception").
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
