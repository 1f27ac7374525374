"""A tiny training loop that saves a DCP checkpoint every few steps (run as a subprocess).

``python -m tests.helpers.dcp_loop RUN SAVES [--kill-at N] [--resume-from STEP]``: saves
``step_2``, ``step_4``... with ``torch.distributed.checkpoint`` and moves a ``latest`` pointer
after each save. With ``--kill-at N`` the process sends itself SIGKILL in the middle of save
number N: its data files are written, its ``.metadata`` (DCP's commit marker) never is. With
``--resume-from STEP`` it loads ``step_STEP`` first and goes on from there, saving the later
steps again in place (a rollback). Under ``torchrun`` (``RANK`` set) every rank joins a gloo
process group and the saves and loads are collective.
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
    ap.add_argument("--resume-from", type=int, default=None)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    many = "RANK" in os.environ
    if many:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    run = Path(a.run)
    run.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0 if a.resume_from is None else 1 + a.resume_from)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = 1
    if a.resume_from is not None:
        state = {"model": model.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=str(run / f"step_{a.resume_from}"))
        model.load_state_dict(state["model"])
        first = a.resume_from // 2 + 1
    for i in range(first, a.saves + 1):
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
        if not many or int(os.environ["RANK"]) == 0:
            tmp = run / "latest.tmp"
            tmp.write_text(f"step_{step}\n")
            os.replace(tmp, run / "latest")
            print(f"saved step_{step}", flush=True)
    if many:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
