"""The ckpt error tree.

Every error a user can cause (bad path, unknown format, corrupt file, unsafe pickle, existing
destination) is a :class:`CkptError`. The CLI turns it into one line on stderr and its
``exit_code``; anything else is an internal error (exit 101).
"""

from __future__ import annotations

import errno
import re
from collections.abc import Mapping
from pathlib import Path


def _escape(ch: str) -> str:
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte of a non-UTF-8 file name (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


_INVISIBLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")
_INVISIBLE_OR_BREAK = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff"
                                 "\ufffe\uffff]")


def visible(text: str, *, lines: bool = True) -> str:
    """``text`` with control characters written out (``\\x1b``), tabs kept, and newlines
    kept unless ``lines`` is False.

    A file name may hold escape sequences (``\\x1b[31m``) or bytes that XML 1.0 cannot carry;
    printed raw they would drive the terminal, and in a JUnit report they make it unreadable.
    A name holding a newline would forge a line of its own in a log: every one-line message
    (an error, a decision, a table cell) is written with ``lines=False``.
    """
    return (_INVISIBLE if lines else _INVISIBLE_OR_BREAK).sub(lambda m: _escape(m.group()), text)


_NOT_AFTER_DETERMINER = "".join(rf"(?<!\b{w} )" for w in ("a", "an", "the", "no", "each", "every",
                                                         "what to"))


def reworded(text: str | None, names: Mapping[str, str]) -> str | None:
    """``text`` with each whole-word parameter name in ``names`` replaced by its other name
    (a flag on the command line, the Python API's keyword).

    Kept as they are: a name inside a quoted value or a longer name (``'to'``, ``to_dtype``,
    ``--to``), and one read as an English word: after a determiner or "what to" (``not a
    part``, ``no part of``, ``say what to keep``).

    Args:
        text: A message or hint, or None.
        names: Parameter name -> the name to write instead, in the order to replace them.

    Returns:
        The text reworded (None for None).
    """
    if text is None:
        return None
    for name, other in names.items():
        # (A replacement holds no backslash: it is a plain replacement.)
        text = re.sub(rf"(?<![\w'\"./=-]){_NOT_AFTER_DETERMINER}"
                      rf"{re.escape(name)}(?![\w'\"=-])", other, text)
    return text


class CkptError(Exception):
    """Base class of the errors ckpt reports to users.

    Args:
        message: One plain sentence saying what is wrong.
        path: The file or directory the problem is about, if any; it prefixes the message.
        hint: An optional suggestion of what to do about it.
        param: The library parameters (or options-dataclass fields) the message or hint
            names, the main one first; the CLI writes its flags in their place.

    Attributes:
        params: Every parameter the message or hint names, the main one first (empty when none).
        param: The main one, or None.
    """

    exit_code: int = 2
    #: A stable identifier of the kind of error (``error`` in ``--json`` documents).
    kind: str = "error"
    #: ``A`` or ``B`` when the error concerns one side of a comparison (``ckpt diff``).
    side: str | None = None

    def __init__(self, message: str, *, path: str | Path | None = None, hint: str | None = None,
                 param: str | tuple[str, ...] | None = None):
        self.message = message
        self.path = str(path) if path is not None else None
        self.hint = hint
        self.params: tuple[str, ...] = (param,) if isinstance(param, str) else tuple(param or ())
        self.param = self.params[0] if self.params else None
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = ": ".join(p for p in (self.side, self.path) if p)
        return f"{where}: {self.message}" if where else self.message

    def rename_params(self, names: Mapping[str, str]) -> None:
        """Name the parameters as a caller knows them, in place: each of :attr:`params` found
        in ``names`` (library name -> the caller's) is renamed in the message, the hint and
        :attr:`params` (the Python API's keywords: ``fmt`` -> ``input_format``).

        Args:
            names: The renames; parameters not in it keep their names.
        """
        renames = {p: names[p] for p in self.params if p in names and names[p] != p}
        if not renames:
            return
        self.message = reworded(self.message, renames) or ""
        self.hint = reworded(self.hint, renames)
        self.params = tuple(renames.get(p, p) for p in self.params)
        self.param = self.params[0]
        self.args = (self.__str__(),)


class UsageError(CkptError):
    """An option or argument combination that cannot work. Raised by the Python API as a
    :class:`ValueError` too (:func:`with_builtin`).

    Its message names the parameters at fault as the library knows them (``max_memory``,
    ``to``) and the value given; the CLI writes its flags in their place (``--max-memory``).

    Args:
        message: One plain sentence naming the parameter(s) and the value.
        param: The parameter (or options-dataclass field) at fault, or all of them when the
            message names several (``("parts_dir", "part", "finalize")``), the main one first.
        path: As for :class:`CkptError`.
        hint: As for :class:`CkptError`; it may name the parameters too.
    """

    kind = "usage"


class CheckpointNotFoundError(CkptError):
    """The path (file, directory or object) does not exist. Raised by the Python API as a
    :class:`FileNotFoundError` too (:func:`with_builtin`). Its ``kind`` stays ``error``, as
    the ``--json`` documents have always said."""


class UnknownFormatError(CkptError):
    """No reader (or more than one) recognises the input."""

    kind = "unknown-format"


class CorruptCheckpointError(CkptError):
    """The input claims a known format but its bytes contradict it."""

    kind = "corrupt"


class UnsafeCheckpointError(CkptError):
    """Reading the input would need code execution or escapes its directory."""

    kind = "unsafe"


class ZipConflictError(UnsafeCheckpointError):
    """A zip two readers could read differently (two end records, shifted offsets, records
    whose names collide, local headers that disagree with the central directory).

    Attributes:
        code: The finding code validate reports it under (``zip-duplicate-name``...).
    """

    def __init__(self, message: str, *, code: str = "zip-structure",
                 path: str | Path | None = None):
        super().__init__(message, path=path)
        self.code = code


class DestinationExistsError(CkptError):
    """The output already exists and ``--overwrite``/``--force`` was not given (or it is a
    directory where a file goes). Raised by the Python API as a :class:`FileExistsError` too
    (:func:`with_builtin`; ``filename`` the destination)."""

    kind = "destination-exists"


class DestinationError(CkptError):
    """ckpt will not write to this destination: a symbolic link, FIFO, device or socket
    (never written through nor replaced, ``--force`` or not), or a place that cannot be
    written (a read-only directory, a parent that is a file). Raised before any work."""

    kind = "destination"


class UnsupportedError(CkptError):
    """The input is recognised but uses a feature ckpt cannot handle yet."""

    kind = "unsupported"


class StorageError(CkptError):
    """Object storage failed: no such bucket or key, access denied, no credentials, an
    endpoint that cannot be reached or keeps failing. Messages never hold credentials."""

    kind = "storage"


class OutOfMemoryError(CkptError):
    """An allocation failed: the data did not fit the memory there is (or ``ulimit -v``)."""

    kind = "memory"


class BusyError(CkptError):
    """Another process holds what the command needs (another ``ckpt prune`` holds the run's
    lock): nothing was done; try again later. Exit 75 (``EX_TEMPFAIL``), so that cron and
    schedulers can tell "try later" from a wrong command (2)."""

    kind = "busy"
    exit_code = 75


#: The builtin exception each error is raised as too by the Python API.
_BUILTINS: dict[type[CkptError], type[Exception]] = {
    UsageError: ValueError, CheckpointNotFoundError: FileNotFoundError,
    DestinationExistsError: FileExistsError}
_FLAVOURED: dict[type[CkptError], type[CkptError]] = {}


def with_builtin(error: CkptError) -> CkptError:
    """``error`` as the library raises it to its caller: a :class:`UsageError` that is also a
    :class:`ValueError`, a :class:`CheckpointNotFoundError` also a :class:`FileNotFoundError`
    and a :class:`DestinationExistsError` also a :class:`FileExistsError` (``filename`` set
    to the path), so that ``except FileNotFoundError`` works as it does for ``open()``.

    Only at the API's door: inside ckpt, a handler of ``OSError`` around a call must not
    catch ckpt's own errors (and rewrite them as "cannot read").

    Args:
        error: An error raised inside ckpt.

    Returns:
        The same error (same class name, message, attributes and ``isinstance`` results),
        of a subclass that also inherits the builtin; ``error`` itself for the others.
    """
    kind = type(error)
    builtin = next((b for c, b in _BUILTINS.items() if issubclass(kind, c)), None)
    if builtin is None or isinstance(error, builtin):
        return error
    flavoured = _FLAVOURED.get(kind)
    if flavoured is None:
        flavoured = type(kind.__name__, (kind, builtin),
                         {"__module__": kind.__module__, "__qualname__": kind.__qualname__,
                          "__doc__": kind.__doc__})
        _FLAVOURED[kind] = flavoured
    out = flavoured.__new__(flavoured)
    out.__dict__.update(error.__dict__)
    out.args = error.args
    if isinstance(out, OSError):
        out.errno = errno.EEXIST if isinstance(out, FileExistsError) else errno.ENOENT
        out.strerror, out.filename = error.message, error.path
    return out
