"""Streaming writer of torch.save zip files, without torch.

The output is what ``torch.save(OrderedDict(name -> tensor))`` writes: STORED records under
``archive/``, ``data.pkl`` (protocol 2) whose tensors are ``_rebuild_tensor_v2`` calls on
``('storage', torch.XStorage, key, 'cpu', numel)`` persistent ids (``_rebuild_tensor_v3`` with an
untyped storage for dtypes that have no legacy storage class, as torch does), 64-byte aligned
payloads, and the ``version``/``byteorder`` records. ``torch.load(weights_only=True)`` and
``mmap=True`` read it. Tensor bytes are streamed into their records one at a time.
"""

from __future__ import annotations

import io
import pickle
import struct
import uuid
import zipfile
from collections import OrderedDict
from typing import Any, BinaryIO

from ckpt_cli import dtypes

ARCHIVE = "archive/"
_ALIGN = 64
_STORAGE_CLASS = {code: cls for cls, code in dtypes.STORAGE_CLASSES.items()
                  if not cls.startswith(("Q", "Untyped"))}


class _Global:
    """A reference the pickle writes as ``GLOBAL module name`` (never imported here)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> None:  # pickle requires reduce functions to be callable
        raise TypeError("a pickling stand-in; never called")


class _Call:
    """Pickles as ``REDUCE(func, args)``."""

    def __init__(self, func: _Global, args: tuple[Any, ...]):
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


class _Storage:
    def __init__(self, key: str, cls: str, numel: int):
        self.key, self.cls, self.numel = key, cls, numel


# The pure-Python pickler: unlike the C one, its dispatch table can be extended.
_PurePickler: Any = getattr(pickle, "_Pickler")  # noqa: B009 - private name, typed as Any


class _Pickler(_PurePickler):  # type: ignore[misc]
    """The pure-Python pickler, taught to write torch GLOBALs and storage persistent ids."""

    dispatch = _PurePickler.dispatch.copy()

    def save_torch_global(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[_Global] = save_torch_global

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            # torch pickles UntypedStorage by its defining module, typed storages via torch.
            module = "torch.storage" if obj.cls == "UntypedStorage" else "torch"
            return ("storage", _Global(module, obj.cls), obj.key, "cpu", obj.numel)
        return None


def _tensor_call(key: str, code: str, shape: tuple[int, ...], numel: int) -> _Call:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    stride = tuple(reversed(strides))
    hooks = _Call(_Global("collections", "OrderedDict"), ())
    cls = _STORAGE_CLASS.get(code)
    if cls is not None:
        storage = _Storage(key, cls, numel)
        return _Call(_Global("torch._utils", "_rebuild_tensor_v2"),
                     (storage, 0, shape, stride, False, hooks))
    torch_name = dtypes.DTYPES[code].torch_name
    if torch_name is None:
        raise ValueError(f"torch has no dtype for {code}")
    storage = _Storage(key, "UntypedStorage", dtypes.nbytes_of(code, numel))
    return _Call(_Global("torch._utils", "_rebuild_tensor_v3"),
                 (storage, 0, shape, stride, False, hooks, _Global("torch", torch_name)))


def data_pkl(entries: list[tuple[str, str, tuple[int, ...]]],
             aliases: dict[str, str] | None = None) -> bytes:
    """The ``data.pkl`` of an ``OrderedDict`` state dict.

    Args:
        entries: ``(name, dtype code, shape)``; storage ``i`` is ``data/i``.
        aliases: ``{alias: name}``: extra keys that share a listed tensor's storage (tied
            weights), as torch.save writes them.

    Returns:
        The pickle bytes (protocol 2).
    """
    sd: OrderedDict[str, Any] = OrderedDict()
    calls: dict[str, _Call] = {}
    for i, (name, code, shape) in enumerate(entries):
        numel = 1
        for d in shape:
            numel *= d
        calls[name] = sd[name] = _tensor_call(str(i), code, shape, numel)
    for alias, target in (aliases or {}).items():
        sd[alias] = calls[target]
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(sd)
    return buf.getvalue()


def tensor_pkl(code: str, shape: tuple[int, ...]) -> bytes:
    """The ``data.pkl`` of ``torch.save(tensor)`` of one contiguous tensor owning its storage
    (``data/0``), as torch's pickler writes it (protocol 2).

    Args:
        code: The dtype code.
        shape: The tensor's shape.

    Returns:
        The pickle bytes.
    """
    numel = 1
    for d in shape:
        numel *= d
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(_tensor_call("0", code, shape, numel))
    return buf.getvalue()


class TorchZipWriter:
    """Writes one torch.save zip, streaming each storage record.

    Args:
        f: The output file, opened for binary writing.
        entries: ``(name, dtype code, shape)``; the i-th tensor's bytes go to ``data/i``.
        aliases: Tied names, see :func:`data_pkl`.
        serialization_id: The archive's ``.data/serialization_id`` (40 digits); None draws
            one at random, as torch does.
    """

    def __init__(self, f: BinaryIO, entries: list[tuple[str, str, tuple[int, ...]]],
                 aliases: dict[str, str] | None = None, *, serialization_id: str | None = None):
        self.f = f
        self.serialization_id = serialization_id or str(uuid.uuid4().int)[:40]
        self.entries = entries
        self.zf = zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._next = 0
        self._put(f"{ARCHIVE}data.pkl", data_pkl(entries, aliases))
        self._put(f"{ARCHIVE}.format_version", b"1")
        self._put(f"{ARCHIVE}.storage_alignment", b"64")
        self._put(f"{ARCHIVE}byteorder", b"little")

    def _open(self, name: str, size: int) -> Any:
        info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = size
        # zipfile adds a 20-byte ZIP64 extra to the local header under this condition
        # (ZipFile._open_to_write); the padding below must account for it.
        zip64 = size * 1.05 > zipfile.ZIP64_LIMIT
        # Pad the local header's extra field so the payload starts on a 64-byte boundary,
        # as torch does (mmap loads slice storages straight out of the file).
        base = self.f.tell() + 30 + len(name.encode()) + (20 if zip64 else 0) + 4
        pad = -base % _ALIGN
        info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        return self.zf.open(info, "w", force_zip64=zip64)

    def _put(self, name: str, data: bytes) -> None:
        with self._open(name, len(data)) as out:
            out.write(data)

    def write_tensor(self, data: memoryview) -> None:
        """Write the next tensor's record.

        Args:
            data: The tensor's bytes (a flat byte view).
        """
        with self.tensor_record(len(data)) as out:
            out.write(data)

    def tensor_record(self, size: int) -> Any:
        """Open the next tensor's record, to write its ``size`` bytes in pieces.

        Args:
            size: The tensor's size in bytes (the record's header states it up front).

        Returns:
            A writable file object; close it (``with``) after the last piece.
        """
        i = self._next
        self._next += 1
        return self._open(f"{ARCHIVE}data/{i}", size)

    def close(self) -> None:
        """Write the trailing records and the central directory."""
        if self._next != len(self.entries):
            raise ValueError(f"wrote {self._next} of {len(self.entries)} tensors")
        self._put(f"{ARCHIVE}version", b"3\n")
        self._put(f"{ARCHIVE}.data/serialization_id", self.serialization_id.encode())
        self.zf.close()

    def abandon(self) -> None:
        """Give up on an archive the caller discards: write nothing more, not even on
        garbage collection (ZipFile would try to finish a file that is already closed)."""
        self.zf.fp = None
