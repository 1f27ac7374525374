"""A plain ``torch.save`` training dict -> :class:`TrainingState`.

``{"model": model.state_dict(), "optimizer": optimizer.state_dict(), "lr_scheduler": ...,
"step": ..., "rng_state": ...}`` (the keys frameworks use for each, see
:mod:`ckpt_cli.formats.containers`). Read by ckpt's own zip reader and allowlisting
unpickler: no pickle code runs, tensor bytes are read from the archive when the writer asks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ckpt_cli import storage
from ckpt_cli.errors import CorruptCheckpointError, UnsupportedError
from ckpt_cli.formats import containers, read_index
from ckpt_cli.formats.base import read_head
from ckpt_cli.formats.names import WRAPPERS
from ckpt_cli.formats.standins import TensorRecord
from ckpt_cli.formats.torchzip import ZIP_MAGIC, parse_zip
from ckpt_cli.model import CheckpointIndex, TensorInfo
from ckpt_cli.ops.to_dcp import optim
from ckpt_cli.ops.to_dcp.state import LazyTensor, TrainingState
from ckpt_cli.tensors.source import TensorSource

_MODEL = ("model", "state_dict", "model_state_dict", "model_state", "module", "net", "network")
_OPTIM = ("optimizer", "optimizer_state_dict", "optim", "optimizer_state", "opt")
_SCHED = ("lr_scheduler", "scheduler", "lr_scheduler_state_dict", "scheduler_state_dict")
_STEP = ("step", "global_step", "iteration", "train_step", "num_updates")
_RNG = ("rng_state", "rng", "rng_states", "cpu_rng_state", "torch_rng_state")


def read_torch(path: Path) -> TrainingState:
    """Read a ``torch.save`` training dict.

    Args:
        path: The ``.pt``/``.pth``/``.ckpt`` file (torch zip format).

    Returns:
        The training state (model, optimizer named by the model's parameter order,
        scheduler, step, RNG where present).

    Raises:
        UnsupportedError: No model state dict, or an optimizer state ckpt cannot map.
        CorruptCheckpointError: The file cannot be parsed.
    """
    index = read_index(path, "torch")
    tree = _tree(path)
    if not isinstance(tree, dict):
        raise UnsupportedError(f"{path}: holds a {type(tree).__name__}, not a training dict")
    names = {id(leaf): ".".join(p) for p, leaf in containers.walk(tree)
             if isinstance(leaf, TensorRecord)}

    def lazy(rec: TensorRecord) -> LazyTensor:
        info = index.tensors.get(names.get(id(rec), ""))
        if info is None:
            raise CorruptCheckpointError(f"{path}: a tensor ckpt's reader could not place")
        return lazy_of(index, info)

    model_key = _first(tree, _MODEL, lambda v: isinstance(v, dict) and any(
        isinstance(x, TensorRecord) for x in v.values()))
    if model_key is None:
        if all(isinstance(v, TensorRecord) for v in tree.values()) and tree:
            model_sd, model_key = tree, ""  # a bare model state dict
        else:
            raise UnsupportedError(f"{path}: no model state dict (looked for "
                                   f"{', '.join(_MODEL)})")
    else:
        model_sd = tree[model_key]
    prefix = _wrapper(list(model_sd))
    model = {str(k)[len(prefix):]: lazy(v) for k, v in model_sd.items()
             if isinstance(v, TensorRecord)}
    state = TrainingState("torch", model)
    if prefix:
        state.notes.append(f"wrapper prefix {prefix!r} stripped from the model's names")
    opt_key = _first(tree, _OPTIM, lambda v: isinstance(v, dict) and "param_groups" in v)
    if opt_key is not None:
        _read_optimizer(state, tree[opt_key], model_sd, prefix, lazy, f"{path}: {opt_key}")
    else:
        state.notes.append("no optimizer state in the source: a run resumed from the output "
                           "starts its optimizer afresh")
    sched_key = _first(tree, _SCHED, lambda v: isinstance(v, dict))
    if sched_key is not None:
        state.lr_scheduler = plain(tree[sched_key], f"{path}: {sched_key}")
    step_key = _first(tree, _STEP, lambda v: isinstance(v, int) and not isinstance(v, bool))
    state.step = tree[step_key] if step_key is not None else None
    if state.step is None and state.lr_scheduler is not None:
        last = state.lr_scheduler.get("last_epoch")
        if isinstance(last, int) and last >= 0:
            state.step = last
            state.notes.append(f"step {last} taken from the LR scheduler's last_epoch")
    rng_key = _first(tree, _RNG, lambda v: isinstance(v, TensorRecord))
    if rng_key is not None:
        state.rng = {"cpu": lazy(tree[rng_key])}
    used = {model_key, opt_key, sched_key, step_key, rng_key}
    state.extra = {str(k): v for k, v in tree.items() if k not in used and isinstance(
        v, (int, float, str)) and not isinstance(v, bool)}  # epoch, loss...: in train_state
    left = sorted(str(k) for k in tree if k not in used and str(k) not in state.extra)
    if left:
        state.notes.append("not carried: " + ", ".join(left))
    return state


def _read_optimizer(state: TrainingState, osd: Any, model_sd: dict[str, Any], prefix: str,
                    lazy: Any, where: str) -> None:
    groups = osd.get("param_groups")
    raw_state = osd.get("state", {})
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups) or \
            not isinstance(raw_state, dict):
        raise UnsupportedError(f"{where}: not an optimizer.state_dict() (state, param_groups)")
    params = _parameters(model_sd, prefix)
    entries = {i: ({k: (lazy(v) if isinstance(v, TensorRecord) else v) for k, v in e.items()}
                   if isinstance(e, dict) else e) for i, e in raw_state.items()}
    plain_groups = [plain(g, f"{where}.param_groups") for g in groups]
    named, out_groups = optim.map_by_order(params, entries, plain_groups, where)
    state.optimizer_state, state.param_groups = named, out_groups
    state.optimizer = optim.optimizer_name(named, out_groups)
    if state.optimizer is None and named:
        keys = sorted({k for e in named.values() for k in e})
        state.notes.append(f"optimizer not recognised by its state ({', '.join(keys)}): "
                           "carried per parameter as it is")
    state.notes.append(f"optimizer ids named by the model's parameter order "
                       f"({len(params)} parameters)")


def _parameters(model_sd: dict[str, Any], prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    """Trainable parameters in ``model.parameters()`` order: the state dict's order without
    buffers (by name and dtype) and without tied copies (the same storage view again)."""
    out: list[tuple[str, tuple[int, ...]]] = []
    seen: set[tuple[object, ...]] = set()
    for k, v in model_sd.items():
        if not isinstance(v, TensorRecord):
            continue
        name = str(k)[len(prefix):]
        if containers.is_buffer_name(name, v.dtype):
            continue
        key = (v.storage.key if v.storage else id(v), v.storage_offset, v.shape, v.stride)
        if key in seen:
            continue
        seen.add(key)
        out.append((name, v.shape))
    return out


def lazy_of(index: CheckpointIndex, info: TensorInfo) -> LazyTensor:
    def load() -> Any:
        with TensorSource(index) as src:
            return src.read(info)

    def pieces() -> Iterator[np.ndarray]:
        with TensorSource(index) as src:
            yield from src.iter_pieces(info)

    # TensorSource checks a storage entry's CRC-32 as it reads (and fails the read on a
    # mismatch): a tensor that is its whole entry has that CRC.
    s = info.storage
    crc = s.crc if (s is not None and s.crc is not None and not info.chunks
                    and info.stride is None and info.offset == s.start
                    and info.nbytes == s.crc_len) else None
    return LazyTensor(info.dtype, tuple(info.shape), load, pieces, crc)


def _tree(path: Path) -> Any:
    if not read_head(path, 4).startswith(ZIP_MAGIC):
        raise UnsupportedError(f"{path}: a DCP conversion reads torch.save's zip format "
                               "(torch >= 1.6), not a legacy pickle")
    fd = storage.open_regular(path)
    try:
        return parse_zip(fd, 0, path.stat().st_size, str(path)).pickle.obj
    finally:
        storage.close(fd)


def _first(tree: dict[Any, Any], keys: tuple[str, ...], ok: Any) -> str | None:
    return next((k for k in keys if k in tree and ok(tree[k])), None)


def _wrapper(names: list[Any]) -> str:
    prefix = ""
    while names and (w := next((w for w in WRAPPERS if all(
            str(n).startswith(prefix + w) for n in names)), None)):
        prefix += w
    return prefix


def plain(v: Any, where: str) -> Any:
    """A copy made of plain Python values only; anything else is refused, naming it."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        items = [plain(x, where) for x in v]
        return tuple(items) if isinstance(v, tuple) else items
    if isinstance(v, dict):
        return {k: plain(x, f"{where}.{k}") for k, x in v.items()}
    raise UnsupportedError(f"{where} holds a {getattr(v, 'qualname', type(v).__name__)}, not a "
                           "plain value: ckpt cannot carry it")
