"""What ``validate`` returns: the checks it knows, each check's outcome, per-checkpoint and
per-run reports, and the state of a ``--part`` run (shown by ``ckpt_cli.render.validate`` and
``ckpt_cli.render.junit``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ckpt_cli.documents import Documented
from ckpt_cli.model import CheckpointIndex, Finding, RunListing

if TYPE_CHECKING:
    from ckpt_cli.manifest import HashStats


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
class ValidateResult(Documented):
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
        strict: Whether warnings fail too (``--strict``): what :attr:`ok` and the
            document's ``strict`` say.
    """

    path: Path
    kind: str
    checkpoints: list[CheckpointReport] = field(default_factory=list)
    run: RunListing | None = None
    run_checks: list[CheckResult] = field(default_factory=list)
    final_model: bool = False
    part: PartStatus | None = None
    latest: LatestChoice | None = None
    strict: bool = False

    command = "validate"

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

    @property
    def ok(self) -> bool:
        """Valid, and with :attr:`strict` free of warnings too: what exit status 0 means."""
        return self.exit_code(strict=self.strict) == 0

    def json_body(self) -> dict[str, Any]:
        """The ``validate --json`` document without ``schema_version`` and ``command``."""
        from ckpt_cli.ops.validate.document import result_dict  # lazy: document.py types against it

        return {**result_dict(self), "strict": self.strict}
