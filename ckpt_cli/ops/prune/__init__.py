"""``prune``: delete old checkpoints of a run directory by retention rules, safely.

:func:`plan` decides and :func:`execute` carries the decisions out (``ckpt prune`` shows the
plan and asks in between); :func:`prune` is both in one call. The order of work, and why:

1. Refuse roots that cannot be meant (``/``, ``$HOME``, a whole bucket, a directory without
   checkpoints) unless ``any_dir`` says otherwise, and a checkpoint (of any format) always,
   naming its run directory: nothing is ever created inside a checkpoint.
2. Take ``.ckpt-prune.lock`` with ``flock`` (not for ``dry_run``), so two prunes never race;
   the lock is held until :func:`execute` has finished.
3. List the run directory, gather facts by reading files (lock files, quick validation of the
   newest checkpoints, metric values, HF Trainer's best checkpoint), and let the pure
   :func:`ckpt_cli.ops.prune.retention.plan_prune` decide.
4. Stop for ``dry_run``, or when the user declines.
5. :func:`execute` (:mod:`ckpt_cli.ops.prune.executor`, the one executor) walks the decisions
   and deletes each through the run's site. Locally (:mod:`ckpt_cli.ops.prune.local`) it
   finishes the trash an interrupted prune left, then for each checkpoint to delete re-checks
   it (it may have changed since planning), renames it out of the checkpoint namespace to
   ``.ckpt-trash-<name>``, checks it again and puts it back if it changed while being moved,
   and only after all renames are durable (``fsync`` of the directory) removes the trash. A
   crash leaves trash that no reader mistakes for a checkpoint and that the next prune removes,
   never a half-deleted checkpoint under its own name. On object storage
   (:mod:`ckpt_cli.ops.prune.objects`) it aborts stale multipart uploads and deletes each
   re-checked checkpoint's keys, markers first. The renames and removals themselves are
   :mod:`ckpt_cli.ops.prune.deletion`; metric values come from
   :mod:`ckpt_cli.ops.prune.metrics`, the timelines a rollback abandoned from
   :mod:`ckpt_cli.ops.prune.timelines`; thinning (``--thin-after``) is
   :mod:`ckpt_cli.ops.prune.thin`.

Nothing here prints or prompts; what happens goes to ``on_event`` (each step, for a log) and
``progress`` (the count, :class:`ckpt_cli.progress.Progress`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from ckpt_cli import storage
from ckpt_cli.errors import UsageError
from ckpt_cli.formats import finding_sentence, first_error
from ckpt_cli.formats.probe import LINK_OUT
from ckpt_cli.model import RunListing
from ckpt_cli.ops.prune.deletion import mounts_inside
from ckpt_cli.ops.prune.executor import ANY_DIR_HINT, PlannedPrune, RunSite, execute
from ckpt_cli.ops.prune.local import LOCK_NAME as LOCK_NAME
from ckpt_cli.ops.prune.local import LocalRun
from ckpt_cli.ops.prune.local import sweep as sweep
from ckpt_cli.ops.prune.metrics import metric_values, trainer_state
from ckpt_cli.ops.prune.objects import PrefixRun
from ckpt_cli.ops.prune.result import Outcome as Outcome
from ckpt_cli.ops.prune.result import PruneEvent, PruneResult
from ckpt_cli.ops.prune.retention import (
    PrunePlan,
    PrunePolicy,
    RunFacts,
    plan_prune,
    ranked_entries,
)
from ckpt_cli.ops.prune.timelines import abandoned_checkpoints
from ckpt_cli.ops.resume import choose
from ckpt_cli.ops.validate.layoutcheck import rank_findings
from ckpt_cli.progress import Progress
from ckpt_cli.resolve import holds_runs
from ckpt_cli.runs import ITSELF, list_run, run_dir_problem, writer_lock
from ckpt_cli.trust.ledger import read_ledger

__all__ = ["LOCK_NAME", "NO_CHECKPOINTS_YET", "Outcome", "PlannedPrune", "PruneEvent",
           "PruneResult", "execute", "gather_facts", "plan", "prune", "quick_validate", "sweep"]


def prune(path: str | Path, policy: PrunePolicy, *, pattern: str | None = None,
          metrics_file: str | Path | None = None, dry_run: bool = False, any_dir: bool = False,
          confirm: Callable[[PrunePlan], bool] | None = None,
          on_event: Callable[[PruneEvent], None] | None = None,
          progress: Progress | None = None, now: float | None = None) -> PruneResult:
    """Plan the retention of a run directory's checkpoints and, unless ``dry_run``, apply it:
    :func:`plan`, then :func:`execute`.

    Args:
        path: The run directory.
        policy: What to keep (see :class:`~ckpt_cli.ops.prune.retention.PrunePolicy`).
        pattern: A regex that overrides checkpoint-name recognition.
        metrics_file: A CSV, JSON or JSON-lines file of metrics by step (for ``keep_best``).
        dry_run: Plan only; change nothing and take no lock.
        any_dir: Accept ``/``, ``$HOME`` and directories that do not look like run directories.
        confirm: Called with the plan before anything is changed, when there is something to
            delete; returning False changes nothing.
        on_event: Called with each :class:`PruneEvent` (``planned`` first).
        progress: Called as checkpoints are deleted (or kept after all, or fail):
            ``("deleting", checkpoints_done, checkpoints_to_delete)``.
        now: The current time for ages and the grace period (tests); the clock by default.

    Returns:
        The :class:`PruneResult`; deletions that failed are in it, not raised.

    Raises:
        UsageError: A policy that cannot be meant, a root refused without ``any_dir``, a metric
            no checkpoint has.
        CkptError: The directory is missing or unreadable, or another prune holds the lock.
    """
    with plan(path, policy, pattern=pattern, metrics_file=metrics_file, dry_run=dry_run,
              any_dir=any_dir, now=now) as planned:
        if on_event is not None:
            on_event(PruneEvent("planned", total=len(planned.plan.to_delete),
                                plan=planned.plan))
        if planned.asks and confirm is not None and not confirm(planned.plan):
            planned.decline()
        return execute(planned, on_event=on_event, progress=progress)


NO_CHECKPOINTS_YET = "holds no checkpoints yet: nothing to do"


def plan(path: str | Path, policy: PrunePolicy, *, pattern: str | None = None,
         metrics_file: str | Path | None = None, dry_run: bool = False, any_dir: bool = False,
         now: float | None = None) -> PlannedPrune:
    """Check the run directory, take its lock (unless ``dry_run``) and decide what to keep.

    Args:
        path: The run directory (a local directory or a prefix on object storage).
        policy: What to keep (see :class:`~ckpt_cli.ops.prune.retention.PrunePolicy`).
        pattern: A regex that overrides checkpoint-name recognition.
        metrics_file: A CSV, JSON or JSON-lines file of metrics by step (for ``keep_best``).
        dry_run: Plan only: take no lock; :func:`execute` then changes nothing.
        any_dir: Accept ``/``, ``$HOME``, a whole bucket and directories that do not look like
            run directories.
        now: The current time for ages and the grace period (tests); the clock by default.

    Returns:
        The :class:`~ckpt_cli.ops.prune.executor.PlannedPrune` (its ``plan`` holds the
        decisions, protections and reasons); use it as a context manager, or pass it to
        :func:`execute`, which releases the lock.

    Raises:
        UsageError: A policy that cannot be meant, a root refused without ``any_dir``, a metric
            no checkpoint has.
        CkptError: The directory is missing or unreadable, or another prune holds the lock.
    """
    policy.check()
    given = storage.locate(path)
    # Directories and files, or keys below a prefix: the site knows how to delete there.
    site: RunSite = (LocalRun if storage.has_file_system(given) else PrefixRun)(
        given, any_dir=any_dir, now=now)
    problem = run_dir_problem(site.root, pattern)
    # Only "no checkpoint is there (yet)": a cron job that starts before training's first
    # save is a quiet success, not an error.
    quiet = problem is not None and problem.startswith("holds no checkpoints")
    if problem is not None and problem.startswith(ITSELF):
        # Never, not even with any_dir: the lock (and thinning's work) would land inside it.
        raise UsageError(problem, path=given,
                         hint=f"prune the directory that holds it: {site.root.parent}")
    if quiet and pattern is None and isinstance(site, LocalRun):
        above = holds_runs(site.root)  # a directory of runs is no run "before its first save"
        if above is not None:
            raise above
    if problem and not quiet and not any_dir:
        raise UsageError(problem, path=given, hint=ANY_DIR_HINT, param="any_dir")
    swept: tuple[list[str], dict[str, str]] = ([], {})
    with contextlib.ExitStack() as hold:
        if not dry_run:
            hold.enter_context(site.lock())
            if isinstance(site, LocalRun):
                # Before listing: what a killed write left goes first, so the plan (and the
                # re-checks against it) see the run without it.
                swept = site.sweep()
        listing = list_run(site.root, pattern, strict=True)
        facts = gather_facts(listing, policy, metrics_file)
        result = PruneResult(given, plan_prune(listing, policy, site.start, facts), dry_run,
                             pattern=pattern,
                             metrics_file=Path(metrics_file) if metrics_file else None)
        result.note = NO_CHECKPOINTS_YET if quiet else None
        result.trash_removed, result.trash_failed = swept
        site.planned(result)
        return PlannedPrune(site, result, hold.pop_all())


def gather_facts(listing: RunListing, policy: PrunePolicy,
                 metrics_file: str | Path | None = None) -> RunFacts:
    """Read what :func:`~ckpt_cli.ops.prune.retention.plan_prune` needs from the files.

    Quick validation walks from the newest checkpoint back and stops at the first complete one
    that reads without errors, so it reads one or a few checkpoints' headers, not all.

    Args:
        listing: The run directory.
        policy: The policy (metrics are read only for ``keep_best``).
        metrics_file: An explicit metrics file, if any.

    Returns:
        The :class:`~ckpt_cli.ops.prune.retention.RunFacts`.

    Raises:
        UsageError: ``keep_best`` and no checkpoint has a value for the metric.
        CkptError: The metrics file cannot be read.
    """
    facts = RunFacts()
    remote = not storage.has_file_system(listing.root)
    # Mount points inside the run directory (usually none: then no per-checkpoint work).
    points = [] if remote else mounts_inside(str(listing.root))
    real_root = str(listing.root) if remote else os.path.realpath(listing.root)
    for e in listing.entries:
        lock = writer_lock(e.path)
        if lock:
            facts.locks[e.name] = lock
        inside = points and mounts_inside(os.path.join(real_root, e.name), points)
        if inside:
            facts.pinned[e.name] = f"a file system is mounted inside it ({inside[0]})"
    ledger = read_ledger(listing.root)
    if ledger is not None:
        facts.ledger = True
        names = {e.name for e in listing.entries}
        # What training resumes from is never deleted nor thinned, also when it is not the
        # newest by step (a run resumed from an earlier step: the higher steps left behind
        # are another timeline).
        choice = choose(listing.root)
        if choice is not None and choice.path.name in names:
            facts.pinned[choice.path.name] = ("resume-path answers it: the newest verified "
                                              "checkpoint of the run's current timeline")
        # Checkpoints a rollback left behind take no place of the rules (their own timeline).
        facts.abandoned = abandoned_checkpoints(ledger, listing.root, names)
        for path, line in ledger.latest().items():
            if path in names:
                facts.verdicts[path] = line.good
                if not line.good:
                    first = line.problems[0] if line.problems else "no problem recorded"
                    facts.validity[path] = f"the run ledger's verdict is bad: {first}"
    for e in listing.entries:
        if not e.complete and LINK_OUT in (e.reason or ""):
            facts.validity.setdefault(e.name, e.reason)  # not read: no verdict of its files
    for e in reversed(ranked_entries(listing.entries)):
        if not e.complete or e.name in facts.validity or e.name in facts.abandoned:
            continue  # the newest valid one is searched on the current timeline
        why = quick_validate(e.path)
        facts.validity[e.name] = why
        if why is None:
            break
    history, best = trainer_state(listing)
    if best:
        facts.pinned[best[0]] = best[1]
    if policy.keep_best is not None and policy.metric:
        facts.metrics = metric_values(listing, policy.metric, history, metrics_file)
    return facts


def quick_validate(path: Path) -> str | None:
    """Read a checkpoint's index (headers and pickles only) and report the first error
    (:func:`ckpt_cli.formats.first_error`), plus validate's rank-file check.

    Args:
        path: A checkpoint file or directory.

    Returns:
        None if it reads without error findings, else why it is not valid.
    """
    index, why = first_error(path)
    if index is None or why is not None:
        return why
    # Rank files against the world sizes the checkpoint records (a directory listing): a
    # ZeRO-3 tag missing one rank's model states reads fine but cannot be loaded.
    ranks = rank_findings(index, path) if path.is_dir() else None
    errors = [f for f in ranks[0] if f.severity == "error"] if ranks is not None else []
    return finding_sentence(errors[0]) if errors else None
