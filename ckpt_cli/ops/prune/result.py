"""What ``prune`` returns: the events of a run, each checkpoint's outcome and :class:`PruneResult`,
shown by ``ckpt_cli.render.prune``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli.documents import Documented
from ckpt_cli.optionspec import Caller

if TYPE_CHECKING:
    from ckpt_cli.ops.prune.retention import Decision, PrunePlan



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
class PruneResult(Documented):
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
            :class:`ckpt_cli.trust.thinning.Thinned`.
        thin_skipped: Checkpoints the plan thins that were left whole, and why.
        thin_failed: Checkpoints a killed prune began thinning that this one could not settle
            (unreadable, or their manifest could not be written), and why; also in
            ``thin_skipped``. The prune is not ``ok`` then.
        caller: Whom ``to_dict()`` names options for in reasons and messages: ``python``
            (``keep=2``) or ``cli`` (``--keep 2``, set by ``ckpt prune``). The decisions keep
            them neutral, between backticks (:func:`ckpt_cli.optionspec.word`).
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
    thin_failed: dict[str, str] = field(default_factory=dict)
    caller: Caller = "python"

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
        nothing made the plan stop (a stop is a finding cron should report), and every
        thinning a killed prune left was settled."""
        return (not self.named("failed") and not self.trash_failed and not self.halted
                and not self.thin_failed)

    command = "prune"

    @property
    def deleted(self) -> list[str]:
        """The names of the checkpoints deleted (none in a dry run)."""
        return [d.entry.name for d in self.named("deleted")]

    def json_body(self) -> dict[str, Any]:
        """The ``prune --json`` document without ``schema_version`` and ``command``."""
        from ckpt_cli.ops.prune.document import prune_doc  # lazy: document.py types against it

        return prune_doc(self)
