"""The options of :func:`ckpt_cli.ops.validate.validate`: :class:`ValidateOptions`, each field
the one declaration of a ``ckpt validate`` flag and a ``ckpt_cli.validate()`` keyword (light:
the command line builds its flags from it without importing the op)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckpt_cli.choices import InputFormat, ManifestHash
from ckpt_cli.ops.options import common
from ckpt_cli.optionspec import option
from ckpt_cli.parts import Part


@dataclass(frozen=True, slots=True)
class ValidateOptions:
    """What :func:`~ckpt_cli.ops.validate.validate` checks (``ckpt validate``'s options,
    declared once: see :mod:`ckpt_cli.optionspec`). ``max_memory`` is bytes here; the command
    line and the API also take it as text (``512MB``)."""

    latest: bool = option(False, help=(
        "Run directory: validate only the checkpoint training resumes from (what latest or "
        "last.ckpt names, else the newest step; never an HF final model beside "
        "checkpoint-N)."))
    values: bool = option(False, help="Also read every floating tensor: NaN, Inf, all-zero.")
    require: str | None = option(None, metavar="LIST", help=(
        "Make missing training state an error: optimizer,step (comma-separated)."))
    quick: bool = option(False, help=(
        "Structure only: skip the CRC-32 pass and chunk decoding (a manifest is still "
        "verified)."))
    write_manifest: bool = option(False, help=(
        "Record size and checksum of every file in a manifest inside the checkpoint (only if "
        "it is valid)."))
    manifest_hash: ManifestHash = option("xxh3_128", metavar="NAME", help=(
        "Checksum of `write_manifest`: xxh3_128, blake3 or sha256."))
    strict: bool = option(False, help="Warnings fail too (exit 1; the result's ok is False).")
    jobs: int | None = option(None, short="-j", min=1, metavar="N", help=(
        "Threads for checksums (default: CPUs, at most 8)."))
    pattern: str | None = common.pattern()
    part: Part | str | None = common.part()
    finalize: bool = option(False, help=(
        "Complete a job split with `part` from every part's receipt (exit 2 naming the parts "
        "missing)."))
    parts_dir: str | Path | None = option(None, metavar="DIR", kind="path", help=(
        "With `part`: keep the parts' receipts in DIR (default: beside the checkpoint)."))
    input_format: InputFormat | None = common.input_format()
    allow_global: tuple[str, ...] = common.allow_global()
    max_memory: int | None = common.max_memory(
        "the data being checked (the values scan, the checksum buffers)")
    concurrency: int | None = common.concurrency()
