"""``prune`` in a local run directory: :class:`LocalRun`, the executor's site for a directory.

It refuses roots that cannot be meant, holds ``.ckpt-prune.lock``, finishes an interrupted
prune's trash, then for each checkpoint re-checks it, renames it aside to a trash name, checks it
again, and removes the trash only after every rename is durable (see :mod:`ckpt_cli.ops.prune`,
step 5). Every rename and removal is relative to the directory held open
(:mod:`ckpt_cli.ops.prune.deletion`); nothing is followed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ckpt_cli.errors import BusyError, CkptError, UsageError
from ckpt_cli.formats import check_exists
from ckpt_cli.manifest import MANIFEST_SUFFIX
from ckpt_cli.model import POINTER_UNREADABLE, RunEntry
from ckpt_cli.ops.prune.deletion import (
    HeldDir,
    mounts_inside,
    put_back,
    remove_child,
    trash_name,
)
from ckpt_cli.ops.prune.executor import ANY_DIR_HINT
from ckpt_cli.ops.prune.result import Outcome, PruneEvent, PruneResult
from ckpt_cli.ops.prune.retention import (
    Decision,
    PrunePlan,
    pointer_protections,
)
from ckpt_cli.runs import (
    LOCK_SUFFIX,
    POINTER_FILES,
    PRUNE_LOCK,
    read_pointers,
    stale_temporaries,
    tree_scan,
)


def _sweep(root: HeldDir, now: float) -> tuple[list[str], dict[str, str]]:
    """Remove what interrupted writes left: an interrupted prune's trash, a killed thinning's
    or manifest write's temporaries, at the run's top and inside its checkpoints
    (:func:`ckpt_cli.runs.stale_temporaries` decides; a writer still running keeps its own).
    The caller holds the prune lock. Returns what was removed and what could not be, with why.
    """
    removed: list[str] = []
    failed: dict[str, str] = {}
    for name in orphan_manifests(root):
        err = remove_child(root, name)
        if err:
            failed[name] = err
        else:
            removed.append(name)
    for path in stale_temporaries(root.path, now):
        rel = path.relative_to(root.path).as_posix()
        held = root if path.parent == root.path else None
        try:
            if held is None:
                held = HeldDir(path.parent)
            err = remove_child(held, path.name)
        except OSError as e:
            err = f"cannot open its directory: {e.strerror}"
        finally:
            if held is not None and held is not root:
                held.close()
        if err:
            failed[rel] = err
        else:
            removed.append(rel)
    return removed, failed


def orphan_manifests(root: HeldDir, only: str | None = None) -> list[str]:
    """The manifests at the run's top whose checkpoint is gone (``model_5.pt.ckpt-manifest.json``
    without ``model_5.pt``): regular files only, by name.

    Args:
        root: The run directory, held open.
        only: Look at this checkpoint's manifest only (no listing).

    Returns:
        Their names, sorted.
    """
    out: list[str] = []
    try:
        if only is not None:
            names = [only + MANIFEST_SUFFIX]
        else:
            with os.scandir(root.fd) as it:
                names = sorted(e.name for e in it if e.name.endswith(MANIFEST_SUFFIX))
    except OSError:
        return out
    for name in names:
        base = name.removesuffix(MANIFEST_SUFFIX)
        try:
            regular = stat.S_ISREG(root.lstat(name).st_mode)
        except OSError:
            continue
        if base and regular and not root.exists(base):
            out.append(name)
    return out


def sweep(path: Path) -> list[str]:
    """The sweep every prune starts with, alone: for ``ckpt watch``'s passes.

    Args:
        path: A local run directory.

    Returns:
        What was removed (relative to the run); nothing when there was nothing to remove or
        another prune holds the lock (that prune sweeps itself).
    """
    if not stale_temporaries(path, time.time()) and not _has_orphans(path):
        return []  # the usual case: no lock file created, no directory held
    try:
        root = _checked_root(path, any_dir=True)
        with _locked(root):
            held = HeldDir(root)
            try:
                return _sweep(held, time.time())[0]
            finally:
                held.close()
    except (CkptError, OSError):
        return []


def _has_orphans(path: Path) -> bool:
    try:
        held = HeldDir(path)
    except OSError:
        return False
    try:
        return bool(orphan_manifests(held))
    finally:
        held.close()


LOCK_NAME = PRUNE_LOCK
"""The file ``prune`` locks in the run directory (left in place: removing a lock file races)."""


class LocalRun:
    """A run directory on a file system, as the executor's :class:`~ckpt_cli.ops.prune.executor.
    RunSite`.

    Args:
        path: The run directory as given.
        any_dir: Accept ``/``, ``$HOME`` and its parents.
        now: The current time (tests); the clock by default.

    Raises:
        UsageError: A root refused without ``any_dir``.
        CkptError: It is missing or not a directory.
    """

    def __init__(self, path: Path, *, any_dir: bool, now: float | None) -> None:
        self.root = _checked_root(path, any_dir)
        self.start, self._started = (time.time() if now is None else now), time.monotonic()
        self._held: HeldDir | None = None
        self._plan: PrunePlan | None = None
        self._pointers: PointerWatch | None = None
        # Mount points inside the run directory while deleting, read once (None: all, read
        # at each check); mounts made later are caught by the removal walk's mount-id check.
        self._points: list[str] | None = None

    def clock(self) -> float:
        """The current time: ``now`` moved on by the monotonic clock."""
        return self.start + (time.monotonic() - self._started)

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """Hold ``.ckpt-prune.lock`` (see :func:`_locked`)."""
        return _locked(self.root)

    def sweep(self) -> tuple[list[str], dict[str, str]]:
        """Under the lock, before listing: remove what interrupted writes left (see
        :func:`_sweep`): removed, and failed with why."""
        held = HeldDir(self.root)
        try:
            return _sweep(held, self.clock())
        finally:
            held.close()

    def planned(self, result: PruneResult) -> None:
        """Take note of the plan (its pointers are the ones re-checks compare with)."""
        self._plan = result.plan
        self._pointers = PointerWatch(self.root, result.plan)

    def _state(self) -> tuple[PrunePlan, PointerWatch]:
        assert self._plan is not None and self._pointers is not None, "planned() first"
        return self._plan, self._pointers

    def _dir(self) -> HeldDir:
        assert self._held is not None, "begin() first"
        return self._held

    def begin(self, result: PruneResult, report: Callable[[PruneEvent], None]) -> None:
        """Hold the directory open (what interrupted writes left was swept before planning)."""
        self._state()
        self._held = HeldDir(self.root)
        self._points = mounts_inside(str(self.root))

    def recheck(self, entry: RunEntry) -> str | None:
        """:func:`recheck` now."""
        plan, pointers = self._state()
        return recheck(self.root, entry, plan, self.clock(), pointers, self._points)

    def set_aside(self, d: Decision) -> Outcome | str:
        """Re-check it and rename it aside to a trash name, or put it back if it changed while
        being moved: the trash name, or the outcome when it stays."""
        held, name = self._dir(), d.entry.name
        _, pointers = self._state()
        # Its top is stat-ed before the re-check walks it: whatever is added at its top after
        # this moment changes the top's modification time, which is compared after the rename.
        try:
            top = held.lstat(name)
        except OSError:
            top = None
        why = self.recheck(d.entry)
        if why or top is None:
            return Outcome("skipped", why or "it is gone already (removed by someone else)")
        try:
            trash = trash_name(held, name)
            held.rename(name, trash)
        except OSError as e:
            return Outcome("failed", f"could not move it aside: {e.strerror}")
        why = _moved_unchanged(held, top, trash, d.entry, pointers)
        if why:
            return Outcome(*put_back(held, name, trash, why))
        return trash

    def make_durable(self) -> None:
        """The renames must be on disk before any file goes: after a crash the checkpoint is
        then either whole under its name or (partly) gone under a trash name."""
        held = self._dir()
        try:
            os.fsync(held.fd)
        except OSError as e:
            # Some file systems cannot fsync a directory (EINVAL); their renames are as
            # durable as they get. Anything else: stop before removing anything.
            if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise CkptError(f"cannot flush the renames to disk: {e.strerror}; the moved "
                                "checkpoints stay as .ckpt-trash-* for the next prune",
                                path=held.path) from None

    def remove(self, d: Decision, waiting: str) -> Outcome:
        """Remove the trash a checkpoint was renamed to."""
        err = remove_child(self._dir(), waiting)
        if err:
            return Outcome("failed", f"{err}; the rest is left as {waiting} for the next prune "
                                     "to remove")
        # Its manifest beside it (a single file's) goes too, unless a new save took the name
        # meanwhile (the manifest may be that one's); one a crash leaves is an orphan the
        # next sweep removes.
        held = self._dir()
        if not held.exists(d.entry.name) and d.entry.name + MANIFEST_SUFFIX in (
                orphan_manifests(held, only=d.entry.name)):
            remove_child(held, d.entry.name + MANIFEST_SUFFIX)
        return Outcome("deleted")

    def end(self) -> None:
        """Release the directory."""
        if self._held is not None:
            self._held.close()
            self._held = None
        self._points = None


def _checked_root(path: Path, any_dir: bool) -> Path:
    """The real path of the run directory, refusing ``/``, ``$HOME`` and its parents unless
    ``any_dir``."""
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
    what = ("the root directory" if root == Path(root.anchor) else "your home directory"
            if root == home else "a parent of your home directory" if root in home.parents
            else None)
    if what and not any_dir:
        raise UsageError(f"refusing to prune {what}", path=path, hint=ANY_DIR_HINT,
                         param="any_dir")
    return root

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
    scan = tree_scan(Path(path), own_times=True)  # as the listing scanned it
    before = (entry.bytes, entry.files, entry.mtime, entry.changed)
    if (scan.bytes, scan.files, scan.mtime, scan.changed) != before:
        return (f"it changed since planning ({entry.files:,} -> {scan.files:,} files, "
                f"{entry.bytes:,} -> {scan.bytes:,} bytes, or newer times)")
    if plan.policy.grace and now - scan.changed < plan.policy.grace:
        return "it changed within `grace`"
    why = (pointers or PointerWatch(root, plan)).protects(entry)
    if why:
        return why
    for lock in (f"{entry.name}{LOCK_SUFFIX}", f".{entry.name}{LOCK_SUFFIX}"):
        if os.path.lexists(os.path.join(root, lock)):
            return f"lock file {lock} appeared"
    return None


def _moved_unchanged(root: HeldDir, top: os.stat_result, trash: str, entry: RunEntry,
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
            raise BusyError("another ckpt prune is running on this directory", path=root,
                            hint=f"it holds {root / LOCK_NAME}; try again when it has "
                                 "finished") from None
        yield
    finally:
        os.close(fd)
