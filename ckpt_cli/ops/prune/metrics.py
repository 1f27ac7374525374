"""Metric values of a run's checkpoints, and HF Trainer's state, read from files.

For ``ckpt prune --keep-best``: a metrics file (Lightning's CSVLogger CSV, JSON lines, JSON),
HF Trainer's ``trainer_state.json`` log history, and metrics in checkpoint names.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import orjson

from ckpt_cli import storage
from ckpt_cli.dtypes import strict_int
from ckpt_cli.errors import CheckpointNotFoundError, CkptError, UsageError
from ckpt_cli.model import RunListing


def trainer_state(listing: RunListing) -> tuple[list[dict[str, Any]], tuple[str, str] | None]:
    """HF Trainer's log history and best checkpoint, from the newest ``trainer_state.json``.

    The Trainer reloads ``best_model_checkpoint`` at the end of training
    (``load_best_model_at_end``) and its own rotation never deletes it, so neither do we.

    Args:
        listing: The run directory (its own ``trainer_state.json`` and its checkpoints').

    Returns:
        ``(log history entries, (best checkpoint's name, why it is kept) or None)``; an
        unreadable or malformed state file gives ``([], None)``.
    """
    states = [listing.root / "trainer_state.json"]
    states.append(next((e.path / "trainer_state.json" for e in reversed(listing.entries)
                        if e.complete and (e.path / "trainer_state.json").is_file()), states[0]))
    newest = max((p for p in states if p.is_file()), key=lambda p: p.stat().st_mtime,
                 default=None)
    if newest is None:
        return [], None
    # Not a regular file or over its cap: an error (a state that cannot be read could hide
    # the best checkpoint); malformed JSON counts as no state, as before.
    raw = storage.read_side(newest, "trainer-state")
    try:
        data = orjson.loads(raw or b"")
    except orjson.JSONDecodeError:
        return [], None
    if not isinstance(data, dict):
        return [], None
    raw_history = data.get("log_history")
    history = [h for h in raw_history if isinstance(h, dict)] if isinstance(
        raw_history, list) else []
    best = data.get("best_model_checkpoint")
    names = {e.name for e in listing.entries}
    if isinstance(best, str) and Path(best).name in names:
        where = newest.relative_to(listing.root)
        return history, (Path(best).name, f"{where} names it best_model_checkpoint: the HF "
                                          "Trainer reloads it at the end of training")
    return history, None


def metric_values(listing: RunListing, metric: str, history: list[dict[str, Any]],
                   metrics_file: str | Path | None) -> dict[str, float]:
    """``--metric`` per checkpoint: the metrics file, else the name, else trainer state.

    Args:
        listing: The run directory.
        metric: The metric's name (``eval_<metric>`` is accepted too).
        history: HF Trainer's log history (from :func:`trainer_state`).
        metrics_file: An explicit metrics file (see :func:`read_metrics_file`), if any.

    Returns:
        Checkpoint name -> value, for those that have one.

    Raises:
        UsageError: No checkpoint has a value for the metric.
        CkptError: The metrics file cannot be read or parsed.
    """
    keys = (metric, f"eval_{metric}")
    by_step: dict[int, float] = {}
    by_name: dict[str, float] = {}
    seen: set[str] = set()
    for h in history:
        seen.update(k for k in h if isinstance(k, str) and k != "step")
        value = next((h[k] for k in keys if _is_number(h.get(k))), None)
        if value is not None and isinstance(h.get("step"), int):
            by_step[h["step"]] = float(value)
    if metrics_file is not None:
        file_steps, file_names, file_keys = read_metrics_file(Path(metrics_file), keys)
        by_step.update(file_steps)
        by_name.update(file_names)
        seen.update(file_keys)
    out: dict[str, float] = {}
    steps = {e.step for e in listing.entries if e.step is not None}
    for e in listing.entries:
        seen.update(e.metrics)
        value = by_name.get(e.name)
        if value is None:
            value = e.metrics.get(metric)
        if value is None and e.step is not None:
            value = by_step.get(e.step)
            if value is None and e.step - 1 not in steps:
                # Lightning's CSVLogger logs validation at step S-1 for the checkpoint named
                # step=S. Only that: a value from further back evaluated another model.
                value = by_step.get(e.step - 1)
        if value is not None:
            out[e.name] = value
    if not out:
        known = ", ".join(sorted(seen)[:12]) or "none"
        raise UsageError(f"no checkpoint has a value for metric {metric} (metrics found: "
                         f"{known})", hint="check the name, or give metrics_file",
                         param=("metric", "metrics_file"))
    return out


def read_metrics_file(path: Path, keys: tuple[str, ...],
                      ) -> tuple[dict[int, float], dict[str, float], set[str]]:
    """Metric values by step and by checkpoint name from a metrics file.

    Accepted: CSV with a ``step`` (or ``global_step``) column (Lightning's CSVLogger); JSON
    lines of objects with ``step``; a JSON list of such objects, an object with a
    ``log_history`` list (an HF ``trainer_state.json``), or an object mapping checkpoint names
    or steps to a value or to an object of metrics.

    Args:
        path: The file.
        keys: The metric's accepted names (``loss`` and ``eval_loss``...), first match wins.

    Returns:
        ``(by step, by name, every metric name seen)``.

    Raises:
        CkptError: The file cannot be read or parsed.
    """
    raw = storage.read_side(path, "metrics")
    if raw is None:
        raise CheckpointNotFoundError("cannot read the metrics file: no such file", path=path)
    rows: list[Any]
    try:
        if path.suffix == ".csv":
            rows = list(csv.DictReader(raw.decode("utf-8", "replace").splitlines()))
        elif path.suffix == ".jsonl":
            rows = [orjson.loads(line) for line in raw.splitlines() if line.strip()]
        else:
            doc = orjson.loads(raw)
            rows = doc.get("log_history", doc) if isinstance(doc, dict) else doc
    except (orjson.JSONDecodeError, csv.Error, UnicodeDecodeError) as e:
        raise CkptError(f"cannot parse the metrics file: {e}", path=path) from None
    by_step: dict[int, float] = {}
    by_name: dict[str, float] = {}
    seen: set[str] = set()
    if isinstance(rows, dict):
        for name, v in rows.items():
            if isinstance(v, dict):
                seen.update(v)
                value = next((_as_float(v.get(k)) for k in keys
                              if _as_float(v.get(k)) is not None), None)
            else:
                value = _as_float(v)
            if value is None:
                continue
            if (step := strict_int(str(name))) is not None:
                by_step[step] = value
            else:
                by_name[str(name)] = value
        return by_step, by_name, seen
    if not isinstance(rows, list):
        raise CkptError("metrics file: expected rows of metrics by step", path=path)
    for row in rows:
        if not isinstance(row, dict):
            continue
        # csv.DictReader files surplus fields under the key None.
        seen.update(k for k in row if isinstance(k, str) and k not in ("step", "global_step"))
        step = _as_int(row.get("step", row.get("global_step")))
        value = next((_as_float(row.get(k)) for k in keys if _as_float(row.get(k)) is not None),
                     None)
        if step is not None and value is not None:
            by_step[step] = value
    return by_step, by_name, seen


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _as_float(v: Any) -> float | None:
    if _is_number(v):
        return float(v)
    if isinstance(v, str) and v.strip():
        try:
            return float(v)
        except ValueError:
            return None
    return None


def _as_int(v: Any) -> int | None:
    f = _as_float(v)
    return int(f) if f is not None and math.isfinite(f) and f == int(f) else None
