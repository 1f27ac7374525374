"""``prune``'s one executor: what :func:`ckpt_cli.ops.prune.plan` returns, and :func:`execute`,
which walks its decisions and deletes (then thins) each through a :class:`RunSite`.

Where the run lives makes the difference, and only the site knows it:
:class:`ckpt_cli.ops.prune.local.LocalRun` (a directory held open: trash names, renames made
durable before anything is removed, mount checks, the lock) and
:class:`ckpt_cli.ops.prune.objects.PrefixRun` (keys below a prefix: markers first, stale
multipart uploads aborted). Both re-check each checkpoint right before it goes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ckpt_cli.model import RunEntry
from ckpt_cli.ops.prune.result import Outcome, PruneEvent, PruneResult
from ckpt_cli.ops.prune.retention import Decision, PrunePlan
from ckpt_cli.ops.prune.thin import thin
from ckpt_cli.progress import Progress

Report = Callable[[PruneEvent], None]

ANY_DIR_HINT = "pass any_dir if this really is the run directory to prune"
"""The hint of a root a site refuses to prune (``any_dir`` accepts it)."""


class RunSite(Protocol):
    """Where a run's checkpoints are deleted: the executor's one interface.

    Attributes:
        root: The run directory to list and work in (local: resolved, no symlink in it).
        start: The current time when it was opened (what the plan ages checkpoints by).
    """

    root: Path
    start: float

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """What keeps another prune out from planning to the end of :func:`execute`."""

    def planned(self, result: PruneResult) -> None:
        """Take note of the plan, and add what the site knows to the result (object
        storage: the keys to delete, stale uploads, whether the bucket keeps versions)."""

    def begin(self, result: PruneResult, report: Report) -> None:
        """Before the first deletion: finish what an interrupted prune left (local trash,
        object storage's stale multipart uploads)."""

    def set_aside(self, d: Decision) -> Outcome | str:
        """Re-check a checkpoint the plan deletes and take it out of the run: an
        :class:`Outcome` when that finished it (deleted, skipped, failed), else the name it now
        waits under for :meth:`remove` (after :meth:`make_durable`)."""

    def make_durable(self) -> None:
        """Make every :meth:`set_aside` durable before anything is removed."""

    def remove(self, d: Decision, waiting: str) -> Outcome:
        """Remove a checkpoint :meth:`set_aside` left waiting under ``waiting``."""

    def end(self) -> None:
        """After the last deletion (also when one raised): release what :meth:`begin` took."""

    def recheck(self, entry: RunEntry) -> str | None:
        """None if checkpoint ``entry`` is still as planned, else why it is kept as it is."""


class PlannedPrune:
    """What :func:`ckpt_cli.ops.prune.plan` returns: the plan, and what :func:`execute` needs.

    Hold it as a context manager (or :meth:`close` it): it may hold the run directory's lock
    from planning until :func:`execute` (which closes it) has finished.

    Args:
        site: Where the run lives.
        result: The result before anything is done (its ``plan`` holds the decisions,
            protections and reasons).
        hold: Releases the lock (and what else planning took) when closed.
    """

    def __init__(self, site: RunSite, result: PruneResult,
                 hold: contextlib.ExitStack) -> None:
        self.site, self.result, self._hold = site, result, hold

    @property
    def plan(self) -> PrunePlan:
        """The decisions: what is kept and why, what is deleted or thinned."""
        return self.result.plan

    @property
    def dry_run(self) -> bool:
        """Whether it was planned only to be shown (:func:`execute` changes nothing)."""
        return self.result.dry_run

    @property
    def asks(self) -> bool:
        """Whether executing it changes something, so that the user is asked first."""
        return not self.dry_run and bool(self.plan.to_delete
                                         or any(d.thin for d in self.plan.decisions))

    def decline(self) -> None:
        """The user said no: :func:`execute` changes nothing, and the result says so."""
        self.result.declined = True

    def close(self) -> None:
        """Release the lock (idempotent)."""
        self._hold.close()

    def __enter__(self) -> PlannedPrune:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def execute(planned: PlannedPrune, *,
            on_event: Callable[[PruneEvent], None] | None = None,
            progress: Progress | None = None) -> PruneResult:
    """Carry out a plan: delete what it deletes, then thin what it thins, each re-checked
    right before; nothing for a dry run or a declined plan. Releases the plan's lock.

    Args:
        planned: What :func:`ckpt_cli.ops.prune.plan` returned.
        on_event: Called with each :class:`PruneEvent` (``trash``, ``moved``, ``deleted``,
            ``skipped``, ``failed``, ``thinned``, ``thin-skipped``).
        progress: Called as each checkpoint to delete is deleted, kept after all or fails:
            ``("deleting", checkpoints_done, checkpoints_to_delete)``
            (:class:`ckpt_cli.progress.Progress`).

    Returns:
        The :class:`PruneResult`; deletions that failed are in it, not raised.

    Raises:
        CkptError: A local run's renames cannot be made durable (nothing is removed then).
    """

    def report(event: PruneEvent) -> None:
        if on_event is not None:
            on_event(event)
        if progress is not None and event.kind in ("deleted", "skipped", "failed"):
            progress("deleting", event.done, event.total)

    result, site = planned.result, planned.site
    try:
        if planned.dry_run or result.declined:
            return result
        _delete(site, result, report)
        thin(site.root, planned.plan, result, site.recheck, report)
        return result
    finally:
        planned.close()


def _delete(site: RunSite, result: PruneResult, report: Report) -> None:
    """Every checkpoint the plan deletes, through ``site``: each set aside (after its
    re-check), then those left waiting removed once all are durable."""
    victims = result.plan.to_delete
    total, done = len(victims), 0
    waiting: list[tuple[Decision, str]] = []

    def finish(d: Decision, outcome: Outcome) -> None:
        nonlocal done
        done += 1
        result.outcomes[d.entry.name] = outcome
        report(PruneEvent(outcome.status, d.entry.name, outcome.detail, done, total, d))

    try:
        site.begin(result, report)
        for d in victims:
            step = site.set_aside(d)
            if isinstance(step, Outcome):
                finish(d, step)
                continue
            waiting.append((d, step))
            report(PruneEvent("moved", d.entry.name, None, done, total, d))
        if waiting:
            site.make_durable()
        for d, name in waiting:
            finish(d, site.remove(d, name))
    finally:
        site.end()
