"""``prune``: delete old checkpoints of a run directory by retention rules, safely.

The order of work, and why:

1. Refuse roots that cannot be meant (``/``, ``$HOME``, a checkpoint, a directory without
   checkpoints) unless forced.
2. Take ``.ckpt-prune.lock`` with ``flock`` (not for ``dry_run``), so two prunes never race.
3. List the run directory, gather facts by reading files (lock files, quick validation of the
   newest checkpoints, metric values, HF Trainer's best checkpoint), and let the pure
   :func:`ckpt_cli.planning.plan_prune` decide.
4. Stop for ``dry_run``; ask ``confirm`` (the CLI's prompt) when given.
5. Finish the trash an interrupted prune left, then for each checkpoint to delete: re-check it
   (it may have changed since planning), rename it out of the checkpoint namespace to
   ``.ckpt-trash-<name>``, check it again and put it back if it changed while being moved, and
   only after all renames are durable (``fsync`` of the directory) remove the trash. A crash
   leaves trash that no reader mistakes for a checkpoint and that the next prune removes, never
   a half-deleted checkpoint under its own name.

Nothing here prints or prompts; progress goes to ``on_progress``.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import math
import os
import re
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.formats import check_exists, read_index
from ckpt_cli.formats.names import TRASH_PREFIX
from ckpt_cli.model import RunEntry, RunListing
from ckpt_cli.ops.validate.layoutcheck import rank_findings
from ckpt_cli.planning import (
    Decision,
    PrunePlan,
    PrunePolicy,
    RunFacts,
    plan_prune,
    pointer_protections,
    ranked_entries,
)
from ckpt_cli.runs import (
    LOCK_SUFFIX,
    POINTER_FILES,
    POINTER_UNREADABLE,
    list_run,
    read_pointers,
    run_dir_problem,
    tree_scan,
    writer_lock,
)

LOCK_NAME = ".ckpt-prune.lock"
"""The file ``prune`` locks in the run directory (left in place: removing a lock file races)."""
RESCUE_PREFIX = ".ckpt-rescued-"
"""Where a checkpoint goes when it changed while being moved aside and its name was taken."""
_NAME_MAX = 255


@dataclass(frozen=True, slots=True)
class PruneEvent:
    """Progress of a prune, for ``on_progress``.

    Attributes:
        kind: ``planned``, ``trash`` (leftover trash removed), ``moved`` (renamed aside),
            ``deleted``, ``skipped`` or ``failed``.
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


def prune(path: str | Path, policy: PrunePolicy, *, pattern: str | None = None,
          metrics_file: str | Path | None = None, dry_run: bool = False, force: bool = False,
          confirm: Callable[[PrunePlan], bool] | None = None,
          on_progress: Callable[[PruneEvent], None] | None = None,
          now: float | None = None) -> PruneResult:
    """Plan the retention of a run directory's checkpoints and, unless ``dry_run``, apply it.

    Args:
        path: The run directory.
        policy: What to keep (see :class:`~ckpt_cli.planning.PrunePolicy`).
        pattern: A regex that overrides checkpoint-name recognition.
        metrics_file: A CSV, JSON or JSON-lines file of metrics by step (for ``keep_best``).
        dry_run: Plan only; change nothing and take no lock.
        force: Accept ``/``, ``$HOME`` and directories that do not look like run directories.
        confirm: Called with the plan before anything is changed, when there is something to
            delete; returning False changes nothing.
        on_progress: Called with each :class:`PruneEvent`.
        now: The current time for ages and the grace period (tests); the clock by default.

    Returns:
        The :class:`PruneResult`; deletions that failed are in it, not raised.

    Raises:
        UsageError: A policy that cannot be meant, a root refused without ``force``, a metric
            no checkpoint has.
        CkptError: The directory is missing or unreadable, or another prune holds the lock.
    """
    policy.check()
    root_arg = Path(path)
    root = _check_root(root_arg, force, pattern)
    start, started = (time.time() if now is None else now), time.monotonic()

    def clock() -> float:
        return start + (time.monotonic() - started)

    report = on_progress or (lambda _e: None)
    with contextlib.nullcontext() if dry_run else _locked(root):
        listing = list_run(root, pattern, strict=True)
        facts = gather_facts(listing, policy, metrics_file)
        plan = plan_prune(listing, policy, start, facts)
        result = PruneResult(root_arg, plan, dry_run, pattern=pattern,
                             metrics_file=Path(metrics_file) if metrics_file else None)
        report(PruneEvent("planned", total=len(plan.to_delete), plan=plan))
        if dry_run:
            return result
        if plan.to_delete and confirm is not None and not confirm(plan):
            result.declined = True
            return result
        held = _Root(root)
        try:
            _finish_trash(held, listing, result, report)
            _delete(held, plan, result, clock, report)
        finally:
            held.close()
    return result


def _check_root(path: Path, force: bool, pattern: str | None) -> Path:
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
    if what and not force:
        raise UsageError(f"refusing to prune {what}", path=path, hint=hint)
    problem = run_dir_problem(root, pattern)
    if problem and not force:
        raise UsageError(problem, path=path, hint=hint)
    return root


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
    """Read what :func:`~ckpt_cli.planning.plan_prune` needs from the files.

    Quick validation walks from the newest checkpoint back and stops at the first complete one
    that reads without errors, so it reads one or a few checkpoints' headers, not all.

    Args:
        listing: The run directory.
        policy: The policy (metrics are read only for ``keep_best``).
        metrics_file: An explicit metrics file, if any.

    Returns:
        The :class:`~ckpt_cli.planning.RunFacts`.

    Raises:
        UsageError: ``keep_best`` and no checkpoint has a value for the metric.
        CkptError: The metrics file cannot be read.
    """
    facts = RunFacts()
    # Mount points inside the run directory (usually none: then no per-checkpoint work).
    points = mounts_inside(str(listing.root))
    real_root = os.path.realpath(listing.root)
    for e in listing.entries:
        lock = writer_lock(e.path)
        if lock:
            facts.locks[e.name] = lock
        inside = points and mounts_inside(os.path.join(real_root, e.name), points)
        if inside:
            facts.pinned[e.name] = f"a file system is mounted inside it ({inside[0]})"
    for e in reversed(ranked_entries(listing.entries)):
        if not e.complete:
            continue
        why = quick_validate(e.path)
        facts.validity[e.name] = why
        if why is None:
            break
    history, best = _trainer_state(listing)
    if best:
        facts.pinned[best[0]] = best[1]
    if policy.keep_best is not None and policy.metric:
        facts.metrics = _metric_values(listing, policy.metric, history, metrics_file)
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


def _trainer_state(listing: RunListing) -> tuple[list[dict[str, Any]], tuple[str, str] | None]:
    """HF Trainer's log history and best checkpoint, from the newest ``trainer_state.json``.

    The Trainer reloads ``best_model_checkpoint`` at the end of training
    (``load_best_model_at_end``) and its own rotation never deletes it, so neither do we.
    """
    states = [listing.root / "trainer_state.json"]
    states.append(next((e.path / "trainer_state.json" for e in reversed(listing.entries)
                        if e.complete and (e.path / "trainer_state.json").is_file()), states[0]))
    newest = max((p for p in states if p.is_file()), key=lambda p: p.stat().st_mtime,
                 default=None)
    if newest is None:
        return [], None
    try:
        data = orjson.loads(newest.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return [], None
    if not isinstance(data, dict):
        return [], None
    raw_history = data.get("log_history")
    history = [h for h in raw_history if isinstance(h, dict)] if isinstance(
        raw_history, list) else []
    best = data.get("best_model_checkpoint")
    names = {e.name for e in listing.entries}
    if isinstance(best, str) and Path(best).name in names:
        where = newest.relative_to(listing.root)
        return history, (Path(best).name, f"{where} names it best_model_checkpoint: the HF "
                                          "Trainer reloads it at the end of training")
    return history, None


def _metric_values(listing: RunListing, metric: str, history: list[dict[str, Any]],
                   metrics_file: str | Path | None) -> dict[str, float]:
    """``--metric`` per checkpoint: the metrics file, else the name, else trainer state."""
    keys = (metric, f"eval_{metric}")
    by_step: dict[int, float] = {}
    by_name: dict[str, float] = {}
    seen: set[str] = set()
    for h in history:
        seen.update(k for k in h if isinstance(k, str) and k != "step")
        value = next((h[k] for k in keys if _is_number(h.get(k))), None)
        if value is not None and isinstance(h.get("step"), int):
            by_step[h["step"]] = float(value)
    if metrics_file is not None:
        file_steps, file_names, file_keys = read_metrics_file(Path(metrics_file), keys)
        by_step.update(file_steps)
        by_name.update(file_names)
        seen.update(file_keys)
    out: dict[str, float] = {}
    steps = {e.step for e in listing.entries if e.step is not None}
    for e in listing.entries:
        seen.update(e.metrics)
        value = by_name.get(e.name)
        if value is None:
            value = e.metrics.get(metric)
        if value is None and e.step is not None:
            value = by_step.get(e.step)
            if value is None and e.step - 1 not in steps:
                # Lightning's CSVLogger logs validation at step S-1 for the checkpoint named
                # step=S. Only that: a value from further back evaluated another model.
                value = by_step.get(e.step - 1)
        if value is not None:
            out[e.name] = value
    if not out:
        known = ", ".join(sorted(seen)[:12]) or "none"
        raise UsageError(f"no checkpoint has a value for --metric {metric} (metrics found: "
                         f"{known})", hint="check the name, or give --metrics-file")
    return out


def read_metrics_file(path: Path, keys: tuple[str, ...],
                      ) -> tuple[dict[int, float], dict[str, float], set[str]]:
    """Metric values by step and by checkpoint name from a metrics file.

    Accepted: CSV with a ``step`` (or ``global_step``) column (Lightning's CSVLogger); JSON
    lines of objects with ``step``; a JSON list of such objects, an object with a
    ``log_history`` list (an HF ``trainer_state.json``), or an object mapping checkpoint names
    or steps to a value or to an object of metrics.

    Args:
        path: The file.
        keys: The metric's accepted names (``loss`` and ``eval_loss``...), first match wins.

    Returns:
        ``(by step, by name, every metric name seen)``.

    Raises:
        CkptError: The file cannot be read or parsed.
    """
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CkptError(f"cannot read the metrics file: {e.strerror}", path=path) from None
    rows: list[Any]
    try:
        if path.suffix == ".csv":
            rows = list(csv.DictReader(raw.decode("utf-8", "replace").splitlines()))
        elif path.suffix == ".jsonl":
            rows = [orjson.loads(line) for line in raw.splitlines() if line.strip()]
        else:
            doc = orjson.loads(raw)
            rows = doc.get("log_history", doc) if isinstance(doc, dict) else doc
    except (orjson.JSONDecodeError, csv.Error, UnicodeDecodeError) as e:
        raise CkptError(f"cannot parse the metrics file: {e}", path=path) from None
    by_step: dict[int, float] = {}
    by_name: dict[str, float] = {}
    seen: set[str] = set()
    if isinstance(rows, dict):
        for name, v in rows.items():
            if isinstance(v, dict):
                seen.update(v)
                value = next((_as_float(v.get(k)) for k in keys
                              if _as_float(v.get(k)) is not None), None)
            else:
                value = _as_float(v)
            if value is None:
                continue
            if str(name).isdigit():
                by_step[int(name)] = value
            else:
                by_name[str(name)] = value
        return by_step, by_name, seen
    if not isinstance(rows, list):
        raise CkptError("metrics file: expected rows of metrics by step", path=path)
    for row in rows:
        if not isinstance(row, dict):
            continue
        # csv.DictReader files surplus fields under the key None.
        seen.update(k for k in row if isinstance(k, str) and k not in ("step", "global_step"))
        step = _as_int(row.get("step", row.get("global_step")))
        value = next((_as_float(row.get(k)) for k in keys if _as_float(row.get(k)) is not None),
                     None)
        if step is not None and value is not None:
            by_step[step] = value
    return by_step, by_name, seen


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _as_float(v: Any) -> float | None:
    if _is_number(v):
        return float(v)
    if isinstance(v, str) and v.strip():
        try:
            return float(v)
        except ValueError:
            return None
    return None


def _as_int(v: Any) -> int | None:
    f = _as_float(v)
    return int(f) if f is not None and math.isfinite(f) and f == int(f) else None


# -- execution ---------------------------------------------------------------------------------


class _Root:
    """The run directory, held open while deleting.

    Every rename and removal is relative to this descriptor (``*at`` system calls), so
    replacing the directory's path with a symlink mid-prune cannot redirect them elsewhere.

    Args:
        path: The run directory (already resolved: no symlink in it).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.dev = os.fstat(self.fd).st_dev
        self.mount = (self.dev, mount_id(self.fd))

    def close(self) -> None:
        """Release the descriptor."""
        os.close(self.fd)

    def lstat(self, name: str) -> os.stat_result:
        """``lstat`` of a child."""
        return os.lstat(name, dir_fd=self.fd)

    def exists(self, name: str) -> bool:
        """Whether a child exists (a dangling symlink counts)."""
        try:
            self.lstat(name)
        except FileNotFoundError:
            return False
        return True

    def rename(self, src: str, dst: str) -> None:
        """Rename a child (the caller checked that ``dst`` is free)."""
        os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)


def _finish_trash(root: _Root, listing: RunListing, result: PruneResult,
                  report: Callable[[PruneEvent], None]) -> None:
    """Remove what an interrupted prune renamed aside but did not get to remove."""
    for name in listing.leftovers:
        if not name.startswith(TRASH_PREFIX):
            continue  # other leftovers (writers' temporary names) may still be in use
        err = _remove(root, name)
        if err:
            result.trash_failed[name] = err
            report(PruneEvent("failed", name, err))
        else:
            result.trash_removed.append(name)
            report(PruneEvent("trash", name))


def _delete(root: _Root, plan: PrunePlan, result: PruneResult, clock: Callable[[], float],
            report: Callable[[PruneEvent], None]) -> None:
    victims = plan.to_delete
    total = len(victims)
    moved: list[tuple[Decision, str]] = []
    done = 0
    pointers = PointerWatch(root.path, plan)
    # Mount points inside the run directory; mounts made after this are caught by the
    # mount-id check of the removal walk.
    points = mounts_inside(str(root.path))

    def finish(d: Decision, status: str, detail: str | None = None) -> None:
        nonlocal done
        done += 1
        result.outcomes[d.entry.name] = Outcome(status, detail)
        report(PruneEvent(status, d.entry.name, detail, done, total, d))

    for d in victims:
        name = d.entry.name
        # Its top is stat-ed before the re-check walks it: whatever is added at its top after
        # this moment changes the top's modification time, which is compared after the rename.
        try:
            top = root.lstat(name)
        except OSError:
            top = None
        why = recheck(root.path, d.entry, plan, clock(), pointers, points)
        if why or top is None:
            finish(d, "skipped", why or "it is gone already (removed by someone else)")
            continue
        try:
            trash = _trash_name(root, name)
            root.rename(name, trash)
        except OSError as e:
            finish(d, "failed", f"could not move it aside: {e.strerror}")
            continue
        why = _moved_unchanged(root, top, trash, d.entry, pointers)
        if why:
            finish(d, *_put_back(root, name, trash, why))
            continue
        moved.append((d, trash))
        report(PruneEvent("moved", name, None, done, total, d))
    if moved:
        # The renames must be on disk before any file goes: after a crash the checkpoint is
        # then either whole under its name or (partly) gone under a trash name.
        try:
            os.fsync(root.fd)
        except OSError as e:
            # Some file systems cannot fsync a directory (EINVAL); their renames are as
            # durable as they get. Anything else: stop before removing anything.
            if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise CkptError(f"cannot flush the renames to disk: {e.strerror}; the moved "
                                "checkpoints stay as .ckpt-trash-* for the next prune",
                                path=root.path) from None
    for d, trash in moved:
        err = _remove(root, trash)
        if err:
            finish(d, "failed", f"{err}; the rest is left as {trash} for the next prune to "
                                "remove")
        else:
            finish(d, "deleted")


class PointerWatch:
    """Re-reads the run directory's pointers when, and only when, their files change.

    Checking "does a pointer name this now?" before each of thousands of deletions must not
    re-read and re-parse every pointer file each time; an ``lstat`` of each tells whether it
    may have changed.

    Args:
        root: The run directory.
        plan: The plan (its pointers are the ones decided with).
    """

    def __init__(self, root: Path, plan: PrunePlan) -> None:
        self.root, self.plan = root, plan
        self.names = [*POINTER_FILES, *(n for n in plan.listing.pointers if n.startswith("last"))]
        self._paths = [os.path.join(root, n) for n in self.names]
        self._sig: list[tuple[int, int, int, int] | None] | None = None
        self._why: str | None = None
        self._pointers: dict[str, str] = dict(plan.listing.pointers)

    def _signature(self) -> list[tuple[int, int, int, int] | None]:
        out: list[tuple[int, int, int, int] | None] = []
        for path in self._paths:
            try:
                st = os.lstat(path)
            except OSError:
                out.append(None)
                continue
            out.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return out

    def protects(self, entry: RunEntry) -> str | None:
        """Why a pointer protects ``entry`` now (which it did not when the plan was made).

        Args:
            entry: A checkpoint of the plan.

        Returns:
            The reason, or None.
        """
        sig = self._signature()
        if sig != self._sig:
            self._sig = sig
            links = [n for n in self.names if n.startswith("last")]
            pointers, findings = read_pointers(self.root, links)
            bad = [f for f in findings if f.code == POINTER_UNREADABLE]
            self._why = bad[0].message if bad else None
            self._pointers = pointers
        if self._why:
            return self._why
        if self._pointers == self.plan.listing.pointers:
            return None
        protected = pointer_protections(self.plan.listing.entries, self._pointers).get(
            entry.name)
        return f"now {protected[1]}" if protected else None


def recheck(root: Path, entry: RunEntry, plan: PrunePlan, now: float,
            pointers: PointerWatch | None = None, points: list[str] | None = None) -> str | None:
    """Check right before deleting that a checkpoint is still what the plan decided about.

    Between planning and deleting (a prompt, other deletions) a writer may have added files to
    it, touched it, started rewriting it, locked it, or moved a pointer to it. Its tree must be
    exactly as planned (sizes, file count, modification and inode-change times): an unchanged
    tree is also still complete and has no new lock file inside.

    Args:
        root: The run directory.
        entry: The checkpoint as planned.
        plan: The plan.
        now: The current time.
        pointers: A :class:`PointerWatch` shared across checks (one is made if None).
        points: Mount points to consider (those inside the run directory), read once per
            prune (all are read if None).

    Returns:
        None if it may be deleted, else why not.
    """
    path = os.path.join(root, entry.name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "it is gone already (removed by someone else)"
    except OSError as e:
        return f"cannot check it: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link now; never followed"
    inside = mounts_inside(path, points)
    if inside:
        return f"a file system is mounted inside it ({inside[0]}); not deleted"
    scan = tree_scan(Path(path))
    before = (entry.bytes, entry.files, entry.mtime, entry.changed)
    if (scan.bytes, scan.files, scan.mtime, scan.changed) != before:
        return (f"it changed since planning ({entry.files:,} -> {scan.files:,} files, "
                f"{entry.bytes:,} -> {scan.bytes:,} bytes, or newer times)")
    if plan.policy.grace and now - scan.changed < plan.policy.grace:
        return "it changed within --grace"
    why = (pointers or PointerWatch(root, plan)).protects(entry)
    if why:
        return why
    for lock in (f"{entry.name}{LOCK_SUFFIX}", f".{entry.name}{LOCK_SUFFIX}"):
        if os.path.lexists(os.path.join(root, lock)):
            return f"lock file {lock} appeared"
    return None


def _moved_unchanged(root: _Root, top: os.stat_result, trash: str, entry: RunEntry,
                     pointers: PointerWatch) -> str | None:
    """Whether anything changed a checkpoint, or a pointer moved to it, while it was being
    renamed aside (since the re-check, microseconds ago).

    A file or directory added at its top changes the top's modification time; the rename
    itself only sets the inode-change time.
    """
    try:
        now = root.lstat(trash)
    except OSError as e:
        return f"cannot check it after moving it aside: {e.strerror}"
    if (now.st_ino, now.st_size, now.st_mtime_ns) != (top.st_ino, top.st_size, top.st_mtime_ns):
        return "it changed while being moved aside"
    return pointers.protects(entry)


def _put_back(root: _Root, name: str, trash: str, why: str) -> tuple[str, str]:
    """Undo a rename aside; if the name was taken meanwhile, keep the data under a rescue name."""
    if not root.exists(name):
        try:
            root.rename(trash, name)
            return "skipped", f"{why}; put back"
        except OSError:
            pass
    rescue = _fit(f"{RESCUE_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
    try:
        root.rename(trash, rescue)
        return "failed", f"{why}, and {name} was re-created meanwhile; kept as {rescue}"
    except OSError as e:
        return "failed", f"{why}; it is left as {trash} ({e.strerror})"


def _trash_name(root: _Root, name: str) -> str:
    """A free trash name for ``name``: ``.ckpt-trash-<name>``, made unique if taken."""
    plain = _fit(TRASH_PREFIX + name)
    if not root.exists(plain):
        return plain
    return _fit(f"{TRASH_PREFIX}{name}", f".{uuid.uuid4().hex[:8]}")


def _fit(name: str, suffix: str = "") -> str:
    """Shorten a name so that with ``suffix`` it fits the 255-byte limit of file names."""
    # fsencode keeps undecodable bytes of odd names (surrogateescape) instead of failing.
    raw = os.fsencode(name)
    room = _NAME_MAX - len(os.fsencode(suffix))
    if len(raw) > room:
        name = os.fsdecode(raw[:room])
    return name + suffix


def _remove(root: _Root, name: str) -> str | None:
    """Remove a child of the run directory, file or tree; None, or what failed.

    Walks with directory file descriptors and ``O_NOFOLLOW`` (as ``shutil.rmtree`` does on
    Linux, without its per-entry path building, which costs as much as the unlinks): a
    directory swapped for a symlink mid-walk is unlinked as a link, never entered, and a
    directory on another file system (a mount point) is never entered.
    """
    try:
        st = root.lstat(name)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot check {name}: {e.strerror}"
    errors: list[str] = []
    if stat.S_ISDIR(st.st_mode):
        _remove_dir(root.fd, name, name, errors, root.mount)
    else:
        _unlink(root.fd, name, name, errors)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return f"cannot remove {errors[0]}{more}"
    return None


def _unlink(dir_fd: int, name: str, where: str, errors: list[str],
            op: Callable[..., None] = os.unlink) -> None:
    """``op`` (unlink, or rmdir) of ``name`` in ``dir_fd``; a failure is added to ``errors``."""
    try:
        op(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as e:
        errors.append(f"{where}: {e.strerror}")


def mount_points() -> list[str]:
    """Every mount point (Linux ``/proc/self/mountinfo``; [] elsewhere)."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = os.fsdecode(f.read()).splitlines()  # as realpath decodes names
    except OSError:
        return []
    # Field 5 is the mount point, with space, tab, newline and backslash octal-escaped.
    return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            for fields in (line.split(" ") for line in lines) if len(fields) >= 5]


def mounts_inside(path: str, points: list[str] | None = None) -> list[str]:
    """Mount points at or below ``path`` (``points``: from :func:`mount_points`).

    A bind mount of a directory of the same file system looks like any directory to a walk;
    deleting through it would delete what it shows, outside the run directory.
    """
    if points is not None and not points:
        return []
    real = os.path.realpath(path)
    inside = real.rstrip("/") + "/"
    return [p for p in (mount_points() if points is None else points)
            if p == real or p.startswith(inside)]


def mount_id(fd: int) -> int | None:
    """The id of the mount an open file lies on (Linux ``/proc/self/fdinfo``), or None.

    Device numbers do not tell a bind mount of a directory of the same file system from the
    directory itself; mount ids do.
    """
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _remove_dir(parent: int, name: str, where: str, errors: list[str],
                mount: tuple[int, int | None]) -> None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # no longer a directory: remove the link
            _unlink(parent, name, where, errors)
        else:
            errors.append(f"{where}: {e.strerror}")
        return
    dev, mnt = mount
    if os.fstat(fd).st_dev != dev or (mnt is not None and mount_id(fd) != mnt):
        os.close(fd)
        errors.append(f"{where}: another file system is mounted there; not entered")
        return
    try:
        with os.scandir(fd) as it:
            children = [(c.name, c.is_dir(follow_symlinks=False)) for c in it]
        unlink = os.unlink
        # The loop body is as lean as it can be: at tens of thousands of files, interpreter
        # overhead per file would otherwise cost more than the unlink system calls.
        for child, is_dir in children:
            if is_dir:
                _remove_dir(fd, child, f"{where}/{child}", errors, mount)
                continue
            try:
                unlink(child, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                errors.append(f"{where}/{child}: {e.strerror}")
    except OSError as e:
        errors.append(f"{where}: {e.strerror}")
    finally:
        os.close(fd)
    _unlink(parent, name, where, errors, os.rmdir)
