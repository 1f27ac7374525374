"""Writing one output from many processes: each part writes its own shards, the last one the
index.

Every part computes the same shard plan (:func:`ckpt_cli.writers.plan.plan_shards`) from the
source's metadata and deals the shards to parts by size (:func:`ckpt_cli.parts.assign`). A
part writes its shards into the staging directory's ``out/`` (each under a temporary name,
fsynced, then renamed), runs the caller's checks, and leaves a receipt saying which files it
wrote and their sizes. Under the staging lock, whoever finds every receipt there, matching the
plan, finalizes: it checks every planned file is there with the size its receipt gives,
writes the index and side files, fsyncs, and renames ``out/`` into place (or, for a
single-file output, the one file), then removes the staging directory. Until then nothing
at the destination looks like an output.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli.errors import DestinationExistsError
from ckpt_cli.manifest import manifest_path
from ckpt_cli.parts import (
    Part,
    PartOutcome,
    PartsIncompleteError,
    PartStore,
    assign,
    describe_parts,
    fingerprint,
    staging_dir,
)
from ckpt_cli.storage.atomic import fsync_path, fsync_tree, replace_dir

if TYPE_CHECKING:
    from ckpt_cli.writers.plan import ShardPlan
    from ckpt_cli.writers import WriteResult

OUT = "out"


@dataclass(frozen=True, slots=True)
class PartJob:
    """How a write is split over parts.

    Attributes:
        part: This process's part, or None to only finalize (``--finalize`` alone).
        finalize: Finalize now: with parts missing it is an error (exit 2) naming them.
        source_id: What identifies the source (files, sizes, mtimes): part of the plan, so
            that parts reading a source that changed between them refuse to mix.
        check_shard: Called with each of this part's shards once written (path, and the
            indices of its tensors); what it returns goes into the receipt (a digest...).
        on_finalize: Called with the complete staged output (index and side files
            included) and every receipt, before it is renamed into place (to write a
            manifest...).
    """

    part: Part | None
    finalize: bool = False
    source_id: Any = None
    check_shard: Callable[[Path, Sequence[int]], dict[str, Any]] | None = None
    on_finalize: Callable[[Path, dict[int, dict[str, Any]]], None] | None = None


def owners(plan: ShardPlan, count: int) -> list[int]:
    """Which part writes each shard of ``plan`` (from 1): dealt by size, deterministically."""
    return assign(list(plan.sizes), count)


def write_parted(dest: Path, job: PartJob, plan: ShardPlan, content_id: str, as_file: bool,
                 overwrite: bool, result: WriteResult,
                 write_mine: Callable[[list[int], Path], Generator[tuple[int, Path], None, None]],
                 finish: Callable[[Path], list[tuple[str, int]]],
                 before_commit: Callable[[Path], None] | None) -> None:
    """Do this process's part of a split write, then finalize if every part is done.

    Args:
        dest: The output file or directory.
        job: The split.
        plan: The shard plan (the same in every part).
        content_id: Fingerprint of what is written (tensors, metadata, side files).
        as_file: Whether ``dest`` is a single file.
        overwrite: Replace an existing ``dest`` (at finalize).
        result: Filled in: the files this process wrote, and ``part``.
        write_mine: Writes the given shards (indices into the plan) into a directory, each
            under a temporary name then renamed; yields each shard and its path once done.
        finish: Writes the index and side files into the staged directory; returns them.
        before_commit: The caller's check of this part's work (FP16 overflow...), before
            its receipt is written.

    Raises:
        DestinationExistsError: ``dest`` exists and ``overwrite`` is False.
        PartsIncompleteError: Parts of another plan are staged, or a finalize found parts
            missing or files not matching their receipts.
    """
    if (dest.exists() or dest.is_symlink()) and not overwrite:
        raise DestinationExistsError("already exists", path=dest,
                                     hint="pass --force to replace it (every part the same)")
    root = staging_dir(dest)
    count = job.part.count if job.part else _staged_count(root, dest)
    plan_id = fingerprint({"content": content_id, "source": job.source_id, "parts": count,
                           "dest": dest.name, "file": as_file, "files": plan.files})
    store = PartStore(root, plan_id, count, what=str(dest))
    outcome = PartOutcome(job.part, count, [])
    result.part = outcome
    out_dir = root / OUT
    if job.part is not None:
        store.join()
        out_dir.mkdir(exist_ok=True)
        mine = [i for i, p in enumerate(owners(plan, count)) if p == job.part.index]
        written: list[list[Any]] = []
        with contextlib.closing(write_mine(mine, out_dir)) as shards:
            for i, path in shards:
                size = path.stat().st_size
                extra = job.check_shard(path, plan.members[i]) if job.check_shard else {}
                written.append([plan.files[i], size, extra])
                result.files.append((plan.files[i], size))
                outcome.files.append(plan.files[i])
        if before_commit:
            before_commit(out_dir)
        fsync_path(out_dir)
        store.write_receipt(job.part.index, {"files": written})
    try:
        with store.lock():
            _settle(dest, store, plan, count, job, outcome, result, overwrite, as_file, finish)
    except FileNotFoundError:
        # The staging directory went while we waited for its lock: another part finalized.
        if not (dest.exists() and not root.exists()):
            raise
        outcome.finalized = True


def _staged_count(root: Path, dest: Path) -> int:
    recorded = PartStore(root, "", 0, what=str(dest)).recorded_plan()
    if recorded is None:
        raise PartsIncompleteError(
            f"nothing to finalize: no parts are staged for it (expected {root})", path=dest,
            hint="run the parts with --part K/N first (with the same options)")
    count = recorded.get("parts")
    if not isinstance(count, int) or count < 1:
        raise PartsIncompleteError("the staged part plan is unreadable", path=root)
    return count


def _settle(dest: Path, store: PartStore, plan: ShardPlan, count: int, job: PartJob,
            outcome: PartOutcome, result: WriteResult, overwrite: bool, as_file: bool,
            finish: Callable[[Path], list[tuple[str, int]]]) -> None:
    """Under the lock: finalize if every receipt is there, else say what is missing."""
    recorded = store.recorded_plan()
    out_dir = store.root / OUT
    if recorded is not None and recorded.get("plan") != store.plan_id:
        store.join()  # raises, naming both plans
    if recorded is None or not out_dir.exists():
        if not dest.exists():
            raise PartsIncompleteError(
                "the staging directory was removed while the parts ran; nothing was finalized",
                path=store.root, hint="run every part again")
        # Finalized by another part (it removes the staging directory last).
        shutil.rmtree(store.root, ignore_errors=True)
        outcome.finalized = True
        return
    receipts = store.receipts()
    missing = store.missing(receipts)
    if missing:
        outcome.waiting_for = missing
        if job.finalize or job.part is None:
            raise store.incomplete(missing)
        return
    staged = _check_receipts(store, plan, count, receipts)
    extra = finish(out_dir) if not as_file else []
    if job.on_finalize:
        job.on_finalize(out_dir, receipts)
    fsync_tree(out_dir)
    _commit(out_dir, dest, plan, as_file, overwrite)
    shutil.rmtree(store.root, ignore_errors=True)
    fsync_path(dest.parent)
    result.files[:] = [*staged, *extra]
    outcome.finalized = outcome.finalized_here = True


def _check_receipts(store: PartStore, plan: ShardPlan, count: int,
                    receipts: dict[int, dict[str, Any]]) -> list[tuple[str, int]]:
    """Every planned file comes from the part planned to write it, at its receipt's size."""
    planned = owners(plan, count)
    sizes: dict[str, int] = {}
    wrong: dict[int, str] = {}
    for k, receipt in receipts.items():
        for entry in receipt.get("files", []):
            ok = (isinstance(entry, list) and len(entry) >= 2 and entry[0] in plan.files
                  and isinstance(entry[1], int))
            if not ok or planned[plan.files.index(entry[0])] != k:
                wrong.setdefault(k, "its receipt lists files the plan does not give it")
                continue
            sizes[entry[0]] = entry[1]
    for i, fname in enumerate(plan.files):
        path = store.root / OUT / fname
        if fname not in sizes:
            wrong.setdefault(planned[i], f"{fname} is not in its receipt")
        elif not path.is_file() or path.stat().st_size != sizes[fname]:
            wrong.setdefault(planned[i], f"{fname} is missing or not the size its receipt "
                                         "gives")
    if wrong:
        parts = sorted(wrong)
        raise PartsIncompleteError(
            f"cannot finalize {store.what}: {describe_parts(parts)} did not write what the "
            f"plan gives ({'; '.join(f'part {k}: {wrong[k]}' for k in parts[:3])})",
            path=store.root, hint="rerun those parts with the same options, then --finalize")
    return [(f, sizes[f]) for f in plan.files]


def _commit(out_dir: Path, dest: Path, plan: ShardPlan, as_file: bool, overwrite: bool) -> None:
    if not as_file:
        replace_dir(out_dir, dest, overwrite)
        return
    if (dest.exists() or dest.is_symlink()) and not overwrite:
        raise DestinationExistsError("appeared while the parts were writing; not replaced",
                                     path=dest)
    if dest.is_dir() and not dest.is_symlink():
        raise DestinationExistsError("is a directory; not replacing it", path=dest)
    os.replace(out_dir / plan.files[0], dest)
    with contextlib.suppress(FileNotFoundError):
        manifest_path(dest).unlink()  # it described what was there before
