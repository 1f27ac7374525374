"""``ckpt stats``' result: figures per tensor and module, per checkpoint, and the anomalies."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ckpt_cli.documents import Documented
from ckpt_cli.formats import names
from ckpt_cli.formats.base import refused
from ckpt_cli.model import Finding
from ckpt_cli.tensors.moments import HIST_LO, Moments

WRAPPERS = (*names.WRAPPERS, *names.CONTAINERS)
"""Prefixes that containers and wrappers put before every weight's name
(:mod:`ckpt_cli.formats.names`)."""


def container_prefix(names: list[str], containers: Iterable[str] = ()) -> str:
    """The prefix every one of ``names`` (the model's weights and buffers) carries that is not
    the model's own: a container of the pickled tree (``containers``: ``state_dict.``,
    ``model.``...) and the wrappers of :data:`WRAPPERS`, outermost first.

    Lightning's ``state_dict.net.0.weight`` gives ``state_dict.`` (``net`` is the model's top
    module); a ``{"model": state_dict}`` dict gives ``model.``; DDP in it ``model.module.``.
    """
    known = (*dict.fromkeys(c for c in containers if c.endswith(".")), *WRAPPERS)
    prefix = ""
    rest = list(names)
    while rest:
        p = next((w for w in known if all(n.startswith(w) and len(n) > len(w)
                                          for n in rest)), None)
        if p is None:
            break
        prefix += p
        rest = [n[len(p):] for n in rest]
    return prefix


def module_of(name: str, depth: int | None, prefix: str = "") -> str:
    """The module a tensor rolls up into: its first ``depth`` name components, or all but the
    last (the module that owns it) when ``depth`` is None; a name carrying ``prefix`` (see
    :func:`container_prefix`) is counted, and shown, without it. A tensor at the model's top
    level (a causal mask buffer) is a row of its own, under its name."""
    if prefix and name.startswith(prefix):
        name = name[len(prefix):]
    parts = name.split(".")[:-1]
    return ".".join(parts[:depth] if depth is not None else parts) or name


CHECKPOINT = "(checkpoint)"
"""The ``module`` of anomalies of a whole checkpoint (``unreadable``, ``mismatch``)."""


def hist_bins(m: Moments) -> list[tuple[int | None, int | None, int]]:
    """The histogram of ``|x|`` from its first to its last used bin, as ``(lo, hi, count)``:
    the bin holds ``2**lo <= |x| < 2**hi`` (``lo`` None: the first bin of all, which holds
    everything below ``2**hi``; ``hi`` None: the last, everything from ``2**lo`` up)."""
    used = [i for i, c in enumerate(m.hist) if c]
    if not used:
        return []
    last = len(m.hist) - 1
    return [(None if i == 0 else HIST_LO + i, None if i == last else HIST_LO + i + 1,
             m.hist[i]) for i in range(used[0], used[-1] + 1)]


def _num(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def figures(m: Moments, *, hist: bool = False) -> dict[str, Any]:
    """The JSON figures of a :class:`Moments` (``--json``'s per tensor and module fields)."""
    doc: dict[str, Any] = {
        "numel": m.numel, "mean": m.mean if m.count else None, "std": _num(m.std),
        "min": m.min if m.count else None, "max": m.max if m.count else None,
        "absmax": m.absmax, "l2": _num(m.l2), "zeros": m.zeros,
        "nan": m.nan, "inf": m.inf, "tiny": m.tiny}
    if hist:  # the compact histogram is trimmed at both ends already
        doc["hist"] = {"first_binade": HIST_LO + m.hist_lo if m.hist_bins else None,
                       "counts": list(m.hist_bins)}
    return doc


@dataclass(slots=True)
class TensorStats:
    """One tensor's figures in one checkpoint.

    Attributes:
        name: Its name.
        dtype: Its stored dtype.
        shape: Its shape.
        group: ``model``, ``buffer``, ``optimizer`` or ``other``.
        moments: Its figures (None when its values could not be read).
        dequantized: The scale its FP8 values were multiplied by, if any.
        error: Why its values could not be read.
        same_as: The tensor whose bytes it views (tied weights): figures are that one's.
        module: The module it rolls up into.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    group: str
    moments: Moments | None
    dequantized: str | None = None
    error: str | None = None
    same_as: str | None = None
    module: str = ""

    def to_json(self, hist: bool) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                               "group": self.group}
        doc.update(figures(self.moments, hist=hist) if self.moments is not None else {
            "numel": math.prod(self.shape)})
        doc["dequantized_with"] = self.dequantized
        doc["same_as"] = self.same_as
        doc["error"] = self.error
        return doc


@dataclass(slots=True)
class ModuleStats:
    """A module's figures: its tensors' values together.

    Attributes:
        name: The module (a name prefix).
        tensors: Tensors rolled into it (tied copies once).
        moments: Their figures together.
        update: ``||W_t - W_{t-1}||`` over its tensors, against the previous checkpoint of the
            run (None: first checkpoint, or not comparable).
        previous_l2: The previous checkpoint's L2 norm of the same tensors.
        masks: -Inf values of its buffers (attention masks hold them on purpose: counted in
            ``inf``, never flagged).
        float_sumsq: Sum of squares of its floating-point weights, buffers and optimizer
            state only (None: it has none); an integer buffer (BatchNorm's
            ``num_batches_tracked``) counts steps, and its norm grows with them, not with the
            weights' health.
        state_nan: NaN values of its non-parameter state (group ``other``: callbacks, loop
            counters, Lightning's ``best_model_score``), counted in ``nan``, never judged.
        state_inf: Infinite values of that state (ModelCheckpoint's ``inf`` on purpose).
        init_sq: The squared L2 norm its matrices would have at torch's default
            initialization (``numel / (3 * fan_in)`` each): the module's own scale, against
            which a norm is near zero (a LoRA ``B`` still growing from its zeros).
        optimizer: It holds optimizer state (Adam's moments: zero at step 0, growing from
            there).
    """

    name: str
    tensors: int = 0
    moments: Moments = field(default_factory=Moments)
    update: float | None = None
    previous_l2: float | None = None
    masks: int = 0
    float_sumsq: float | None = None
    state_nan: int = 0
    state_inf: int = 0
    init_sq: float = 0.0
    optimizer: bool = False

    @property
    def float_l2(self) -> float | None:
        """L2 norm of its floating-point tensors (None: it has none): what norm jumps are
        judged on."""
        return None if self.float_sumsq is None else math.sqrt(self.float_sumsq)

    @property
    def suspect_inf(self) -> int:
        """Infinite values other than buffers' -Inf and non-parameter state's."""
        return self.moments.inf - self.masks - self.state_inf

    @property
    def suspect_nan(self) -> int:
        """NaN values other than non-parameter state's."""
        return self.moments.nan - self.state_nan

    @property
    def update_ratio(self) -> float | None:
        """``||W_t - W_{t-1}|| / ||W_{t-1}||`` (None when unknown or the previous norm is 0)."""
        if self.update is None or not self.previous_l2:
            return None
        return self.update / self.previous_l2

    def to_json(self, hist: bool) -> dict[str, Any]:
        return {"name": self.name, "tensors": self.tensors,
                **figures(self.moments, hist=hist),
                "update_l2": _num(self.update), "update_ratio": _num(self.update_ratio)}


@dataclass(slots=True)
class CheckpointStats:
    """One checkpoint's figures.

    Attributes:
        name: Its name (in the run directory, or the path given).
        path: Where it is.
        step: Its training step, if known.
        format: Its format.
        tensors: Per tensor, in name order.
        modules: Per module, in name order.
        cached: Tensors whose figures came from the cache.
        computed: Tensors whose figures were computed now.
    """

    name: str
    path: Path
    step: int | None
    format: str
    tensors: list[TensorStats] = field(default_factory=list)
    modules: list[ModuleStats] = field(default_factory=list)
    cached: int = 0
    computed: int = 0


@dataclass(frozen=True, slots=True)
class Anomaly:
    """Something in the figures a healthy run does not do.

    Attributes:
        step: The checkpoint's step (None when unknown).
        checkpoint: The checkpoint's name.
        module: The module.
        kind: ``nan`` or ``inf`` (appeared), ``norm-jump``, ``frozen`` (stopped changing),
            ``dead`` (a tensor became all zeros), ``unreadable`` (values, or the whole
            checkpoint, not read) or ``mismatch`` (not the previous checkpoint's model).
        message: One line in plain words.
        figures: The figures that triggered it.
    """

    step: int | None
    checkpoint: str
    module: str
    kind: str
    message: str
    figures: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "checkpoint": self.checkpoint, "module": self.module,
                "kind": self.kind, "message": self.message, **self.figures}


ANOMALY_KINDS = ("nan", "inf", "norm-jump", "frozen", "dead", "unreadable", "mismatch")


@dataclass(slots=True)
class StatsResult(Documented):
    """What ``ckpt stats`` found.

    Attributes:
        path: The path given.
        run: Whether it is a run directory (figures per checkpoint) or one checkpoint.
        checkpoints: The checkpoints, oldest first.
        anomalies: What was flagged, in step order.
        scope: ``weights`` (model weights and buffers) or ``all``.
        depth: The module roll-up's depth (None: each tensor's own module).
        hist: Whether histograms are part of the document.
        jump: The norm jump flagged (run directories).
        skipped: Run entries not read (incomplete), with why.
        bytes_read: Bytes of tensor data read now (each byte of a file once: never more
            than ``files_bytes``).
        files_bytes: Bytes of the checkpoints' files.
        seconds: Wall time.
        kernel: Which kernel computed the figures (``compiled`` or ``numpy``).
        cache_dir: The cache directory (None with the cache off).
        part: ``--part``: ``{"part", "parts", "tensors", "complete"}``, else None.
        findings: The safety findings of the reads (``formats.base.safety_findings``): pickle
            globals that run code, unscannable or hidden pickles, duplicate header keys.
    """

    command: ClassVar[str] = "stats"
    path: Path
    run: bool
    checkpoints: list[CheckpointStats]
    anomalies: list[Anomaly]
    scope: str
    depth: int | None
    hist: bool
    jump: float
    skipped: dict[str, str] = field(default_factory=dict)
    bytes_read: int = 0
    files_bytes: int = 0
    seconds: float = 0.0
    kernel: str = "numpy"
    cache_dir: Path | None = None
    part: dict[str, Any] | None = None
    findings: list[Finding] = field(default_factory=list)

    @property
    def last_good(self) -> CheckpointStats | None:
        """Run directories: the newest checkpoint before the first one with an anomaly (the
        one to roll back to); None without anomalies, or when the first one has one."""
        if not self.run or not self.anomalies:
            return None
        bad = {a.checkpoint for a in self.anomalies}
        names = {c.name for c in self.checkpoints}
        # A checkpoint that could not be opened at all is in no list: its step bounds it.
        cut = min((a.step for a in self.anomalies if a.checkpoint not in names
                   and a.step is not None), default=None)
        good = None
        for c in self.checkpoints:
            if c.name in bad or (cut is not None and c.step is not None and c.step >= cut):
                return good
            good = c
        return good

    @property
    def exit_code(self) -> int:
        """1 when an anomaly was found or a read's safety findings fail it (as validate's
        would: :func:`ckpt_cli.formats.base.refused`), else 0."""
        return 1 if self.anomalies or refused(self.findings) else 0

    def json_body(self) -> dict[str, Any]:
        """The ``stats --json`` document (layout in docs/json-schema.md)."""
        doc: dict[str, Any] = {
            "path": str(self.path), "mode": "run" if self.run else "checkpoint",
            "scope": self.scope, "depth": self.depth,
            "read": {"bytes": self.bytes_read, "seconds": round(self.seconds, 3),
                     "kernel": self.kernel,
                     "cached_tensors": sum(c.cached for c in self.checkpoints),
                     "computed_tensors": sum(c.computed for c in self.checkpoints),
                     "cache_dir": str(self.cache_dir) if self.cache_dir is not None else None},
            "part": self.part,
            "findings": [f.to_dict() for f in self.findings],
        }
        if self.run:
            doc["jump"] = self.jump
            doc["checkpoints"] = [
                {"name": c.name, "path": str(c.path), "step": c.step, "format": c.format,
                 "modules": [m.to_json(self.hist) for m in c.modules]}
                for c in self.checkpoints]
            doc["skipped"] = [{"name": k, "reason": v} for k, v in self.skipped.items()]
            good = self.last_good
            doc["last_good"] = None if good is None else {
                "name": good.name, "path": str(good.path), "step": good.step}
        else:
            c = self.checkpoints[0]
            doc["format"] = c.format
            doc["step"] = c.step
            doc["tensors"] = [t.to_json(self.hist) for t in c.tensors]
            doc["modules"] = [m.to_json(self.hist) for m in c.modules]
        doc["anomalies"] = [a.to_json() for a in self.anomalies]
        return doc
