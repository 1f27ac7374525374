"""The shared model of a checkpoint that every reader produces and every command consumes.

Nothing here imports torch or numpy.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from ckpt_cli import dtypes

GROUPS: tuple[str, ...] = ("model", "buffer", "optimizer", "other")
"""Tensor groups, in display order: trainable weights, buffers, optimizer state, the rest."""

Severity = Literal["error", "warning", "info"]


class WrittenFile(NamedTuple):
    """A file a command wrote: its name (relative to the output directory, or the output
    file's own name) and its size in bytes. A tuple, so ``name, size = f`` works too."""

    path: str
    bytes: int

@dataclass(frozen=True, slots=True)
class StorageRef:
    """The storage a torch tensor views: one zip entry (or legacy storage) in one file.

    Attributes:
        file: Path of the file holding it, relative to the index's base directory.
        key: The storage key (zip entry ``data/<key>``).
        start: Absolute byte offset of the storage's first byte in ``file``; None when missing.
        nbytes: Bytes the pickle says the storage holds.
        dtype: Canonical dtype of the storage's elements (``U8`` for untyped storages).
        crc: The CRC-32 the zip records for the storage's entry (None: legacy, unknown, or
            a zip written with checksums off).
        crc_len: Bytes that CRC covers (the entry's length).
    """

    file: str
    key: str
    start: int | None
    nbytes: int
    dtype: str
    crc: int | None = None
    crc_len: int = 0


@dataclass(frozen=True, slots=True)
class Chunk:
    """One piece of a sharded tensor (DCP), stored as an embedded torch.save zip.

    Attributes:
        offsets: Where the piece starts in the global tensor, per dimension.
        sizes: The piece's shape.
        file: File holding it, relative to the checkpoint directory.
        offset: Byte offset of the embedded item in ``file``.
        length: Length in bytes of the embedded item (on disk).
        transforms: Storage transforms applied (for example ``("stream.zstd/1",)``).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Everything about one tensor except its values.

    Attributes:
        name: Unique name within the checkpoint (a flattened key path, e.g. ``model.fc.weight``).
        dtype: Canonical dtype code (see :mod:`ckpt_cli.dtypes`).
        shape: Logical shape.
        nbytes: Bytes of the tensor's elements (``numel * itemsize``).
        group: ``model``, ``buffer``, ``optimizer`` or ``other``.
        file: File holding its bytes, relative to the index's base directory; None if nowhere.
        offset: Absolute byte offset of element 0 in ``file``; None if not a single range.
        stride: Element strides when not C-contiguous, else None.
        storage: For torch pickles, the storage it views (shared storage means tied tensors).
        storage_offset: Offset of element 0 in ``storage``, in elements.
        chunks: For sharded (DCP) tensors, the pieces that tile its shape.
        kind: ``dense`` for ordinary tensors; else what it is (``meta``, ``sparse``...).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    group: str = "model"
    file: str | None = None
    offset: int | None = None
    stride: tuple[int, ...] | None = None
    storage: StorageRef | None = None
    storage_offset: int = 0
    chunks: tuple[Chunk, ...] = ()
    kind: str = "dense"

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def is_floating(self) -> bool:
        """Whether the dtype is a real floating-point type."""
        return dtypes.DTYPES[self.dtype].is_floating

    @property
    def view_key(self) -> tuple[object, ...] | None:
        """What two names of one stored view share (tied weights: the same bytes read the same
        way), so that readers of values read them once; None for a tensor whose bytes are not
        in a file of the checkpoint (nothing to share)."""
        if self.file is None:
            return None
        return (self.file, self.offset, self.shape, self.stride, self.dtype, self.chunks)


@dataclass(frozen=True, slots=True)
class FileInfo:
    """One file of a checkpoint.

    Attributes:
        path: Path relative to the index's base directory.
        bytes: Size on disk.
        role: What it holds: ``weights``, ``optimizer``, ``shard``, ``metadata``, ``index``,
            ``rng``, ``scheduler``, ``args``, ``pointer`` or ``other``.
        format: The reader that understood it, or None.
    """

    path: str
    bytes: int
    role: str = "weights"
    format: str | None = None


@dataclass(frozen=True, slots=True)
class Finding:
    """One observation about a checkpoint: a problem, a risk, or a note.

    Attributes:
        severity: ``error`` (invalid or unsafe), ``warning`` (suspicious), ``info``.
        code: Stable machine-readable code, e.g. ``unsafe-global`` or ``crc-mismatch``.
        message: One plain-words sentence.
        file: The file it is about, relative to the checkpoint root, if any.
        location: Where in the file: a tensor name, a zip entry, a byte offset.
    """

    severity: Severity
    code: str
    message: str
    file: str | None = None
    location: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"severity": self.severity, "code": self.code, "message": self.message,
                "file": self.file, "location": self.location}


QUANT_SCALES = ("weight_scale_inv", "weight_scale", "scale_weight", "input_scale",
                "activation_scale", "output_scale")
"""Last name parts of quantization scales (FP8 weights' and activations'): metadata of a
quantized weight, not parameters of the model."""


def parameters_of(t: TensorInfo) -> int:
    """The parameters ``t`` adds to a count of the model: its elements when it is a model
    weight, else 0 (buffers, optimizer state, quantization scales (:data:`QUANT_SCALES`) and
    the rest are not parameters).

    The one rule behind :attr:`CheckpointIndex.num_parameters`, the module tree and the
    ``total_parameters`` ckpt writes into an index (each over tensors counted once, see
    :meth:`CheckpointIndex.distinct_tensors`).
    """
    if t.group != "model" or t.name.rpartition(".")[2] in QUANT_SCALES:
        return 0
    return t.numel


@dataclass(slots=True)
class CheckpointIndex:
    """The metadata of one checkpoint (a file, a shard set or a checkpoint directory).

    Attributes:
        format: The reader's name (``safetensors``, ``torch``, ``dcp`` ...).
        root: The path the user gave.
        base: Directory that ``TensorInfo.file`` and ``FileInfo.path`` are relative to.
        tensors: Tensors by unique name, in file order.
        files: The files making up the checkpoint.
        metadata: Training facts found: ``step``, ``epoch``, ``lr``, versions, hyper-parameters.
        objects: Non-tensor leaves (scalars, strings) by flattened name, for ``diff``.
        layout: Shard layout: ``world_size``, ``zero_stage``, ``tp``, ``pp``, ``ranks`` ...
        findings: Problems and notes found while reading.
        flavor: A more specific producer, e.g. ``lightning``, ``hf-trainer``, ``deepspeed``.
        containers: Top-level keys of the pickled tree that hold nested tensors (``model``,
            ``optimizer``, ``state_dict``...), as name prefixes with their group.
        aliases: Tied copies found by value where no storage sharing is recorded (DCP,
            safetensors): copy -> the tensor it repeats; counted once (see
            :mod:`ckpt_cli.formats.ties`).
        possible_aliases: Same tie-like name, dtype and shape, but bytes not sampled: counted
            twice, and said so.
        name_step: The step the checkpoint's name gives (``step_000400``, ``checkpoint-50``;
            a file inside such a directory), shown when the contents record none.
    """

    format: str
    root: Path
    base: Path
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    files: list[FileInfo] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    flavor: str | None = None
    containers: dict[str, str] = field(default_factory=dict)
    duplicates: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    possible_aliases: dict[str, str] = field(default_factory=dict)
    name_step: int | None = None

    def add_tensor(self, info: TensorInfo) -> TensorInfo:
        """Add a tensor. One whose name is taken (the same key in two files, or ``"a.b"``
        beside ``{"a": {"b": ...}}``) is listed as ``name#2`` and recorded in
        :attr:`duplicates` (listed name -> the name it shares); see :meth:`note_duplicates`.

        Returns:
            The tensor as listed.
        """
        if info.name in self.tensors:
            i = 2
            while f"{info.name}#{i}" in self.tensors:
                i += 1
            shared = info.name
            info = dataclasses.replace(info, name=f"{shared}#{i}")
            self.duplicates[info.name] = shared
        self.tensors[info.name] = info
        return info

    def note_duplicates(self, rel: str, names: Iterable[str]) -> None:
        """One warning for the tensors of file ``rel`` whose names were taken (if any)."""
        if not self.duplicates:  # the common case: no copy of a million names
            return
        here = set(names)
        dup = [n for n in self.duplicates if n in here]  # in the order they were read
        if not dup:
            return
        where = sorted({self.tensors[self.duplicates[n]].file or "?" for n in dup})
        shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
        self.add(Finding("warning", "duplicate-name",
                         f"{len(dup)} tensor name(s) here are already taken (in {shown}); "
                         f"listed with a #N suffix, e.g. {dup[0]!r}", rel, dup[0]))

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors, tied tensors (one storage, two names) once."""
        return sum(t.nbytes for t in self.distinct_tensors())

    @property
    def file_bytes(self) -> int:
        """Bytes on disk of all files."""
        return sum(f.bytes for f in self.files)

    @property
    def bytes_by_group(self) -> dict[str, int]:
        """Tensor bytes per group (tied tensors once); every group in :data:`GROUPS` is present."""
        out = dict.fromkeys(GROUPS, 0)
        for t in self.distinct_tensors():
            out[t.group] = out.get(t.group, 0) + t.nbytes
        return out

    @property
    def num_parameters(self) -> int:
        """Elements of the model group (trainable weights; buffers and optimizer excluded).

        Tied weights (one storage under two names, e.g. an embedding and the output head) count
        once, as ``model.num_parameters()`` counts them. Where the files hold only placeholders
        for the weights (DeepSpeed ZeRO-3), the count the checkpoint declares
        (``layout["param_count"]``) is used: its flat master-weight partitions, grouped as
        model weights, are padded.
        """
        counted = sum(parameters_of(t) for t in self.distinct_tensors())
        declared = self.layout.get("param_count")
        if isinstance(declared, int) and (declared > counted or "master_weights" in self.layout):
            return declared
        return counted

    @property
    def params_by_dtype(self) -> dict[str, int]:
        """Elements of model and buffer tensors per dtype code (tied tensors once;
        quantization scales, :data:`QUANT_SCALES`, are not counted)."""
        c: Counter[str] = Counter()
        for t in self.distinct_tensors():
            if t.group in ("model", "buffer") and t.name.rpartition(".")[2] not in QUANT_SCALES:
                c[t.dtype] += t.numel
        return dict(c)

    @property
    def bytes_by_dtype(self) -> dict[str, int]:
        """Bytes of all tensors per dtype code (tied tensors once)."""
        c: Counter[str] = Counter()
        for t in self.distinct_tensors():
            c[t.dtype] += t.nbytes
        return dict(c)

    def distinct_tensors(self) -> Iterator[TensorInfo]:
        """The tensors, leaving out a second name for the same view of the same storage (tied
        weights, which torch.save writes once) and the tied copies in :attr:`aliases`."""
        return self._distinct({})

    def _distinct(self, ties: dict[str, tuple[str, str]]) -> Iterator[TensorInfo]:
        """:meth:`distinct_tensors`, noting each left-out name in ``ties`` (-> kept, how)."""
        seen: dict[tuple[Any, ...], str] = {}
        for t in self.tensors.values():
            if t.name in self.aliases:
                ties[t.name] = (self.aliases[t.name], "values")
                continue
            if t.storage is not None:
                key = (t.storage.file, t.storage.key, t.storage_offset, t.shape, t.stride,
                       t.dtype)
                if key in seen:
                    ties[t.name] = (seen[key], "storage")
                    continue
                seen[key] = t.name
            yield t

    def tied_tensors(self) -> list[dict[str, Any]]:
        """Tensors that repeat another (tied weights), and whether counts include them twice.

        Returns:
            ``{name, tied_to, tie, counted_twice}`` each: ``tie`` is ``storage`` (one storage,
            two names), ``values`` (same shape, dtype and sampled bytes, where no storage
            sharing is recorded) or ``unverified`` (a tie-like name of the same shape and
            dtype whose bytes could not be sampled: ``counted_twice``).
        """
        ties: dict[str, tuple[str, str]] = {}
        for _ in self._distinct(ties):
            pass
        out = [{"name": n, "tied_to": to, "tie": how, "counted_twice": False}
               for n, (to, how) in ties.items()]
        out.extend({"name": n, "tied_to": to, "tie": "unverified", "counted_twice": True}
                   for n, to in self.possible_aliases.items())
        return out

    def _step(self) -> tuple[int | None, str | None]:
        recorded = self.metadata.get("step")
        if isinstance(recorded, int) and not isinstance(recorded, bool):
            return recorded, "metadata"
        if self.name_step is not None:
            return self.name_step, "name"
        return None, None

    @property
    def step(self) -> int | None:
        """The training step: recorded in the checkpoint, else the one its name gives, else
        None (:attr:`step_source` says which)."""
        return self._step()[0]

    @property
    def step_source(self) -> str | None:
        """Where :attr:`step` came from: ``metadata`` (recorded in the checkpoint), ``name``
        (only its name gives one) or None."""
        return self._step()[1]

    def add(self, finding: Finding) -> None:
        """Record a finding."""
        self.findings.append(finding)

    def path_of(self, rel: str) -> Path:
        """Absolute path of a file named relative to :attr:`base`."""
        return self.base / rel


@dataclass(slots=True)
class RunEntry:
    """One checkpoint inside a run directory.

    Attributes:
        name: File or directory name inside the run directory.
        path: Its full path.
        step: Training step, or None when it could not be found.
        step_source: Where ``step`` came from: ``name``, ``metadata`` or ``mtime``.
        format: The detected format, or None.
        bytes: Bytes on disk (recursive for directories).
        files: Number of files (recursive).
        mtime: Newest modification time among its files (seconds since the epoch).
        complete: Whether it looks whole (commit markers present, headers consistent).
        reason: Why it is not complete, or a note.
        latest: Whether a ``latest`` pointer names it.
        metrics: Metrics found in its name or metadata (for example ``val_loss``).
        changed: Newest modification or inode-change time among its files: how recently
            anything touched it, even a copy that preserved modification times.
    """

    name: str
    path: Path
    step: int | None
    step_source: str
    format: str | None
    bytes: int
    files: int
    mtime: float
    complete: bool
    reason: str | None = None
    latest: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    changed: float = 0.0


# Codes of a run listing's findings that other layers act on (prune halts on the first two).
POINTER_UNREADABLE = "pointer-unreadable"
DANGLING_POINTER = "dangling-pointer"
MTIME_ORDER = "mtime-order"


@dataclass(slots=True)
class RunListing:
    """A run directory: its checkpoints ordered by step (oldest first).

    Attributes:
        root: The run directory.
        entries: Checkpoints, oldest first.
        latest: Name of the entry a ``latest`` pointer names, if any.
        pointers: The pointer files found and what each names.
        leftovers: Temporary or trash entries left by interrupted writers or prunes.
        findings: Notes about the listing (for example ordering by mtime).
    """

    root: Path
    entries: list[RunEntry] = field(default_factory=list)
    latest: str | None = None
    pointers: dict[str, str] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
