"""Normalisers for golden JSON: pin what varies between runs and machines."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: Keys whose values are timings or file times: never the same twice.
VOLATILE_KEYS = frozenset({"seconds", "mtime", "bytes_per_second"})


def stable(root: Path) -> Any:
    """A normaliser: timings and mtimes become ``"<varies>"``, paths under ``root`` relative."""
    prefix = str(root) + os.sep

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: "<varies>" if k in VOLATILE_KEYS and x is not None else walk(x)
                    for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, str):
            return v.replace(prefix, "").replace(str(root), ".")
        return v

    return walk


def safetensors_run(root: Path) -> Path:
    """A run dir of four step dirs, each a model.safetensors written by safetensors itself,
    a ``latest`` pointer and mtimes fixed in 2020 (so no checkpoint is recent)."""
    import numpy as np
    from safetensors.numpy import save_file

    run = root / "run"
    for i, step in enumerate((100, 200, 300, 400)):
        d = run / f"step_{step:06d}"
        d.mkdir(parents=True)
        w = np.arange(64, dtype=np.float32).reshape(8, 8) + i
        save_file({"w": w, "b": np.full(8, i, dtype=np.int64)}, str(d / "model.safetensors"),
                  metadata={"step": str(step)})
    (run / "latest").write_text("step_000400\n")
    t = 1_580_000_000
    for i, p in enumerate(sorted(run.rglob("*"))):
        os.utime(p, (t + i, t + i))
    for i, d in enumerate(sorted(run.iterdir())):
        os.utime(d, (t + 100 * i, t + 100 * i))
    os.utime(run, (t, t))
    return run
