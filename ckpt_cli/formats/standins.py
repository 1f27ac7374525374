"""What the safe unpickler (:mod:`ckpt_cli.formats.unpickler`) hands a pickle for each name it
asks for: the exact names allowed (:data:`_ALLOWED`, judged by :func:`classify_global`), each
mapped to one of ckpt's own stand-ins that builds an inert record (:class:`TensorRecord`,
:class:`StorageRecord`, dtypes, sizes, plain containers), and :class:`Opaque`, what every
other name becomes: a class that only records what the pickle does with it. Nothing here
imports or calls anything a checkpoint names; a stand-in asked to change (BUILD onto a
global) records the attempt in the unpickler loading on this thread (:data:`_ACTIVE`).
"""

from __future__ import annotations

import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ckpt_cli import dtypes
from ckpt_cli.formats import allowlist


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
        # (reported as a TorchScript archive); a Python unpickler cannot import them. Only
        # the shape TorchScript gives torch's own classes (``__torch__.torch.nn...``,
        # ``__torch__.torch.classes...``) is a stand-in; ``__torch__.os.system`` and every
        # other name is judged by what follows the prefix, and refused.
        rest = qualname.removeprefix("__torch__.")
        if allowlist.is_dangerous(rest):
            return "dangerous"
        return "torchscript" if rest.startswith(_TORCHSCRIPT_STANDINS) else "unknown"
    return "dangerous" if allowlist.is_dangerous(qualname, dotted=dotted) else "unknown"


_TORCHSCRIPT_STANDINS = ("torch.nn.", "torch.classes.", "torch.ao.", "torch.jit.")
"""What a TorchScript class name may say after ``__torch__.`` to stand for a class of torch
itself (a scripted ``torch.nn.Linear`` is ``__torch__.torch.nn.modules.linear.Linear``)."""


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
