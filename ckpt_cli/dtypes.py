"""Canonical dtype codes and their torch, numpy and storage-class names.

ckpt names dtypes with the safetensors codes (``F32``, ``BF16``, ``F8_E4M3`` ...) plus ``C128``,
which safetensors lacks but torch writes. Nothing here imports torch; numpy and ml_dtypes are
imported only when an array dtype is asked for.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True, slots=True)
class DType:
    """One element type.

    Attributes:
        code: Canonical code, e.g. ``"BF16"``.
        bits: Bits per element (4 and 6 for the sub-byte float formats).
        kind: ``"float"``, ``"int"``, ``"uint"``, ``"bool"``, ``"complex"`` or ``"bits"``.
        torch_name: Attribute name in the ``torch`` module, or None if torch has none.
        numpy_name: Name in numpy or ml_dtypes, or None if neither has it.
    """

    code: str
    bits: int
    kind: str
    torch_name: str | None
    numpy_name: str | None

    @property
    def itemsize(self) -> int:
        """Bytes per element, rounded up (sub-byte types are packed in pairs)."""
        return max(1, self.bits // 8)

    @property
    def is_floating(self) -> bool:
        """True for real floating-point types (the ones casts and NaN checks apply to)."""
        return self.kind == "float"


_TABLE: tuple[DType, ...] = (
    DType("BOOL", 8, "bool", "bool", "bool"),
    DType("F4", 4, "float", "float4_e2m1fn_x2", None),
    DType("F6_E2M3", 6, "float", None, None),
    DType("F6_E3M2", 6, "float", None, None),
    DType("U8", 8, "uint", "uint8", "uint8"),
    DType("I8", 8, "int", "int8", "int8"),
    DType("F8_E5M2", 8, "float", "float8_e5m2", "float8_e5m2"),
    DType("F8_E4M3", 8, "float", "float8_e4m3fn", "float8_e4m3fn"),
    DType("F8_E8M0", 8, "float", "float8_e8m0fnu", "float8_e8m0fnu"),
    DType("F8_E4M3FNUZ", 8, "float", "float8_e4m3fnuz", "float8_e4m3fnuz"),
    DType("F8_E5M2FNUZ", 8, "float", "float8_e5m2fnuz", "float8_e5m2fnuz"),
    DType("I16", 16, "int", "int16", "int16"),
    DType("U16", 16, "uint", "uint16", "uint16"),
    DType("F16", 16, "float", "float16", "float16"),
    DType("BF16", 16, "float", "bfloat16", "bfloat16"),
    DType("I32", 32, "int", "int32", "int32"),
    DType("U32", 32, "uint", "uint32", "uint32"),
    DType("F32", 32, "float", "float32", "float32"),
    DType("C64", 64, "complex", "complex64", "complex64"),
    DType("F64", 64, "float", "float64", "float64"),
    DType("I64", 64, "int", "int64", "int64"),
    DType("U64", 64, "uint", "uint64", "uint64"),
    DType("C128", 128, "complex", "complex128", "complex128"),
    # torch-only types: half-precision complex, and raw bit containers. Described, compared
    # byte for byte, never cast; neither safetensors nor ckpt's torch writer holds them.
    DType("C32", 32, "complex", "complex32", None),
    DType("BITS8", 8, "bits", "bits8", None),
    DType("BITS16", 16, "bits", "bits16", None),
    DType("BITS1X8", 8, "bits", "bits1x8", None),
    DType("BITS2X4", 8, "bits", "bits2x4", None),
    DType("BITS4X2", 8, "bits", "bits4x2", None),
)

DTYPES: dict[str, DType] = {d.code: d for d in _TABLE}
"""Every known dtype by canonical code."""

_BY_TORCH: dict[str, DType] = {d.torch_name: d for d in _TABLE if d.torch_name}
# torch spells some dtypes two ways in its pickles and reprs.
_BY_TORCH.update({"float": DTYPES["F32"], "double": DTYPES["F64"], "half": DTYPES["F16"],
                  "long": DTYPES["I64"], "int": DTYPES["I32"], "short": DTYPES["I16"],
                  "cfloat": DTYPES["C64"], "cdouble": DTYPES["C128"], "chalf": DTYPES["C32"]})

# Legacy typed-storage classes that torch.save still names in its pickles.
STORAGE_CLASSES: dict[str, str] = {
    "FloatStorage": "F32", "DoubleStorage": "F64", "HalfStorage": "F16",
    "BFloat16Storage": "BF16", "LongStorage": "I64", "IntStorage": "I32",
    "ShortStorage": "I16", "CharStorage": "I8", "ByteStorage": "U8", "BoolStorage": "BOOL",
    "ComplexFloatStorage": "C64", "ComplexDoubleStorage": "C128",
    "QInt8Storage": "I8", "QUInt8Storage": "U8", "QInt32Storage": "I32",
    "QUInt4x2Storage": "U8", "QUInt2x4Storage": "U8",
    # UntypedStorage counts bytes; the real dtype comes from _rebuild_tensor_v3.
    "UntypedStorage": "U8",
}


def get(code: str) -> DType:
    """Look up a canonical dtype code.

    Args:
        code: A canonical code such as ``"F32"``.

    Returns:
        The :class:`DType`.

    Raises:
        KeyError: If the code is unknown.
    """
    return DTYPES[code]


def from_torch_name(name: str) -> DType | None:
    """Map a torch dtype name (``"float32"``, ``"torch.bfloat16"``) to a :class:`DType`.

    Args:
        name: The dtype's attribute name, with or without the ``torch.`` prefix.

    Returns:
        The :class:`DType`, or None when ckpt does not know it.
    """
    return _BY_TORCH.get(name.removeprefix("torch."))


def nbytes_of(code: str, numel: int) -> int:
    """Bytes that ``numel`` packed elements of ``code`` take (sub-byte types round up).

    Args:
        code: Canonical dtype code.
        numel: Number of logical elements.

    Returns:
        The byte count.
    """
    bits = DTYPES[code].bits
    return (numel * bits + 7) // 8


@functools.cache
def numpy_dtype(code: str) -> np.dtype[Any]:
    """The numpy dtype for a code, using ml_dtypes for BF16 and the FP8 types.

    Args:
        code: Canonical dtype code.

    Returns:
        A numpy dtype whose itemsize equals the code's.

    Raises:
        KeyError: If numpy cannot represent the code (F4, F6).
    """
    import numpy as np  # heavy: numpy

    name = DTYPES[code].numpy_name
    if name is None:
        raise KeyError(code)
    if hasattr(np, name):
        return np.dtype(name)
    import ml_dtypes  # heavy: ml_dtypes

    out: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
    return out


def torch_dtype(code: str) -> Any:
    """The torch dtype for a code (imports torch).

    Args:
        code: Canonical dtype code.

    Returns:
        A ``torch.dtype``.

    Raises:
        KeyError: If torch has no such dtype.
    """
    import torch  # heavy: torch

    name = DTYPES[code].torch_name
    if name is None or not hasattr(torch, name):
        raise KeyError(code)
    return getattr(torch, name)


MAX_ELEMENTS = 2**63 - 1
"""The most elements (and the largest dimension, and the most bytes) a tensor may declare:
what torch's signed 64-bit sizes hold."""
MAX_DIMS = 64
"""The most dimensions a tensor may declare (torch refuses more)."""


def to_torch(arr: Any, code: str) -> Any:
    """A torch tensor sharing ``arr``'s bytes, of dtype ``code`` (imports torch): BF16 and FP8
    (ml_dtypes in numpy) travel as same-size integers, then are viewed; a 0-d array stays
    0-d (``np.ascontiguousarray`` would make it 1-d).

    Args:
        arr: A numpy array of ``code``'s values.
        code: Canonical dtype code.

    Returns:
        A ``torch.Tensor`` of ``arr``'s shape.
    """
    import numpy as np  # heavy: numpy
    import torch  # heavy: torch

    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    if arr.dtype.kind == "V":
        ints = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[arr.dtype.itemsize]
        return torch.from_numpy(arr.view(ints)).view(torch_dtype(code))
    return torch.from_numpy(arr)


def shape_problem(shape: tuple[int, ...] | list[int]) -> str | None:
    """Why a declared shape cannot be a tensor's, checked before any arithmetic on it: more
    than :data:`MAX_DIMS` dimensions, a dimension or an element count past 2^63-1.

    Args:
        shape: Non-negative integer sizes (checked by the caller).

    Returns:
        The reason, or None when the shape is one torch can hold.
    """
    if len(shape) > MAX_DIMS:
        return f"{len(shape)} dimensions, more than {MAX_DIMS}"
    numel = 1
    for d in shape:
        if d > MAX_ELEMENTS:
            return f"a dimension of {d}, past 2^63-1"
        numel *= d
    if numel > MAX_ELEMENTS:
        return f"{numel:,} elements, past 2^63-1"
    return None


def strict_int(text: str | bytes, *, signed: bool = False, limit: int = MAX_ELEMENTS
               ) -> int | None:
    """The one parser of numbers read from a checkpoint (a step in metadata, a pointer's
    iteration, a memo index): ASCII digits only, at most 19 of them, at most ``limit``.

    ``str.isdigit`` accepts ``"²"`` and other digits ``int`` refuses, and ``int`` refuses
    more than 4,300 digits: a checkpoint's text must never reach it unchecked.

    Args:
        text: The text (surrounding whitespace is not allowed).
        signed: Whether one leading ``-`` is allowed.
        limit: The largest magnitude accepted.

    Returns:
        The number, or None when ``text`` is not one within those bounds.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("ascii")
        except UnicodeDecodeError:
            return None
    digits = text[1:] if signed and text.startswith("-") else text
    if not 0 < len(digits) <= 19 or not all(c in "0123456789" for c in digits):
        return None
    value = int(digits)
    if value > limit:
        return None
    return -value if digits is not text else value
