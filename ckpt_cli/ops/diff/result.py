"""What ``diff`` takes and returns: :class:`DiffOptions` and :class:`DiffResult` with its parts
(per-tensor, per-module, metadata, renames, one-sided tensors), shown by ``ckpt_cli.render.diff``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckpt_cli.documents import Documented
from ckpt_cli.fp8.scheme import expected_error
from ckpt_cli.model import CheckpointIndex
from ckpt_cli.ops.diff.compare import relative_l2
from ckpt_cli.ops.options.diff import DiffOptions as DiffOptions
from ckpt_cli.units import natural_key

if TYPE_CHECKING:
    from ckpt_cli.ops.diff.compare import DiffStats, Tolerance
    from ckpt_cli.runs import Followed


@dataclass(frozen=True, slots=True)
class Rename:
    """A prefix stripped from one side's names.

    Attributes:
        side: ``a`` or ``b``.
        prefix: The prefix removed.
        tensors: How many tensor names it changed.
        source: ``option`` (``--strip-prefix``) or ``auto``.
    """

    side: str
    prefix: str
    tensors: int
    source: str


@dataclass(frozen=True, slots=True)
class OnlyIn:
    """A tensor present on one side only.

    Attributes:
        name: Its name after normalisation.
        original: Its name in its checkpoint.
        dtype: Canonical dtype code.
        shape: Shape.
        group: Its group on that side.
        tied_to: When it is a tied copy of a tensor both sides have, that tensor's name; such
            an entry is not a difference (the other side dropped a duplicate, as HF exports
            drop ``lm_head.weight`` when it is tied to the embeddings).
        tie: How the tie was recognised: ``storage`` (both names view the same stored bytes),
            ``recorded`` (the other side's safetensors metadata names the copy it dropped) or
            ``values`` (same dtype, shape and exactly the same values).
    """

    name: str
    original: str
    dtype: str
    shape: tuple[int, ...]
    group: str
    tied_to: str | None = None
    tie: str | None = None


@dataclass(frozen=True, slots=True)
class Dequantized:
    """How one common tensor's values were compared when a side stores it in FP8 with a
    scale: each such side dequantized (``weight * scale`` in FP32) first.

    Attributes:
        scale_a: A's scale tensor (as stored), or None when A is not quantized.
        layout_a: ``block``, ``channel`` or ``tensor`` for A's scale, or None.
        scale_b: B's scale tensor, or None.
        layout_b: Likewise for B.
    """

    scale_a: str | None
    layout_a: str | None
    scale_b: str | None
    layout_b: str | None

    @property
    def layout(self) -> str | None:
        """The coarser layout of the quantized sides (the one that bounds the error)."""
        order = ("block", "channel", "tensor")
        got = [x for x in (self.layout_a, self.layout_b) if x is not None]
        return max(got, key=order.index) if got else None

    def error_bound(self) -> float:
        """The README's error bound for this pair (:func:`error_bound`)."""
        return error_bound(self)


@dataclass(slots=True)
class TensorDiff:
    """One tensor name present on both sides.

    Attributes:
        name: The normalised name.
        name_a: Its name in A.
        name_b: Its name in B.
        group: Its group (A's, or B's when A says ``other``).
        dtype_a: Dtype in A.
        dtype_b: Dtype in B.
        shape_a: Shape in A.
        shape_b: Shape in B.
        status: One of :data:`STATUSES`.
        stats: Value statistics, when values were compared.
        tolerance: The tolerance that decided ``status``, when values were compared.
        reason: Why values were skipped.
    """

    name: str
    name_a: str
    name_b: str
    group: str
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    status: str = "not_compared"
    stats: DiffStats | None = None
    tolerance: Tolerance | None = None
    reason: str | None = None

    @property
    def parameters(self) -> int:
        """Elements (of A's shape)."""
        return math.prod(self.shape_a)

    @property
    def dtype_changed(self) -> bool:
        """Whether the two sides store it in different dtypes."""
        return self.dtype_a != self.dtype_b

    @property
    def rel_l2(self) -> float:
        """Relative L2 change (0 without statistics)."""
        return self.stats.rel_l2 if self.stats is not None else 0.0

    def finite_rel_l2(self) -> float | None:
        """The relative L2 error, or None (:func:`rel_l2_of`)."""
        return rel_l2_of(self)


@dataclass(frozen=True, slots=True)
class MetaDiff:
    """A non-tensor value that differs.

    Attributes:
        key: Flattened key (``step``, ``hyper_parameters.lr``, ``loss``).
        a: A's value (None when absent; see ``status``).
        b: B's value (likewise).
        status: ``changed``, ``only_in_a`` or ``only_in_b``.
        provenance: Whether the key records how ckpt made the file (``ckpt.source``,
            ``ckpt.source_format``, ``ckpt.conversion``) rather than what it holds: shown,
            never a difference.
        follows: Why a changed value follows from the tensors (a config's ``dtype`` or
            ``torch_dtype`` that changed exactly as the tensors' dtypes did: ``F32 -> F16``):
            shown as a note, never a difference. None for every other value.
    """

    key: str
    a: Any
    b: Any
    status: str
    provenance: bool = False
    follows: str | None = None


@dataclass(slots=True)
class ModuleDiff:
    """The roll-up of one module prefix (``--by-module``).

    Attributes:
        name: The prefix (``layers.3.attn``); ``(top level)`` for names without a dot.
        tensors: Tensors present on both sides.
        changed: Of those, how many are different (changed or shape changed).
        only_in_a: Tensors only in A.
        only_in_b: Tensors only in B.
        parameters: Elements of the common tensors.
        norm_a: L2 norm of A's compared values.
        norm_b: L2 norm of B's compared values.
        norm_diff: L2 norm of the differences.
    """

    name: str
    tensors: int = 0
    changed: int = 0
    only_in_a: int = 0
    only_in_b: int = 0
    parameters: int = 0
    norm_a: float = 0.0
    norm_b: float = 0.0
    norm_diff: float = 0.0

    @property
    def rel_l2(self) -> float:
        """``||A - B|| / max(||A||, ||B||)`` over the module's compared tensors."""
        return relative_l2(self.norm_diff, self.norm_a, self.norm_b)


@dataclass(slots=True)
class DiffResult(Documented):
    """What ``diff`` found.

    Attributes:
        index_a: Side A.
        index_b: Side B.
        options: The options used.
        scope: ``weights`` (model weights and buffers) or ``all``.
        scope_note: Why the scope differs from the one asked for, if it does.
        renames: Prefixes stripped, per side.
        excluded_a: A's tensors outside the scope, counted by group.
        excluded_b: B's tensors outside the scope, counted by group.
        tensors: Names on both sides, in A's order.
        only_a: Names only in A, in A's order.
        only_b: Names only in B, in B's order.
        metadata: Non-tensor values that differ.
        same_checkpoint: Why both sides are one checkpoint (the same path, or the same file
            or directory by device and inode), when they are: then no value was read and
            every common tensor is ``identical``; None otherwise.
        followed_a: The run directory pointer followed to A's checkpoint, if A was one.
        followed_b: The same for B.
        dequantized: Common tensors stored in FP8 with a scale on one side or both, by
            name: their values were compared dequantized.
        scales_a: A's scale tensors (and activation scales) belonging to those weights: not
            compared on their own, not reported as only in A.
        scales_b: The same for B.
        fp8_unpaired: Common FP8 tensors without a usable scale, compared as stored (a
            line each, ``A: ...``/``B: ...``, saying why).
        path_a: A as given (the document's ``a.path``; empty: the checkpoint's root).
        path_b: B as given.
        optimizer_ids: How one side's optimizer ids were matched to the other side's
            parameter names (by the model's parameter order), or why they were not; None
            when neither side names its optimizer state by id against names.
    """

    index_a: CheckpointIndex
    index_b: CheckpointIndex
    options: DiffOptions
    scope: str
    scope_note: str | None = None
    renames: list[Rename] = field(default_factory=list)
    excluded_a: dict[str, int] = field(default_factory=dict)
    excluded_b: dict[str, int] = field(default_factory=dict)
    tensors: list[TensorDiff] = field(default_factory=list)
    only_a: list[OnlyIn] = field(default_factory=list)
    only_b: list[OnlyIn] = field(default_factory=list)
    metadata: list[MetaDiff] = field(default_factory=list)
    same_checkpoint: str | None = None
    followed_a: Followed | None = None
    followed_b: Followed | None = None
    dequantized: dict[str, Dequantized] = field(default_factory=dict)
    scales_a: list[str] = field(default_factory=list)
    scales_b: list[str] = field(default_factory=list)
    fp8_unpaired: list[str] = field(default_factory=list)
    path_a: str = ""
    path_b: str = ""
    optimizer_ids: str | None = None

    command = "diff"

    def json_body(self) -> dict[str, Any]:
        """The ``diff --json`` document without ``schema_version`` and ``command``."""
        from ckpt_cli.ops.diff.document import document  # lazy: document.py types against it

        return document(self)

    def with_status(self, *statuses: str) -> list[TensorDiff]:
        """Common tensors whose status is one of ``statuses``, in A's order."""
        return [t for t in self.tensors if t.status in statuses]

    @property
    def changed(self) -> list[TensorDiff]:
        """Tensors whose values differ beyond the tolerance, most changed first."""
        return sorted(self.with_status("changed"), key=lambda t: (-t.rel_l2, t.name))

    @property
    def shape_changes(self) -> list[TensorDiff]:
        """Tensors whose shape differs."""
        return self.with_status("shape_changed")

    @property
    def dtype_changes(self) -> list[TensorDiff]:
        """Tensors (of the same shape or not) stored in different dtypes."""
        return [t for t in self.tensors if t.dtype_changed]

    @property
    def metadata_changes(self) -> list[MetaDiff]:
        """Non-tensor values present on both sides with different values (provenance keys,
        which say how each file was made, excepted)."""
        return [m for m in self.metadata if m.status == "changed" and not m.provenance
                and m.follows is None]

    @property
    def metadata_notes(self) -> list[MetaDiff]:
        """Changed values that follow from the tensors (``follows``): noted, not a
        difference."""
        return [m for m in self.metadata if m.follows is not None]

    @property
    def provenance_differences(self) -> list[str]:
        """Provenance keys (``ckpt.source``...) that differ or are on one side only: shown,
        and noted, but not a difference."""
        return [m.key for m in self.metadata if m.provenance]

    def differences(self) -> list[str]:
        """Why the checkpoints differ, one short phrase each (empty when they are equal)."""
        out: list[str] = []
        untied_a = [o for o in self.only_a if o.tied_to is None]
        untied_b = [o for o in self.only_b if o.tied_to is None]
        for n, what in ((len(self.changed), "changed"),
                        (len(untied_a), "only in A"),
                        (len(untied_b), "only in B"),
                        (len(self.shape_changes), "with a different shape")):
            if n:
                out.append(f"{n} tensor{'s' if n != 1 else ''} {what}")
        if self.options.structure_only and self.dtype_changes:
            n = len(self.dtype_changes)
            out.append(f"{n} tensor{'s' if n != 1 else ''} with a different dtype")
        if self.metadata_changes:
            n = len(self.metadata_changes)
            out.append(f"{n} metadata value{'s' if n != 1 else ''} changed")
        return out

    @property
    def equal(self) -> bool:
        """Whether the checkpoints are equal (values within tolerance).

        Different only when: a tensor is changed beyond tolerance, a name is on one side only
        (tied aliases excepted), a shape differs, a non-tensor value on both sides differs
        (provenance keys excepted), or, without values, a dtype differs. A dtype change
        whose values are within the tolerance is reported but is not a difference.
        """
        return not self.differences()

    def by_module(self, depth: int | None = None) -> list[ModuleDiff]:
        """Roll tensors up by module prefix, in natural name order (``layers.2`` < ``layers.10``).

        Args:
            depth: Name components kept (``2``: ``layers.3``); None keeps all but the last
                (the module that owns the tensor).

        Returns:
            One :class:`ModuleDiff` per prefix.
        """
        mods: dict[str, ModuleDiff] = {}

        def mod(name: str) -> ModuleDiff:
            parts = name.split(".")[:-1]
            key = ".".join(parts[:depth] if depth is not None else parts) or "(top level)"
            return mods.setdefault(key, ModuleDiff(key))

        for t in self.tensors:
            m = mod(t.name)
            m.tensors += 1
            m.parameters += t.parameters
            m.changed += t.status in ("changed", "shape_changed")
            if t.stats is not None:
                m.norm_a = math.hypot(m.norm_a, t.stats.norm_a)
                m.norm_b = math.hypot(m.norm_b, t.stats.norm_b)
                m.norm_diff = math.hypot(m.norm_diff, t.stats.norm_diff)
        for o in self.only_a:
            mod(o.name).only_in_a += 1
        for o in self.only_b:
            mod(o.name).only_in_b += 1
        return sorted(mods.values(), key=lambda m: natural_key(m.name))

    def quantized_side(self) -> str:
        """Which sides hold FP8 weights compared dequantized (:func:`quantized_side`)."""
        return quantized_side(self)


def rel_l2_of(t: TensorDiff) -> float | None:
    """A compared tensor's relative L2 error, or None (not compared, raw bytes only, or not
    finite)."""
    if t.stats is None or t.stats.raw_only:
        return None
    x = t.rel_l2
    return x if math.isfinite(x) else None


def error_bound(dq: Dequantized) -> float:
    """The README's error bound for one E4M3 rounding in the pair's (coarser) layout; two
    independent roundings (both sides quantized) add in quadrature: sqrt(2) times it."""
    return expected_error(dq.layout) * (math.sqrt(2) if dq.scale_a and dq.scale_b else 1.0)


def quantized_side(r: DiffResult) -> str:
    """Which sides hold the FP8 weights compared dequantized: ``a``, ``b``, ``both`` or
    ``none``."""
    a = any(d.scale_a for d in r.dequantized.values())
    b = any(d.scale_b for d in r.dequantized.values())
    return "both" if a and b else "a" if a else "b" if b else "none"
