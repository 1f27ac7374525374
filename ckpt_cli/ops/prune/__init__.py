"""``prune``: delete old checkpoints of a run directory by retention rules, safely.

The order of work, and why:

1. Refuse roots that cannot be meant (``/``, ``$HOME``, a checkpoint, a directory without
   checkpoints) unless ``any_dir`` says otherwise.
2. Take ``.ckpt-prune.lock`` with ``flock`` (not for ``dry_run``), so two prunes never race.
3. List the run directory, gather facts by reading files (lock files, quick validation of the
   newest checkpoints, metric values, HF Trainer's best checkpoint), and let the pure
   :func:`ckpt_cli.ops.prune.retention.plan_prune` decide.
4. Stop for ``dry_run``; ask ``confirm`` (the CLI's prompt) when given.
5. Finish the trash an interrupted prune left, then for each checkpoint to delete: re-check it
   (it may have changed since planning), rename it out of the checkpoint namespace to
   ``.ckpt-trash-<name>``, check it again and put it back if it changed while being moved, and
   only after all renames are durable (``fsync`` of the directory) remove the trash. A crash
   leaves trash that no reader mistakes for a checkpoint and that the next prune removes, never
   a half-deleted checkpoint under its own name. This step is :mod:`ckpt_cli.ops.prune.local`
   (a prefix on object storage: :mod:`ckpt_cli.ops.prune.objects`); the renames and removals
   themselves are :mod:`ckpt_cli.ops.prune.deletion`; metric values come from
   :mod:`ckpt_cli.ops.prune.metrics`.

Nothing here prints or prompts; progress goes to ``on_progress``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

from ckpt_cli import storage
from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.formats import check_exists, read_index
from ckpt_cli.model import RunEntry, RunListing
from ckpt_cli.ops.prune.deletion import (
    HeldDir,
    mounts_inside,
)
from ckpt_cli.ops.prune.local import PointerWatch, _delete, _finish_trash, recheck
from ckpt_cli.ops.prune.metrics import metric_values, trainer_state
from ckpt_cli.ops.prune.objects import (
    _abort_upload,
    _delete_prefix,
    _keys_of,
    _recheck_prefix,
    _stale_uploads,
)
from ckpt_cli.ops.prune.result import Outcome, PruneEvent, PruneResult
from ckpt_cli.ops.prune.retention import (
    PrunePlan,
    PrunePolicy,
    RunFacts,
    plan_prune,
    ranked_entries,
)
from ckpt_cli.ops.validate.layoutcheck import rank_findings
from ckpt_cli.runs import (
    list_run,
    run_dir_problem,
    tree_scan,
    writer_lock,
)
from ckpt_cli.trust.ledger import Ledger, read_ledger

LOCK_NAME = ".ckpt-prune.lock"
"""The file ``prune`` locks in the run directory (left in place: removing a lock file races)."""


def prune(path: str | Path, policy: PrunePolicy, *, pattern: str | None = None,
          metrics_file: str | Path | None = None, dry_run: bool = False, any_dir: bool = False,
          confirm: Callable[[PrunePlan], bool] | None = None,
          on_progress: Callable[[PruneEvent], None] | None = None,
          now: float | None = None) -> PruneResult:
    """Plan the retention of a run directory's checkpoints and, unless ``dry_run``, apply it.

    Args:
        path: The run directory.
        policy: What to keep (see :class:`~ckpt_cli.ops.prune.retention.PrunePolicy`).
        pattern: A regex that overrides checkpoint-name recognition.
        metrics_file: A CSV, JSON or JSON-lines file of metrics by step (for ``keep_best``).
        dry_run: Plan only; change nothing and take no lock.
        any_dir: Accept ``/``, ``$HOME`` and directories that do not look like run directories.
        confirm: Called with the plan before anything is changed, when there is something to
            delete; returning False changes nothing.
        on_progress: Called with each :class:`PruneEvent`.
        now: The current time for ages and the grace period (tests); the clock by default.

    Returns:
        The :class:`PruneResult`; deletions that failed are in it, not raised.

    Raises:
        UsageError: A policy that cannot be meant, a root refused without ``any_dir``, a metric
            no checkpoint has.
        CkptError: The directory is missing or unreadable, or another prune holds the lock.
    """
    policy.check()
    root_arg = storage.locate(path)
    if not storage.has_file_system(root_arg):  # keys, not directories: the prefix pruner
        remote = _prune_prefix(root_arg, policy, pattern=pattern, metrics_file=metrics_file,
                               dry_run=dry_run, any_dir=any_dir, confirm=confirm,
                               report=on_progress or (lambda _e: None), now=now)
        return remote
    root, note = _check_root(root_arg, any_dir, pattern)
    start, started = (time.time() if now is None else now), time.monotonic()

    def clock() -> float:
        return start + (time.monotonic() - started)

    report = on_progress or (lambda _e: None)
    with contextlib.nullcontext() if dry_run else _locked(root):
        result = _planned(root, root_arg, policy, pattern, metrics_file, dry_run, start)
        result.note = note
        listing, plan = result.plan.listing, result.plan
        if not _go_ahead(result, confirm, report):
            return result
        held = HeldDir(root)
        try:
            _finish_trash(held, listing, result, report)
            _delete(held, plan, result, clock, report)
        finally:
            held.close()
        _thin(root, plan, result, clock, report)
    return result


def _thin(root: Path, plan: PrunePlan, result: PruneResult, clock: Callable[[], float],
          report: Callable[[PruneEvent], None],
          recheck_one: Callable[[RunEntry], str | None] | None = None) -> None:
    """Rewrite the checkpoints the plan thins (``--thin-after``), each re-checked first
    (``recheck_one``: the object-storage re-check; local: :func:`recheck`), and append a
    ``thinned`` line to the run ledger for each."""
    from ckpt_cli.trust.ledger import THINNED, LedgerEntry, append
    from ckpt_cli.trust.thinning import PENDING, can_thin, thin_file, tidy

    if recheck_one is None:
        pointers = PointerWatch(root, plan)

        def recheck_one(entry: RunEntry) -> str | None:
            return recheck(root, entry, plan, clock(), pointers)
    book = read_ledger(root) if any(d.thin for d in plan.decisions) else None
    # Checkpoints that had a manifest (a killed thinning may have set it aside already).
    manifested = {e.path for e in book.entries if e.manifest_digest} if book else set()
    for d in plan.decisions:
        if not d.thin:
            continue
        name = d.entry.name
        why = can_thin(d.entry.path) or recheck_one(d.entry)
        if not why and d.entry.step is None and not storage.has_file_system(d.entry.path):
            # Its place in the run comes from its objects' LastModified, which the rewrite
            # would reset (S3 cannot set it): it would then pass for the newest checkpoint.
            why = ("no step in its name or metadata: ordered by modification time, which "
                   "rewriting it on object storage would reset; left whole")
        if why:
            result.thin_skipped[name] = why
            report(PruneEvent("thin-skipped", name, why, plan=plan))
            continue

        def intent(dropped: list[str], dtype: str | None, before: int,
                   name: str = name, step: int | None = d.entry.step) -> None:
            # Recorded before the first change: a crash from here on leaves a checkpoint that
            # is whole or thinned, with or without its manifest; readers of the ledger then
            # verify it afresh instead of reporting it bad (see thinning.pending).
            append(root, LedgerEntry(path=name, step=step, time=time.time(), event=THINNED,
                                     verdict="good", bytes=before,
                                     detail={"dropped": dropped, "dtype": dtype,
                                             "bytes_before": before, PENDING: True}))

        try:
            if book is not None and _killed_thinning(book, name):
                tidy(d.entry.path)  # object storage: what the killed thinning left unnamed
            done = thin_file(d.entry.path, to=plan.policy.thin_to, on_start=intent)
        except CkptError as e:
            result.thin_skipped[name] = e.message
            report(PruneEvent("thin-skipped", name, e.message, plan=plan))
            continue
        if done is None:
            result.thin_skipped[name] = "no optimizer state to drop (thinned already?)"
            _confirm_interrupted(root, name, d.entry.step)
            continue
        if done.manifest_digest is None and name in manifested:
            from ckpt_cli.manifest import write_manifest
            from ckpt_cli.trust.ledger import manifest_digest

            with contextlib.suppress(CkptError):  # watch writes it when it verifies it
                write_manifest(d.entry.path)
                done.manifest_digest = manifest_digest(d.entry.path)
        result.thinned[name] = done
        detail = {"dropped": done.dropped, "dtype": done.dtype,
                  "bytes_before": done.bytes_before}
        append(root, LedgerEntry(path=name, step=d.entry.step, time=time.time(), event=THINNED,
                                 verdict="good", bytes=done.bytes_after,
                                 manifest_digest=done.manifest_digest, detail=detail))
        report(PruneEvent("thinned", name, f"dropped {', '.join(done.dropped) or 'nothing'}"
                          f"{', weights to ' + done.dtype if done.dtype else ''}: "
                          f"{done.bytes_before:,} -> {done.bytes_after:,} bytes", plan=plan))


def _killed_thinning(book: Ledger, name: str) -> bool:
    """Whether the newest ``thinned`` line of checkpoint ``name`` is a pending intent."""
    from ckpt_cli.trust.ledger import THINNED
    from ckpt_cli.trust.thinning import pending

    line = next((e for e in reversed(book.entries) if e.path == name and e.event == THINNED),
                None)
    return line is not None and pending(line)


def _confirm_interrupted(root: Path, name: str, step: int | None) -> None:
    """A checkpoint thinned by a prune that was killed before recording it (its newest
    ``thinned`` line is still the intent): give it its manifest again (when it has none) and
    record the thinning as done."""
    from ckpt_cli.manifest import manifest_path, write_manifest
    from ckpt_cli.trust.ledger import THINNED, LedgerEntry, append, manifest_digest
    from ckpt_cli.trust.thinning import PENDING, pending

    book = read_ledger(root)
    # Its newest thinning line (a watch pass may have verified it again since).
    line = next((e for e in reversed(book.entries) if e.path == name and e.event == THINNED),
                None) if book is not None else None
    if line is None or not pending(line):
        return
    path = root / name
    if not manifest_path(path).exists():
        with contextlib.suppress(CkptError):  # then watch writes it when it verifies it
            write_manifest(path)
    detail = {k: v for k, v in line.detail.items() if k != PENDING}
    append(root, LedgerEntry(path=name, step=step, time=time.time(), event=THINNED,
                             verdict="good", bytes=tree_scan(path).bytes,
                             manifest_digest=manifest_digest(path), detail=detail))


def _planned(root: Path, given: Path, policy: PrunePolicy, pattern: str | None,
             metrics_file: str | Path | None, dry_run: bool, now: float) -> PruneResult:
    """List the run, gather its facts and plan: the result before anything is done."""
    listing = list_run(root, pattern, strict=True)
    facts = gather_facts(listing, policy, metrics_file)
    plan = plan_prune(listing, policy, now, facts)
    return PruneResult(given, plan, dry_run, pattern=pattern,
                       metrics_file=Path(metrics_file) if metrics_file else None)


def _go_ahead(result: PruneResult, confirm: Callable[[PrunePlan], bool] | None,
              report: Callable[[PruneEvent], None]) -> bool:
    """Report the plan; whether to delete (not a dry run, and ``confirm`` did not decline)."""
    plan = result.plan
    report(PruneEvent("planned", total=len(plan.to_delete), plan=plan))
    if result.dry_run:
        return False
    if ((plan.to_delete or any(d.thin for d in plan.decisions)) and confirm is not None
            and not confirm(plan)):
        result.declined = True
        return False
    return True


NO_CHECKPOINTS_YET = "holds no checkpoints yet: nothing to do"


def _no_checkpoints(problem: str | None) -> bool:
    """Whether ``run_dir_problem`` said only that no checkpoint is there (yet): a cron job that
    starts before training's first save is a quiet success, not an error."""
    return problem is not None and problem.startswith("holds no checkpoints")


def _check_root(path: Path, any_dir: bool, pattern: str | None) -> tuple[Path, str | None]:
    check_exists(path)
    if not path.is_dir():
        raise CkptError("not a directory", path=path)
    # Work on the real path: the root's own symlink is what the user named, but nothing below
    # it is ever followed.
    root = path.resolve(strict=True)
    try:
        home = Path.home().resolve()
    except (RuntimeError, KeyError, OSError):  # no HOME and no passwd entry: nothing to guard
        home = Path(root.anchor) / ".ckpt-no-home"
    hint = "pass --any-dir if this really is the run directory to prune"
    what = ("the root directory" if root == Path(root.anchor) else "your home directory"
            if root == home else "a parent of your home directory" if root in home.parents
            else None)
    if what and not any_dir:
        raise UsageError(f"refusing to prune {what}", path=path, hint=hint)
    problem = run_dir_problem(root, pattern)
    if _no_checkpoints(problem):
        return root, NO_CHECKPOINTS_YET
    if problem and not any_dir:
        raise UsageError(problem, path=path, hint=hint)
    return root, None


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``root/.ckpt-prune.lock`` (released when the process
    dies, so a crashed prune never blocks the next)."""
    lock = root / LOCK_NAME
    try:
        # O_NOFOLLOW: a lock file that is a symlink must not make us open (and create) a file
        # elsewhere.
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except PermissionError:
        # Someone else's lock file in a shared run directory: flock works on a read-only
        # descriptor too.
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise CkptError(f"cannot open the lock file {LOCK_NAME}: {e.strerror}", path=root,
                            hint="prune needs to read or create the lock file") from None
    except OSError as e:
        raise CkptError(f"cannot open the lock file {LOCK_NAME}: {e.strerror}", path=root,
                        hint="prune needs write access to the run directory") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CkptError(f"cannot lock {LOCK_NAME}: {e.strerror}", path=root) from None
            raise CkptError("another ckpt prune is running on this directory", path=root,
                            hint=f"it holds {root / LOCK_NAME}; try again when it has "
                                 "finished") from None
        yield
    finally:
        os.close(fd)


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
        for path, line in ledger.latest().items():
            if path in names:
                facts.verdicts[path] = line.good
                if not line.good:
                    first = line.problems[0] if line.problems else "no problem recorded"
                    facts.validity[path] = f"the run ledger's verdict is bad: {first}"
    for e in reversed(ranked_entries(listing.entries)):
        if not e.complete or e.name in facts.validity:
            continue
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
    """Read a checkpoint's index (headers and pickles only) and report the first error.

    Args:
        path: A checkpoint file or directory.

    Returns:
        None if it reads without error findings, else why it is not valid.
    """
    try:
        index = read_index(path)
    except CkptError as e:
        return e.message
    except Exception as e:  # a reader failing on odd input must not stop the prune: keep more
        return f"could not be read: {type(e).__name__}: {e}"
    errors = [f for f in index.findings if f.severity == "error"]
    # Rank files against the world sizes the checkpoint records (a directory listing): a
    # ZeRO-3 tag missing one rank's model states reads fine but cannot be loaded.
    ranks = rank_findings(index, path) if path.is_dir() else None
    if ranks is not None:
        errors += [f for f in ranks[0] if f.severity == "error"]
    if errors:
        where = ":".join(x for x in (errors[0].file, errors[0].location) if x)
        return f"{where}: {errors[0].message}" if where else errors[0].message
    return None


# -- a prefix on object storage ---------------------------------------------------------------

def _prune_prefix(root: Path, policy: PrunePolicy, *, pattern: str | None,
                  metrics_file: str | Path | None, dry_run: bool, any_dir: bool,
                  confirm: Callable[[PrunePlan], bool] | None,
                  report: Callable[[PruneEvent], None], now: float | None) -> PruneResult:
    """:func:`prune` of a run directory on object storage, with the same rules.

    The plan is the same pure :func:`~ckpt_cli.ops.prune.retention.plan_prune` of the same listing
    (newest valid kept, in-progress and too-recent checkpoints kept, ``latest`` pointers
    honoured). An object store has no locks and no rename, so the deletion differs: each
    checkpoint is re-listed right before it goes (any change since planning keeps it), only
    keys below ``<prefix>/<name>`` are deleted (``DeleteObjects``, 1,000 keys a call), its
    commit markers first. A versioned bucket is said so: deleted objects stay as noncurrent
    versions, and cost money, until a lifecycle rule expires them.
    """
    obj = cast(storage.ObjectPath, root)
    check_exists(root)
    if not root.is_dir():
        raise CkptError("not a prefix with checkpoints below it", path=root)
    hint = "pass --any-dir if this really is the run directory to prune"
    if "/" not in obj.key and not any_dir:
        raise UsageError("refusing to prune a whole bucket", path=root, hint=hint)
    problem = run_dir_problem(root, pattern)
    if problem and not any_dir and not _no_checkpoints(problem):
        raise UsageError(problem, path=root, hint=hint)
    result = _planned(root, root, policy, pattern, metrics_file, dry_run,
                      time.time() if now is None else now)
    result.note = NO_CHECKPOINTS_YET if _no_checkpoints(problem) else None
    plan = result.plan
    result.versioned = obj.store.versioned(obj.key.split("/", 1)[0])
    for d in plan.to_delete:
        result.keys[d.entry.name] = _keys_of(obj, d.entry.name)
    result.stale_uploads = _stale_uploads(obj, plan, time.time() if now is None else now)
    if not _go_ahead(result, confirm, report):
        return result
    for key, uid in result.stale_uploads:
        _abort_upload(obj, key, uid, result, report)
    done, total = 0, len(plan.to_delete)
    for d in plan.to_delete:
        name = d.entry.name
        obj.store.changed()  # see it as it is now, not as planned
        why = _recheck_prefix(obj, d.entry, plan, time.time() if now is None else now)
        status, detail = ("skipped", why) if why else _delete_prefix(obj, name)
        done += 1
        result.outcomes[name] = Outcome(status, detail)
        report(PruneEvent(status, name, detail, done, total, d))

    def recheck_object(entry: RunEntry) -> str | None:
        obj.store.changed()  # see it as it is now, not as planned
        return _recheck_prefix(obj, entry, plan, time.time() if now is None else now)

    _thin(root, plan, result, time.time, report, recheck_object)
    return result
