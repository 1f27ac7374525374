"""Machine output: one JSON document on stdout, keys sorted, ``schema_version`` first-class.

Every command's document carries ``schema_version`` (bumped only for breaking changes) and
``command``. The per-command layouts are documented in ``docs/json-schema.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson

from ckpt_cli.model import CheckpointIndex, RunEntry, RunListing, TensorInfo

SCHEMA_VERSION = 1

# Documents written (or begun) by this process: a failing command prints its error document
# only if it has not printed one already, so that stdout holds exactly one object.
_emitted = 0


def dumps(doc: dict[str, Any]) -> bytes:
    """Serialize a document (sorted keys, two-space indent, trailing newline).

    File names that are not valid UTF-8 (Python keeps their bytes as lone surrogates) are
    written with ``\\xNN`` escapes instead of failing, and integers beyond 64 bits in full.
    """
    option = (orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY
              | orjson.OPT_NON_STR_KEYS)
    try:
        return orjson.dumps(doc, option=option, default=_default) + b"\n"
    except orjson.JSONEncodeError:
        clean = _printable(doc)
    try:
        return orjson.dumps(clean, option=option, default=_default) + b"\n"
    except orjson.JSONEncodeError:
        # Integers beyond 64 bits (a crafted shape's element count): orjson cannot write
        # them, the standard library can.
        import json

        return (json.dumps(clean, sort_keys=True, indent=2, default=_default,
                           ensure_ascii=False) + "\n").encode()


def _printable(obj: Any) -> Any:
    if isinstance(obj, str):
        return obj.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if isinstance(obj, Path):
        return _printable(str(obj))
    if isinstance(obj, dict):
        return {_printable(k): _printable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_printable(v) for v in obj]
    return obj


def emit(command: str, doc: dict[str, Any]) -> None:
    """Write a command's JSON document to stdout.

    Args:
        command: The command name, stored as ``command``.
        doc: The document body.
    """
    global _emitted
    body = {"schema_version": SCHEMA_VERSION, "command": command, **doc}
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


def _default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return repr(obj)


def tensor_dict(t: TensorInfo) -> dict[str, Any]:
    """A tensor's JSON form."""
    return {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
            "parameters": t.numel, "group": t.group, "file": t.file, "offset": t.offset,
            "chunks": len(t.chunks) if t.chunks else None,
            "contiguous": t.stride is None, "kind": t.kind}


def index_summary(index: CheckpointIndex) -> dict[str, Any]:
    """The summary keys every checkpoint description shares (inspect, validate, diff)."""
    return {
        "format": index.format,
        "flavor": index.flavor,
        "files": [{"path": f.path, "bytes": f.bytes, "role": f.role, "format": f.format}
                  for f in index.files],
        "num_files": len(index.files),
        "file_bytes": index.file_bytes,
        "num_tensors": len(index.tensors),
        "num_parameters": index.num_parameters,
        "tied_tensors": index.tied_tensors(),
        "total_bytes": index.total_bytes,
        "bytes_by_group": index.bytes_by_group,
        "params_by_dtype": index.params_by_dtype,
        "bytes_by_dtype": index.bytes_by_dtype,
        "metadata": index.metadata,
        "step": index.step[0],
        "step_source": index.step[1],
        "layout": index.layout,
        "warnings": [f.to_dict() for f in index.findings],
    }


def run_entry_dict(e: RunEntry) -> dict[str, Any]:
    """A run directory entry's JSON form."""
    return {"name": e.name, "path": str(e.path), "step": e.step, "step_source": e.step_source,
            "format": e.format, "bytes": e.bytes, "files": e.files, "mtime": e.mtime,
            "complete": e.complete, "reason": e.reason, "latest": e.latest,
            "metrics": e.metrics}


def run_dict(run: RunListing) -> dict[str, Any]:
    """A run listing's JSON form."""
    return {"checkpoints": [run_entry_dict(e) for e in run.entries], "latest": run.latest,
            "pointers": run.pointers, "leftovers": run.leftovers,
            "run_warnings": [f.to_dict() for f in run.findings]}
