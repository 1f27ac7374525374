"""``convert``'s result and options (what render/ and the Python API load without the op)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli.documents import Documented
from ckpt_cli.model import Finding

# Declared in a light module (``ckpt convert --help`` builds its flags from it); re-exported.
from ckpt_cli.ops.options.convert import ConvertOptions as ConvertOptions
from ckpt_cli.optionspec import Caller, word

if TYPE_CHECKING:
    from ckpt_cli.runs import Followed
    from ckpt_cli.writers import WriteResult


# -- the result ------------------------------------------------------------------------------------

@dataclass(slots=True)
class ConvertResult(Documented):
    """What ``convert`` did.

    Attributes:
        source: The input path.
        source_format: Its format.
        output: The written file or directory.
        write: Files written and sizes.
        tensors: Output tensors, in order (name -> (dtype, shape)).
        renamed: How names were changed (container and wrapper prefixes stripped).
        dropped: Tensors left out, counted per group.
        casts: ``"F32->F16"`` -> number of tensors.
        aliases: Tied tensors written once: ``{dropped name: kept name}``.
        overflow: Tensors with values beyond FP16's range (count), when casting to FP16.
        clamped: Whether overflowing values were clamped (``--clamp``).
        metadata: The ``__metadata__`` written.
        notes: Plain-words remarks (what was dropped, chosen, copied).
        seconds: Wall time.
        warnings: Source files whose pickles would run code under ``torch.load`` (see
            :func:`hostile_warnings`).
        followed: The run directory's pointer followed to the checkpoint read, if
            ``source`` was a run directory.
        kept: Quantized tensors (FP8...) ``--to`` left as they are, by dtype.
        kept_scales: Their scales, left as they are too, by dtype.
        config_dtype: How the copied ``config.json``'s dtype was rewritten to the output's
            (``{file, keys, from, to}``), or None.
        kept_fp32: Each ``--keep-fp32`` glob and the output tensors it kept in FP32 (an empty
            list: it matched none).
        caller: Whom ``to_dict()`` names options for in ``notes`` (kept neutral, between
            backticks): ``python`` (``keep_fp32``) or ``cli`` (``--keep-fp32``, set by
            ``ckpt convert``); see :func:`ckpt_cli.optionspec.word`.
    """

    source: Path
    source_format: str
    output: Path
    write: WriteResult
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    renamed: list[str]
    dropped: dict[str, int]
    casts: dict[str, int]
    aliases: dict[str, str]
    overflow: dict[str, int]
    clamped: bool
    metadata: dict[str, str]
    notes: list[str]
    seconds: float
    warnings: list[Finding] = field(default_factory=list)
    followed: Followed | None = None
    kept: dict[str, int] = field(default_factory=dict)
    kept_scales: dict[str, int] = field(default_factory=dict)
    config_dtype: dict[str, Any] | None = None
    kept_fp32: dict[str, list[str]] = field(default_factory=dict)
    caller: Caller = "python"

    command = "convert"

    def json_body(self) -> dict[str, Any]:
        """The ``convert --json`` document without ``schema_version`` and ``command``."""
        return {
            "source": str(self.source), "source_format": self.source_format,
            "output": str(self.output), "num_tensors": len(self.tensors),
            "tensors": [{"name": n, "dtype": d, "shape": list(s)}
                        for n, (d, s) in self.tensors.items()],
            "renamed": self.renamed, "dropped": self.dropped, "casts": self.casts,
            "aliases": self.aliases, "overflow": self.overflow, "clamped": self.clamped,
            "kept": self.kept, "kept_scales": self.kept_scales, "kept_fp32": self.kept_fp32,
            "config_dtype": self.config_dtype, "metadata": self.metadata,
            "notes": [word(n, self.caller) for n in self.notes],
            "seconds": round(self.seconds, 3),
            "warnings": [w.to_dict() for w in self.warnings],
            "followed": self.followed.to_dict() if self.followed else None,
            **self.write.document()}
