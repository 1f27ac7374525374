"""The one DCP writer: a :class:`TrainingState` -> a torch.distributed.checkpoint directory.

DCP's format is written directly, without torch (importing ``torch.distributed.checkpoint``
costs seconds and ~300 MB before the first byte): the state dict is flattened and planned as
``dcp.save`` with the ``DefaultSavePlanner`` plans it, each item is the ``torch.save`` archive
``FileSystemWriter`` would write (:mod:`.zipitem`), and ``.metadata`` is the pickle of the
``Metadata`` it would write (:mod:`.dcpmeta`). Tensors go through convert's write path: read
(in pieces, where a reader gives :attr:`LazyTensor.pieces`) on a background thread within a
memory budget (:class:`ckpt_cli.writers.pipeline.Prefetch`), the files synced in the
background while the next ones are written (:class:`SyncBehind`). Each large tensor gets a
file of its own; the small ones (and the non-tensor values) share files of at most
``bucket_bytes``. The directory is built in a temporary sibling and renamed into place
(:func:`ckpt_cli.storage.atomic.atomic_dir`), or uploaded under an object-storage prefix
(:mod:`ckpt_cli.writers.dcp`: each file to its final key, nothing synced locally),
``.metadata`` written last.

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

import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ckpt_cli import dtypes, storage
from ckpt_cli.errors import CorruptCheckpointError, UnsupportedError, UsageError
from ckpt_cli.ops.to_dcp.dcpmeta import Item, flatten, metadata_bytes
from ckpt_cli.ops.to_dcp.state import LazyTensor, TrainingState
from ckpt_cli.ops.to_dcp.zipitem import ItemZip, object_item, tensor_header
from ckpt_cli.storage import stages
from ckpt_cli.storage.reads import MEMORY_BUDGET, crc32_parallel
from ckpt_cli.tensors import cast
from ckpt_cli.writers import WriteResult
from ckpt_cli.writers.dcp import DcpTarget, dcp_destination
from ckpt_cli.writers.pipeline import Flusher, Prefetch, tensor_bytes
from ckpt_cli.writers.plan import OutTensor
from ckpt_cli.writers.safetensors import write_all

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
              bucket_bytes: int = 64 << 20, max_memory: int | None = None) -> WriteResult:
    """Write a layout (:func:`layout_state`) as a DCP directory at ``out``, atomically.

    Args:
        tree: The state dict with :class:`LazyTensor` leaves.
        out: The directory to create.
        overwrite: Replace an existing ``out``.
        on_progress: Called with tensor bytes as each piece of a tensor is written.
        on_start: Called once with the total tensor bytes.
        bucket_bytes: Tensors smaller than this share files of at most this size (with the
            non-tensor values); larger ones get a file each.
        max_memory: Bytes of tensor data read ahead of the writer (default
            :data:`ckpt_cli.storage.reads.MEMORY_BUDGET`); tensors that stream in pieces
            (:attr:`LazyTensor.pieces`) never sit in memory whole.

    Returns:
        The files written (``.metadata`` is the index file).

    Raises:
        CorruptCheckpointError: A tensor read from the source has another shape or dtype
            than its reader declared.
        UnsupportedError: A value DCP cannot hold (two leaves with one key, a dtype torch
            lacks).
        DestinationExistsError: ``out`` exists and ``overwrite`` is False.
    """
    items = flatten(tree)
    tensors = [it for it in items if it.is_tensor]
    for it in tensors:
        _dtype_of(it.fqn, it.value.dtype)
    total = sum(it.nbytes for it in tensors)
    if on_start is not None:
        on_start(total)
    buckets = _buckets(items, bucket_bytes)
    # The tensors in the order they are written: each file's, in order (bytes items first).
    order = [it for b in buckets for it in b if it.is_tensor]
    outs = [OutTensor(it.fqn, it.value.dtype, it.value.shape, _checked(it.fqn, it.value),
                      _checked_pieces(it.fqn, it.value)) for it in order]
    written: list[Item] = []
    # A local directory or a prefix on object storage (writers/dcp.py): every file bounded
    # by the whole checkpoint's bytes (plus the pickled values), which sizes upload parts.
    with dcp_destination(out, overwrite=overwrite, expected=total + bucket_bytes) as dest:
        syncer = SyncBehind(local=dest.fs is None)
        with syncer, Prefetch(outs, max_memory or MEMORY_BUDGET) as source:
            k = 0
            for n, bucket in enumerate(buckets):
                name = f"__0_{n}0.distcp"  # DCP's names: rank 0, bucket n, its file 0
                with _create(dest, name) as f:
                    pos = 0
                    for it in [i for i in bucket if not i.is_tensor] + [
                            i for i in bucket if i.is_tensor]:
                        it.file, it.offset = name, pos
                        if it.is_tensor:
                            it.length = _write_tensor(f, source, k, outs[k], it.value.crc,
                                                      syncer, on_progress)
                            k += 1
                        else:
                            data = _object_item(it)
                            write_all(f, memoryview(data))
                            it.length = len(data)
                        pos += it.length
                        written.append(it)
                    syncer.done(f)
            syncer.finish()
        with _create(dest, ".metadata") as f:
            write_all(f, memoryview(metadata_bytes(items, written, dest.root,
                                                   str(uuid.uuid4()))))
    return WriteResult(out, dest.files, ".metadata", total, len(tensors))


def _create(dest: DcpTarget, name: str) -> Any:
    """A new file ``name`` of the output, as a context manager (an upload on object storage)."""
    if dest.fs is not None:
        return dest.fs.create_stream(f"{dest.root}/{name}", "wb")
    return storage.create(Path(dest.root) / name, expected=0, buffering=0)


def _write_tensor(f: Any, source: Prefetch, k: int, t: OutTensor, known: int | None,
                  syncer: SyncBehind, on_progress: Callable[[int], None] | None) -> int:
    """Write tensor ``k`` as ``torch.save`` of it, its bytes piece by piece; its length.
    ``known``: the CRC-32 of its bytes that the source's reader checks (else computed)."""
    z = ItemZip(lambda mv: write_all(f, mv))
    tensor_header(z, t.dtype, t.shape, t.nbytes)
    for data in tensor_bytes(source, k, t):
        crc = known if known is not None else crc32_parallel(data, z.crc, cast.cast_pool(),
                                                             cast.cast_threads())
        with stages.stage("write", len(data)):
            z.data(data, crc)
        syncer.wrote(f, len(data))
        if on_progress is not None:
            on_progress(len(data))
        del data
    z.end()
    return z.finish()


class SyncBehind:
    """Makes the files of a write durable in the background, in batches of about
    :attr:`ckpt_cli.writers.pipeline.Flusher.EVERY` bytes, while the next ones are written.

    A DCP directory is many files of at most a bucket each (64 MiB): syncing each one as it
    closes (as :class:`~ckpt_cli.writers.pipeline.Flusher` does a shard) would pay a journal
    commit per file. Here the files written since the last batch (the one being written too,
    when it grows past the interval alone) are synced together, one after another on a
    background thread; the next batch waits for the previous, so dirty data stays within
    about two intervals. :meth:`finish` syncs the rest and raises the first error any sync
    met: the write then fails, nothing unsynced becomes the output.
    """

    def __init__(self, *, local: bool = True) -> None:
        self._local = local  # uploads (object storage) have nothing to sync
        self._fds: list[int] = []  # duplicates of the descriptors to sync, closed once synced
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._error: OSError | None = None

    def __enter__(self) -> SyncBehind:
        return self

    def __exit__(self, *exc: object) -> None:
        """Close what was not synced (after an error); wait for a sync under way."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def _add(self, f: Any) -> None:
        if self._local:
            self._fds.append(os.dup(f.fileno()))

    def wrote(self, f: Any, n: int) -> None:
        """``n`` more bytes written to the open file ``f``."""
        self._pending += n
        if self._pending >= Flusher.EVERY:
            self._add(f)
            self._start()

    def done(self, f: Any) -> None:
        """The file ``f`` is complete (about to close): sync it with the next batch."""
        self._add(f)

    def _start(self) -> None:
        self._wait()
        fds, self._fds, self._pending = self._fds, [], 0
        self._thread = threading.Thread(target=self._sync, args=(fds,),
                                        name="ckpt-fdatasync", daemon=True)
        self._thread.start()

    def _sync(self, fds: list[int]) -> None:
        for fd in fds:
            self._sync_one(fd)

    def _sync_one(self, fd: int) -> None:
        try:
            if self._error is None:
                with stages.stage("fsync"):
                    os.fdatasync(fd)
        except OSError as e:  # raised in the writer's thread by _wait()
            self._error = e
        finally:
            os.close(fd)

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """Sync every file not yet synced, and wait."""
        if self._fds:
            self._start()
        self._wait()


def _object_item(it: Item) -> bytes:
    """``torch.save`` of a non-tensor value; one that is not plain data is refused."""
    import pickle  # lazy: only for the error it raises

    try:
        return object_item(it.value)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise UnsupportedError(f"{it.fqn}: a value DCP cannot hold "
                               f"({type(it.value).__name__}: {e})") from None


def _dtype_of(name: str, code: str) -> np.dtype[Any]:
    """The numpy dtype of a tensor DCP can hold."""
    if dtypes.DTYPES[code].torch_name is None:
        raise UnsupportedError(f"{name}: torch has no dtype for {code}: DCP cannot hold it")
    try:
        return dtypes.numpy_dtype(code)
    except KeyError:
        raise UnsupportedError(f"{name}: ckpt cannot move {code} values into DCP") from None


def _check(name: str, lz: LazyTensor, arr: np.ndarray) -> np.ndarray:
    """``arr`` if its dtype is the declared one (or, for BF16/FP8, integers of its width:
    the bits), else an error (never a silent cast)."""
    want = _dtype_of(name, lz.dtype)
    if arr.dtype != want and not (arr.dtype.kind in "ui" and dtypes.DTYPES[lz.dtype].is_floating
                                  and arr.dtype.itemsize == want.itemsize):
        raise CorruptCheckpointError(f"{name}: read {arr.dtype}, expected {lz.dtype}")
    return arr


def _checked(name: str, lz: LazyTensor) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        arr = np.asarray(lz.load())
        if tuple(arr.shape) != tuple(lz.shape):
            raise CorruptCheckpointError(f"{name}: read shape {tuple(arr.shape)}, expected "
                                         f"{lz.shape}")
        arr = _check(name, lz, arr)
        return arr if arr.flags.c_contiguous else arr.copy(order="C")
    return load


def _checked_pieces(name: str, lz: LazyTensor) -> Callable[[], Iterator[np.ndarray]] | None:
    if lz.pieces is None:
        return None
    pieces = lz.pieces

    def gen() -> Iterator[np.ndarray]:
        it = pieces()
        try:
            for arr in it:
                yield _check(name, lz, arr).view(_dtype_of(name, lz.dtype))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
    return gen


def _buckets(items: list[Item], limit: int) -> list[list[Item]]:
    """Group the leaves into files: the non-tensor values and the tensors under ``limit``
    bytes packed into files of at most ``limit`` bytes, each larger tensor alone."""
    small: list[list[Item]] = [[]]
    size = 0
    big: list[list[Item]] = []
    for item in items:
        if not item.is_tensor:
            small[0].append(item)
            continue
        nbytes = item.nbytes
        if nbytes >= limit:
            big.append([item])
            continue
        if size + nbytes > limit:
            small.append([])
            size = 0
        small[-1].append(item)
        size += nbytes
    return [b for b in small if b] + big
