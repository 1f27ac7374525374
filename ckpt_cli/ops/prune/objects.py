"""``prune`` of a run directory on object storage: the helpers that list, re-check and delete a
checkpoint's keys below a prefix, and abort the multipart uploads a killed writer left
(:func:`ckpt_cli.ops.prune._prune_prefix` plans and drives them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

from ckpt_cli import storage
from ckpt_cli.errors import CkptError
from ckpt_cli.model import RunEntry
from ckpt_cli.ops.prune.result import PruneEvent, PruneResult
from ckpt_cli.ops.prune.retention import (
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
    """The keys of checkpoint ``name``: the object itself or every key below its prefix,
    never one outside ``<root>/<name>``."""
    child = root / name
    keys = child.keys_below()
    inside = f"{child.key}/"
    return [k for k in keys if k == child.key or k.startswith(inside)]


def _recheck_prefix(root: storage.ObjectPath, entry: RunEntry, plan: PrunePlan,
                    now: float) -> str | None:
    """None if checkpoint ``entry`` is still as planned; else why it is kept after all."""
    run = cast(Path, root)
    scan = tree_scan(run / entry.name)
    if not scan.exists:
        return "it is gone already (removed by someone else)"
    if (scan.bytes, scan.files, scan.mtime) != (entry.bytes, entry.files, entry.mtime):
        return (f"it changed since planning ({entry.files:,} -> {scan.files:,} objects, "
                f"{entry.bytes:,} -> {scan.bytes:,} bytes, or newer times)")
    if plan.policy.grace and now - scan.mtime < plan.policy.grace:
        return "it changed within --grace"
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
