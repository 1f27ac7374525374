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

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from ckpt_cli.integrations.lightning import VerifiedModelCheckpoint

    out: Path = ns.out
    saw: dict[int, list[str]] = {}

    class Mod(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 8)

        def training_step(self, batch: Any, _i: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    class Break(Callback):  # type: ignore[misc]
        """Damages the ``--break-at`` file on rank 0 right after Lightning wrote it."""

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            real = trainer.save_checkpoint

            def save(filepath: str, *a: Any, **kw: Any) -> None:
                real(filepath, *a, **kw)  # every rank calls it; rank 0 writes
                if trainer.is_global_zero and trainer.global_step == ns.break_at:
                    f = Path(filepath)
                    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

            trainer.save_checkpoint = save

        def on_train_batch_end(self, trainer: Any, *_a: Any) -> None:
            if out.is_dir():
                saw[trainer.global_step] = sorted(p.name for p in out.iterdir())

    ck = VerifiedModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=1,
                                 filename="{step}")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)),
                                         batch_size=4)
    trainer = L.Trainer(max_steps=ns.steps, accelerator="cpu", devices=2, strategy="ddp",
                        callbacks=[Break(), ck], logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    torch.manual_seed(0)
    trainer.fit(Mod(), loader)
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
