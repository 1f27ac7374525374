"""Thinning: rewrite old training checkpoints in place without their optimizer state.

``prune --thin-after K`` keeps the newest K counted checkpoints whole (see
:mod:`ckpt_cli.retention`); older ones that stay keep their weights and training metadata (step,
epoch, loops, scheduler, RNG) but lose the optimizer state, which is most of a training
checkpoint's bytes (Adam: two FP32 moments per parameter). ``--thin-to bf16`` also casts the
floating-point weights to BF16. ``--keep-full-every N`` keeps checkpoints whose step is a multiple
of N whole.

Done so far: single-file torch checkpoints (``torch.save`` ``.pt``/``.pth``/``.bin`` and
Lightning ``.ckpt``) on local disk. The file is read with ``torch.load(weights_only=True)``
(never executing code from it); a file that needs more is left whole. The thinned copy is
written beside it under a temporary name (``.NAME.ckpt-tmp-*``, which prune and validate treat
as a leftover), fsynced, validated, and renamed over the original with one ``rename``: a crash
leaves either the original or the thinned file complete under the checkpoint's name.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli.atomic import fsync_path, tmp_sibling
from ckpt_cli.errors import CkptError

# Top-level keys that hold optimizer state in the training files of the frameworks ckpt reads:
# Lightning (optimizer_states), plain training loops (optimizer, optimizer_state_dict, optim).
OPTIMIZER_KEYS = ("optimizer_states", "optimizer", "optimizer_state_dict", "optim",
                  "optim_state")
# Only what is optimizer state by its shape is dropped: torch's Optimizer.state_dict() is a
# dict with "state" and "param_groups" (Lightning keeps a list of them). A key of the same name
# holding anything else (a name, hyperparameters) stays.
# Where the weights are: Lightning and most loops (state_dict), others (model...).
WEIGHT_KEYS = ("state_dict", "model", "model_state_dict", "module")
THIN_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
THIN_DTYPES = ("bf16",)
# HF Trainer checkpoint-N: the optimizer's own file goes; weights, trainer_state.json,
# scheduler.pt, rng_state*.pth and scaler.pt stay.
HF_OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")


@dataclass(slots=True)
class Thinned:
    """What thinning one checkpoint did.

    Attributes:
        path: The checkpoint.
        dropped: The top-level keys removed.
        dtype: ``bf16`` when the weights were cast, else None.
        bytes_before: Its size before.
        bytes_after: Its size after.
        manifest_digest: SHA-256 of its manifest, rewritten for the thinned files, when it had
            one (None: it had none).
    """

    path: Path
    dropped: list[str] = field(default_factory=list)
    dtype: str | None = None
    bytes_before: int = 0
    bytes_after: int = 0
    manifest_digest: str | None = None

    @property
    def saved(self) -> int:
        """Bytes saved."""
        return self.bytes_before - self.bytes_after


def can_thin(path: Path) -> str | None:
    """None if ``path`` is a checkpoint this module can thin, else why not."""
    if path.is_symlink():
        return "a symbolic link: never followed"
    if path.is_dir() and (path / "trainer_state.json").is_file():
        return None
    if not path.is_file():
        return "only single-file torch checkpoints are thinned so far"
    if not path.name.endswith(THIN_SUFFIXES):
        return "only single-file torch checkpoints (.pt, .pth, .ckpt, .bin) are thinned so far"
    return None


def _set_manifest_aside(path: Path) -> str | None:
    """Remove the checkpoint's manifest before its files change; return its algorithm.

    The old manifest describes the files about to be rewritten; left in place it would make the
    thinned checkpoint fail ``validate``. Removed first, a crash at any later point leaves a
    checkpoint without a manifest (which validates) rather than one contradicting its files.
    """
    from ckpt_cli.manifest import DEFAULT_ALGORITHM, manifest_path, read_manifest

    mp = manifest_path(path)
    if mp.is_symlink() or not mp.is_file():
        return None
    try:
        old = read_manifest(path)
    except CkptError:
        old = None
    algorithm = old.algorithm if old is not None else None
    os.unlink(mp)
    fsync_path(mp.parent)
    return algorithm or DEFAULT_ALGORITHM


def _manifest_again(path: Path, algorithm: str | None) -> str | None:
    """Write the thinned checkpoint's manifest when it had one; its digest for the ledger."""
    if algorithm is None:
        return None
    from ckpt_cli.ledger import manifest_digest
    from ckpt_cli.manifest import write_manifest

    write_manifest(path, algorithm=algorithm)
    return manifest_digest(path)


def _load(path: Path) -> dict[str, Any]:
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # any reader failure means: leave it whole
        raise CkptError(f"cannot be read without executing code from it ({type(e).__name__}); "
                        "left whole", path=path) from None
    if not isinstance(obj, dict):
        raise CkptError("not a dict of training state; left whole", path=path)
    return obj


def _is_optimizer_state(value: Any) -> bool:
    """Whether ``value`` is an optimizer's ``state_dict()`` (or a list/dict of them)."""
    if isinstance(value, dict) and "state" in value and "param_groups" in value:
        return True
    if isinstance(value, list | tuple) and value:
        return all(_is_optimizer_state(v) for v in value)
    if isinstance(value, dict) and value and "state" not in value:
        return all(_is_optimizer_state(v) for v in value.values())
    return False


def _cast(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.to(torch.bfloat16) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast(v) for k, v in obj.items()}
    return obj


def thin_file(path: Path, *, to: str | None = None) -> Thinned | None:
    """Rewrite one torch checkpoint file in place without its optimizer state.

    Args:
        path: The checkpoint file.
        to: ``bf16`` to cast floating-point weights, or None to keep their dtype.

    Returns:
        What was done, or None when it holds no optimizer state (and ``to`` is None): nothing
        to drop.

    Raises:
        CkptError: It cannot be read safely, or the thinned copy does not validate (the
            original is then left as it was).
    """
    import torch

    from ckpt_cli.ops.prune import quick_validate

    if to is not None and to not in THIN_DTYPES:
        raise CkptError(f"--thin-to must be one of {', '.join(THIN_DTYPES)}, not {to!r}")
    why = can_thin(path)
    if why:
        raise CkptError(why, path=path)
    if path.is_dir():
        return _thin_hf_dir(path)
    before = path.stat()
    state = _load(path)
    dropped = [k for k in OPTIMIZER_KEYS if k in state and _is_optimizer_state(state[k])]
    if not dropped:
        # Nothing to drop: no training state here (weights only, EMA, or thinned already), and
        # --thin-to alone would be a lossy cast of a checkpoint nobody asked to thin.
        return None
    thin = {k: v for k, v in state.items() if k not in dropped}
    if to == "bf16":
        thin = {k: (_cast(v) if k in WEIGHT_KEYS else v) for k, v in thin.items()}
    tmp = tmp_sibling(path)
    try:
        torch.save(thin, tmp)
        os.chmod(tmp, before.st_mode & 0o7777)
        # Its age and owner stay the original's: retention by age (--older-than, --grace)
        # must not take a thinned old checkpoint for a new one.
        with contextlib.suppress(OSError):
            os.chown(tmp, before.st_uid, before.st_gid)
        os.utime(tmp, ns=(before.st_atime_ns, before.st_mtime_ns))
        fsync_path(tmp)
        problem = quick_validate(tmp)
        if problem:
            raise CkptError(f"the thinned copy does not validate ({problem}); left whole",
                            path=path)
        now = path.stat()
        if (now.st_ino, now.st_size, now.st_mtime_ns) != (before.st_ino, before.st_size,
                                                           before.st_mtime_ns):
            raise CkptError("it changed while being thinned; left as it is", path=path)
        algorithm = _set_manifest_aside(path)
        # One rename: the name holds the original or the thinned file, never neither.
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_path(path.parent)
    digest = _manifest_again(path, algorithm)
    return Thinned(path, dropped, to, before.st_size, path.stat().st_size, digest)


def _thin_hf_dir(path: Path) -> Thinned | None:
    """An HF Trainer ``checkpoint-N``: remove its optimizer file (one ``unlink`` each, so a crash
    leaves it with or without that file, complete either way: the Trainer resumes with a fresh
    optimizer when the file is absent). Its weights are left as stored (``--thin-to`` is not
    applied to safetensors weights yet)."""
    from ckpt_cli.ops.prune import quick_validate
    from ckpt_cli.runs import tree_scan

    victims = [n for n in HF_OPTIMIZER_FILES
               if (path / n).is_file() and not (path / n).is_symlink()]
    if not victims:
        return None
    bytes_before = tree_scan(path).bytes
    problem = quick_validate(path)
    if problem:
        raise CkptError(f"does not validate ({problem}); left whole", path=path)
    algorithm = _set_manifest_aside(path)
    for n in victims:
        os.unlink(path / n)
    fsync_path(path)
    digest = _manifest_again(path, algorithm)
    return Thinned(path, victims, None, bytes_before, tree_scan(path).bytes, digest)
