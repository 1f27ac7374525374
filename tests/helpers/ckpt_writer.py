"""A training job's checkpoint writer, to race ``ckpt prune`` against.

Usage: python ckpt_writer.py RUN_DIR FIRST_STEP COUNT [--every STEPS]

Saves ``step_NNNNNN/`` checkpoints the way hand-written training loops do: each is three
torch.save shards written one after another (with a pause between them, so a prune can look at
the directory mid-save), and only then ``latest`` is moved to it (atomically). After every write
it checks that everything it has written for the current checkpoint is still there and prints
``ok`` at the end; a prune that touched an in-progress checkpoint makes it fail.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

PARTS = 3


def write_checkpoint(run: Path, step: int, pause: float) -> None:
    """Write one checkpoint and then point ``latest`` at it."""
    d = run / f"step_{step:06d}"
    d.mkdir()
    written: list[Path] = []
    for part in range(PARTS):
        p = d / f"model_part{part}.pt"
        torch.save({"w": torch.full((32, 32), float(step)), "step": step}, p)
        written.append(p)
        missing = [q.name for q in written if not q.is_file()]
        if missing:
            raise SystemExit(f"step {step}: {missing} vanished while the checkpoint was written")
        time.sleep(pause)
    tmp = run / ".latest.tmp"
    tmp.write_text(d.name + "\n")
    os.replace(tmp, run / "latest")


def main() -> None:
    run, first, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    every = int(sys.argv[sys.argv.index("--every") + 1]) if "--every" in sys.argv else 100
    pause = float(sys.argv[sys.argv.index("--pause") + 1]) if "--pause" in sys.argv else 0.0
    for i in range(count):
        write_checkpoint(run, first + i * every, pause)
    print("ok")


if __name__ == "__main__":
    main()
