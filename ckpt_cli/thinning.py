"""Thinning: rewrite old training checkpoints in place without their optimizer state.

``prune --thin-after K`` keeps the newest K counted checkpoints whole (see
:mod:`ckpt_cli.ops.prune.retention`); older ones that stay keep their weights and training
metadata (step,
epoch, loops, scheduler, RNG) but lose the optimizer state, which is most of a training
checkpoint's bytes (Adam: two FP32 moments per parameter). ``--thin-to bf16`` also casts the
floating-point weights to BF16. ``--keep-full-every N`` keeps checkpoints whose step is a multiple
of N whole.

What is thinned, and how each rewrite stays atomic:

- Single torch files (``torch.save`` ``.pt``/``.pth``/``.bin``, Lightning ``.ckpt``), and step
  directories holding one (``step_000100/checkpoint.pt``): read with
  ``torch.load(weights_only=True)`` (never executing code from it; a file that needs more is
  left whole), the thinned copy written beside it under a trash name (``.ckpt-trash-NAME.thin-*``,
  which the next prune removes after a kill; inside a step directory a ``.NAME.ckpt-tmp-*``
  name), fsynced, validated and renamed over the original with one ``rename``.
- DCP directories: read with ckpt's own reader, what is kept saved again with DCP's own writer
  (no process group) into a trash-named sibling directory, swapped with the original in one
  ``renameat2(RENAME_EXCHANGE)`` (left whole where the file system cannot).
- HF Trainer ``checkpoint-N``: the optimizer file unlinked; with ``--thin-to bf16`` a copy with
  BF16 safetensors and an updated ``config.json`` is built beside it and swapped in.
- Object storage: a torch file object replaced with one upload, an HF prefix's optimizer object
  deleted (one request each).

The run ledger gets a ``thinned`` line with ``"pending": true`` (see :func:`pending`) before the
first change, and the confirming line after, so a thinning killed midway is verified afresh
rather than reported bad, and never resumed from.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ckpt_cli import storage
from ckpt_cli.errors import CkptError
from ckpt_cli.storage.atomic import fsync_path, fsync_tree, tmp_sibling

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


PENDING = "pending"
"""Key of a ``thinned`` ledger line's ``detail`` written *before* the checkpoint changes (the
intent): until the line that follows a successful thinning, the checkpoint may be the original
or the thinned one, with or without its manifest, and must be verified afresh, never reported
bad for not matching what was recorded."""


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
    from ckpt_cli.formats.dcp import metadata_file

    return metadata_file(path) is not None


def lone_torch_file(path: Path) -> Path | None:
    """The one torch file of a step directory that holds nothing else (the sample run's
    ``step_000100/checkpoint.pt``; its manifest aside), or None."""
    from ckpt_cli.manifest import MANIFEST_NAME

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
    storage.remove(mp)  # locally unlinked and the directory fsynced; on a store one DELETE
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


OnStart = Callable[[list[str], "str | None", int], None]
"""Called once right before a checkpoint's first change, with what will be dropped, the dtype
and its bytes before: ``prune`` records the intent in the run ledger there (see
:func:`pending`)."""


def _drop_optimizer(state: dict[str, Any], to: str | None
                    ) -> tuple[dict[str, Any], list[str]] | None:
    """The state without its optimizer entries (weights cast with ``to="bf16"``) and the keys
    dropped; None when there is nothing to drop: no training state (weights only, EMA, or
    thinned already), and --thin-to alone would be a lossy cast nobody asked for."""
    dropped = [k for k in OPTIMIZER_KEYS if k in state and _is_optimizer_state(state[k])]
    if not dropped:
        return None
    thin = {k: v for k, v in state.items() if k not in dropped}
    if to == "bf16":
        thin = {k: (_cast(v) if k in WEIGHT_KEYS else v) for k, v in thin.items()}
    return thin, dropped


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
        raise CkptError(f"--thin-to must be one of {', '.join(THIN_DTYPES)}, not {to!r}")
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


def _thin_torch(path: Path, to: str | None, on_start: OnStart,
                checkpoint: Path) -> Thinned | None:
    """One torch file (``checkpoint`` is itself, or the step directory holding it): rewritten
    under a trash or temporary name (see :func:`_work_name`), renamed over the original in one
    ``rename``."""
    import torch

    from ckpt_cli.ops.prune import quick_validate
    from ckpt_cli.runs import tree_scan

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
        problem = quick_validate(tmp)
        if problem:
            raise CkptError(f"the thinned copy does not validate ({problem}); left whole",
                            path=checkpoint)
        now = path.stat()
        if (now.st_ino, now.st_size, now.st_mtime_ns) != (before.st_ino, before.st_size,
                                                           before.st_mtime_ns):
            raise CkptError("it changed while being thinned; left as it is", path=checkpoint)
        on_start(dropped, to, bytes_before)
        algorithm = _set_manifest_aside(checkpoint)
        # One rename: the name holds the original or the thinned file, never neither.
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_path(path.parent)
    digest = _manifest_again(checkpoint, algorithm)
    if newest is not None:
        _keep_age(checkpoint, newest)
    return Thinned(checkpoint, dropped, to, bytes_before, tree_scan(checkpoint).bytes, digest)


def _work_name(path: Path) -> Path:
    """Where the thinned copy of the checkpoint ``path`` (at the top of its run) is built: a
    name of prune's trash (``.ckpt-trash-NAME.thin-*``), which no reader takes for a checkpoint
    and which the next prune removes when a kill left it behind. Only prune thins, under its
    lock, so no other prune removes it while it is being written."""
    from ckpt_cli.formats.names import TRASH_PREFIX
    from ckpt_cli.ops.prune.deletion import fit_name

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
    from ckpt_cli.manifest import DEFAULT_ALGORITHM, manifest_path, read_manifest
    from ckpt_cli.ops.prune import quick_validate
    from ckpt_cli.runs import tree_scan
    from ckpt_cli.storage.atomic import exchange

    problem = quick_validate(tmp)
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
        exchange(tmp, path)
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
    from ckpt_cli.storage.atomic import exchange

    a, b = tmp_sibling(parent / "swap-a"), tmp_sibling(parent / "swap-b")
    try:
        a.mkdir()
        b.mkdir()
        exchange(a, b)
    except OSError as e:
        return e.strerror or str(e)
    finally:
        for p in (a, b):
            with contextlib.suppress(OSError):
                p.rmdir()
    return None


# Top-level keys of DCP training state that are not weights (torchtitan, torchtune and plain
# loops): their floating tensors are never cast by --thin-to.
NOT_WEIGHTS = ("lr_scheduler", "lr_schedulers", "scheduler", "dataloader", "train_state",
               "rng", "rng_state", "rng_states", "extra_state", "loops", "callbacks", "trainer")


def _torch_of(arr: Any, code: str) -> Any:
    """A torch tensor sharing ``arr``'s bytes (BF16 and FP8 travel as same-size integers)."""
    import numpy as np
    import torch

    from ckpt_cli import dtypes

    arr = np.ascontiguousarray(arr)
    td = dtypes.torch_dtype(code)
    size = arr.dtype.itemsize
    if size in (1, 2, 4, 8) and dtypes.DTYPES[code].kind != "complex":
        ints = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[size]
        return torch.from_numpy(arr.view(ints)).view(td)
    return torch.from_numpy(arr)


def _tree_path(fqn: str, planner: dict[Any, Any]) -> tuple[Any, ...]:
    """Where an item sat in the saved state dict (DCP's ``planner_data``), keys as saved."""
    p = planner.get(fqn)
    if isinstance(p, tuple) and p and all(isinstance(k, str | int) for k in p) and (
            ".".join(str(k) for k in p) == fqn):
        return p
    return tuple(fqn.split("."))


def _put(tree: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    node = tree
    for k in path[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise CkptError(f"items {'.'.join(map(str, path))!r} and a parent of it both hold "
                            "values; left whole")
        node = nxt
    node[path[-1]] = value


def _dcp_optimizer_tops(paths: list[tuple[Any, ...]]) -> list[str]:
    """Top-level keys of a DCP checkpoint that hold optimizer state by shape: named like one,
    with ``state``/``param_groups`` one or two levels below (an optimizer, or a list or dict
    of them), or flattened into ``state.*``/``param_groups.*`` keys."""
    tops: list[str] = []
    for p in paths:
        k = p[0]
        # torch's get_state_dict(flatten_optimizer_state_dict=True), as torchtitan saves it,
        # keys the optimizer's entries "state.<param>.exp_avg" and "param_groups.<param>.lr".
        if (isinstance(k, str) and k in OPTIMIZER_KEYS and k not in tops
                and any(isinstance(x, str) and (x in ("state", "param_groups") or x.startswith(
                    ("state.", "param_groups."))) for x in p[1:3])):
            tops.append(k)
    return [k for k in OPTIMIZER_KEYS if k in tops]


def _thin_dcp_dir(path: Path, to: str | None, on_start: OnStart) -> Thinned | None:
    """A torch.distributed.checkpoint directory: read with ckpt's own reader (never unpickling
    anything but tensors and plain values, ``weights_only``), what is kept saved again with
    DCP's own writer (no process group) into a trash-named sibling directory, swapped in."""
    import warnings

    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    newest = _newest_ns(path)
    picked = _dcp_thinned_state(path, to)
    if picked is None:
        return None
    state, dropped, others, bytes_before, _meta = picked
    tmp = _work_name(path)
    tmp.mkdir(mode=path.stat().st_mode & 0o7777)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that no process group is running
            dcp_save(state, storage_writer=FileSystemWriter(str(tmp)), no_dist=True)
        for c in others:  # files beside DCP's (e.g. Megatron's metadata.json): kept as they are
            shutil.copy2(c, tmp / c.name)
        return _swap_in(path, tmp, on_start, dropped, to, bytes_before, newest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _dcp_thinned_state(path: Path, to: str | None
                       ) -> tuple[dict[Any, Any], list[str], list[Path], int, Path] | None:
    """What thinning keeps of a DCP checkpoint (local or on object storage), read with ckpt's
    own reader: ``(the state dict to save, top-level keys dropped, files beside DCP's, bytes
    before, its metadata file)``, or None when it holds no optimizer state.

    The kept tensors are held in memory (one copy, cast when ``to`` says so): the weights and
    training metadata, about a third of an Adam checkpoint (a sixth with ``bf16``)."""
    import io

    import torch

    from ckpt_cli.formats import read_index
    from ckpt_cli.formats.base import read_full
    from ckpt_cli.formats.dcp import metadata_file, parse_metadata, storage_map
    from ckpt_cli.manifest import MANIFEST_NAME
    from ckpt_cli.ops.prune import quick_validate
    from ckpt_cli.runs import tree_scan
    from ckpt_cli.storage import open_regular
    from ckpt_cli.tensors.cast import cast_array
    from ckpt_cli.tensors.source import TensorSource

    meta = metadata_file(path)
    if meta is None:
        raise CkptError("its .metadata is gone; left as it is", path=path)
    problem = quick_validate(path)
    if problem:
        raise CkptError(f"does not validate ({problem}); left whole", path=path)
    bytes_before = tree_scan(path).bytes
    fields, _ = parse_metadata(meta)
    raw_planner = fields.get("planner_data")
    planner: dict[Any, Any] = raw_planner if isinstance(raw_planner, dict) else {}
    items = {str(k): v for k, v in fields["state_dict_metadata"].items()}
    paths = {fqn: _tree_path(fqn, planner) for fqn in items}
    dropped = _dcp_optimizer_tops(list(paths.values()))
    if not dropped:
        return None
    others = [c for c in path.iterdir()
              if c.name not in (meta.name, MANIFEST_NAME) and not c.name.endswith(".distcp")]
    if any(c.is_symlink() or not c.is_file() for c in others):
        raise CkptError("holds more than DCP's files (a link or a directory); left whole",
                        path=path)
    index = read_index(path)
    tops = {p[0] for fqn, p in paths.items() if p[0] not in dropped}
    weight_tops = {k for k in tops if k in WEIGHT_KEYS} or {k for k in tops
                                                           if k not in NOT_WEIGHTS}
    where = storage_map(fields.get("storage_data"), path, meta)
    state: dict[Any, Any] = {}
    try:
        with TensorSource(index) as src:
            for fqn, t in index.tensors.items():
                p = paths.get(fqn, tuple(fqn.split(".")))
                if p[0] in dropped:
                    continue
                arr, code = src.read(t), t.dtype
                if (to == "bf16" and p[0] in weight_tops and code in ("F32", "F64", "F16")):
                    arr, code = cast_array(arr, "BF16", name=fqn), "BF16"
                _put(state, p, _torch_of(arr, code))
        for fqn, md in items.items():
            p = paths[fqn]
            if p[0] in dropped or fqn in index.tensors:
                continue
            if not getattr(md, "qualname", "").endswith("BytesStorageMetadata"):
                raise CkptError(f"item {fqn!r} is neither a tensor nor bytes; left whole")
            rel, off, length, _tr = where[(fqn, None)]
            buf = bytearray(length)
            fd = open_regular(path / rel)
            try:
                if read_full(fd, off, memoryview(buf)) != length:
                    raise CkptError(f"item {fqn!r} is cut short; left whole", path=path)
            finally:
                storage.close(fd)
            try:
                value = torch.load(io.BytesIO(bytes(buf)), map_location="cpu",
                                   weights_only=True)
            except Exception as e:  # any reader failure means: leave it whole
                raise CkptError(f"item {fqn!r} cannot be read without executing code from it "
                                f"({type(e).__name__}); left whole", path=path) from None
            _put(state, p, value)
    except KeyError:  # a dtype torch has no name for (F4, F6)
        raise CkptError("holds a tensor torch cannot represent; left whole", path=path) \
            from None
    return state, dropped, others, bytes_before, meta


def _thin_hf_dir(path: Path, to: str | None, on_start: OnStart) -> Thinned | None:
    """An HF Trainer ``checkpoint-N``.

    Without ``to``: its optimizer file is removed (one ``unlink`` each, so a crash leaves it
    with or without that file, complete either way: the Trainer resumes with a fresh optimizer
    when the file is absent). With ``to="bf16"``: a copy of the directory is built beside it
    (unchanged files hard-linked, the ``model*.safetensors`` weights cast to BF16 with
    :mod:`ckpt_cli.tensors.cast`, ``config.json``'s dtype and the index's ``total_size`` updated, no
    optimizer file) and swapped in with one atomic exchange.
    """
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
    if to == "bf16":
        return _hf_to_bf16(path, victims, on_start, bytes_before)
    on_start(victims, None, bytes_before)
    algorithm = _set_manifest_aside(path)
    for n in victims:
        os.unlink(path / n)
    fsync_path(path)
    digest = _manifest_again(path, algorithm)
    return Thinned(path, victims, None, bytes_before, tree_scan(path).bytes, digest)


def _hf_to_bf16(path: Path, victims: list[str], on_start: OnStart,
                bytes_before: int) -> Thinned:
    import json

    from ckpt_cli.manifest import MANIFEST_NAME

    newest = _newest_ns(path)
    children = list(path.iterdir())
    if any(c.is_symlink() or not c.is_file() for c in children):
        raise CkptError("holds links or subdirectories; --thin-to bf16 leaves it whole",
                        path=path)
    weights = [c for c in children if c.name.startswith("model")
               and c.name.endswith(".safetensors")]
    if not weights:
        raise CkptError("no model*.safetensors weights to cast; left whole", path=path)
    if any(c.name.endswith((".bin", ".pt", ".pth")) and "model" in c.name for c in children):
        raise CkptError("holds torch-pickle weights beside safetensors; --thin-to bf16 casts "
                        "only safetensors and leaves it whole", path=path)
    tmp = _work_name(path)
    tmp.mkdir(mode=path.stat().st_mode & 0o7777)
    try:
        sizes: dict[str, int] = {}
        for c in children:
            if c.name in victims or c.name == MANIFEST_NAME:
                continue
            if c in weights:
                sizes[c.name] = _safetensors_to_bf16(c, tmp / c.name)
                shutil.copystat(c, tmp / c.name)
            elif c.name == "config.json":
                cfg = json.loads(c.read_text())
                keys = [k for k in ("torch_dtype", "dtype") if k in cfg] or ["torch_dtype"]
                for k in keys:
                    cfg[k] = "bfloat16"
                (tmp / c.name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
                shutil.copystat(c, tmp / c.name)
            elif c.name.endswith(".safetensors.index.json"):
                continue  # below, once every shard's size is known
            else:
                try:
                    os.link(c, tmp / c.name)  # unchanged: shared, not copied
                except OSError:
                    shutil.copy2(c, tmp / c.name)
        for c in children:
            if c.name.endswith(".safetensors.index.json") and c.name.startswith("model"):
                doc = json.loads(c.read_text())
                if isinstance(doc.get("metadata"), dict) and "total_size" in doc["metadata"]:
                    doc["metadata"]["total_size"] = sum(sizes.values())
                (tmp / c.name).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
                shutil.copystat(c, tmp / c.name)
            elif c.name.endswith(".safetensors.index.json"):
                os.link(c, tmp / c.name)
        return _swap_in(path, tmp, on_start, victims, "bf16", bytes_before, newest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _safetensors_to_bf16(src: Path, dest: Path) -> int:
    """Write ``src`` to ``dest`` with its FP32/FP16/FP64 tensors cast to BF16 (one tensor in
    memory at a time); returns the bytes of tensor data written."""
    import numpy as np

    from ckpt_cli.formats import read_index
    from ckpt_cli.tensors.cast import cast_array
    from ckpt_cli.tensors.source import TensorSource
    from ckpt_cli.writers.safetensors import header_bytes, write_all

    index = read_index(src)
    order = sorted(index.tensors.values(), key=lambda t: t.offset or 0)
    codes = {t.name: ("BF16" if t.dtype in ("F32", "F64", "F16") else t.dtype) for t in order}
    meta = index.metadata.get("safetensors_metadata")
    header, sizes = header_bytes([(t.name, codes[t.name], t.shape) for t in order],
                                 meta if isinstance(meta, dict) else None)
    with open(dest, "xb") as f, TensorSource(index) as source:
        write_all(f, memoryview(header))
        for t in order:
            arr = source.read(t)
            if codes[t.name] != t.dtype:
                arr = cast_array(arr, "BF16", name=t.name)
            write_all(f, memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data))
    return sum(sizes)


# -- object storage -----------------------------------------------------------------------------


def _thin_remote(path: Path, to: str | None, on_start: OnStart) -> Thinned | None:
    """A checkpoint on object storage. S3 has no rename, but a PUT (or a multipart upload's
    completion) replaces an object whole, and a DELETE removes one: each object changes in one
    step, never showing half-written bytes."""
    if path.is_dir():
        if (path / "trainer_state.json").is_file():
            return _thin_hf_prefix(path, to, on_start)
        if _is_dcp(path):
            return _thin_dcp_prefix(path, to, on_start)
        inner = lone_torch_file(path)
        if inner is None:
            raise CkptError("it changed while being thinned; left as it is", path=path)
        return _thin_object(inner, to, on_start, path)
    return _thin_object(path, to, on_start, path)


def _thin_object(obj: Path, to: str | None, on_start: OnStart, checkpoint: Path
                 ) -> Thinned | None:
    """One torch file object: read whole, thinned in memory, validated from a local temporary
    copy, and stored over the original with one upload (which replaces it atomically)."""
    import io
    import tempfile

    import torch

    from ckpt_cli.ops.prune import quick_validate
    from ckpt_cli.runs import tree_scan

    before = obj.stat()
    try:
        state = torch.load(io.BytesIO(obj.read_bytes()), map_location="cpu", weights_only=True)
    except CkptError:
        raise
    except Exception as e:  # any reader failure means: leave it whole
        raise CkptError(f"cannot be read without executing code from it ({type(e).__name__}); "
                        "left whole", path=obj) from None
    if not isinstance(state, dict):
        raise CkptError("not a dict of training state; left whole", path=obj)
    picked = _drop_optimizer(state, to)
    if picked is None:
        return None
    thin, dropped = picked
    del state
    out = io.BytesIO()
    torch.save(thin, out)
    data = out.getvalue()
    with tempfile.TemporaryDirectory(prefix="ckpt-thin-") as td:
        local = Path(td) / obj.name
        local.write_bytes(data)
        problem = quick_validate(local)
    if problem:
        raise CkptError(f"the thinned copy does not validate ({problem}); left whole",
                        path=checkpoint)
    bytes_before = tree_scan(checkpoint).bytes
    cast(storage.ObjectPath, obj).store.changed()  # as it is now, not as listed
    now = obj.stat()
    if (now.st_size, now.st_mtime) != (before.st_size, before.st_mtime):
        raise CkptError("it changed while being thinned; left as it is", path=checkpoint)
    on_start(dropped, to, bytes_before)
    algorithm = _set_manifest_aside(checkpoint)
    obj.write_bytes(data)  # one upload: the key holds the original or the thinned object
    digest = _manifest_again(checkpoint, algorithm)
    return Thinned(checkpoint, dropped, to, bytes_before, tree_scan(checkpoint).bytes, digest)


def _thin_hf_prefix(path: Path, to: str | None, on_start: OnStart) -> Thinned | None:
    """An HF Trainer ``checkpoint-N`` prefix: its optimizer object deleted (one DELETE); with
    ``to="bf16"`` its weights cast too (see :func:`_hf_prefix_to_bf16`)."""
    from ckpt_cli.ops.prune import quick_validate
    from ckpt_cli.runs import tree_scan

    tidy(path, ours_only=True)  # a killed --thin-to's uploads, never named by the index
    victims = [n for n in HF_OPTIMIZER_FILES if (path / n).is_file()]
    if not victims:
        return None
    problem = quick_validate(path)
    if problem:
        raise CkptError(f"does not validate ({problem}); left whole", path=path)
    bytes_before = tree_scan(path).bytes
    if to == "bf16":
        return _hf_prefix_to_bf16(path, victims, on_start, bytes_before)
    on_start(victims, None, bytes_before)
    algorithm = _set_manifest_aside(path)
    for n in victims:
        (path / n).unlink()
    cast(storage.ObjectPath, path).store.changed()
    digest = _manifest_again(path, algorithm)
    return Thinned(path, victims, None, bytes_before, tree_scan(path).bytes, digest)


# -- DCP and HF prefixes on object storage: new objects, then the one that names them ------------

THIN_TAG = re.compile(r"thin[0-9a-f]{8}")
"""The mark in the names of the objects a thinning on object storage writes beside the
originals (``__thin1a2b3c4d_0_0.distcp``, ``model-00001-of-00002.thin1a2b3c4d.safetensors``):
a fresh random tag each time, so they never collide with an existing object, and an object
carrying one that its checkpoint's ``.metadata`` or index does not name is the leftover of a
thinning killed before it committed (see :func:`tidy`)."""


def _new_tag() -> str:
    return f"thin{uuid.uuid4().hex[:8]}"


def _dcp_writer(directory: Path, prefix: str) -> Any:
    """DCP's own ``FileSystemWriter`` for ``directory`` whose data files are named
    ``<prefix><rank>_<n>.distcp`` instead of ``__<rank>_<n>.distcp``.

    DCP records each item's file in ``.metadata`` (``storage_data``: ``_StorageInfo``'s
    ``relative_path``, the name its writer gave the file) and its reader opens exactly that
    name, so files written under other names need nothing rewritten: the writer's global plan
    carries the name prefix (``prepare_global_plan`` sets ``__<i>_`` per rank), replaced here.
    """
    import dataclasses

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class _Named(FileSystemWriter):
        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            plans = super().prepare_global_plan(plans)
            return [dataclasses.replace(p, storage_data=type(p.storage_data)(f"{prefix}{i}_"))
                    for i, p in enumerate(plans)]

    return _Named(str(directory))


def _referenced(path: Path) -> set[str] | None:
    """The files a remote checkpoint's commit record names: a DCP ``.metadata``'s data files,
    or an HF index's shards (None: neither can be read)."""
    import json

    from ckpt_cli.formats.dcp import metadata_file, parse_metadata, storage_map

    meta = metadata_file(path)
    try:
        if meta is not None:
            fields, _ = parse_metadata(meta)
            return {v[0] for v in storage_map(fields.get("storage_data"), path, meta).values()}
        idx = [c for c in path.iterdir() if c.name.startswith("model")
               and c.name.endswith(".safetensors.index.json")]
        if len(idx) == 1:
            wm = json.loads(idx[0].read_text()).get("weight_map")
            return {str(v) for v in wm.values()} if isinstance(wm, dict) else None
        if (path / "model.safetensors").is_file():
            return {"model.safetensors"}
    except (CkptError, OSError, ValueError):
        return None
    return None


def _unreferenced(path: Path, ours_only: bool) -> list[str]:
    """Data objects of a remote DCP or HF checkpoint that its commit record does not name:
    with ``ours_only`` only those whose name carries a thinning's tag (:data:`THIN_TAG`)."""
    from ckpt_cli.formats.dcp import metadata_file

    named = _referenced(path)
    if named is None:
        return []
    dcp = metadata_file(path) is not None
    out = []
    for c in path.iterdir():
        data = (c.name.endswith(".distcp") if dcp
                else c.name.startswith("model") and c.name.endswith(".safetensors"))
        if (data and c.name not in named and c.is_file()
                and (not ours_only or THIN_TAG.search(c.name))):
            out.append(c.name)
    return sorted(out)


def tidy(path: Path, *, ours_only: bool = False) -> list[str]:
    """Remove what a thinning on object storage killed midway left in checkpoint ``path``: the
    data objects its ``.metadata`` (DCP) or index (HF) does not name. Before the commit record
    was replaced those are the new ones (tagged, see :data:`THIN_TAG`); after, the originals.
    ``prune`` calls it for a checkpoint whose newest ledger line is a pending thinning (see
    :func:`pending`); with ``ours_only`` only tagged objects go, which nothing but a thinning
    writes. A no-op on local checkpoints (their thinning leaves a trash-named directory, which
    prune removes). Returns the names removed."""
    if storage.can_rename_atomically(path) or not path.is_dir():
        return []
    gone = _unreferenced(path, ours_only)
    if gone:
        algorithm = _set_manifest_aside(path)  # a watch pass may have listed them in it
        store = cast(storage.ObjectPath, path).store
        store.delete([cast(storage.ObjectPath, path / n).key for n in gone])
        _manifest_again(path, algorithm)
    return gone


def _upload_file(local: Path, dest: Path) -> None:
    """Stream a local file to the object ``dest`` (one object appearing whole at the end: a
    PUT, or a multipart upload's completion), 8 MiB read at a time."""
    size = local.stat().st_size
    with open(local, "rb") as f, storage.Upload(cast(storage.ObjectPath, dest),
                                                expected=size) as up:
        while chunk := f.read(8 << 20):
            up.write(chunk)


def _put_commit(dest: Path, data: bytes) -> None:
    """Store a checkpoint's commit record (DCP ``.metadata``, an HF index or a lone
    ``model.safetensors``) with one upload: the step at which the thinned checkpoint replaces
    the original."""
    dest.write_bytes(data)


def _delete_old(path: Path, names: list[str]) -> None:
    """Delete the original objects the replaced commit record no longer names."""
    if names:
        cast(storage.ObjectPath, path).store.delete(
            [cast(storage.ObjectPath, path / n).key for n in sorted(set(names))])


def _unchanged(path: Path, before: dict[str, tuple[int, float]]) -> bool:
    cast(storage.ObjectPath, path).store.changed()  # as it is now, not as listed
    return _sizes(path) == before


def _sizes(path: Path) -> dict[str, tuple[int, float]]:
    from ckpt_cli.manifest import MANIFEST_NAME

    out = {}
    for c in path.iterdir():
        if c.name != MANIFEST_NAME and c.is_file():
            st = c.stat()
            out[c.name] = (st.st_size, st.st_mtime)
    return out


def _thin_dcp_prefix(path: Path, to: str | None, on_start: OnStart) -> Thinned | None:
    """A DCP checkpoint on object storage, which has no rename.

    The thinned checkpoint is saved by DCP's own writer into a local temporary directory, its
    data files named with a fresh tag (``__thin1a2b3c4d_0_0.distcp``, see :func:`_dcp_writer`;
    DCP's ``.metadata`` names them itself), validated there, and uploaded beside the original
    files (streamed from disk, one object at a time). Then ``.metadata`` is replaced with one
    PUT, and the original data files are deleted. At every moment the prefix loads: before
    the PUT the old ``.metadata`` names the old files, after it the new one names the new
    files. A kill in between leaves objects the ``.metadata`` does not name; the next prune
    removes them (:func:`tidy`) and finishes the thinning.
    """
    import tempfile
    import warnings

    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from ckpt_cli.formats.dcp import METADATA
    from ckpt_cli.ops.prune import quick_validate
    from ckpt_cli.runs import tree_scan

    tidy(path, ours_only=True)  # a killed thinning's uploads, never named by .metadata
    before = _sizes(path)
    picked = _dcp_thinned_state(path, to)
    if picked is None:
        return None
    state, dropped, _others, bytes_before, meta = picked
    if meta.name != METADATA:
        raise CkptError(f"its metadata is {meta.name}, not {METADATA}; left whole", path=path)
    old = sorted(_referenced(path) or ())
    tag = _new_tag()
    with tempfile.TemporaryDirectory(prefix="ckpt-thin-") as td:
        local = Path(td) / "dcp"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that no process group is running
            dcp_save(state, storage_writer=_dcp_writer(local, f"__{tag}_"), no_dist=True)
        del state
        files = sorted(c.name for c in local.iterdir() if c.name != METADATA)
        if not files or any(not (n.startswith(f"__{tag}_") and n.endswith(".distcp"))
                            for n in files) or any(n in before for n in files):
            raise CkptError("DCP's writer did not name its files as asked; left whole",
                            path=path)
        problem = quick_validate(local)
        if problem:
            raise CkptError(f"the thinned copy does not validate ({problem}); left whole",
                            path=path)
        if not _unchanged(path, before):
            raise CkptError("it changed while being thinned; left as it is", path=path)
        on_start(dropped, to, bytes_before)
        algorithm = _set_manifest_aside(path)
        for n in files:
            _upload_file(local / n, path / n)
        _put_commit(path / METADATA, (local / METADATA).read_bytes())
    _delete_old(path, [n for n in old if n not in files])
    cast(storage.ObjectPath, path).store.changed()
    digest = _manifest_again(path, algorithm)
    return Thinned(path, dropped, to, bytes_before, tree_scan(path).bytes, digest)


def _hf_prefix_to_bf16(path: Path, victims: list[str], on_start: OnStart,
                       bytes_before: int) -> Thinned:
    """``--thin-to bf16`` on an HF ``checkpoint-N`` prefix on object storage.

    Sharded (``model.safetensors.index.json``): each shard is cast into a local temporary file
    and uploaded under a new, tagged name (``model-00001-of-00002.thin1a2b3c4d.safetensors``),
    then ``config.json``'s dtype is stored, then the index naming the new shards (one PUT: the
    step at which loaders see the BF16 weights), then the old shards and the optimizer state
    are deleted. A lone ``model.safetensors``: replaced by one upload (after ``config.json``),
    then the optimizer state deleted. Before the index (or the weights) is replaced the
    checkpoint loads as it was; after, as thinned; a kill in between leaves shards the index
    does not name, which the next prune removes (:func:`tidy`) before finishing the work.
    """
    import json
    import tempfile

    from ckpt_cli.formats import read_index
    from ckpt_cli.ops.prune import quick_validate
    from ckpt_cli.runs import tree_scan

    children = list(path.iterdir())
    if any(not c.is_file() for c in children):
        raise CkptError("holds sub-prefixes; --thin-to bf16 leaves it whole", path=path)
    if any(c.name.endswith((".bin", ".pt", ".pth")) and "model" in c.name for c in children):
        raise CkptError("holds torch-pickle weights beside safetensors; --thin-to bf16 casts "
                        "only safetensors and leaves it whole", path=path)
    idxs = [c for c in children if c.name.startswith("model")
            and c.name.endswith(".safetensors.index.json")]
    if len(idxs) > 1:
        raise CkptError("holds more than one weights index; left whole", path=path)
    named = _referenced(path)
    weights = [c for c in children if c.name.startswith("model")
               and c.name.endswith(".safetensors") and named is not None and c.name in named]
    if not weights or (not idxs and [w.name for w in weights] != ["model.safetensors"]):
        raise CkptError("no model*.safetensors weights (named by an index, or a lone "
                        "model.safetensors) to cast; left whole", path=path)
    before = _sizes(path)
    infos = {w.name: read_index(w) for w in weights}
    wide = ("F32", "F64", "F16")
    to_cast = [w for w in weights if any(t.dtype in wide for t in infos[w.name].tensors.values())]
    if not to_cast:  # cast already (a killed thinning committed its index): the optimizer goes
        on_start(victims, "bf16", bytes_before)
        algorithm = _set_manifest_aside(path)
        _delete_old(path, victims)
        digest = _manifest_again(path, algorithm)
        return Thinned(path, victims, "bf16", bytes_before, tree_scan(path).bytes, digest)
    tag = _new_tag()
    renamed = {w.name: (f"{w.name[:-len('.safetensors')]}.{tag}.safetensors" if idxs
                        else w.name) for w in to_cast}
    with tempfile.TemporaryDirectory(prefix="ckpt-thin-") as td:
        local = Path(td)
        total = 0
        for w in weights:
            if w.name in renamed:
                out = local / renamed[w.name]
                total += _safetensors_to_bf16(w, out)
                problem = quick_validate(out)
                if problem:
                    raise CkptError(f"the cast copy of {w.name} does not validate ({problem}); "
                                    "left whole", path=path)
            else:
                total += sum(t.nbytes for t in infos[w.name].tensors.values())
        config: bytes | None = None
        if (path / "config.json").is_file():
            cfg = json.loads((path / "config.json").read_text())
            if isinstance(cfg, dict):
                for k in [k for k in ("torch_dtype", "dtype") if k in cfg] or ["torch_dtype"]:
                    cfg[k] = "bfloat16"
                config = (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()
        index: bytes | None = None
        if idxs:
            doc = json.loads(idxs[0].read_text())
            doc["weight_map"] = {k: renamed.get(v, v) for k, v in doc["weight_map"].items()}
            if isinstance(doc.get("metadata"), dict) and "total_size" in doc["metadata"]:
                doc["metadata"]["total_size"] = total
            index = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
        if not _unchanged(path, before):
            raise CkptError("it changed while being thinned; left as it is", path=path)
        on_start(victims, "bf16", bytes_before)
        algorithm = _set_manifest_aside(path)
        if idxs:
            for n in renamed.values():
                _upload_file(local / n, path / n)
        if config is not None:
            (path / "config.json").write_bytes(config)  # one PUT
        if index is not None:
            _put_commit(idxs[0], index)
        else:
            _upload_file(local / "model.safetensors", path / "model.safetensors")
    _delete_old(path, victims + ([n for n in renamed if n not in renamed.values()]))
    cast(storage.ObjectPath, path).store.changed()
    digest = _manifest_again(path, algorithm)
    return Thinned(path, victims, "bf16", bytes_before, tree_scan(path).bytes, digest)
