"""Helpers the ``ckpt stats RUN`` test modules share (test_stats_run*.py): the JSON of a run,
its findings, and torch's own figures of a run's modules."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from tests.conftest import run_cli
from tests.helpers.train_loop import load_model, module_of


def stats_json(*args: str | Path, code: int = 0) -> dict[str, Any]:
    """``ckpt stats ARGS --json``, its exit status checked, parsed."""
    r = run_cli("stats", *args, "--json")
    assert r.exit_code == code, r.stdout + r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def found(doc: dict[str, Any]) -> set[tuple[int, str, str]]:
    return {(a["step"], a["module"], a["kind"]) for a in doc["anomalies"]}


def model_bytes(path: Path) -> int:
    """Bytes of the saved model's tensors (the default scope: weights and buffers)."""
    return sum(t.numel() * t.element_size() for t in load_model(path).values())


def torch_modules(prev: Path | None, cur: Path) -> dict[str, dict[str, float | None]]:
    """Per module: torch's float64 L2 norm and update ratio ||W_t - W_{t-1}|| / ||W_{t-1}||
    over the module's tensors (None where a value is not finite)."""
    now = load_model(cur)
    before = load_model(prev) if prev is not None else {}
    sq: dict[str, float] = {}
    upd: dict[str, float] = {}
    base: dict[str, float] = {}
    for name, t in now.items():
        mod = module_of(name)
        x = t.double()
        finite = x[torch.isfinite(x)]
        sq[mod] = sq.get(mod, 0.0) + float(finite.pow(2).sum())
        if name in before:
            b = before[name].double()
            upd[mod] = upd.get(mod, 0.0) + float((x - b).pow(2).sum())
            base[mod] = base.get(mod, 0.0) + float(b[torch.isfinite(b)].pow(2).sum())
    out: dict[str, dict[str, float | None]] = {}
    for mod, s in sq.items():
        ratio = None
        if mod in upd and math.isfinite(upd[mod]) and base[mod] > 0:
            ratio = math.sqrt(upd[mod]) / math.sqrt(base[mod])
        out[mod] = {"l2": math.sqrt(s), "update_ratio": ratio}
    return out


def close(a: float | None, b: float | None, rel: float = 1e-12) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b))
