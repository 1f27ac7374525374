"""Per-stage busy time, for the benchmarks: where a run's time goes, and on how many threads.

Off unless ``CKPT_STAGE_REPORT`` names a file: then every :func:`stage` block adds its wall
time to its stage's busy time, counts the threads that ran it, and the totals are written to
that file as JSON when the process exits (``{"stages": {name: {"busy_s", "threads", "calls",
"bytes"}}, "threads_setting": n}``). A stage whose busy time is close to the run's wall time on
one thread is the bottleneck; busy time above wall time means it ran on several threads.
When off, :func:`stage` costs one global lookup.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckpt_cli.errors import CkptError
from ckpt_cli.storage.atomic import atomic_file
from ckpt_cli.storage.threads import worker_threads

_PATH = os.environ.get("CKPT_STAGE_REPORT") or None
_LOCK = threading.Lock()
_STATS: dict[str, dict[str, Any]] = {}


def enabled() -> bool:
    """Whether stage times are being recorded."""
    return _PATH is not None


@contextlib.contextmanager
def stage(name: str, nbytes: int = 0) -> Iterator[None]:
    """Count the time spent in the block as busy time of stage ``name``.

    Args:
        name: The stage (``read``, ``cast``, ``write``, ``fsync``, ``hash``...).
        nbytes: Bytes the block handled, for the report.
    """
    if _PATH is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        add(name, time.perf_counter() - t0, nbytes)


def add(name: str, seconds: float, nbytes: int = 0) -> None:
    """Add ``seconds`` of busy time (and ``nbytes``) to stage ``name`` from this thread."""
    if _PATH is None:
        return
    ident = threading.get_ident()
    with _LOCK:
        s = _STATS.setdefault(name, {"busy_s": 0.0, "calls": 0, "bytes": 0, "_threads": set()})
        s["busy_s"] += seconds
        s["calls"] += 1
        s["bytes"] += nbytes
        s["_threads"].add(ident)


def snapshot() -> dict[str, dict[str, Any]]:
    """The totals so far: per stage, busy seconds, calls, bytes and the number of threads."""
    with _LOCK:
        return {k: {"busy_s": round(v["busy_s"], 4), "calls": v["calls"], "bytes": v["bytes"],
                    "threads": len(v["_threads"])} for k, v in _STATS.items()}


def _dump() -> None:  # pragma: no cover - runs at exit of a benchmarked process
    if _PATH is None:
        return
    try:  # through the one door out, as every file ckpt writes
        with atomic_file(Path(_PATH), overwrite=True) as tmp:
            tmp.write_text(json.dumps({"stages": snapshot(),
                                       "threads_setting": worker_threads()}))
    except (OSError, CkptError):
        pass


if _PATH is not None:
    atexit.register(_dump)
