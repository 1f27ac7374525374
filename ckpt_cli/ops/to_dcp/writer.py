"""The one DCP writer: a :class:`TrainingState` -> a torch.distributed.checkpoint directory.

The state dict handed to ``dcp.save`` holds *meta* tensors (shape and dtype, no bytes) for
every lazy tensor; a save planner loads each one's values only when the storage writer asks
for it (``resolve_data``). ``FileSystemWriter`` keeps every tensor of a file until the file
is done, so the storage writer here puts each large tensor in a file of its own and packs the
small ones (and the non-tensor values) into files of at most ``bucket_bytes``: memory stays
bounded by the larger of the largest tensor and that bucket (64 MiB). The directory is built
in a temporary sibling and renamed into place (:func:`ckpt_cli.storage.atomic.atomic_dir`),
or uploaded under an object-storage prefix (:mod:`ckpt_cli.writers.dcp`), ``.metadata`` last.

Layouts (the loading side's state dict, as ``dcp.load`` sees it):

- ``torchtitan``: the model's FQNs at the top level, ``optimizer`` flattened as
  ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` gives it
  (``state.<fqn>.<key>``, ``param_groups.<fqn>.<hyperparameter>``), ``lr_scheduler``,
  ``train_state`` (``step`` as an int32 tensor, as torchtitan's ``TrainState``; the source's
  other plain values such as ``epoch`` beside it) and ``rng`` where known.
- ``recipe``: ``model`` (FQN -> tensor) and ``optim`` in ``get_state_dict``'s nested form
  (``state`` -> FQN -> key, ``param_groups`` with FQNs in ``params``), plus ``lr_scheduler``,
  ``train_state`` (``step`` as an int) and ``rng`` where known.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ckpt_cli import dtypes
from ckpt_cli.errors import CorruptCheckpointError, UsageError
from ckpt_cli.ops.to_dcp.state import LazyTensor, TrainingState
from ckpt_cli.writers import WriteResult
from ckpt_cli.writers.dcp import dcp_destination

LAYOUTS = ("torchtitan", "recipe")
"""``--dcp-layout`` values: the top-level keys the output is written under."""


def layout_state(state: TrainingState, layout: str) -> dict[str, Any]:
    """The state dict a resuming run loads, with :class:`LazyTensor` leaves.

    Args:
        state: The training state.
        layout: ``torchtitan`` or ``recipe`` (see the module docstring).

    Returns:
        The nested state dict (lazy tensors and plain values).

    Raises:
        UsageError: An unknown layout.
    """
    if layout not in LAYOUTS:
        raise UsageError(f"dcp_layout must be torchtitan or recipe, not {layout!r}",
                         param="dcp_layout")
    optim = optimizer_nested(state)
    out: dict[str, Any] = {}
    if layout == "torchtitan":
        out.update(state.model)
        if optim is not None:
            out["optimizer"] = flatten_optimizer(optim)
    else:
        out["model"] = dict(state.model)
        if optim is not None:
            out["optim"] = optim
    if state.lr_scheduler is not None:
        out["lr_scheduler"] = state.lr_scheduler
    train: dict[str, Any] = dict(state.extra)
    if state.step is not None:
        train["step"] = _int32(state.step) if layout == "torchtitan" else state.step
    if train:
        out["train_state"] = train
    if state.rng:
        out["rng"] = dict(state.rng)
    return out


def optimizer_nested(state: TrainingState) -> dict[str, Any] | None:
    """``get_state_dict``'s optimizer form: ``{"state": {fqn: {key: value}}, "param_groups":
    [{..., "params": [fqn...]}]}``; None without optimizer state. A scalar ``step`` becomes a
    0-d FP32 tensor, as ``torch.optim.Adam`` keeps it."""
    if not state.param_groups and not state.optimizer_state:
        return None
    per: dict[str, dict[str, Any]] = {}
    for fqn, entries in state.optimizer_state.items():
        per[fqn] = {k: (_f32(v) if k == "step" and not isinstance(v, LazyTensor) else v)
                    for k, v in entries.items()}
    return {"state": per, "param_groups": [dict(g) for g in state.param_groups]}


def flatten_optimizer(optim: dict[str, Any]) -> dict[str, Any]:
    """The flat form of ``flatten_optimizer_state_dict=True`` (what torchtitan saves)."""
    flat: dict[str, Any] = {}
    for fqn, entries in optim["state"].items():
        for k, v in entries.items():
            flat[f"state.{fqn}.{k}"] = v
    for group in optim["param_groups"]:
        for fqn in group["params"]:
            for k, v in group.items():
                if k != "params":
                    flat[f"param_groups.{fqn}.{k}"] = v
    return flat


def _scalar(value: int | float, dtype: str) -> LazyTensor:
    return LazyTensor(dtype, (), lambda: np.asarray(value, dtype=dtypes.numpy_dtype(dtype)))


def _f32(v: Any) -> Any:
    return _scalar(float(v), "F32") if isinstance(v, (int, float)) else v


def _int32(v: int) -> LazyTensor:
    return _scalar(int(v), "I32")


def count_tensors(tree: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The lazy tensors of a layout, by their dotted DCP key."""
    found: dict[str, tuple[str, tuple[int, ...]]] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, LazyTensor):
            found[prefix] = (node.dtype, node.shape)
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))

    walk(tree, "")
    return found


def write_dcp(tree: dict[str, Any], out: Path, *, overwrite: bool = False,
              on_progress: Callable[[int], None] | None = None,
              on_start: Callable[[int], None] | None = None,
              bucket_bytes: int = 64 << 20) -> WriteResult:
    """Write a layout (:func:`layout_state`) as a DCP directory at ``out``, atomically.

    Args:
        tree: The state dict with :class:`LazyTensor` leaves.
        out: The directory to create.
        overwrite: Replace an existing ``out``.
        on_progress: Called with tensor bytes as each tensor is written.
        on_start: Called once with the total tensor bytes.
        bucket_bytes: Tensors smaller than this share files of at most this size (with the
            non-tensor values); larger ones get a file each. Memory held: the larger of this
            and the largest tensor.

    Returns:
        The files written (``.metadata`` is the index file).

    Raises:
        CorruptCheckpointError: A tensor read from the source has another shape or dtype
            than its reader declared.
        DestinationExistsError: ``out`` exists and ``overwrite`` is False.
    """
    import torch  # heavy: torch
    from torch.distributed.checkpoint.api import CheckpointException  # heavy: torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # heavy: torch
    from torch.distributed.checkpoint.filesystem import FileSystemWriter  # heavy: torch
    from torch.distributed.checkpoint.state_dict_saver import save  # heavy: torch

    lazies: dict[int, tuple[str, LazyTensor]] = {}

    def placeholders(node: Any, prefix: str) -> Any:
        if isinstance(node, LazyTensor):
            t = torch.empty(node.shape, dtype=dtypes.torch_dtype(node.dtype), device="meta")
            lazies[id(t)] = (prefix, node)
            return t
        if isinstance(node, dict):
            return {k: placeholders(v, f"{prefix}.{k}" if prefix else str(k))
                    for k, v in node.items()}
        return node

    sd = placeholders(tree, "")
    total = sum(dtypes.nbytes_of(lz.dtype, int(np.prod(lz.shape, dtype=np.int64)))
                for _, lz in lazies.values())
    if on_start is not None:
        on_start(total)

    class LazyPlanner(DefaultSavePlanner):
        """Reads each tensor's values when the storage writer asks for them."""

        def resolve_data(self, write_item: Any) -> Any:
            obj = self.lookup_object(write_item.index)
            found = lazies.get(id(obj))
            if found is None:
                return self.transform_object(write_item, obj)
            name, lz = found
            tensor = _loaded(name, lz)
            if on_progress is not None:
                on_progress(tensor.numel() * tensor.element_size())
            return tensor

    class BucketWriter(FileSystemWriter):
        """Small items (non-tensor values, tensors under ``bucket_bytes``) share files of at
        most ``bucket_bytes``; each larger tensor gets a file of its own."""

        def write_data(self, plan: Any, planner: Any) -> Any:
            from torch.futures import Future  # heavy: torch

            buckets = _buckets(plan.items, bucket_bytes)
            prefix = plan.storage_data.prefix
            results: list[Any] = []
            for n, items in enumerate(buckets):
                # "__0_" + "{n}" + DCP's count "0": ranks parse as DCP names them.
                part = replace(plan, items=items,
                               storage_data=replace(plan.storage_data, prefix=f"{prefix}{n}"))
                results += super().write_data(part, planner).wait()
            done: Future[list[Any]] = Future()
            done.set_result(results)
            return done

    # A local directory or a prefix on object storage (writers/dcp.py): every file bounded
    # by the whole checkpoint's bytes (plus the pickled values), which sizes upload parts.
    with dcp_destination(out, overwrite=overwrite, expected=total + bucket_bytes) as dest:
        # sync_files=False: atomic_dir fsyncs the whole tree before the rename.
        writer = BucketWriter(dest.root, single_file_per_rank=True, sync_files=False,
                              thread_count=1)
        dest.attach(writer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's notes on single-process saves
            try:
                save(sd, storage_writer=writer, planner=LazyPlanner(), no_dist=True)
            except CheckpointException as e:
                raise _cause(e) from None
    return WriteResult(out, dest.files, ".metadata", total, len(lazies))


def _loaded(name: str, lz: LazyTensor) -> Any:
    import torch  # heavy: torch

    arr = np.asarray(lz.load())
    if tuple(arr.shape) != tuple(lz.shape):
        raise CorruptCheckpointError(f"{name}: read shape {tuple(arr.shape)}, expected "
                                     f"{lz.shape}")
    want = dtypes.torch_dtype(lz.dtype)
    if arr.dtype.kind in "ui" and want.is_floating_point:  # BF16/FP8 as integer bits
        if arr.dtype.itemsize != want.itemsize:
            raise CorruptCheckpointError(f"{name}: read {arr.dtype}, expected {lz.dtype}")
        ints = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[arr.dtype.itemsize]
        t = torch.from_numpy(np.ascontiguousarray(arr).view(ints)).view(want)
    else:
        t = dtypes.to_torch(arr, lz.dtype)
        if t.dtype != want:  # never a silent cast
            raise CorruptCheckpointError(f"{name}: read {t.dtype}, expected {lz.dtype}")
    return t.reshape(lz.shape)


def _buckets(items: list[Any], limit: int) -> list[list[Any]]:
    """Group write items into files: the non-tensor values and the tensors under ``limit``
    bytes packed into files of at most ``limit`` bytes, each larger tensor alone."""
    from torch.distributed.checkpoint.planner import WriteItemType  # heavy: torch

    small: list[list[Any]] = [[]]
    size = 0
    big: list[list[Any]] = []
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            small[0].append(item)
            continue
        props, n = item.tensor_data.properties, 1
        for d in item.tensor_data.size:
            n *= d
        nbytes = n * props.dtype.itemsize
        if nbytes >= limit:
            big.append([item])
            continue
        if size + nbytes > limit:
            small.append([])
            size = 0
        small[-1].append(item)
        size += nbytes
    return [b for b in small if b] + big


def _cause(e: BaseException) -> BaseException:
    """The error a rank raised inside ``dcp.save`` (ckpt's own, an ``OSError``), unwrapped
    from DCP's ``CheckpointException`` so that it reaches the user as one line."""
    for failure in getattr(e, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(inner, BaseException):
            return inner
    return e
