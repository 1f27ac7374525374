"""Machine output: one JSON document on stdout, keys sorted, ``schema_version`` first-class.

Every command's document carries ``schema_version`` (bumped only for breaking changes) and
``command``. The per-command layouts are documented in ``docs/json-schema.md``; each result
builds its own (:class:`ckpt_cli.documents.Documented`), and the shared parts and the
serialization live in :mod:`ckpt_cli.documents`, which imports no rich (the Python API uses it).
"""

from __future__ import annotations

import sys
from typing import Any

from ckpt_cli.documents import (
    SCHEMA_VERSION,
    Documented,
    dumps,
    envelope,
    index_summary,
    run_dict,
    run_entry_dict,
    tensor_dict,
)

__all__ = ["SCHEMA_VERSION", "dumps", "emit", "emit_error", "emit_result", "emitted",
           "index_summary", "run_dict", "run_entry_dict", "tensor_dict"]

# Documents written (or begun) by this process: a failing command prints its error document
# only if it has not printed one already, so that stdout holds exactly one object.
_emitted = 0


def emit(command: str, doc: dict[str, Any]) -> None:
    """Write a command's JSON document to stdout.

    Args:
        command: The command name, stored as ``command``.
        doc: The document body.
    """
    _write(envelope(command, doc))


def emit_result(result: Documented) -> None:
    """Write a result's document (:meth:`~ckpt_cli.documents.Documented.document`, the one
    its ``to_dict()`` returns) to stdout."""
    _write(result.document())


def _write(body: dict[str, Any]) -> None:
    global _emitted
    data = dumps(body)
    _emitted += 1
    sys.stdout.buffer.write(data)
    sys.stdout.flush()


def emitted() -> int:
    """How many documents :func:`emit` has written (or begun to write) in this process."""
    return _emitted


def emit_error(command: str, error: dict[str, Any], exit_code: int) -> None:
    """Write the document of a command that failed: ``{error: {...}, exit_code}``.

    Args:
        command: The command name.
        error: ``{kind, message, path, side, hint, text}`` (see docs/json-schema.md).
        exit_code: The process's exit status.
    """
    emit(command, {"error": error, "exit_code": exit_code})
