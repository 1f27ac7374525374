"""Run ``prune --thin-after`` on a run directory and SIGKILL the process at its N-th file-system
change (nothing of Python's cleanup runs, as in a real ``kill -9``).

``python -m tests.helpers.thin_kill_at RUN THIN_AFTER N``: every call of ``os.replace``,
``os.rename``, ``os.unlink``, ``os.rmdir``, ``os.mkdir``, ``os.fsync``, ``os.utime``,
``os.link`` and ``os.open`` with ``O_CREAT`` counts; the N-th is not made. Exits 3 when the
prune finished before its N-th change, printing how many changes it made.

``python -m tests.helpers.thin_kill_at --many THIN_AFTER TO RUN:N [RUN:N...]``: the same for
each RUN (``TO`` is ``bf16`` or ``-``), each prune in a child forked from this one process, so
that torch and ckpt are imported once for many kill points; prints one line per RUN:
``RUN STATUS`` (``killed``, or ``done:<changes>``).

``python -m tests.helpers.thin_kill_at --at STEP RUN THIN_AFTER TO``: kill the prune at one named
step of thinning instead (``manifest``: after the rewrite or swap, before the new manifest and the
confirming ledger line; ``aside``: after the intent line, with the checkpoint still whole;
``removed``: the same, its manifest removed).
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any


def _prune_killed_at(run: Path, after: int, at: int, to: str | None) -> None:
    """Prune ``run`` in this process, killing it at its ``at``-th change; print the count and
    exit 3 when it finishes first."""
    from ckpt_cli.ops.prune import prune
    from ckpt_cli.ops.prune.retention import PrunePolicy

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

    for name in ("replace", "rename", "unlink", "rmdir", "mkdir", "fsync", "utime", "link"):
        setattr(os, name, counted(getattr(os, name)))
    os.open = counted(os.open, creates=True)  # type: ignore[assignment]
    prune(run, PrunePolicy(keep=None, thin_after=after, grace=0, thin_to=to))
    print(count, flush=True)  # how many changes the whole prune made
    sys.stdout.flush()
    os._exit(3)


def _many(after: int, to: str | None, points: list[str]) -> None:
    # Imported before forking: each child then starts at once. Nothing has run a torch op (no
    # thread pool started), so forking is safe.
    import torch.distributed.checkpoint  # noqa: F401

    import ckpt_cli.ops.prune
    import ckpt_cli.trust.thinning  # noqa: F401

    for point in points:
        run, at = point.rsplit(":", 1)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.dup2(w, 1)
            _prune_killed_at(Path(run), after, int(at), to)
        os.close(w)
        with os.fdopen(r) as f:
            out = f.read()
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            print(run, "killed", flush=True)
        else:
            print(run, f"done:{out.split()[-1] if out.split() else '?'}", flush=True)


def _prune_killed_in(run: Path, step: str, after: int, to: str | None) -> None:
    """Prune ``run``, killing it where thinning reaches ``step`` (see the module's doc)."""
    from ckpt_cli.ops.prune import prune
    from ckpt_cli.ops.prune.retention import PrunePolicy
    from ckpt_cli.trust.thinning import base

    def die(*_a: Any, **_k: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    if step == "manifest":
        base._manifest_again = die  # type: ignore[assignment]
    elif step == "aside":
        base._set_manifest_aside = die  # type: ignore[assignment]
    elif step == "removed":
        set_aside = base._set_manifest_aside

        def removed_then_die(path: Path) -> str | None:
            set_aside(path)
            return die()

        base._set_manifest_aside = removed_then_die  # type: ignore[assignment]
    else:
        raise SystemExit(f"unknown step {step!r}")
    prune(run, PrunePolicy(keep=None, thin_after=after, grace=0, thin_to=to))
    os._exit(3)


def main() -> None:
    warnings.simplefilter("ignore")
    if sys.argv[1] == "--at":
        to = None if sys.argv[5] == "-" else sys.argv[5]
        _prune_killed_in(Path(sys.argv[3]), sys.argv[2], int(sys.argv[4]), to)
        return
    if sys.argv[1] == "--many":
        to = None if sys.argv[3] == "-" else sys.argv[3]
        _many(int(sys.argv[2]), to, sys.argv[4:])
        return
    _prune_killed_at(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), None)


if __name__ == "__main__":
    main()
