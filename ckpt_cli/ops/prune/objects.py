"""``prune`` of a run directory on object storage: :class:`PrefixRun`, the executor's site for a
prefix, and the helpers that list, re-check and delete a checkpoint's keys below it and abort the
multipart uploads a killed writer left.

The plan is the same pure :func:`~ckpt_cli.ops.prune.retention.plan_prune` of the same listing
(newest valid kept, in-progress and too-recent checkpoints kept, ``latest`` pointers honoured).
An object store has no locks and no rename, so the deletion differs: each checkpoint is re-listed
right before it goes (any change since planning keeps it), only keys below ``<prefix>/<name>`` are
deleted (``DeleteObjects``, 1,000 keys a call), its commit markers first. A versioned bucket is
said so: deleted objects stay as noncurrent versions, and cost money, until a lifecycle rule
expires them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

from ckpt_cli import storage
from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.formats import check_exists
from ckpt_cli.manifest import MANIFEST_SUFFIX
from ckpt_cli.model import RunEntry
from ckpt_cli.ops.prune.executor import ANY_DIR_HINT
from ckpt_cli.ops.prune.result import Outcome, PruneEvent, PruneResult
from ckpt_cli.ops.prune.retention import (
    Decision,
    PrunePlan,
)
from ckpt_cli.runs import (
    read_pointers,
    tree_scan,
    writer_lock,
)

# What a checkpoint's readers trust it by: deleted first, so that an interrupted deletion
# leaves an incomplete checkpoint (which validate reports and the next prune removes), never
# one that looks complete with objects missing.
_MARKERS = (".metadata", ".index.json", "trainer_state.json", "metadata.json", "latest",
            "latest_checkpointed_iteration.txt", "ckpt-manifest.json")


class PrefixRun:
    """A run directory on object storage (a prefix), as the executor's
    :class:`~ckpt_cli.ops.prune.executor.RunSite`: no lock, no rename; each checkpoint is
    re-listed right before its keys are deleted.

    Args:
        path: The prefix.
        any_dir: Accept a whole bucket.
        now: The current time (tests); the clock by default.

    Raises:
        UsageError: A whole bucket without ``any_dir``.
        CkptError: Nothing is below the prefix.
    """

    def __init__(self, path: Path, *, any_dir: bool, now: float | None) -> None:
        self.root, self._obj, self._now = path, cast(storage.ObjectPath, path), now
        check_exists(path)
        if not path.is_dir():
            raise CkptError("not a prefix with checkpoints below it", path=path)
        if "/" not in self._obj.key and not any_dir:
            raise UsageError("refusing to prune a whole bucket", path=path, hint=ANY_DIR_HINT,
                             param="any_dir")
        self.start = self.clock()
        self._plan: PrunePlan | None = None

    def clock(self) -> float:
        """The current time (``now`` when given)."""
        return time.time() if self._now is None else self._now

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """Nothing: an object store has no locks (each deletion is re-checked instead)."""
        return contextlib.nullcontext()

    def planned(self, result: PruneResult) -> None:
        """Add whether the bucket keeps versions, the keys of each checkpoint to delete and
        the stale uploads to abort."""
        obj, plan = self._obj, result.plan
        self._plan = plan
        result.versioned = obj.store.versioned(obj.key.split("/", 1)[0])
        for d in plan.to_delete:
            result.keys[d.entry.name] = _keys_of(obj, d.entry.name)
        result.stale_uploads = _stale_uploads(obj, plan, self.clock())

    def begin(self, result: PruneResult, report: Callable[[PruneEvent], None]) -> None:
        """Abort the stale multipart uploads; delete the manifests whose checkpoint is gone."""
        for key, uid in result.stale_uploads:
            _abort_upload(self._obj, key, uid, result, report)
        orphans = _orphan_manifests(self._obj)
        if orphans:
            try:
                self._obj.store.delete(orphans)
            except CkptError as e:
                result.trash_failed.update({k.rsplit("/", 1)[-1]: e.message for k in orphans})
            else:
                result.trash_removed.extend(k.rsplit("/", 1)[-1] for k in orphans)

    def recheck(self, entry: RunEntry) -> str | None:
        """:func:`_recheck_prefix`, seeing the store as it is now, not as planned."""
        assert self._plan is not None, "planned() first"
        self._obj.store.changed()
        return _recheck_prefix(self._obj, entry, self._plan, self.clock())

    def set_aside(self, d: Decision) -> Outcome | str:
        """Re-check it and delete its keys: nothing waits (an object store has no rename)."""
        why = self.recheck(d.entry)
        return Outcome("skipped", why) if why else self.remove(d, d.entry.name)

    def make_durable(self) -> None:
        """Nothing: each deletion is done when its call returns."""

    def remove(self, d: Decision, waiting: str) -> Outcome:
        """Delete the checkpoint's keys, markers first."""
        return Outcome(*_delete_prefix(self._obj, waiting))

    def end(self) -> None:
        """Nothing held."""


def _stale_uploads(root: storage.ObjectPath, plan: PrunePlan,
                   now: float) -> list[tuple[str, str]]:
    """Multipart uploads below the prefix that a killed writer left: invisible, but their
    parts are billed. Only those idle (no new part) for longer than ``--grace`` and than
    :data:`~ckpt_cli.storage.UPLOAD_IDLE` count (an upload's progress shows only in its
    parts), and never one under a checkpoint a pointer names."""
    horizon = now - max(plan.policy.grace, storage.UPLOAD_IDLE)
    named = {f"{root.key}/{t}/" for t in plan.listing.pointers.values()}
    try:
        pending = root.store.pending_uploads(root.key + "/")
    except CkptError:  # a role without s3:ListBucketMultipartUploads: leave them be
        return []
    return [(k, uid) for k, uid, last in pending
            if last < horizon and not any(k.startswith(n) for n in named)]


def _abort_upload(root: storage.ObjectPath, key: str, upload_id: str, result: PruneResult,
                  report: Callable[[PruneEvent], None]) -> None:
    try:
        root.store.abort_upload(key, upload_id)
    except CkptError as e:
        report(PruneEvent("failed", key, f"could not abort its unfinished upload: {e.message}"))
    else:
        result.uploads_aborted.append(key)


def _keys_of(root: storage.ObjectPath, name: str) -> list[str]:
    """The keys of checkpoint ``name``: the object itself or every key below its prefix, and
    its manifest beside it (``<name>.ckpt-manifest.json``), never another outside
    ``<root>/<name>``."""
    child = root / name
    keys = child.keys_below()
    inside = f"{child.key}/"
    side = root / (name + MANIFEST_SUFFIX)
    return [k for k in keys if k == child.key or k.startswith(inside)] + (
        [side.key] if keys and side.is_file() else [])


def _orphan_manifests(root: storage.ObjectPath) -> list[str]:
    """The keys of manifests directly below the prefix whose checkpoint is gone."""
    names = set(root.store.children(root.key))
    return [f"{root.key}/{n}" for n in sorted(names) if n.endswith(MANIFEST_SUFFIX)
            and n.removesuffix(MANIFEST_SUFFIX) and n.removesuffix(MANIFEST_SUFFIX) not in names
            and (root / n).is_file()]


def _recheck_prefix(root: storage.ObjectPath, entry: RunEntry, plan: PrunePlan,
                    now: float) -> str | None:
    """None if checkpoint ``entry`` is still as planned; else why it is kept after all."""
    run = cast(Path, root)
    scan = tree_scan(run / entry.name, own_times=True)  # as the listing scanned it
    if not scan.exists:
        return "it is gone already (removed by someone else)"
    if (scan.bytes, scan.files, scan.mtime) != (entry.bytes, entry.files, entry.mtime):
        return (f"it changed since planning ({entry.files:,} -> {scan.files:,} objects, "
                f"{entry.bytes:,} -> {scan.bytes:,} bytes, or newer times)")
    if plan.policy.grace and now - scan.mtime < plan.policy.grace:
        return "it changed within `grace`"
    pointers, _ = read_pointers(run)
    named = [p for p, target in pointers.items() if target == entry.name]
    if named:
        return f"{named[0]} names it now"
    lock = writer_lock(run / entry.name)
    if lock:
        return f"lock file {lock} appeared"
    return None


def _delete_prefix(root: storage.ObjectPath, name: str) -> tuple[str, str | None]:
    keys = _keys_of(root, name)
    if not keys:
        return "skipped", "it is gone already (removed by someone else)"
    first = [k for k in keys if k.endswith(_MARKERS)]
    rest = [k for k in keys if k not in set(first)]
    try:
        if first:
            root.store.delete(first)
        root.store.delete(rest)
    except CkptError as e:
        return "failed", (f"{e.message}; what is left has no commit marker: validate reports it "
                           "and the next prune removes it")
    return "deleted", None
