"""A tiny training loop that saves a DCP checkpoint every few steps (run as a subprocess).

``python -m tests.helpers.dcp_loop RUN SAVES [--kill-at N]``: saves ``step_2``, ``step_4``...
with ``torch.distributed.checkpoint`` and moves a ``latest`` pointer after each save. With
``--kill-at N`` the process sends itself SIGKILL in the middle of save number N: its data
files are written, its ``.metadata`` (DCP's commit marker) never is.
"""

from __future__ import annotations

import argparse
import os
import signal
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("saves", type=int)
    ap.add_argument("--kill-at", type=int, default=None)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    run = Path(a.run)
    run.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(1, a.saves + 1):
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
        step = 2 * i
        writer = FileSystemWriter(str(run / f"step_{step}"))
        if a.kill_at == i:
            def die(*_args: object, **_kwargs: object) -> None:
                os.kill(os.getpid(), signal.SIGKILL)  # killed before the commit marker

            writer.finish = die  # type: ignore[method-assign]
        dcp.save({"model": model.state_dict(), "step": step}, storage_writer=writer)
        tmp = run / "latest.tmp"
        tmp.write_text(f"step_{step}\n")
        os.replace(tmp, run / "latest")
        print(f"saved step_{step}", flush=True)


if __name__ == "__main__":
    main()
