"""``thin_file``: thin one checkpoint, by its layout and where it lives."""

from __future__ import annotations

from pathlib import Path

from ckpt_cli import storage
from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.trust.thinning.base import (
    THIN_DTYPES,
    OnStart,
    Thinned,
    _is_dcp,
    can_thin,
    lone_torch_file,
)
from ckpt_cli.trust.thinning.dcp import _thin_dcp_dir
from ckpt_cli.trust.thinning.hf import _thin_hf_dir
from ckpt_cli.trust.thinning.objects import _thin_remote
from ckpt_cli.trust.thinning.torchfile import _thin_torch

__all__ = ["OnStart", "thin_file"]


def thin_file(path: Path, *, to: str | None = None,
              on_start: OnStart | None = None) -> Thinned | None:
    """Rewrite one checkpoint in place without its optimizer state.

    Args:
        path: The checkpoint (a torch file, a step directory holding one, a DCP directory or
            an HF Trainer ``checkpoint-N`` directory).
        to: ``bf16`` to cast floating-point weights, or None to keep their dtype.
        on_start: Called right before the first change (see :data:`OnStart`).

    Returns:
        What was done, or None when it holds no optimizer state: nothing to drop.

    Raises:
        CkptError: It cannot be read safely, or the thinned copy does not validate (the
            original is then left as it was).
    """
    if to is not None and to not in THIN_DTYPES:
        raise UsageError(f"thin_to must be one of {', '.join(THIN_DTYPES)}, not {to!r}",
                         param="thin_to")
    why = can_thin(path)
    if why:
        raise CkptError(why, path=path)
    start = on_start or (lambda _d, _t, _b: None)
    if not storage.can_rename_atomically(path):
        return _thin_remote(path, to, start)
    if path.is_dir():
        if (path / "trainer_state.json").is_file():
            return _thin_hf_dir(path, to, start)
        if _is_dcp(path):
            return _thin_dcp_dir(path, to, start)
        inner = lone_torch_file(path)
        if inner is None:  # changed since can_thin
            raise CkptError("it changed while being thinned; left as it is", path=path)
        return _thin_torch(inner, to, start, path)
    return _thin_torch(path, to, start, path)
