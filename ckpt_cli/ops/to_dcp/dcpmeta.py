"""DCP's plan and ``.metadata`` for one process's save, without torch.

What ``dcp.save(state_dict, no_dist=True)`` with the ``DefaultSavePlanner`` does before and
after writing the bytes, for a state dict of lazy tensors and plain values:

- :func:`flatten`: ``flatten_state_dict``: mappings are walked (keys as ``str``), lists are
  walked by index when they hold a tensor, a mapping or such a list, anything else is a leaf;
  each leaf's key is its path joined by ``.``, and ``planner_data`` maps it to the path.
- :func:`metadata_bytes`: the ``Metadata`` that ``FileSystemWriter.finish`` pickles:
  ``state_dict_metadata`` (a ``TensorStorageMetadata`` with one chunk per tensor, a
  ``BytesStorageMetadata`` per other value), ``planner_data``, ``storage_data``
  (``MetadataIndex`` -> ``_StorageInfo(relative_path, offset, length)``, in the order written),
  ``storage_meta`` and ``version``. The pickle names torch's classes as globals and rebuilds
  them as pickling them does (``NEWOBJ`` + ``BUILD`` of each dataclass's fields); nothing
  here imports torch. ``tests/ops/to_dcp/test_dcp_writer.py`` checks it equals torch's.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from ckpt_cli import dtypes
from ckpt_cli.errors import UnsupportedError
from ckpt_cli.ops.to_dcp.state import LazyTensor
from ckpt_cli.writers.torchzip import _Call, _Global, _Pickler

DCP_VERSION = "1.0.0"
"""``torch.distributed.checkpoint.metadata``'s ``CURRENT_DCP_VERSION`` written since torch
2.5 (``Metadata.version``)."""

Path_ = tuple[str | int, ...]


@dataclass(slots=True)
class Item:
    """One leaf of the flattened state dict and where its bytes went.

    Attributes:
        fqn: The flattened key (the path joined by ``.``).
        path: The path (``planner_data``).
        value: A :class:`LazyTensor` or a plain value (saved with ``torch.save``).
        file: The ``.distcp`` file holding it, once written.
        offset: Where its archive starts in that file.
        length: The archive's length.
    """

    fqn: str
    path: Path_
    value: Any
    file: str = ""
    offset: int = 0
    length: int = 0

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.value, LazyTensor)

    @property
    def nbytes(self) -> int:
        v = self.value
        n = 1
        for d in v.shape:
            n *= d
        return dtypes.nbytes_of(v.dtype, n)


def flatten(tree: dict[str, Any]) -> list[Item]:
    """The leaves of ``tree`` in DCP's order, keyed as ``flatten_state_dict`` keys them.

    Raises:
        UnsupportedError: Two leaves with the same key (``{"a.b": 1, "a": {"b": 2}}``).
    """
    out: dict[str, Item] = {}
    for path, value in _walk(tree, ()):
        fqn = ".".join(map(str, path))
        if fqn in out:
            raise UnsupportedError(f"two values of the training state have the DCP key {fqn!r}")
        out[fqn] = Item(fqn, path, value)
    return list(out.values())


def _terminal(value: Any) -> bool:
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    return not any(isinstance(v, LazyTensor) or (isinstance(v, (dict, list))
                                                  and not _terminal(v)) for v in value)


def _walk(value: Any, path: Path_) -> Iterator[tuple[Path_, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, (*path, str(k)))
    elif _terminal(value) or not path:
        yield path, value
    else:
        for i, v in enumerate(value):
            yield from _walk(v, (*path, i))


_META = "torch.distributed.checkpoint.metadata"
_G = {name: _Global(_META, name) for name in (
    "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
    "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
_STORAGE_INFO = _Global("torch.distributed.checkpoint.filesystem", "_StorageInfo")
_SIZE = _Global("torch", "Size")
_STRIDED = _Call(_Global("torch.serialization", "_get_layout"), ("torch.strided",))
_CONTIGUOUS = _Call(_G["_MEM_FORMAT_ENCODING"], (0,))  # TORCH_CONTIGUOUS_FORMAT
_PATH = _Global("pathlib", "PosixPath")


class _Obj:
    """Pickles as an instance of ``cls`` made without ``__init__`` (``NEWOBJ``), given
    ``state`` (``BUILD``: the dataclass's fields, or what its ``__setstate__`` takes)."""

    def __init__(self, cls: _Global, state: Any = None):
        self.cls, self.state = cls, state


class _MetaPickler(_Pickler):
    dispatch = _Pickler.dispatch.copy()

    def save_obj(self, obj: _Obj) -> None:
        self.save(obj.cls)
        self.write(b")\x81")  # EMPTY_TUPLE NEWOBJ
        self.memoize(obj)
        if obj.state is not None:
            self.save(obj.state)
            self.write(b"b")  # BUILD

    dispatch[_Obj] = save_obj


def _size(dims: tuple[int, ...]) -> _Call:
    return _Call(_SIZE, (tuple(dims),))


def _dtype(code: str) -> _Global:
    name = dtypes.DTYPES[code].torch_name
    if name is None:
        raise UnsupportedError(f"torch has no dtype for {code}: DCP cannot hold it")
    return _Global("torch", name)


def _tensor_md(lz: LazyTensor) -> _Obj:
    props = _Obj(_G["TensorProperties"], (_dtype(lz.dtype), _STRIDED, False, _CONTIGUOUS,
                                          False))
    chunk = _Obj(_G["ChunkStorageMetadata"], {"offsets": _size((0,) * len(lz.shape)),
                                              "sizes": _size(lz.shape)})
    return _Obj(_G["TensorStorageMetadata"], {"properties": props, "size": _size(lz.shape),
                                              "chunks": [chunk]})


def metadata_bytes(items: list[Item], written: list[Item], checkpoint_id: str,
                   save_id: str) -> bytes:
    """The ``.metadata`` of a save.

    Args:
        items: Every leaf, in the flattened order.
        written: The same leaves in the order their archives were written.
        checkpoint_id: The directory the save wrote into (``StorageMeta.checkpoint_id``).
        save_id: The save's id (a UUID, as ``FileSystemWriter`` draws one).

    Returns:
        The pickle bytes.
    """
    sd_md = {it.fqn: (_tensor_md(it.value) if it.is_tensor else _Obj(_G["BytesStorageMetadata"]))
             for it in items}
    storage: dict[_Obj, _Obj] = {}
    for it in written:
        key = _Obj(_G["MetadataIndex"], {
            "fqn": it.fqn, "offset": _size((0,) * len(it.value.shape)) if it.is_tensor else None,
            "index": 0 if it.is_tensor else None})
        storage[key] = _Obj(_STORAGE_INFO, {"relative_path": it.file, "offset": it.offset,
                                            "length": it.length})
    where = PurePosixPath(checkpoint_id)
    meta = _Obj(_G["StorageMeta"], {"checkpoint_id": _Call(_PATH, where.parts),
                                    "save_id": save_id, "load_id": None, "modules": []})
    root = _Obj(_G["Metadata"], {"state_dict_metadata": sd_md,
                                 "planner_data": {it.fqn: it.path for it in items},
                                 "storage_data": storage, "storage_meta": meta,
                                 "version": DCP_VERSION})
    buf = io.BytesIO()
    _MetaPickler(buf, protocol=2).dump(root)
    return buf.getvalue()
