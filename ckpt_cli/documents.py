"""The ``--json`` documents: their envelope, their serialization, and the JSON forms of the
model's types that several documents share.

Each command's result type builds its own document (``json_body()``) and inherits
:class:`Documented`, which adds ``schema_version`` and ``command``: the CLI prints that document
(``render/json.py``) and ``result.to_dict()`` returns it parsed, so the two cannot drift. This
module imports no rich, typer or torch (the Python API's results use it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import orjson

from ckpt_cli.model import CheckpointIndex, RunEntry, RunListing, TensorInfo

#: The version of every ``--json`` document's layout, bumped only for breaking changes.
SCHEMA_VERSION = 1


class Documented:
    """A command's result with a ``--json`` document.

    Subclasses set :attr:`command` and write :meth:`json_body`.
    """

    __slots__ = ()
    #: The command whose document this is (``command`` in the document).
    command: ClassVar[str] = ""

    def json_body(self) -> dict[str, Any]:
        """The document without ``schema_version`` and ``command`` (layout in
        docs/json-schema.md)."""
        raise NotImplementedError

    def document(self) -> dict[str, Any]:
        """The whole document as built (paths, tuples), ``schema_version`` and ``command``
        first: what the CLI's ``--json`` serializes."""
        return envelope(self.command, self.json_body())

    def to_dict(self) -> dict[str, Any]:
        """The command's ``--json`` document, as the CLI prints it, parsed: plain ``dict``,
        ``list``, ``str``, ``int``, ``float``, ``bool`` and ``None`` only.

        Returns:
            The document; ``json.loads`` of the CLI's output for the same arguments.
        """
        return plain(self.document())


def envelope(command: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with ``schema_version`` and ``command`` in front."""
    return {"schema_version": SCHEMA_VERSION, "command": command, **body}


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
        return (json.dumps(clean, sort_keys=True, indent=2, default=_default,
                           ensure_ascii=False) + "\n").encode()


def plain(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` as :func:`dumps` writes it, read back: JSON types only (paths as text, tuples
    as lists, non-finite floats as None, as the CLI prints them)."""
    parsed: dict[str, Any] = json.loads(dumps(doc))
    return parsed


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
        "step": index.step,
        "step_source": index.step_source,
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
