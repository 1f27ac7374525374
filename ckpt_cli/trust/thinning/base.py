"""What every layout of thinning shares: the optimizer keys and their shape, the ``pending``
intent line, the manifest set aside before a change and written again after, the trash-named
work copy, and the atomic swap of a local directory.

The other modules call the steps a kill can interrupt (:func:`_set_manifest_aside`,
:func:`_manifest_again`, :func:`_swap_in`) through this module (``base._swap_in``), so a test
that stands in for one (a prune killed at that point) does so in one place.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli import storage
from ckpt_cli.errors import CkptError
from ckpt_cli.formats import first_error
from ckpt_cli.formats.dcp import metadata_file
from ckpt_cli.formats.names import MANIFEST_NAME, TRASH_PREFIX, fit_name
from ckpt_cli.manifest import (
    DEFAULT_ALGORITHM,
    manifest_digest,
    manifest_path,
    read_manifest,
    write_manifest,
)
from ckpt_cli.runs import tree_scan
from ckpt_cli.storage import atomic
from ckpt_cli.storage.atomic import fsync_path, fsync_tree, tmp_sibling

# Top-level keys that hold optimizer state in the training files of the frameworks ckpt reads:
# Lightning (optimizer_states), plain training loops (optimizer, optimizer_state_dict, optim).
OPTIMIZER_KEYS = ("optimizer_states", "optimizer", "optimizer_state_dict", "optim",
                  "optim_state")
# Only what is optimizer state by its shape is thinned: torch's Optimizer.state_dict() is a
# dict with "state" and "param_groups" (Lightning keeps a list of them). A key of the same name
# holding anything else (a name, hyperparameters) stays. Thinning empties "state" (the
# per-parameter tensors: Adam's moments) and keeps "param_groups" (lr, betas, weight decay,
# initial_lr...): the frameworks restore an optimizer with Optimizer.load_state_dict, which
# takes an empty "state" (Adam re-creates its moments at the next step), so a resumed run keeps
# the learning rate its scheduler reached instead of the fresh optimizer's initial one.
# Where the weights are: Lightning and most loops (state_dict), others (model...).
WEIGHT_KEYS = ("state_dict", "model", "model_state_dict", "module")
THIN_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
THIN_DTYPES = ("bf16",)
# HF Trainer checkpoint-N: the optimizer's own file is rewritten without its state (the Trainer
# restores scheduler.pt only together with it); weights, trainer_state.json, scheduler.pt,
# rng_state*.pth and scaler.pt stay.
HF_OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")


@dataclass(slots=True)
class Thinned:
    """What thinning one checkpoint did.

    Attributes:
        path: The checkpoint.
        dropped: The optimizer entries (top-level keys, or HF's optimizer files) whose
            per-parameter state was dropped; their hyperparameters (``param_groups``) stay.
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


PENDING = "pending"
"""Key of a ``thinned`` ledger line's ``detail`` written *before* the checkpoint changes (the
intent): until the line that follows a successful thinning, the checkpoint may be the original
or the thinned one, with or without its manifest, and must be verified afresh, never reported
bad for not matching what was recorded."""


UNDONE = "undone"
"""Key of a ``thinned`` ledger line's ``detail`` that settles an intent (:data:`PENDING`) whose
thinning was never carried out: the checkpoint is whole, with its optimizer state (``dropped``
is empty). Not a thinning: :func:`thinned_line` is False for it."""


def thinned_line(line: Any) -> bool:
    """Whether a ledger line confirms that its checkpoint was thinned (neither the intent nor
    the record that a thinning was not carried out)."""
    detail = getattr(line, "detail", None)
    return getattr(line, "event", None) == "thinned" and isinstance(detail, dict) and not (
        detail.get(PENDING) or detail.get(UNDONE))


def pending(line: Any) -> bool:
    """Whether a ledger line is the intent of a thinning that has not been confirmed yet."""
    detail = getattr(line, "detail", None)
    return getattr(line, "event", None) == "thinned" and isinstance(detail, dict) and bool(
        detail.get(PENDING))


def can_thin(path: Path) -> str | None:
    """None if ``path`` is a checkpoint this module can thin, else why not."""
    if path.is_symlink():
        return "a symbolic link: never followed"
    if (not storage.can_rename_atomically(path) and path.is_dir()
            and not (path / "trainer_state.json").is_file() and not lone_torch_file(path)
            and not _is_dcp(path)):
        return ("on object storage only torch files, prefixes holding one, DCP step prefixes "
                "and HF checkpoint-N prefixes are thinned so far")
    if path.is_dir():
        if (path / "trainer_state.json").is_file() or _is_dcp(path) or lone_torch_file(path):
            return None
        return ("only torch files, step directories holding one, DCP directories and HF "
                "checkpoint-N directories are thinned so far")
    if not path.is_file():
        return "only single-file torch checkpoints are thinned so far"
    if not path.name.endswith(THIN_SUFFIXES):
        return "only single-file torch checkpoints (.pt, .pth, .ckpt, .bin) are thinned so far"
    return None


def _is_dcp(path: Path) -> bool:
    return metadata_file(path) is not None


def lone_torch_file(path: Path) -> Path | None:
    """The one torch file of a step directory that holds nothing else (the sample run's
    ``step_000100/checkpoint.pt``; its manifest aside), or None."""
    found: list[Path] = []
    try:
        children = list(path.iterdir())
    except OSError:
        return None
    for c in children:
        if c.name == MANIFEST_NAME:
            continue
        if c.is_symlink() or not c.is_file() or not c.name.endswith(THIN_SUFFIXES):
            return None
        found.append(c)
    return found[0] if len(found) == 1 else None


def quick_check(path: Path) -> str | None:
    """Why a (thinned) checkpoint does not read cleanly, or None: its index read through the
    allowlist (:func:`ckpt_cli.formats.first_error`). Thinning rewrites no layout with rank
    files, so this is prune's quick validation for what it writes."""
    return first_error(path)[1]


def _set_manifest_aside(path: Path) -> str | None:
    """Remove the checkpoint's manifest before its files change; return its algorithm.

    The old manifest describes the files about to be rewritten; left in place it would make the
    thinned checkpoint fail ``validate``. Removed first, a crash at any later point leaves a
    checkpoint without a manifest (which validates) rather than one contradicting its files.
    """
    mp = manifest_path(path)
    if mp.is_symlink() or not mp.is_file():
        return None
    try:
        old = read_manifest(path)
    except CkptError:
        old = None
    algorithm = old.algorithm if old is not None else None
    storage.remove(mp)  # locally unlinked and the directory fsynced; on a store one DELETE
    return algorithm or DEFAULT_ALGORITHM


def _manifest_again(path: Path, algorithm: str | None) -> str | None:
    """Write the thinned checkpoint's manifest when it had one; its digest for the ledger."""
    if algorithm is None:
        return None

    write_manifest(path, algorithm=algorithm)
    return manifest_digest(path)


def _load(path: Path) -> dict[str, Any]:
    import torch  # heavy: torch

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
    import torch  # heavy: torch

    if isinstance(obj, torch.Tensor):
        return obj.to(torch.bfloat16) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast(v) for k, v in obj.items()}
    return obj


OnStart = Callable[[list[str], "str | None", int], None]
"""Called once right before a checkpoint's first change, with what will be dropped, the dtype
and its bytes before: ``prune`` records the intent in the run ledger there (see
:func:`pending`)."""


def _has_state(value: Any) -> bool:
    """Whether an optimizer's ``state_dict()`` (or a list/dict of them) holds any per-parameter
    state: an empty ``state`` is a fresh or a thinned optimizer, nothing to drop."""
    if isinstance(value, dict) and "state" in value and "param_groups" in value:
        return bool(value["state"])
    if isinstance(value, list | tuple):
        return any(_has_state(v) for v in value)
    return isinstance(value, dict) and any(_has_state(v) for v in value.values())


def _stateless(value: Any) -> Any:
    """An optimizer's ``state_dict()`` (or a list/dict of them, as found by
    :func:`_is_optimizer_state`) with an empty ``state`` and everything else (``param_groups``)
    as it was."""
    if isinstance(value, dict) and "state" in value and "param_groups" in value:
        return {**value, "state": {}}
    if isinstance(value, list | tuple):
        return type(value)(_stateless(v) for v in value)
    return {k: _stateless(v) for k, v in value.items()}


def _drop_optimizer(state: dict[str, Any], to: str | None
                    ) -> tuple[dict[str, Any], list[str]] | None:
    """The state with its optimizers' per-parameter state emptied (their ``param_groups``
    kept; weights cast with ``to="bf16"``) and the keys thinned; None when there is nothing to
    drop: no training state (weights only, EMA, or thinned already), and --thin-to alone would
    be a lossy cast nobody asked for."""
    dropped = [k for k in OPTIMIZER_KEYS if k in state and _is_optimizer_state(state[k])
               and _has_state(state[k])]
    if not dropped:
        return None
    thin = {k: (_stateless(v) if k in dropped else v) for k, v in state.items()}
    if to == "bf16":
        thin = {k: (_cast(v) if k in WEIGHT_KEYS else v) for k, v in thin.items()}
    return thin, dropped


def _optimizer_file_without_state(path: Path, obj: Any = None) -> dict[str, Any] | None:
    """An optimizer file's ``state_dict()`` (HF Trainer's ``optimizer.pt``) with an empty
    ``state`` and its ``param_groups`` kept; None when its state is empty already (thinned).

    Args:
        path: The file, read with ``torch.load(weights_only=True)`` unless ``obj`` is given.
        obj: What it holds, read already (an object on object storage).

    Returns:
        The thinned state dict, or None.

    Raises:
        CkptError: It cannot be read safely, or it is not an optimizer's state dict.
    """
    if obj is None:
        obj = _load(path)
    if not (isinstance(obj, dict) and "state" in obj and "param_groups" in obj):
        raise CkptError("not an optimizer's state dict; left whole", path=path)
    return _stateless(obj) if _has_state(obj) else None


def _work_name(path: Path) -> Path:
    """Where the thinned copy of the checkpoint ``path`` (at the top of its run) is built: a
    name of prune's trash (``.ckpt-trash-NAME.thin-*``), which no reader takes for a checkpoint
    and which the next prune removes when a kill left it behind. Only prune thins, under its
    lock, so no other prune removes it while it is being written."""
    return path.parent / fit_name(f"{TRASH_PREFIX}{path.name}", f".thin-{uuid.uuid4().hex[:8]}")


def _keep_age(path: Path, newest_ns: int) -> None:
    """Give nothing in the directory ``path`` (itself included) a newer modification time than
    the checkpoint had before thinning: retention by age must not take it for a new one."""
    for dirpath, dirs, files in os.walk(path, topdown=False):
        for name in (*files, *dirs, None):
            p = os.path.join(dirpath, name) if name is not None else dirpath
            with contextlib.suppress(OSError):
                st = os.lstat(p)
                if st.st_mtime_ns > newest_ns and not os.path.islink(p):
                    os.utime(p, ns=(st.st_atime_ns, newest_ns))


def _newest_ns(path: Path) -> int:
    newest = os.lstat(path).st_mtime_ns
    for dirpath, dirs, files in os.walk(path):
        for name in (*files, *dirs):
            with contextlib.suppress(OSError):
                newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime_ns)
    return newest


def _swap_in(path: Path, tmp: Path, on_start: OnStart, dropped: list[str], to: str | None,
             bytes_before: int, newest_ns: int) -> Thinned:
    """Put the finished thinned directory ``tmp`` in the place of checkpoint ``path``.

    The two are swapped with one ``renameat2(RENAME_EXCHANGE)``: at every moment ``path`` is
    either the original or the thinned directory, complete; the original then sits under the
    trash name ``tmp`` had (see :func:`_work_name`) and is removed (by the next prune, when a
    kill interrupts this).
    """
    problem = quick_check(tmp)
    if problem:
        raise CkptError(f"the thinned copy does not validate ({problem}); left whole",
                        path=path)
    _keep_age(tmp, newest_ns)
    fsync_tree(tmp)
    if tree_scan(path).bytes != bytes_before or _newest_ns(path) != newest_ns:
        raise CkptError("it changed while being thinned; left as it is", path=path)
    algorithm: str | None = None
    mp = manifest_path(path)
    if mp.is_file() and not mp.is_symlink():
        try:
            old = read_manifest(path)
        except CkptError:
            old = None
        algorithm = (old.algorithm if old is not None else None) or DEFAULT_ALGORITHM
    why = _cannot_exchange(path.parent)
    if why:
        raise CkptError(f"the file system cannot swap directories atomically ({why}); left "
                        "whole", path=path)
    on_start(dropped, to, bytes_before)
    try:
        atomic.exchange(tmp, path)
    except OSError as e:
        raise CkptError(f"the file system cannot swap directories atomically ({e.strerror}); "
                        "left whole", path=path) from None
    fsync_path(path.parent)
    try:
        shutil.rmtree(tmp)  # the original, now under the trash name
    except OSError:
        pass  # what is left has a trash name: the next prune removes it
    digest = _manifest_again(path, algorithm)
    _keep_age(path, newest_ns)
    return Thinned(path, dropped, to, bytes_before, tree_scan(path).bytes, digest)


def _cannot_exchange(parent: Path) -> str | None:
    """Why two directories in ``parent`` cannot be swapped atomically (None: they can), tried
    on two empty ones before anything is recorded or changed."""
    a, b = tmp_sibling(parent / "swap-a"), tmp_sibling(parent / "swap-b")
    try:
        a.mkdir()
        b.mkdir()
        atomic.exchange(a, b)
    except OSError as e:
        return e.strerror or str(e)
    finally:
        for p in (a, b):
            with contextlib.suppress(OSError):
                p.rmdir()
    return None
