"""Run ``prune --thin-after`` on a run directory and SIGKILL the process at its N-th file-system
change (run as a subprocess: nothing of Python's cleanup runs, as in a real ``kill -9``).

``python -m tests.helpers.thin_kill_at RUN THIN_AFTER N``: every call of ``os.replace``,
``os.rename``, ``os.unlink``, ``os.rmdir``, ``os.mkdir``, ``os.fsync``, ``os.utime`` and
``os.open`` with ``O_CREAT`` counts; the N-th is not made. Exits 3 when the prune finished
before its N-th change, printing how many changes it made.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any


def main() -> None:
    warnings.simplefilter("ignore")
    from ckpt_cli.ops.prune import prune
    from ckpt_cli.ops.prune.retention import PrunePolicy

    run, after, at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    count = 0

    def counted(real: Any, creates: bool = False) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal count
            flags = args[1] if len(args) > 1 else kwargs.get("flags", 0)
            if not creates or (isinstance(flags, int) and flags & os.O_CREAT):
                count += 1
                if count == at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return call

    for name in ("replace", "rename", "unlink", "rmdir", "mkdir", "fsync", "utime"):
        setattr(os, name, counted(getattr(os, name)))
    os.open = counted(os.open, creates=True)  # type: ignore[assignment]
    prune(run, PrunePolicy(keep=None, thin_after=after, grace=0))
    print(count, flush=True)  # how many changes the whole prune made
    sys.exit(3)


if __name__ == "__main__":
    main()
