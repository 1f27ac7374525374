"""``prune``'s deletion in a local run directory: finish an interrupted prune's trash, then for
each checkpoint re-check it, rename it aside to a trash name, check it again, and remove the trash
only after every rename is durable (see :mod:`ckpt_cli.ops.prune`, step 5)."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from ckpt_cli.errors import CkptError
from ckpt_cli.formats.names import TRASH_PREFIX
from ckpt_cli.model import POINTER_UNREADABLE, RunEntry, RunListing
from ckpt_cli.ops.prune.deletion import (
    HeldDir,
    mounts_inside,
    put_back,
    remove_child,
    trash_name,
)
from ckpt_cli.ops.prune.result import Outcome, PruneEvent, PruneResult
from ckpt_cli.ops.prune.retention import (
    Decision,
    PrunePlan,
    pointer_protections,
)
from ckpt_cli.runs import (
    LOCK_SUFFIX,
    POINTER_FILES,
    read_pointers,
    tree_scan,
)


def _finish_trash(root: HeldDir, listing: RunListing, result: PruneResult,
                  report: Callable[[PruneEvent], None]) -> None:
    """Remove what an interrupted prune renamed aside but did not get to remove."""
    for name in listing.leftovers:
        if not name.startswith(TRASH_PREFIX):
            continue  # other leftovers (writers' temporary names) may still be in use
        err = remove_child(root, name)
        if err:
            result.trash_failed[name] = err
            report(PruneEvent("failed", name, err))
        else:
            result.trash_removed.append(name)
            report(PruneEvent("trash", name))


def _delete(root: HeldDir, plan: PrunePlan, result: PruneResult, clock: Callable[[], float],
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
            trash = trash_name(root, name)
            root.rename(name, trash)
        except OSError as e:
            finish(d, "failed", f"could not move it aside: {e.strerror}")
            continue
        why = _moved_unchanged(root, top, trash, d.entry, pointers)
        if why:
            finish(d, *put_back(root, name, trash, why))
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
        err = remove_child(root, trash)
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
