"""Side files: the small files beside checkpoint data (the manifest, the run ledger,
``config.json``, ``trainer_state.json``, an index, a pointer), read one guarded way.

Every side file is checked before it is read: a FIFO would block the read until someone
writes to it, a device (``/dev/zero``) never ends, a socket cannot be read, and a sparse
5 GiB ``config.json`` would be read whole into memory. :func:`read_side` refuses all of them
the same way for a local file and an object: regular files only (checked before the open and
on the descriptor, opened ``O_NONBLOCK``, see :func:`ckpt_cli.storage.open_regular`), and at
most :data:`CAPS` bytes of each kind, with an error naming the file and the cap.

:func:`parse_json` is the JSON half: ``orjson`` (which refuses nesting past 1,024 levels
itself, where ``json`` raises ``RecursionError``), then a bound of :data:`MAX_JSON_DEPTH`
levels, checked without recursion, so that no later walk of the document can recurse too deep.
"""

from __future__ import annotations

import os
import stat
from itertools import chain
from pathlib import Path
from typing import Any

import orjson

from ckpt_cli.errors import CkptError, CorruptCheckpointError
from ckpt_cli.storage.access import close, open_regular, read_full, size_of
from ckpt_cli.storage.local import special_kind
from ckpt_cli.storage.objectpath import ObjectPath

_MiB = 1 << 20

CAPS: dict[str, int] = {
    "manifest": 64 * _MiB,
    "ledger": 64 * _MiB,
    "index": 256 * _MiB,
    "config": 16 * _MiB,
    "trainer-state": 64 * _MiB,
    "json-state": 64 * _MiB,
    "metrics": 256 * _MiB,
    "plan": 64 * _MiB,
    "pointer": 4096,
    "stats-cache": 256 * _MiB,
}
"""The most bytes read of each kind of side file. ``index`` (an HF ``*.index.json``) names
every tensor of a model; a ``pointer`` (``latest``, ``latest_checkpointed_iteration.txt``)
names one checkpoint; ``metrics`` is a ``--metrics-file`` a user names."""

_WHAT = {"manifest": "manifest", "ledger": "run ledger", "index": "index file",
         "config": "config file", "trainer-state": "trainer state",
         "json-state": "JSON state file", "metrics": "metrics file",
         "plan": "plan file", "pointer": "pointer file",
         "stats-cache": "stats cache entry"}

MAX_JSON_DEPTH = 64
"""The deepest nesting accepted in a side file's JSON (and in JSON held in metadata): far more
than any real config needs, few enough that no walk of it recurses too deep."""


def cap_text(n: int) -> str:
    """A cap in words (``64 MiB``, ``4 KiB``)."""
    if n >= _MiB and n % _MiB == 0:
        return f"{n // _MiB} MiB"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024} KiB"
    return f"{n:,} bytes"


def read_side(path: Path, kind: str, *, follow_symlinks: bool = True) -> bytes | None:
    """The bytes of a side file, or None when there is none.

    Args:
        path: The file (local path or object).
        kind: A key of :data:`CAPS`, which bounds the read.
        follow_symlinks: False refuses a symbolic link (the run ledger: a link could make
            appends land elsewhere).

    Returns:
        The whole file, or None if it does not exist.

    Raises:
        CorruptCheckpointError: If it is not a regular file (a FIFO, a device, a socket, a
            directory) or is larger than the cap of its kind.
        CkptError: If it cannot be read.
    """
    cap = CAPS[kind]
    what = _WHAT[kind]
    if isinstance(path, ObjectPath):
        if not path.is_file():
            return None
    else:
        try:
            st = os.stat(path) if follow_symlinks else os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise CkptError(f"cannot read the {what}: {e.strerror or e}", path=path) from None
        kind_of = ("a symbolic link" if stat.S_ISLNK(st.st_mode)
                   else special_kind(st.st_mode))
        if kind_of is not None:
            raise CorruptCheckpointError(f"not a regular file ({kind_of})", path=path)
    h = open_regular(path)
    try:
        size = size_of(h)
        if size > cap:
            raise CorruptCheckpointError(
                f"the {what} is {size:,} bytes, over the {cap_text(cap)} cap for a {what}",
                path=path)
        buf = bytearray(size + 1)  # one byte more tells a file that grew past its size
        n = read_full(h, 0, memoryview(buf))
    except OSError as e:
        raise CkptError(f"cannot read the {what}: {e.strerror or e}", path=path) from None
    finally:
        close(h)
    if n > cap:
        raise CorruptCheckpointError(f"the {what} grew past the {cap_text(cap)} cap for a "
                                     f"{what} while it was read", path=path)
    return bytes(buf[:n])


def parse_json(data: bytes | str, *, what: str, path: str | Path | None,
               max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON from a checkpoint or a side file, with its nesting bounded.

    Args:
        data: The JSON text.
        what: What it is, for the message (``"config.json"``, ``"the manifest"``).
        path: The file, for the message.
        max_depth: The deepest nesting accepted.

    Returns:
        The document.

    Raises:
        CorruptCheckpointError: If it is not JSON, or nests deeper than ``max_depth``.
    """
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        if "recursion" in str(e).lower() or "depth limit" in str(e):
            raise CorruptCheckpointError(f"{what} nests deeper than {max_depth} levels",
                                         path=path) from None
        raise CorruptCheckpointError(f"{what} is not valid JSON ({e})", path=path) from None
    if json_depth_over(doc, max_depth):
        raise CorruptCheckpointError(f"{what} nests deeper than {max_depth} levels", path=path)
    return doc


def json_depth_over(doc: Any, limit: int) -> bool:
    """Whether a parsed JSON document nests deeper than ``limit`` (checked without recursion).

    Level by level, with the walk of each level in C (``chain``, list comprehensions): a
    safetensors header of a million tensors holds seven million values, and a walk that
    stacked each of them cost several times the parse itself.
    """
    level: list[Any] = [doc] if isinstance(doc, (dict, list)) else []
    depth = 1
    while level:
        if depth > limit:
            return True
        dicts = [n for n in level if isinstance(n, dict)]
        kids = chain(chain.from_iterable(map(dict.values, dicts)),
                     chain.from_iterable(n for n in level if not isinstance(n, dict)))
        level = [k for k in kids if isinstance(k, (dict, list))]
        depth += 1
    return False


def load_side_json(path: Path, kind: str, *, what: str | None = None) -> Any:
    """A side file's JSON (:func:`read_side`, then :func:`parse_json`), or None when absent.

    Raises:
        CorruptCheckpointError: Not a regular file, over its cap, not JSON, nested too deep.
        CkptError: If it cannot be read.
    """
    data = read_side(path, kind)
    if data is None:
        return None
    return parse_json(data, what=what or f"the {_WHAT[kind]}", path=path)
