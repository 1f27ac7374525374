"""A stand-in training loop for prune's concurrency test: saves a real ``torch.save``
checkpoint every ``interval`` seconds and writes each one slowly (in chunks, as over a slow
network file system), so that a save in progress is visible for part of every interval.

Usage: python -m tests.helpers.slow_trainer RUN_DIR INTERVAL SAVES
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    run, interval, saves = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    w = torch.randn(256, 128)
    for step in range(1, saves + 1):
        start = time.monotonic()
        w += 0.01
        buf = io.BytesIO()
        torch.save({"model": {"w": w}, "step": step}, buf)
        data = buf.getvalue()
        quarter = len(data) // 4 + 1
        with open(run / f"step_{step:04d}.pt", "wb") as f:
            for i in range(0, len(data), quarter):
                f.write(data[i:i + quarter])
                f.flush()
                time.sleep(interval / 8)
        print(step, flush=True)
        time.sleep(max(0.0, interval - (time.monotonic() - start)))


if __name__ == "__main__":
    main()
