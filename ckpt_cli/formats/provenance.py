"""The ``ckpt.*`` metadata that ckpt writes into its outputs, and how it is read back.

``convert`` and ``consolidate`` record where an output came from and carry the source's
training facts over, as string metadata: in safetensors ``__metadata__`` (every shard) and in
the ``metadata`` of an HF index (a sharded output, torch shards included). A single torch zip
(``-o model.pt``) holds a plain state dict and has no place for them.

Two kinds of key:

- provenance (:data:`SOURCE`, :data:`SOURCE_FORMAT`, :data:`CONVERSION`): how the file was
  made. Two conversions of one checkpoint differ only there, so ``diff`` shows them and does
  not call the checkpoints different for them.
- carried facts (:data:`STEP`, :data:`EPOCH`, :data:`OBJECTS`): what the checkpoint holds.
  Readers turn the step and epoch back into the ``step``/``epoch`` every format reports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpt_cli import storage
from ckpt_cli.dtypes import strict_int

PREFIX = "ckpt."
"""Every key ckpt writes into an output's metadata starts with this."""

SOURCE = "ckpt.source"
SOURCE_FORMAT = "ckpt.source_format"
CONVERSION = "ckpt.conversion"
STEP = "ckpt.step"
EPOCH = "ckpt.epoch"
OBJECTS = "ckpt.objects"

CARRIED: frozenset[str] = frozenset({STEP, EPOCH, OBJECTS})
"""``ckpt.*`` keys that hold the checkpoint's own content rather than its provenance."""

METADATA_DICTS: tuple[str, ...] = ("safetensors_metadata", "index_metadata")
"""Where readers keep the raw string metadata of a file (``CheckpointIndex.metadata`` keys)."""


def is_provenance(key: str) -> bool:
    """Whether a metadata key records how ckpt made a file rather than what the file holds.

    Args:
        key: As written (``ckpt.source``) or as flattened below one of
            :data:`METADATA_DICTS` (``safetensors_metadata.ckpt.source``).

    Returns:
        True for ``ckpt.*`` keys other than the carried facts (:data:`CARRIED`).
    """
    head, _, rest = key.partition(".")
    if head in METADATA_DICTS:
        key = rest
    return key.startswith(PREFIX) and key not in CARRIED


def written_by_ckpt(metadata: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's metadata (``CheckpointIndex.metadata``) says ckpt wrote it.

    Args:
        metadata: The index's metadata, holding the raw string metadata under
            :data:`METADATA_DICTS`.

    Returns:
        True when a :data:`SOURCE` key is recorded.
    """
    return any(isinstance(d, Mapping) and SOURCE in d
               for d in (metadata.get(k) for k in METADATA_DICTS))


def read_back(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The training facts that ``ckpt.*`` metadata carries, as readers report them.

    Args:
        meta: String metadata (safetensors ``__metadata__``, an HF index's ``metadata``).

    Returns:
        ``step`` (an int) and ``epoch`` (an int, or a float as written), where recorded and
        well-formed; nothing else.
    """
    out: dict[str, Any] = {}
    step = meta.get(STEP)
    if isinstance(step, str) and (n := strict_int(step, signed=True)) is not None:
        out["step"] = n
    epoch = meta.get(EPOCH)
    if isinstance(epoch, str):
        if (n := strict_int(epoch, signed=True)) is not None:
            out["epoch"] = n
        elif len(epoch) <= 64:
            try:
                value = float(epoch)
            except ValueError:
                value = math.nan
            if math.isfinite(value):
                out["epoch"] = value
    return out


def source_label(path: Path) -> str:
    """How :data:`SOURCE` names a source, in a file that may be shipped to others.

    A local directory or file is recorded by its name alone (``step_000400``,
    ``checkpoint.pt``; a file's directory can be a home directory whose name is a user's):
    the directories above stay on this machine,
    and two conversions of one source record the same name wherever they are written. A URL
    keeps its scheme, bucket and key (``s3://bucket/run/step_000400``), never credentials
    (``storage.locate`` refuses URLs that carry them; :func:`ckpt_cli.storage.redact` masks
    any value a configured option holds).

    Args:
        path: The source as located (a local ``Path`` or an object-store path).

    Returns:
        The string to record.
    """
    if not storage.has_file_system(path):
        return storage.redact(str(path))
    full = path.resolve()
    return full.name or str(full)
