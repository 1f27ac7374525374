"""The options of :func:`ckpt_cli.ops.sample.write_sample`: :class:`SampleOptions`, each field
the one declaration of a ``ckpt sample`` flag (light: the command line builds its flags from
it without importing the op, which imports torch)."""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_cli.optionspec import option


@dataclass(frozen=True, slots=True)
class SampleOptions:
    """How :func:`~ckpt_cli.ops.sample.write_sample` writes (``ckpt sample``'s options,
    declared once: see :mod:`ckpt_cli.optionspec`)."""

    overwrite: bool = option(False, help=(
        "Replace DEST if it exists (only a sample run ckpt wrote)."))
