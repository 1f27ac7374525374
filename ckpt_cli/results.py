"""Results of the commands: what ``ckpt_cli.ops`` returns and ``ckpt_cli.render`` shows.

One home for the result dataclasses, so that ops (which builds them) and render (which turns
them into tables and JSON documents) both import them from here and never each other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ckpt_cli.cadence import DAY, CheckpointSize, Overhead, expected_overhead
from ckpt_cli.compare import DiffStats, Tolerance, relative_l2
from ckpt_cli.measure import Measurement
from ckpt_cli.model import CheckpointIndex, Finding, RunListing, TensorInfo
from ckpt_cli.retention import Decision, PrunePlan
from ckpt_cli.runs import Followed
from ckpt_cli.units import natural_key
from ckpt_cli.writers import WriteResult

if TYPE_CHECKING:
    from ckpt_cli.manifest import HashStats
    from ckpt_cli.ops.diff import DiffOptions


# -- inspect -----------------------------------------------------------------------------------

@dataclass(slots=True)
class TreeNode:
    """A module prefix with the totals of the tensors below it.

    The totals follow the summary's rules, so that the root's add up to it: a tied copy
    (a second name for one storage, or a copy found by value) is a tensor but adds no
    parameters or bytes, and only model weights are parameters.

    Attributes:
        name: This level's name component (the full prefix is the path from the root).
        tensors: Number of tensor names below (tied copies included, as ``num_tensors``).
        parameters: Parameters below: elements of model weights, tied copies once
            (as ``num_parameters``).
        bytes: Bytes below, tied copies once (as ``total_bytes``).
        bytes_by_group: Those bytes per group (``model``, ``buffer``, ``optimizer``,
            ``other``), as the summary's ``bytes_by_group``.
        tied: Of the tensors below, the tied copies (counted once, under the name they
            repeat).
        children: Sub-prefixes by name, in first-seen order.
    """

    name: str
    tensors: int = 0
    parameters: int = 0
    bytes: int = 0
    bytes_by_group: dict[str, int] = field(default_factory=dict)
    tied: int = 0
    children: dict[str, TreeNode] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"name": self.name, "tensors": self.tensors, "parameters": self.parameters,
                "bytes": self.bytes, "bytes_by_group": self.bytes_by_group, "tied": self.tied,
                "children": [c.to_dict() for c in self.children.values()]}


@dataclass(slots=True)
class InspectResult:
    """What ``inspect`` found.

    Attributes:
        path: The path inspected.
        kind: ``checkpoint`` or ``run``.
        index: The checkpoint described (for a run directory: its latest complete one).
        run: The run listing, for a run directory.
        described: For a run directory, the name of the checkpoint ``index`` describes.
        tensors: Selected tensors (``--tensors``), filtered and sorted.
        tree: Module tree (``--tree``).
        describe_error: Why the run's latest checkpoint could not be read, if it could not.
        final_model: Whether ``index`` is the final model at the top of the run directory
            (an HF Trainer ``output_dir``) rather than one of its checkpoints.
        quantization: The quantization scheme (:func:`ckpt_cli.fp8_scheme.describe`), when
            ``index`` holds FP8 weights, scales or a ``quantization_config``.
    """

    path: Path
    kind: str
    index: CheckpointIndex | None
    run: RunListing | None = None
    described: str | None = None
    tensors: list[TensorInfo] | None = None
    tree: TreeNode | None = None
    describe_error: str | None = None
    final_model: bool = False
    quantization: dict[str, Any] | None = None


# -- validate ----------------------------------------------------------------------------------

Status = Literal["pass", "warn", "fail", "skip"]


CHECKS: dict[str, str] = {
    "readable": "format recognised and metadata readable",
    "complete": "the save finished (commit markers present, files whole)",
    "safetensors-header": "safetensors headers: dtypes, shapes, offsets, file length",
    "zip-structure": "zip end records, central directory, local headers, descriptors",
    "crc32": "CRC-32 of every zip record matches its bytes",
    "storages": "every storage a pickle references exists; every view fits in it",
    "pickle-safety": "pickles reference only allowlisted globals",
    "shard-index": "the index's shards exist, are valid and hold exactly its tensors",
    "dcp-storage": "DCP items lie inside existing files without overlapping",
    "dcp-tiling": "the chunks of each tensor tile its shape exactly",
    "dcp-chunks": "every DCP chunk and item decodes to what .metadata says",
    "rank-files": "the set of rank files matches the world sizes",
    "latest-pointer": "latest pointers name existing checkpoints",
    "resumable": "training state: step and optimizer state",
    "quantization": "every FP8 weight has a scale of a legal shape, finite and positive, "
                    "and quantization_config agrees",
    "values": "floating tensors hold no NaN, Inf or all-zero values",
    "manifest": "files match the integrity manifest",
    "leftovers": "no temporary or trash entries left by interrupted writes",
}
"""Every check ``validate`` knows, by id, with what it verifies (in report order)."""


@dataclass(slots=True)
class CheckResult:
    """The outcome of one check on one checkpoint.

    Attributes:
        id: The check's id (a key of :data:`CHECKS`).
        status: ``fail`` (errors), ``warn`` (warnings only), ``pass``, or ``skip`` (not run).
        summary: One line: what was verified, or why it was skipped.
        findings: The problems and notes it found.
    """

    id: str
    status: Status
    summary: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def title(self) -> str:
        """What the check verifies."""
        return CHECKS.get(self.id, self.id)


def _count(findings: Iterable[Finding], severity: str) -> int:
    return sum(1 for f in findings if f.severity == severity)


@dataclass(slots=True)
class ManifestResult:
    """What was done with the integrity manifest.

    Attributes:
        path: The manifest file.
        action: ``verified`` (present and checked), ``written``, ``absent``, ``not-written``
            (asked for but the checkpoint is invalid or the old manifest disagrees),
            ``unreadable`` (present but malformed), ``pending`` (``--part``: this part hashed
            its files; the finalizer writes it).
        algorithm: Its checksum.
        files: Files hashed.
        bytes: Bytes hashed.
        seconds: Hashing wall time.
        threads: Hashing threads.
        changed: Files whose checksum or size changed, or that are missing.
        extra: Files not in the manifest.
    """

    path: Path
    action: str
    algorithm: str | None = None
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    threads: int = 1
    changed: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Hashing speed in bytes per second (0 when nothing was hashed)."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def add_stats(self, stats: HashStats | None) -> None:
        """Account for one hashing pass."""
        if stats is not None:
            self.files += stats.files
            self.bytes += stats.bytes
            self.seconds += stats.seconds
            self.threads = max(self.threads, stats.threads)


@dataclass(slots=True)
class CheckpointReport:
    """Everything ``validate`` found about one checkpoint.

    Attributes:
        path: The checkpoint (file or directory).
        format: The reader that read it, or None if none could.
        flavor: The producer, when known.
        step: The training step it records.
        checks: Results in :data:`CHECKS` order.
        bytes_read: Bytes streamed (CRC, values, hashing).
        seconds: Wall time.
        manifest: What happened with the manifest.
        index: The metadata read (not part of the JSON output).
    """

    path: Path
    format: str | None = None
    flavor: str | None = None
    step: int | None = None
    checks: list[CheckResult] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0
    manifest: ManifestResult | None = None
    index: CheckpointIndex | None = None

    @property
    def name(self) -> str:
        """The checkpoint's file or directory name."""
        return self.path.name

    @property
    def findings(self) -> list[Finding]:
        """All findings of all checks."""
        return [f for c in self.checks for f in c.findings]

    @property
    def errors(self) -> int:
        """Number of error findings."""
        return _count(self.findings, "error")

    @property
    def warnings(self) -> int:
        """Number of warning findings."""
        return _count(self.findings, "warning")

    @property
    def valid(self) -> bool:
        """No errors (warnings and notes allowed)."""
        return self.errors == 0

    def check(self, check_id: str) -> CheckResult | None:
        """The result of one check, if it ran or was skipped."""
        return next((c for c in self.checks if c.id == check_id), None)


@dataclass(frozen=True, slots=True)
class LatestChoice:
    """The checkpoint ``validate --latest`` chose in a run directory, and why.

    Attributes:
        name: Its name in the run directory.
        path: Its path.
        step: Its training step, if known.
        pointer: The pointer that named it (``latest``,
            ``latest_checkpointed_iteration.txt``, a ``last.ckpt`` link), or None when it is
            the newest checkpoint by step.
        final_model: It is the run directory's own final model, chosen because no checkpoint
            lies beside it (the final model holds weights only: training cannot resume
            from it).
        final_model_skipped: The run directory holds a final model, which was not checked:
            training resumes from the checkpoints beside it, not from it.
    """

    name: str
    path: Path
    step: int | None
    pointer: str | None = None
    final_model: bool = False
    final_model_skipped: bool = False


@dataclass(slots=True)
class PartStatus:
    """Where a split validation (``--part K/N``, ``--finalize``) stands.

    Attributes:
        index: This process's part (from 1), or None for ``--finalize`` alone.
        count: Parts in the plan.
        origin: Where the part came from (``--part 2/4``, ``torchrun RANK=1 ...``).
        files: Files this part checked in depth.
        bytes: Their bytes.
        total_files: Files in the plan.
        plan: The plan's fingerprint.
        staging: The directory the parts' receipts are in.
        finalized: This process merged every part's receipt: the report is the whole
            checkpoint's (else it covers this part's files).
        waiting_for: Parts without a receipt when this part finished.
        finalized_elsewhere: Another part finalized after this one left its receipt.
    """

    index: int | None
    count: int
    origin: str = ""
    files: int = 0
    bytes: int = 0
    total_files: int = 0
    plan: str = ""
    staging: Path | None = None
    finalized: bool = False
    waiting_for: list[int] = field(default_factory=list)
    finalized_elsewhere: bool = False


@dataclass(slots=True)
class ValidateResult:
    """The result of ``validate`` on a checkpoint or a run directory.

    Attributes:
        path: The path given.
        kind: ``checkpoint`` or ``run``.
        checkpoints: One report per checkpoint validated (oldest first for a run).
        run: The run listing, for a run directory.
        run_checks: Checks of the run directory itself (pointers, leftovers).
        final_model: Whether the run directory itself holds a final model (an HF Trainer
            ``output_dir``): then the last report is that model's.
        part: With ``--part`` or ``--finalize``: where the split validation stands.
        latest: With ``--latest``: which checkpoint of the run was chosen, and why.
    """

    path: Path
    kind: str
    checkpoints: list[CheckpointReport] = field(default_factory=list)
    run: RunListing | None = None
    run_checks: list[CheckResult] = field(default_factory=list)
    final_model: bool = False
    part: PartStatus | None = None
    latest: LatestChoice | None = None

    @property
    def findings(self) -> list[Finding]:
        """All findings: the run's, then each checkpoint's."""
        return [f for c in self.run_checks for f in c.findings] + [
            f for r in self.checkpoints for f in r.findings]

    @property
    def valid(self) -> bool:
        """No errors anywhere."""
        return _count(self.findings, "error") == 0

    def exit_code(self, *, strict: bool = False) -> int:
        """0 when valid (and, with ``strict``, without warnings), else 1."""
        bad = _count(self.findings, "error") + (_count(self.findings, "warning")
                                                 if strict else 0)
        return 1 if bad else 0


# -- diff --------------------------------------------------------------------------------------

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
    """

    key: str
    a: Any
    b: Any
    status: str
    provenance: bool = False


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
class DiffResult:
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
        return [m for m in self.metadata if m.status == "changed" and not m.provenance]

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
        if not self.options.values and self.dtype_changes:
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


# -- convert -----------------------------------------------------------------------------------

@dataclass(slots=True)
class ConvertResult:
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


# -- consolidate -------------------------------------------------------------------------------

@dataclass(slots=True)
class ConsolidateResult:
    """What ``consolidate`` did.

    Attributes:
        source: The input path.
        kind: ``dcp``, ``deepspeed``, ``hf-index`` or ``rank-files``.
        output: The output file or directory.
        write: Files written.
        files_before: Number of input files.
        bytes_before: Bytes of the input on disk.
        elements_in: Elements of the selected source tensors (padding excluded).
        elements_out: Elements written.
        tensors: Number of tensors written.
        aliases: Tied/shared tensors written once.
        dropped: Source tensors left out, per group.
        details: Facts about the source (world size, ZeRO stage, step...).
        verified: Tensors re-read from the output and compared with the source (``--verify``).
        notes: Remarks.
        seconds: Wall time.
        warnings: Source files whose pickles would run code under ``torch.load``.
        followed: The run directory's pointer followed to the checkpoint merged, if
            ``source`` was a run directory.
        kept: Quantized tensors (FP8...) ``--to`` left as they are, by dtype.
        kept_scales: Their scales, left as they are too, by dtype.
    """

    source: Path
    kind: str
    output: Path
    write: WriteResult
    files_before: int
    bytes_before: int
    elements_in: int
    elements_out: int
    tensors: int
    aliases: dict[str, str]
    dropped: dict[str, int]
    details: dict[str, Any] = field(default_factory=dict)
    verified: int | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    warnings: list[Finding] = field(default_factory=list)
    followed: Followed | None = None
    kept: dict[str, int] = field(default_factory=dict)
    kept_scales: dict[str, int] = field(default_factory=dict)

    @property
    def lost_elements(self) -> int:
        """Selected source elements that did not reach the output (0 when all is well)."""
        return self.elements_in - self.elements_out


# -- ckpt plan ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IntervalFigures:
    """What checkpointing at one interval costs.

    Attributes:
        seconds: Compute time between checkpoints (tau).
        blocking: Seconds training stalls per checkpoint at this interval; None without a
            bandwidth.
        overhead: Expected time lost; None without an MTBF or a bandwidth.
        checkpoints_per_day: Checkpoints completed per day of wall-clock time: useful
            compute per day over the interval (a day over the period when no MTBF is known).
        bytes_per_day: Bytes written per day.
        files_per_day: Files created per day.
        inodes_per_day: Files and directories created per day.
    """

    seconds: float
    blocking: float | None
    overhead: Overhead | None
    checkpoints_per_day: float
    bytes_per_day: float
    files_per_day: float
    inodes_per_day: float

    @property
    def period(self) -> float:
        """Wall-clock seconds from one checkpoint to the next (failures aside)."""
        return self.seconds + (self.blocking or 0.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"seconds": self.seconds, "blocking_seconds": self.blocking,
                "period_seconds": self.period,
                "overhead": self.overhead.to_dict() if self.overhead else None,
                "checkpoints_per_day": self.checkpoints_per_day,
                "bytes_per_day": round(self.bytes_per_day),
                "files_per_day": self.files_per_day, "inodes_per_day": self.inodes_per_day}


@dataclass(slots=True)
class PlanResult:
    """What ``plan`` worked out. Figures that need an input not given are None.

    Attributes:
        size: The checkpoint.
        files_per_checkpoint: ``--ranks``, else the checkpoint's own file count.
        inodes_per_checkpoint: Files plus the directories holding them.
        bandwidth: Storage write bandwidth in bytes per second.
        measurement: The ``--measure`` run that gave ``bandwidth``.
        async_save: Whether only the snapshot to host memory blocks training.
        snapshot_bandwidth: Device-to-host bytes per second of one rank (``--async``).
        mtbf: The job's mean time between failures in seconds.
        gpus: ``--gpus``, when the MTBF comes from a per-device figure.
        gpu_mtbf: ``--gpu-mtbf`` in seconds.
        restart: Seconds to restart after a failure (``--restart``; 0 when not given).
        keep: Checkpoints retained (``--keep``).
        young: Figures at Young's interval.
        daly: Figures at Daly's interval (the optimum).
        current: Figures at ``--interval``.
        notes: Plain-words remarks on the figures (assumptions, what is missing).
    """

    size: CheckpointSize
    files_per_checkpoint: int
    inodes_per_checkpoint: int
    bandwidth: float | None = None
    measurement: Measurement | None = None
    async_save: bool = False
    snapshot_bandwidth: float | None = None
    mtbf: float | None = None
    gpus: int | None = None
    gpu_mtbf: float | None = None
    restart: float = 0.0
    keep: int | None = None
    thin_after: int | None = None
    thin_to: str | None = None
    young: IntervalFigures | None = None
    daly: IntervalFigures | None = None
    current: IntervalFigures | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def write_seconds(self) -> float | None:
        """Seconds to write one training checkpoint to storage (W)."""
        return None if self.bandwidth is None else self.size.training / self.bandwidth

    @property
    def snapshot_seconds(self) -> float | None:
        """Seconds to copy one checkpoint to host memory, all ranks at once (``--async``)."""
        if not self.async_save or self.snapshot_bandwidth is None:
            return None
        return self.size.training / (self.snapshot_bandwidth * self.files_per_checkpoint)

    @property
    def cost(self) -> float | None:
        """Seconds one checkpoint stalls training when the interval is long enough (C)."""
        return self.snapshot_seconds if self.async_save else self.write_seconds

    def blocking_at(self, interval: float) -> float | None:
        """Seconds training stalls per checkpoint at ``interval``.

        Synchronous: the write. ``--async``: the snapshot, plus the wait for the previous
        write when it takes longer than ``interval``.
        """
        write = self.write_seconds
        if write is None:
            return None
        if not self.async_save:
            return write
        return (self.snapshot_seconds or 0.0) + max(0.0, write - interval)

    def overhead_at(self, interval: float) -> Overhead | None:
        """Expected time lost at ``interval``; None without an MTBF or a bandwidth."""
        blocking = self.blocking_at(interval)
        if blocking is None or self.mtbf is None:
            return None
        # A save protects only once it is on storage: with --async each failure also loses
        # the work done while the last one was still being written.
        lag = (self.write_seconds or 0.0) if self.async_save else 0.0
        return expected_overhead(interval, blocking, self.mtbf, self.restart + lag)

    def figures_at(self, interval: float) -> IntervalFigures:
        """All the figures for checkpointing every ``interval`` seconds of compute."""
        blocking = self.blocking_at(interval)
        overhead = self.overhead_at(interval)
        # Each `interval` of useful compute ends in one completed save; failures (when the MTBF
        # is known) take their share of the day and cut some saves short.
        useful = DAY if overhead is None else DAY * (1.0 - overhead.total)
        per_day = useful / (interval + (blocking or 0.0) if overhead is None else interval)
        return IntervalFigures(
            seconds=interval, blocking=blocking, overhead=overhead,
            checkpoints_per_day=per_day, bytes_per_day=per_day * self.size.training,
            files_per_day=per_day * self.files_per_checkpoint,
            inodes_per_day=per_day * self.inodes_per_checkpoint)

    def curve(self, points: int = 49) -> list[tuple[float, float]]:
        """Expected time lost against interval, log-spaced around the optimum.

        The range is a tenth to ten times Daly's interval, widened to take in ``--interval``.

        Args:
            points: Number of samples.

        Returns:
            ``(interval_seconds, overhead_total)`` pairs, or ``[]`` without an optimum.
        """
        lo, hi = self.curve_range()
        if self.daly is None or points < 2:
            return []
        out = []
        for i in range(points):
            tau = lo * (hi / lo) ** (i / (points - 1))
            over = self.overhead_at(tau)
            assert over is not None  # there is an optimum, so an MTBF and a bandwidth
            out.append((tau, over.total))
        return out

    def curve_range(self) -> tuple[float, float]:
        """The interval range of :meth:`curve`, in seconds (``(0, 0)`` without an optimum)."""
        if self.daly is None:
            return 0.0, 0.0
        lo, hi = self.daly.seconds / 10, self.daly.seconds * 10
        if self.current is not None:
            lo = min(lo, self.current.seconds / 1.5)
            hi = max(hi, self.current.seconds * 1.5)
        return lo, hi

    @property
    def steady_bytes(self) -> int | None:
        """Storage held by ``--keep`` training checkpoints."""
        return None if self.keep is None else self.keep * self.size.training

    @property
    def peak_bytes(self) -> int | None:
        """Storage while a new checkpoint is written and the oldest not yet deleted."""
        return None if self.keep is None else (self.keep + 1) * self.size.training

    @property
    def thinned_bytes(self) -> int | None:
        """Bytes of one checkpoint thinned by ``prune --thin-after`` (None without it): the
        weights and metadata without optimizer state or fp32 master copy; with ``--thin-to
        bf16`` the weights at 2 bytes per parameter."""
        if self.thin_after is None:
            return None
        s = self.size
        if self.thin_to == "bf16" and s.parameters:
            return 2 * s.parameters + s.other
        return max(0, s.training - s.optimizer - (s.master or 0))

    def thinning_day(self) -> dict[str, float] | None:
        """Storage added per day of training without thinning and with it, at the interval in
        use (``--interval``, else Daly's optimum); None without ``--thin-after`` or an
        interval."""
        figures = self.current or self.daly
        thinned = self.thinned_bytes
        if figures is None or thinned is None or self.thin_after is None:
            return None
        n = figures.checkpoints_per_day
        whole = min(float(self.thin_after), n)
        return {"interval_seconds": figures.seconds, "checkpoints_per_day": n,
                "bytes_per_day_whole": n * self.size.training,
                "bytes_per_day_thinned": whole * self.size.training + (n - whole) * thinned}

    @property
    def steady_files(self) -> int | None:
        """Files held by ``--keep`` checkpoints."""
        return None if self.keep is None else self.keep * self.files_per_checkpoint


# -- ckpt prune --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PruneEvent:
    """Progress of a prune, for ``on_progress``.

    Attributes:
        kind: ``planned``, ``trash`` (leftover trash removed), ``moved`` (renamed aside),
            ``deleted``, ``skipped``, ``failed``, ``thinned`` or ``thin-skipped``.
        name: The checkpoint (or trash) name, None for ``planned``.
        detail: Why it was skipped or failed, if so.
        done: Checkpoints handled so far.
        total: Checkpoints to delete.
        decision: The checkpoint's decision, for checkpoint events.
        plan: The plan, for ``planned``.
    """

    kind: str
    name: str | None = None
    detail: str | None = None
    done: int = 0
    total: int = 0
    decision: Decision | None = None
    plan: PrunePlan | None = None


@dataclass(slots=True)
class Outcome:
    """What happened to one checkpoint that the plan deletes.

    Attributes:
        status: ``deleted``, ``skipped`` (kept after all: it changed since planning) or
            ``failed``.
        detail: Why it was skipped or failed.
    """

    status: str
    detail: str | None = None


@dataclass(slots=True)
class PruneResult:
    """What a prune planned and did.

    Attributes:
        path: The run directory as given.
        plan: The decisions.
        dry_run: Whether nothing was to be changed.
        declined: Whether ``confirm`` said no (nothing was changed).
        outcomes: For each checkpoint the plan deletes (not in a dry run or when declined).
        trash_removed: Leftover trash of an interrupted prune that was removed.
        trash_failed: Leftover trash that could not be removed, and why.
        pattern: The ``pattern`` used, if any.
        metrics_file: The ``metrics_file`` used, if any.
        keys: On object storage: the keys of each checkpoint the plan deletes.
        versioned: On object storage: whether the bucket keeps versions (None: unknown, or
            a local directory).
        stale_uploads: On object storage: ``(key, upload id)`` of multipart uploads below
            the prefix begun before ``--grace`` and never finished (a killed write's).
        uploads_aborted: The keys of those this prune aborted.
        note: A remark for the user that is no problem (a run directory with no checkpoints
            yet), or None.
        thinned: Checkpoints rewritten without optimizer state (``--thin-after``): name ->
            :class:`ckpt_cli.thinning.Thinned`.
        thin_skipped: Checkpoints the plan thins that were left whole, and why.
    """

    path: Path
    plan: PrunePlan
    dry_run: bool
    declined: bool = False
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    trash_removed: list[str] = field(default_factory=list)
    trash_failed: dict[str, str] = field(default_factory=dict)
    pattern: str | None = None
    metrics_file: Path | None = None
    keys: dict[str, list[str]] = field(default_factory=dict)
    versioned: bool | None = None
    stale_uploads: list[tuple[str, str]] = field(default_factory=list)
    uploads_aborted: list[str] = field(default_factory=list)
    note: str | None = None
    thinned: dict[str, Any] = field(default_factory=dict)
    thin_skipped: dict[str, str] = field(default_factory=dict)

    @property
    def bytes_saved(self) -> int:
        """Bytes saved by thinning."""
        return sum(t.saved for t in self.thinned.values())

    def status(self, d: Decision) -> str:
        """``kept``, ``would-delete`` (dry run, declined), ``deleted``, ``skipped``, ``failed``."""
        if not d.delete:
            return "kept"
        outcome = self.outcomes.get(d.entry.name)
        return outcome.status if outcome else "would-delete"

    def named(self, status: str) -> list[Decision]:
        """The decisions with a given :meth:`status`.

        Args:
            status: ``kept``, ``would-delete``, ``deleted``, ``skipped`` or ``failed``.

        Returns:
            Those decisions, oldest first.
        """
        return [d for d in self.plan.decisions if self.status(d) == status]

    @property
    def bytes_freed(self) -> int:
        """Bytes of the checkpoints deleted."""
        return sum(d.entry.bytes for d in self.named("deleted"))

    @property
    def halted(self) -> bool:
        """Whether the plan stopped all deletion because the run's state is unclear."""
        return any(f.code == "nothing-deleted" for f in self.plan.findings)

    @property
    def ok(self) -> bool:
        """Whether every deletion attempted (and every leftover trash removal) succeeded, and
        nothing made the plan stop (a stop is a finding cron should report)."""
        return not self.named("failed") and not self.trash_failed and not self.halted
