"""``convert``'s options and result (what render/ and the Python API load without the op)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli.documents import Documented
from ckpt_cli.model import Finding
from ckpt_cli.parts import Part

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
            "config_dtype": self.config_dtype, "metadata": self.metadata, "notes": self.notes,
            "seconds": round(self.seconds, 3),
            "warnings": [w.to_dict() for w in self.warnings],
            "followed": self.followed.to_dict() if self.followed else None,
            **self.write.document()}


@dataclass(frozen=True, slots=True)
class ConvertOptions:
    """What :func:`convert` does (``ckpt convert``'s flags; the defaults are theirs).

    Attributes:
        to: ``fp16``, ``bf16``, ``fp32`` or ``keep``: cast of floating-point model tensors;
            ``dcp``: the training state as a DCP directory (:mod:`ckpt_cli.ops.to_dcp`).
        fmt: ``safetensors`` or ``pt``; None infers it from ``output``'s suffix.
        max_shard_size: Largest output shard in bytes (None: one file).
        keep_optimizer: Keep every tensor (optimizer state included) under its own name: a
            pure format change. Non-tensor values go to ``__metadata__["ckpt.objects"]``.
        keep_prefix: Keep wrapper prefixes (``module.``, ``_orig_mod.``).
        keep_fp32: Globs of tensor names kept in (or cast to) FP32.
        clamp: Clamp values beyond FP16's range instead of refusing.
        overwrite: Replace an existing output.
        container: Which top-level container holds the weights when there are several.
        input_format: Force the input format.
        part: Write only this part's share of the output shards (``--part K/N``); the last
            part to finish writes the index (see :mod:`ckpt_cli.writers.parts`).
        finalize: Finalize a split conversion now (an error naming the parts missing).
        max_memory: Memory budget in bytes for data read and cast ahead of the writer
            (default 256 MiB; the largest tensor may add to it).
        fp8_layout: With ``to="fp8"``: ``block``, ``channel`` or ``tensor`` (see
            :mod:`ckpt_cli.fp8`); the tensors not quantized are cast to BF16.
        fp8_activations: With ``to="fp8"`` in the channel/tensor layouts: ``dynamic``
            (per-token FP8 activations at run time, W8A8: the engines' FP8 matmuls) or
            ``none`` (weight-only, W8A16, for GPUs without FP8 matmuls).
        dequantize: With ``to`` ``bf16``/``fp16``/``fp32``: FP8 weights with a recognised
            scale (``weight_scale_inv``, ``weight_scale``, ``scale_weight``) become
            ``weight * scale`` in the target dtype; the scales and ``quantization_config``
            are dropped. A weight without its scale, or a scale of no known shape, is an
            error naming the tensors (nothing written).
        dcp_layout: With ``to="dcp"``: ``torchtitan`` or ``recipe`` top-level keys (see
            :mod:`ckpt_cli.ops.to_dcp.writer`).
    """

    # What is kept, and how it is cast.
    to: str = "keep"
    keep_optimizer: bool = False
    keep_prefix: bool = False
    keep_fp32: tuple[str, ...] = ()
    clamp: bool = False
    container: str | None = None
    input_format: str | None = None
    # The output.
    fmt: str | None = None
    max_shard_size: int | None = None
    overwrite: bool = False
    part: Part | None = None
    finalize: bool = False
    max_memory: int | None = None
    fp8_layout: str = "block"
    fp8_activations: str = "dynamic"
    dequantize: bool = False
    dcp_layout: str = "torchtitan"
