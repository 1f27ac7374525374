"""An allowlisting unpickler that never imports or calls anything from a checkpoint.

``pickle.Unpickler.find_class`` is the only way a pickle reaches a Python object by name
(GLOBAL, STACK_GLOBAL, INST, OBJ and the EXT opcodes all go through it). Ours never imports:

* torch's tensor-rebuild functions, storage classes, dtypes, ``torch.Size`` and a few plain
  containers map to ckpt's own stand-ins that build inert records (:class:`TensorRecord`);
* every other name becomes an :class:`Opaque` subclass made on the fly that only *records*
  what the pickle does with it (call arguments, state, items). Nothing of the named module is
  imported, nothing it names runs.

Every global seen is kept with a classification, so callers can report
"pickle references os.system; not executed".
"""

from __future__ import annotations

import _compat_pickle
import io
import mmap
import os
import pickle
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, overload

from ckpt_cli import dtypes, storage
from ckpt_cli.formats import allowlist

if TYPE_CHECKING:
    from ckpt_cli.storage import Handle


def classify_global(qualname: str, *, dotted: bool = False) -> str:
    """Classify a pickle global as ``allowed``, ``benign``, ``dangerous`` or ``unknown``.

    Only exact names are allowed (see :mod:`ckpt_cli.formats.allowlist`): a name under a
    familiar package, or an attribute path through one, is judged by what it names in full.

    Args:
        qualname: ``module.name`` as written in the pickle.
        dotted: Whether the name part was an attribute path (``GLOBAL 'torch' 'os.system'``).

    Returns:
        ``allowed`` for names ``torch.load(weights_only=True)`` accepts too, ``benign`` for the
        data types on ckpt's own allowlist, ``torchscript`` for TorchScript class types,
        ``dangerous`` for names known to run commands, import code or reach the file system,
        ``unknown`` for everything else (refused too).
    """
    if qualname.startswith("__builtin__."):  # Python 2 pickles name builtins so
        qualname = "builtins." + qualname.removeprefix("__builtin__.")
    if qualname in _ALLOWED_NAMES:
        return "allowed"
    if qualname in allowlist.DATA_TYPES:
        return "benign"
    if qualname.startswith("__torch__."):
        # TorchScript class types: torch.jit.load resolves them from the archive's code/
        # (reported as a TorchScript archive); a Python unpickler cannot import them.
        return "torchscript"
    return "dangerous" if allowlist.is_dangerous(qualname, dotted=dotted) else "unknown"


@dataclass(slots=True)
class StorageRecord:
    """A storage named by a persistent id: ``('storage', cls, key, location, numel)``."""

    key: str
    dtype: str
    location: str
    numel: int

    @property
    def nbytes(self) -> int:
        """Bytes of the storage."""
        return dtypes.nbytes_of(self.dtype, self.numel)


@dataclass(slots=True)
class TensorRecord:
    """An inert description of a tensor found in a pickle."""

    storage: StorageRecord | None
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool = False
    is_parameter: bool = False
    kind: str = "dense"
    parts: tuple[TensorRecord, ...] = ()  # a sparse tensor's index and value tensors


_ACTIVE = threading.local()  # the SafeUnpickler loading on this thread


def _built(name: str) -> None:
    """BUILD (or an attribute set) onto a global: a class, a function, a dtype.

    A real loader would change the global for the rest of the process (and a later GLOBAL
    could then fetch what was planted); torch.save never writes it. ckpt's stand-ins are
    never changed: the unpickler loading records the attempt (reported as an error naming
    the global) and goes on, so the globals after it are named too.

    Raises:
        pickle.UnpicklingError: Outside a load (nothing to record it in).
    """
    loading = getattr(_ACTIVE, "unpickler", None)
    if loading is None:
        raise pickle.UnpicklingError(f"the global {name} cannot be modified")
    loading.builds.add(name)


@dataclass(frozen=True, slots=True)
class DTypeRef:
    """A ``torch.<dtype>`` global."""

    code: str | None
    name: str

    def __setstate__(self, state: Any) -> None:
        _built(f"torch.{self.name}")


@dataclass(frozen=True, slots=True)
class StorageType:
    """A ``torch.<X>Storage`` class global (immutable: dataclass's own ``__setstate__``
    would let a BUILD opcode change the stand-in every later file shares)."""

    dtype: str
    name: str

    def __setstate__(self, state: Any) -> None:
        _built(f"torch.{self.name}")


class _GuardedSetState:
    """``__setstate__`` of :class:`Opaque`: BUILD on an instance records its state; BUILD on
    the stand-in class itself (the global) is recorded as an attempt to modify it."""

    def __get__(self, obj: Opaque | None, owner: type[Opaque]) -> Callable[[Any], None]:
        if obj is None:
            def modify(state: Any) -> None:
                _built(owner.qualname)
            return modify

        def record(state: Any) -> None:
            obj.state = state
        return record


class Opaque:
    """Base of the stand-ins for globals outside the allowlist. Records, never runs.

    Attributes:
        args: Positional arguments the pickle called it with (REDUCE/NEWOBJ).
        kwargs: Keyword arguments (NEWOBJ_EX).
        state: What BUILD set (``__setstate__``).
        items: What APPEND/APPENDS added.
        mapping: What SETITEMS added.
    """

    qualname: ClassVar[str] = "?"
    # The unpickler's set of globals called or instantiated (each stand-in class belongs to
    # one unpickler, so nothing about one file reaches another).
    calls: ClassVar[set[str]] = set()
    # ... and of those whose constructor (__init__) a real loader would run: REDUCE, INST and
    # OBJ with arguments, copyreg._reconstructor's base. NEWOBJ runs only __new__.
    inits: ClassVar[set[str]] = set()
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: Any
    items: list[Any]
    mapping: dict[Any, Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        # REDUCE, NEWOBJ, INST, OBJ and copyreg all come here: the real loader would run the
        # global's code (its __new__/__init__, or the function itself).
        cls.calls.add(cls.qualname)
        self = object.__new__(cls)
        self.args, self.kwargs, self.state = args, kwargs, None
        self.items, self.mapping = [], {}
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        type(self).inits.add(self.qualname)

    __setstate__ = _GuardedSetState()

    def append(self, item: Any) -> None:  # APPEND on a non-list
        self.items.append(item)

    def extend(self, items: Any) -> None:  # APPENDS on a non-list
        self.items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEMS on a non-dict
        self.mapping[key] = value

    def __repr__(self) -> str:
        return f"<{self.qualname}>"

    def fields(self) -> dict[str, Any]:
        """The object's data as a dict: BUILD state, SETITEMS entries, or nothing."""
        st = self.state
        if isinstance(st, tuple) and len(st) == 2 and isinstance(st[1], dict):
            # (dict_state, slots_state) as pickled for classes with __slots__.
            merged = dict(st[0] or {}) if isinstance(st[0], dict) else {}
            merged.update(st[1])
            return merged
        if isinstance(st, dict):
            return dict(st)
        return dict(self.mapping)


def _size(*args: Any) -> tuple[int, ...]:
    return tuple(args[0]) if args else ()


def _rebuild_tensor(storage: Any, storage_offset: int, size: Any, stride: Any, *rest: Any,
                    dtype: str | None = None) -> TensorRecord:
    requires_grad = bool(rest[0]) if rest else False
    if isinstance(storage, StorageRecord):
        code = dtype or storage.dtype
        return TensorRecord(storage, int(storage_offset), tuple(size), tuple(stride), code,
                            requires_grad)
    return TensorRecord(None, 0, tuple(size), tuple(stride or ()), dtype or "U8", requires_grad,
                        kind="unresolved")


def _rebuild_tensor_v2(storage: Any, storage_offset: int, size: Any, stride: Any,
                       *rest: Any) -> TensorRecord:
    return _rebuild_tensor(storage, storage_offset, size, stride, *rest)


def _rebuild_tensor_v3(storage: Any, storage_offset: int, size: Any, stride: Any,
                       requires_grad: Any, hooks: Any, dtype: Any, *rest: Any) -> TensorRecord:
    # A dtype ckpt does not know must not pass for bytes: the record names it, and the
    # reader reports an unknown dtype instead of describing the tensor wrongly.
    code = dtype.code if isinstance(dtype, DTypeRef) else None
    named = dtype.name if isinstance(dtype, DTypeRef) else getattr(dtype, "qualname", "?")
    return _rebuild_tensor(storage, storage_offset, size, stride, requires_grad,
                           dtype=code or f"?{named}")


def _rebuild_parameter(data: Any, requires_grad: Any = False, *rest: Any) -> Any:
    if isinstance(data, TensorRecord):
        data.is_parameter = True
        data.requires_grad = bool(requires_grad)
    return data


class TensorType:
    """``torch.Tensor`` or ``torch.nn.Parameter`` named in a pickle: a marker, not callable.

    torch pickles a tensor that carries Python attributes (DeepSpeed's optimizer state does)
    as ``_rebuild_from_type_v2(rebuild, torch.Tensor, args, attributes)``; the class is only
    an argument there. A pickle that tries to call it fails to unpickle.
    """

    __slots__ = ("name",)
    name: str

    def __init__(self, name: str):
        object.__setattr__(self, "name", name)

    def __setattr__(self, name: str, value: Any) -> None:
        _built(self.name)

    def __setstate__(self, state: Any) -> None:
        _built(self.name)

    def __repr__(self) -> str:
        return self.name


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    # func is one of our stand-ins (or an Opaque class); new_type is only recorded.
    out = func(*args)
    if isinstance(out, TensorRecord) and isinstance(new_type, TensorType) and (
            new_type.name.endswith("Parameter")):
        out.is_parameter = True
    return out


def _rebuild_meta(dtype: Any, size: Any, stride: Any, requires_grad: Any = False,
                  *rest: Any) -> TensorRecord:
    code = dtype.code if isinstance(dtype, DTypeRef) and dtype.code else "U8"
    return TensorRecord(None, 0, tuple(size), tuple(stride), code, bool(requires_grad),
                        kind="meta")


def _rebuild_qtensor(storage: Any, storage_offset: Any, size: Any, stride: Any,
                     *rest: Any) -> TensorRecord:
    # Quantized: integer values in a storage, plus a quantizer (scale, zero point) in `rest`.
    if isinstance(storage, StorageRecord) and isinstance(size, tuple | list):
        quantizer = rest[0] if rest and isinstance(rest[0], tuple | list) else ()
        return TensorRecord(storage, storage_offset if isinstance(storage_offset, int) else 0,
                            tuple(size), tuple(stride) if isinstance(stride, tuple | list)
                            else (), storage.dtype, kind="quantized",
                            parts=tuple(x for x in quantizer if isinstance(x, TensorRecord)))
    return _other_tensor("quantized")(storage, storage_offset, size, stride, *rest)


def _rebuild_sparse(layout: Any, data: Any, *rest: Any) -> TensorRecord:
    # COO: (indices, values, size[, is_coalesced]); CSR/CSC/BSR/BSC: (compressed indices,
    # plain indices, values, size). The shape is the size, the dtype the values'.
    items = tuple(data) if isinstance(data, tuple | list) else ()
    parts = tuple(x for x in items if isinstance(x, TensorRecord))
    size = next((tuple(x) for x in items if isinstance(x, tuple | list)
                 and all(isinstance(d, int) for d in x)), ())
    return TensorRecord(None, 0, size, (), parts[-1].dtype if parts else "U8", kind="sparse",
                        parts=parts)


def _other_tensor(kind: str) -> Callable[..., TensorRecord]:
    def rebuild(*args: Any) -> TensorRecord:
        # Quantized, sparse, nested and subclass tensors: described by kind, data not decoded.
        storage = next((a for a in args if isinstance(a, StorageRecord)), None)
        return TensorRecord(storage, 0, (), (), storage.dtype if storage else "U8", kind=kind)
    return rebuild


def _codecs_encode(obj: Any, encoding: str = "utf-8") -> bytes:
    # Protocol 2 pickles bytes as _codecs.encode(str, 'latin1'); only text encodings allowed.
    if not isinstance(obj, str) or encoding.lower() not in {"latin1", "latin-1", "utf-8", "utf8",
                                                             "ascii", "iso-8859-1"}:
        raise pickle.UnpicklingError("_codecs.encode with unexpected arguments")
    return obj.encode(encoding)


def _ordered_dict(*args: Any) -> OrderedDict[Any, Any]:
    return OrderedDict(*args[:1])


def _set(*args: Any) -> set[Any]:
    return set(*args[:1])


def _frozenset(*args: Any) -> frozenset[Any]:
    return frozenset(*args[:1])


def _complex(*args: Any) -> complex:
    return complex(*args[:2])


def _bytearray(*args: Any) -> bytearray:
    # Pickles write bytearray(str, 'latin-1'); bytearray(10**12) would allocate a terabyte.
    if len(args) == 2 and isinstance(args[0], str) and isinstance(args[1], str):
        return bytearray(_codecs_encode(args[0], args[1]))
    if len(args) == 1 and isinstance(args[0], (bytes, bytearray)):
        return bytearray(args[0])
    raise pickle.UnpicklingError("bytearray with unexpected arguments")


def _device(*args: Any) -> str:
    return ":".join(str(a) for a in args)


def _layout(name: Any = "") -> str:
    return str(name)


def _reconstructor(cls: Any, base: Any = None, state: Any = None) -> Any:
    # copyreg._reconstructor(cls, base, state) is base.__new__(cls, state), then
    # base.__init__(obj, state) unless base is object: only ever our own stand-ins.
    if isinstance(cls, type) and issubclass(cls, Opaque):
        obj = cls.__new__(cls)
        if isinstance(base, type) and issubclass(base, Opaque) and (
                base.qualname != "builtins.object"):
            base.inits.add(base.qualname)
        return obj
    raise pickle.UnpicklingError("copyreg._reconstructor on a non-stand-in class")


class _StandIn:
    """An allowlisted callable as the pickle sees it: callable, but immutable.

    BUILD on a plain function would set attributes on ckpt's own code (``__defaults__``...),
    changing how every later file is read; this wrapper refuses any state.
    """

    __slots__ = ("_fn", "_name")
    _fn: Callable[..., Any]
    _name: str

    def __init__(self, fn: Callable[..., Any], name: str):
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_name", name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        _built(self._name)

    def __setstate__(self, state: Any) -> None:
        _built(self._name)


_ALLOWED: dict[str, Any] = {
    "torch._utils._rebuild_tensor": _rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "torch._tensor._rebuild_from_type": _rebuild_from_type_v2,
    "torch._utils._rebuild_meta_tensor_no_storage": _rebuild_meta,
    "torch._utils._rebuild_qtensor": _rebuild_qtensor,
    "torch._utils._rebuild_sparse_tensor": _rebuild_sparse,
    "torch._utils._rebuild_nested_tensor": _other_tensor("nested"),
    "torch._utils._rebuild_wrapper_subclass": _other_tensor("subclass"),
    "torch._utils._rebuild_device_tensor_from_numpy": _other_tensor("numpy"),
    "torch._utils._rebuild_device_tensor_from_cpu_tensor": _other_tensor("device"),
    "torch.Size": _size,
    "torch.device": _device,
    "torch.serialization._get_layout": _layout,
    # Quantization schemes: names in a quantized tensor's quantizer parameters.
    **{f"torch.{q}": q for q in ("per_tensor_affine", "per_channel_affine",
                                 "per_tensor_symmetric", "per_channel_symmetric",
                                 "per_channel_affine_float_qparams")},
    "collections.OrderedDict": _ordered_dict,
    "_codecs.encode": _codecs_encode,
    "builtins.set": _set,
    "builtins.frozenset": _frozenset,
    "builtins.complex": _complex,
    "builtins.bytearray": _bytearray,
    "__builtin__.set": _set,
    "copyreg._reconstructor": _reconstructor,
    "copy_reg._reconstructor": _reconstructor,
}
for _cls, _code in dtypes.STORAGE_CLASSES.items():
    _ALLOWED[f"torch.{_cls}"] = StorageType(_code, _cls)
    _ALLOWED[f"torch.storage.{_cls}"] = StorageType(_code, _cls)
_ALLOWED["torch.storage.TypedStorage"] = StorageType("U8", "TypedStorage")
for _tt in ("torch.Tensor", "torch.nn.parameter.Parameter"):
    _ALLOWED[_tt] = TensorType(_tt)
for _d in dtypes.DTYPES.values():
    if _d.torch_name:
        _ALLOWED[f"torch.{_d.torch_name}"] = DTypeRef(_d.code, _d.torch_name)
for _layout_name in ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr",
                     "sparse_bsc", "_mkldnn", "jagged", "contiguous_format", "channels_last",
                     "channels_last_3d", "preserve_format"):
    _ALLOWED[f"torch.{_layout_name}"] = _layout_name
_ALLOWED = {k: _StandIn(v, k) if callable(v) and not isinstance(v, (StorageType, DTypeRef,
                                                                    TensorType))
            else v for k, v in _ALLOWED.items()}
# What torch.load(weights_only=True) accepts as well; copyreg is ours only (we never call cls).
_ALLOWED_NAMES = frozenset(_ALLOWED) - {"copyreg._reconstructor", "copy_reg._reconstructor"}


@dataclass(slots=True)
class PickleResult:
    """What a pickle held.

    Attributes:
        obj: The unpickled tree: plain containers, :class:`TensorRecord` and :class:`Opaque`.
        globals: Every global referenced, with its classification.
        storages: Every storage persistent id, by key.
        sources: For globals merged in from another pickle of the same file (a legacy
            stream's sys_info, a zip's ``constants.pkl``), which one.
        calls: The globals outside ckpt's stand-ins that the pickle calls or instantiates.
        builds: The globals the pickle tries to modify (BUILD onto a class or function).
        inits: The classes whose constructor a real loader would run (REDUCE, INST, OBJ).
    """

    obj: Any
    globals: dict[str, str] = field(default_factory=dict)
    storages: dict[str, StorageRecord] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    calls: set[str] = field(default_factory=set)
    builds: set[str] = field(default_factory=set)
    inits: set[str] = field(default_factory=set)


class SafeUnpickler(pickle.Unpickler):
    """Unpickles without importing or running anything (see the module docstring).

    Args:
        file: A binary file object positioned at the pickle.
        extra: More names mapped to ckpt's own stand-ins (e.g. DCP's metadata classes).
        persistent: Replaces the torch-zip ``persistent_load`` (legacy storage ids).
    """

    def __init__(self, file: io.BufferedIOBase | io.BytesIO, extra: dict[str, Any] | None = None,
                 persistent: Callable[[Any], Any] | None = None):
        super().__init__(file)
        self._persistent = persistent
        self.globals: dict[str, str] = {}
        self.calls: set[str] = set()
        self.inits: set[str] = set()
        self.builds: set[str] = set()
        self.storages: dict[str, StorageRecord] = {}
        self._extra = extra or {}
        self._opaque: dict[str, type[Opaque]] = {}

    def load(self) -> Any:
        """Unpickle (see :class:`pickle.Unpickler`), recording BUILDs onto globals."""
        outer = getattr(_ACTIVE, "unpickler", None)
        _ACTIVE.unpickler = self
        try:
            return super().load()
        finally:
            _ACTIVE.unpickler = outer

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 names, mapped as pickle.load maps them (fix_imports): __builtin__ is
        # builtins, cPickle is pickle, copy_reg is copyreg...
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        qual = f"{module}.{name}"
        if qual in self._extra:
            self.globals[qual] = "allowed"
            return self._extra[qual]
        # A dotted name is an attribute path the real loader follows from the module
        # (``GLOBAL 'torch' 'os.system'`` is os.system): judged by the whole path.
        self.globals[qual] = classify_global(qual, dotted="." in name)
        if qual in _ALLOWED:
            return _ALLOWED[qual]
        cls = self._opaque.get(qual)
        if cls is None:
            cls = type(name if name.isidentifier() else "Opaque", (Opaque,),
                       {"qualname": qual, "calls": self.calls, "inits": self.inits})
            self._opaque[qual] = cls
        return cls

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is not None:
            return self._persistent(pid)
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {str(pid)[:80]!r}")
        stype, key, location, numel = pid[1], str(pid[2]), str(pid[3]), pid[4]
        if not isinstance(stype, StorageType) or not isinstance(numel, int) or numel < 0:
            raise pickle.UnpicklingError(f"malformed storage id for key {key!r}")
        rec = self.storages.get(key)
        if rec is None:
            rec = StorageRecord(key, stype.dtype, location, numel)
            self.storages[key] = rec
        return rec


# Opcodes followed by a length and that many bytes: (name, width of the length, signed).
# The C unpickler allocates the length it reads before it reads the bytes (BINBYTES8 of a
# terabyte is a MemoryError; a few gigabytes are allocated for a 100-byte file).
_COUNTED: dict[int, tuple[str, int, bool]] = {
    ord(k): v for k, v in {
        "U": ("SHORT_BINSTRING", 1, False), "T": ("BINSTRING", 4, True),
        "C": ("SHORT_BINBYTES", 1, False), "B": ("BINBYTES", 4, False),
        "\x8e": ("BINBYTES8", 8, False), "\x96": ("BYTEARRAY8", 8, False),
        "\x8c": ("SHORT_BINUNICODE", 1, False), "X": ("BINUNICODE", 4, False),
        "\x8d": ("BINUNICODE8", 8, False), "\x8a": ("LONG1", 1, False),
        "\x8b": ("LONG4", 4, True),
    }.items()}
# Opcodes with a fixed-size argument, by its size (FRAME's is a length, checked as such).
_FIXED: dict[int, int] = {ord(k): n for k, n in {
    "J": 4, "K": 1, "M": 2, "G": 8, "h": 1, "j": 4, "q": 1, "r": 4, "\x82": 1, "\x83": 2,
    "\x84": 4, "\x80": 1, "\x95": 8}.items()}
# Opcodes whose argument is one or two newline-terminated lines.
_LINES: dict[int, int] = {ord(k): n for k, n in {
    "I": 1, "L": 1, "F": 1, "S": 1, "V": 1, "g": 1, "p": 1, "P": 1, "c": 2, "i": 2}.items()}
_NO_ARG = frozenset(b"N\x88\x89]aelt)\x85\x86\x87}dsu\x8f\x90\x91012(\x94\x93Rbo\x81\x92Q"
                    b"\x97\x98.")
_STOP, _FRAME, _PUT, _LONG_BINPUT = ord("."), 0x95, ord("p"), ord("r")
# The walk's fast path, by opcode: the argument's size for opcodes that need no check, -1
# for those with a one-byte length, -3 for LONG_BINPUT, -2 for the rest (STOP, longer
# lengths, FRAME, lines, unknown opcodes).
_SKIP = [-2] * 256
for _op in _NO_ARG - {_STOP}:
    _SKIP[_op] = 0
for _op, _n in _FIXED.items():
    if _op not in (_FRAME, _LONG_BINPUT):
        _SKIP[_op] = _n
for _op, (_name, _n, _signed) in _COUNTED.items():
    if _n == 1:
        _SKIP[_op] = -1
_SKIP[_LONG_BINPUT] = -3  # as common as BINGET in torch's pickles


class PickleLengthError(pickle.UnpicklingError):
    """What :func:`check_lengths` refused, and at which byte (the opcode's offset)."""

    def __init__(self, message: str, at: int):
        super().__init__(message)
        self.at = at


class _PreadView:
    """Read-only ``bytes``-like access to a file through ``os.pread``, a block at a time: what
    :func:`check_lengths` needs (``len``, an index, a slice, ``find``) without mapping the
    file."""

    _BLOCK = 1 << 20

    def __init__(self, fd: Handle, size: int):
        self._fd, self._size = fd, size
        self._at, self._block = -1, b""

    def __len__(self) -> int:
        return self._size

    def _load(self, pos: int) -> None:
        at = pos - pos % self._BLOCK
        if at != self._at:
            self._block, self._at = storage.pread(self._fd, self._BLOCK, at), at

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> bytes: ...

    def __getitem__(self, i: int | slice) -> int | bytes:
        if isinstance(i, slice):
            lo, hi = i.start or 0, min(i.stop if i.stop is not None else self._size, self._size)
            return storage.pread(self._fd, max(hi - lo, 0), lo)
        self._load(i)
        return self._block[i - self._at]

    def find(self, sub: bytes, start: int) -> int:
        pos = start
        while pos < self._size:
            self._load(pos)
            hit = self._block.find(sub, pos - self._at)
            if hit >= 0:
                return self._at + hit
            pos = self._at + len(self._block)
            if not self._block:
                break
        return -1


def check_lengths(buf: bytes | mmap.mmap | _PreadView, start: int = 0) -> int:
    """Walk the opcodes of the pickle at ``buf[start:]`` without building anything, and
    check every length it declares against the bytes that remain after it.

    ``pickle``'s C unpickler allocates a BINBYTES8, BINUNICODE8, BYTEARRAY8, LONG4, FRAME...
    payload (and grows its memo to a LONG_BINPUT index) before it learns that the bytes are
    not there; a crafted length of terabytes would end in a late ``MemoryError`` or exhaust
    memory. Payloads are skipped by index arithmetic, never copied.

    Args:
        buf: The bytes holding the pickle (bytes, or an mmap of a file); they may continue
            past its STOP (a legacy torch stream, tensor bytes).
        start: Where the pickle starts.

    Returns:
        The offset just past the pickle's STOP opcode.

    Raises:
        PickleLengthError: A length larger than what remains, a crafted memo index, an
            unknown opcode, or no STOP before the end.
    """
    end, pos, ops, skip = len(buf), start, 0, _SKIP
    while pos < end:
        op = buf[pos]
        ops += 1
        n = skip[op]
        if n >= 0:  # most opcodes: skip the fixed-size argument
            pos += n + 1
            continue
        if n == -1:  # SHORT_BINUNICODE and the like: a length of at most 255
            if pos + 1 >= end:
                break
            n = buf[pos + 1]
            if pos + 2 + n > end:
                raise PickleLengthError(_too_long(_COUNTED[op][0], pos, n, end - pos - 2), pos)
            pos += n + 2
            continue
        if n == -3:
            if pos + 5 > end:
                break
            _check_memo(int.from_bytes(buf[pos + 1:pos + 5], "little"), pos, ops)
            pos += 5
            continue
        at, pos = pos, pos + 1
        if op == _STOP:
            return pos
        counted = _COUNTED.get(op)
        if counted is not None:
            name, size, signed = counted
            if pos + size > end:
                break
            n = int.from_bytes(buf[pos:pos + size], "little", signed=signed)
            pos += size
            if n < 0 or n > end - pos:
                raise PickleLengthError(_too_long(name, at, n, end - pos), at)
            pos += n
            continue
        width = _FIXED.get(op)
        if width is not None:
            if pos + width > end:
                break
            if op == _FRAME:  # the frame's opcodes follow; only its length is checked
                n = int.from_bytes(buf[pos:pos + 8], "little")
                if n > end - pos - 8:
                    raise PickleLengthError(_too_long("FRAME", at, n, end - pos - 8), at)
            pos += width
            continue
        lines = _LINES.get(op)
        if lines is None:
            raise PickleLengthError(f"unknown opcode {op:#04x} at byte {at:,}", at)
        for _ in range(lines):
            nl = buf.find(b"\n", pos)
            if nl < 0:
                pos = end
                break
            if op == _PUT:
                text = bytes(buf[pos:nl]).strip()
                if text.isdigit():
                    _check_memo(int(text), at, ops)
            pos = nl + 1
    raise PickleLengthError(f"pickle data was truncated (no STOP after byte {start:,})", end)


def _too_long(name: str, at: int, n: int, left: int) -> str:
    return f"{name} at byte {at:,} declares {n:,} bytes but only {max(left, 0):,} remain"


def _check_memo(index: int, at: int, ops: int) -> None:
    # A pickler numbers memo entries from 0, one per object already built: an index past
    # the opcodes read so far is crafted (the C unpickler would size its memo by it).
    if index >= ops:
        raise PickleLengthError(f"memo index {index:,} at byte {at:,} exceeds the "
                                f"{ops:,} opcodes up to it", at)


def safe_load(data: bytes | io.BufferedIOBase, extra: dict[str, Any] | None = None,
              persistent: Callable[[Any], Any] | None = None) -> PickleResult:
    """Unpickle ``data`` safely.

    Every length field is checked against the bytes that remain (:func:`check_lengths`)
    before the unpickler allocates anything.

    Args:
        data: The pickle bytes, or a binary file positioned at it (left just past the
            pickle's STOP).
        extra: Extra stand-ins by qualified name.
        persistent: Replaces the default ``persistent_load`` (torch storage ids).

    Returns:
        The :class:`PickleResult`.

    Raises:
        pickle.UnpicklingError: Malformed pickle (also EOFError, ValueError and the like, which
            callers turn into :class:`ckpt_cli.errors.CorruptCheckpointError`).
    """
    up = unpickler_for(data, extra, persistent)
    obj = up.load()
    return PickleResult(obj, up.globals, up.storages, calls=up.calls, builds=up.builds,
                        inits=up.inits)


def unpickler_for(data: bytes | io.BufferedIOBase, extra: dict[str, Any] | None = None,
                  persistent: Callable[[Any], Any] | None = None) -> SafeUnpickler:
    """A :class:`SafeUnpickler` for ``data`` whose lengths were checked (see :func:`safe_load`).

    Its ``globals`` holds what it saw even when ``load`` fails part-way, which
    :func:`safe_load` loses.

    Args:
        data: The pickle bytes, or a binary file positioned at it.
        extra: Extra stand-ins by qualified name.
        persistent: Replaces the default ``persistent_load``.

    Returns:
        The unpickler, positioned at the pickle.

    Raises:
        pickle.UnpicklingError: A declared length larger than what remains, and the like.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data) if not isinstance(data, bytes) else data
        check_lengths(raw)
        return SafeUnpickler(io.BytesIO(raw), extra, persistent)
    f = data
    if isinstance(f, io.BytesIO):
        check_lengths(f.getvalue(), f.tell())
        return SafeUnpickler(f, extra, persistent)
    window = getattr(f, "raw", None)
    if isinstance(window, storage.Window) and window.start == 0:
        # An object on a store: the walk reads through ranged reads, not the whole object.
        check_lengths(_PreadView(window.fd, window.length), f.tell())
        return SafeUnpickler(f, extra, persistent)
    try:
        fileno = f.fileno()
    except (OSError, AttributeError, io.UnsupportedOperation):
        fileno = -1
    start = f.tell()
    size = os.fstat(fileno).st_size if fileno >= 0 else 0
    if size > 0:
        # An mmap: the walk reads only opcodes and length fields, never the payloads. Mapping
        # a multi-GB file can fail under an address-space limit (ulimit -v on a login node):
        # then the same walk runs over positioned reads of the file.
        try:
            mm = mmap.mmap(fileno, 0, access=mmap.ACCESS_READ)
        except (OSError, MemoryError, OverflowError):
            check_lengths(_PreadView(fileno, size), start)
        else:
            with mm:
                check_lengths(mm, start)
        return SafeUnpickler(f, extra, persistent)
    rest = f.read()
    check_lengths(rest)
    f.seek(start)
    return SafeUnpickler(f, extra, persistent)


def scan_globals(data: bytes) -> tuple[PickleResult, BaseException | None]:
    """The globals a pickle names, even one that does not parse to the end.

    A pickle that fails part-way (or declares an impossible length) still ran what it
    reached under ``pickle.load``: everything before the failure is unpickled safely and its
    globals kept.

    Args:
        data: The pickle bytes.

    Returns:
        ``(what it held (``obj`` None when it stopped early), the error that stopped it or
        None)``: globals and calls hold what was seen up to the error.
    """
    error: BaseException | None = None
    try:
        check_lengths(data)
    except PickleLengthError as e:
        error, data = e, data[:e.at]  # the opcodes before it passed the checks
    up = SafeUnpickler(io.BytesIO(data))
    obj = None
    try:
        obj = up.load()
    except UNPICKLE_ERRORS as e:
        error = error or e
    return PickleResult(obj, up.globals, up.storages, calls=up.calls,
                        builds=up.builds, inits=up.inits), error


UNPICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError,
                   IndexError, AttributeError, OverflowError, MemoryError, RecursionError,
                   UnicodeDecodeError, struct.error)
"""Exceptions a malformed pickle can raise from :func:`safe_load`."""


# Opcodes a protocol 0 or 1 pickle can start with: a mark, a global or instance, an empty
# container, or a value.
_FIRST_OPCODES = frozenset(b"(c}])NILFSVKJMGUTXBCiP\x88\x89\x8a\x8b\x8c\x8d\x8e\x8f\x95\x96")


def looks_like_pickle(head: bytes) -> bool:
    """Whether bytes start like a pickle that ``pickle.load`` (and so ``torch.load``) reads.

    Protocols 2-5 open with PROTO; protocols 0 and 1 (the text protocol) have no header, so
    their opcodes are walked: a plausible first opcode, then no unknown opcode up to STOP or
    the end of ``head``.

    Args:
        head: The first bytes of a file or record (a few KiB).

    Returns:
        True for a pickle of any protocol.
    """
    if len(head) >= 2 and head[0] == 0x80:
        return head[1] <= pickle.HIGHEST_PROTOCOL
    if not head or head[0] not in _FIRST_OPCODES:
        return False
    try:
        check_lengths(head)
    except PickleLengthError as e:
        return e.at >= len(head) - 1 and "truncated" in str(e)  # only cut off by the head
    return True


def static_globals(data: bytes) -> dict[str, str]:
    """The globals a pickle names, found by reading its opcodes without running them.

    For messages about a pickle the unpickler stopped in (a stand-in that cannot do what the
    real object would, a crafted memo index): the real loader would have gone on, so every
    GLOBAL, INST and STACK_GLOBAL to the end is named. STACK_GLOBAL's names are the last two
    strings pushed (directly or from the memo), which is how picklers write them.

    Args:
        data: Pickle bytes (anything after the pickle's STOP is ignored).

    Returns:
        Each global found, with its classification.
    """
    import pickletools  # only for messages about refused pickles

    found: dict[str, str] = {}
    recent: list[Any] = []
    memo: dict[Any, Any] = {}
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            name = op.name
            if name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                qual = f"{module}.{attr}"
                found[qual] = classify_global(qual, dotted="." in attr)
            elif name == "STACK_GLOBAL" and len(recent) >= 2:
                module, attr = str(recent[-2]), str(recent[-1])
                qual = f"{module}.{attr}"
                found[qual] = classify_global(qual, dotted="." in attr)
            elif isinstance(arg, str) and name != "PROTO":
                recent.append(arg)
            elif name == "MEMOIZE" and recent:
                memo[len(memo)] = recent[-1]
            elif name in ("PUT", "BINPUT", "LONG_BINPUT") and recent:
                memo[arg] = recent[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET") and arg in memo:
                recent.append(memo[arg])
            del recent[:-4]
    except (ValueError, EOFError, UnicodeDecodeError, struct.error, KeyError):
        pass  # damaged past here: what was found so far
    return found


def scan_stream(data: bytes, limit: int = 64) -> PickleResult:
    """The globals of every pickle in ``data``, one after another.

    ``torch.load`` of a non-zip file reads a pickle and, if it is the legacy magic number,
    four more: a stand-in for an allowlisted type (``builtins.int(...)``) can make it that
    number where ckpt cannot tell, so every pickle up to the end of the bytes (or the first
    that does not parse, whose opcodes are then read statically) is scanned.

    Args:
        data: Bytes holding pickles back to back (and possibly other bytes after them).
        limit: How many pickles to read at most.

    Returns:
        A :class:`PickleResult` (``obj`` None) with the globals, calls and builds of all.
    """
    out = PickleResult(None)
    pos = 0
    for _ in range(limit):
        if pos >= len(data):
            break
        try:
            end: int | None = check_lengths(data, pos)
        except PickleLengthError:
            end = None
        found, error = scan_globals(data[pos:end])
        for qual, cls in found.globals.items():
            out.globals.setdefault(qual, cls)
        out.calls |= found.calls
        out.builds |= found.builds
        out.inits |= found.inits
        if error is not None or end is None:
            for qual, cls in static_globals(data[pos:]).items():
                out.globals.setdefault(qual, cls)
            break
        pos = end
    return out
