"""An allowlisting unpickler that never imports or calls anything from a checkpoint.

``pickle.Unpickler.find_class`` is the only way a pickle reaches a Python object by name
(GLOBAL, STACK_GLOBAL, INST, OBJ and the EXT opcodes all go through it). Ours never imports:

* torch's tensor-rebuild functions, storage classes, dtypes, ``torch.Size`` and a few plain
  containers map to ckpt's own stand-ins that build inert records (:class:`TensorRecord`; the
  stand-ins and the table of allowed names are :mod:`ckpt_cli.formats.standins`);
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

from ckpt_cli import storage
from ckpt_cli.dtypes import strict_int
from ckpt_cli.formats.standins import (
    _ACTIVE,
    _ALLOWED,
    Opaque,
    StorageRecord,
    StorageType,
    classify_global,
)

# Re-exported: the records and stand-ins, as they were reachable here before they had a
# module of their own.
from ckpt_cli.formats.standins import DTypeRef as DTypeRef
from ckpt_cli.formats.standins import TensorRecord as TensorRecord
from ckpt_cli.formats.standins import _rebuild_meta as _rebuild_meta

if TYPE_CHECKING:
    from ckpt_cli.storage import Handle


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
                memo = strict_int(bytes(buf[pos:nl]).strip())
                if memo is not None:
                    _check_memo(memo, at, ops)
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
    import pickletools  # lazy: messages about refused pickles only

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
