"""Thinning a torch file (``torch.save``), alone or as the one file of a step directory."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ckpt_cli.errors import CkptError
from ckpt_cli.runs import tree_scan
from ckpt_cli.storage.atomic import fsync_path, rename_onto, tmp_sibling
from ckpt_cli.trust.thinning import base
from ckpt_cli.trust.thinning.base import (
    OnStart,
    Thinned,
    _drop_optimizer,
    _keep_age,
    _load,
    _newest_ns,
    _work_name,
    quick_check,
)


def _thin_torch(path: Path, to: str | None, on_start: OnStart,
                checkpoint: Path) -> Thinned | None:
    """One torch file (``checkpoint`` is itself, or the step directory holding it): rewritten
    under a trash or temporary name (see :func:`_work_name`), renamed over the original in one
    ``rename``."""
    import torch  # heavy: torch

    before = path.stat()
    newest = _newest_ns(checkpoint) if checkpoint != path else None
    state = _load(path)
    picked = _drop_optimizer(state, to)
    if picked is None:
        return None
    thin, dropped = picked
    bytes_before = tree_scan(checkpoint).bytes
    # At the run's top a trash name (a killed prune's copy is removed by the next prune, which
    # alone may write one: it holds the prune lock); inside a step directory a temporary name.
    tmp = _work_name(path) if checkpoint == path else tmp_sibling(path)
    try:
        torch.save(thin, tmp)
        os.chmod(tmp, before.st_mode & 0o7777)
        # Its age and owner stay the original's: retention by age (--older-than, --grace)
        # must not take a thinned old checkpoint for a new one.
        with contextlib.suppress(OSError):
            os.chown(tmp, before.st_uid, before.st_gid)
        os.utime(tmp, ns=(before.st_atime_ns, before.st_mtime_ns))
        fsync_path(tmp)
        problem = quick_check(tmp)
        if problem:
            raise CkptError(f"the thinned copy does not validate ({problem}); left whole",
                            path=checkpoint)
        now = path.stat()
        if (now.st_ino, now.st_size, now.st_mtime_ns) != (before.st_ino, before.st_size,
                                                           before.st_mtime_ns):
            raise CkptError("it changed while being thinned; left as it is", path=checkpoint)
        on_start(dropped, to, bytes_before)
        algorithm = base._set_manifest_aside(checkpoint)
        # One rename: the name holds the original or the thinned file, never neither.
        rename_onto(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_path(path.parent)
    digest = base._manifest_again(checkpoint, algorithm)
    if newest is not None:
        _keep_age(checkpoint, newest)
    return Thinned(checkpoint, dropped, to, bytes_before, tree_scan(checkpoint).bytes, digest)
