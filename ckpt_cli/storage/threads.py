"""How many threads ckpt's parallel stages use: the CPUs this process may run on, or the
``CKPT_THREADS`` setting. Its own module so that both the pools (``reads``) and the stage
report (``stages``) read it without importing each other."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), or the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def worker_threads() -> int:
    """Threads per parallel stage (casting blocks): ``CKPT_THREADS`` if set to a positive
    integer, else the usable CPUs, at most 64."""
    raw = os.environ.get("CKPT_THREADS", "").strip()
    if raw.isdigit() and int(raw) > 0:
        return min(int(raw), 256)
    return max(1, min(64, usable_cpus()))


def default_jobs() -> int:
    """Threads for reading and checksumming: ``CKPT_THREADS`` if set, else the usable CPUs,
    at most 8."""
    if os.environ.get("CKPT_THREADS", "").strip().isdigit():
        return worker_threads()
    return max(1, min(8, usable_cpus()))
