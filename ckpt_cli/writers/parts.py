"""Writing one output from many processes: each part writes its own shards, the last one the
index.

Every part computes the same shard plan (:func:`ckpt_cli.writers.plan.plan_shards`) from the
source's metadata and deals the shards to parts by size (:func:`ckpt_cli.parts.assign`). A
part (:class:`PartSink`, the writer's sink for a split job) writes its shards into the staging
directory's ``out/`` (each under a temporary name, fsynced, then renamed), runs the caller's
checks, and leaves a receipt saying which files it wrote and their sizes. Under the staging
lock, whoever finds every receipt there, matching the plan, finalizes: it checks every planned
file is there with the size its receipt gives, writes the index and side files, fsyncs, and
renames ``out/`` into place (or, for a single-file output, the one file), then removes the
staging directory. Until then nothing at the destination looks like an output.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli.errors import DestinationExistsError
from ckpt_cli.parts import (
    Part,
    PartOutcome,
    PartsIncompleteError,
    PartStore,
    assign,
    describe_parts,
    fingerprint,
    staged_count,
    staging_dir,
)
from ckpt_cli.storage.atomic import (
    TMP_MARK,
    check_destination,
    fsync_path,
    fsync_tree,
    rename_onto,
    replace_dir,
)
from ckpt_cli.writers.sink import Sink, Tail, drop_old_manifest

if TYPE_CHECKING:
    from ckpt_cli.writers.plan import ShardPlan

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


class PartSink(Sink):
    """This process's part of a split write: it claims the part (checks the destination, joins
    the staged plan), writes its shards into the staging directory's ``out/`` (each under a
    temporary name, fsynced, then renamed, before its receipt vouches for it), and at
    :meth:`commit` runs the caller's check, leaves its receipt, and finalizes if every part is
    done (:func:`_settle`). Finalizing writes the index and side files into ``out/``.

    Args:
        dest: The output file or directory.
        plan: The shard plan (the same in every part).
        overwrite: Replace an existing ``dest`` (at finalize).
        before_commit: The caller's check of this part's work (FP16 overflow...), given the
            staged directory before its receipt is written.
        job: The split.
        content_id: Fingerprint of what is written (tensors, metadata, side files).
        as_file: Whether ``dest`` is a single file.

    Raises:
        DestinationExistsError: ``dest`` exists and ``overwrite`` is False.
        PartsIncompleteError: Parts of another plan are staged, or (finalizing alone) none.
    """

    def __init__(self, dest: Path, plan: ShardPlan, *, overwrite: bool,
                 before_commit: Callable[[Path], None] | None, job: PartJob, content_id: str,
                 as_file: bool):
        super().__init__(dest, plan, overwrite=overwrite, before_commit=before_commit)
        if (dest.exists() or dest.is_symlink()) and not overwrite:
            raise DestinationExistsError("already exists", path=dest,
                                         hint="pass force to replace it (every part the same)",
                                         param="force")
        check_destination(dest, kind="file" if as_file else "dir", overwrite=overwrite,
                          parents=True)
        self.job, self.as_file = job, as_file
        root = staging_dir(dest)
        count = job.part.count if job.part else staged_count(root, dest)
        plan_id = fingerprint({"content": content_id, "source": job.source_id, "parts": count,
                               "dest": dest.name, "file": as_file, "files": plan.files})
        self.store = PartStore(root, plan_id, count, what=str(dest))
        self.outcome = self.part = PartOutcome(job.part, count, [])
        self.root = root / OUT
        self.receipt: list[list[Any]] = []
        self.shards = None
        if job.part is not None:
            self.store.join()
            self.root.mkdir(exist_ok=True)
            self.shards = [i for i, p in enumerate(owners(plan, count)) if p == job.part.index]

    def target(self, name: str) -> Path:
        return self.root / f".{name}{TMP_MARK}{os.getpid()}"

    @contextlib.contextmanager
    def open(self, name: str, *, expected: int, buffering: int) -> Iterator[Any]:
        tmp = self.target(name)
        try:
            with super().open(name, expected=expected, buffering=buffering) as f:
                yield f
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def wrote(self, name: str, path: Path, size: int) -> None:
        # Durable before it takes its final name (a power loss must not leave a shard of the
        # right size and the wrong bytes that an earlier run's receipt vouches for): the
        # write's background sync of it is under way; this waits for it.
        fsync_path(path)
        final = self.root / name
        rename_onto(path, final)
        i = self.plan.files.index(name)
        extra = self.job.check_shard(final, self.plan.members[i]) if self.job.check_shard else {}
        self.receipt.append([name, size, extra])
        super().wrote(name, final, size)
        self.outcome.files.append(name)

    def commit(self, tail: Tail) -> None:
        job = self.job
        if job.part is not None:
            if self.before_commit:
                self.before_commit(self.root)
            fsync_path(self.root)
            self.store.write_receipt(job.part.index, {"files": self.receipt})
        try:
            with self.store.lock():
                _settle(self, tail)
        except FileNotFoundError:
            # The staging directory went while we waited for its lock: another part finalized.
            if not (self.dest.exists() and not self.store.root.exists()):
                raise
            self.outcome.finalized = True



def _settle(sink: PartSink, tail: Tail) -> None:
    """Under the lock: finalize if every receipt is there, else say what is missing."""
    dest, store, job, outcome = sink.dest, sink.store, sink.job, sink.outcome
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
    staged = _check_receipts(store, sink.plan, store.count, receipts)
    sink.files = []
    if not sink.as_file:
        sink.write_tail(out_dir, tail)
    extra = sink.files
    if job.on_finalize:
        job.on_finalize(out_dir, receipts)
    fsync_tree(out_dir)
    _commit(out_dir, dest, sink.plan, sink.as_file, sink.overwrite)
    shutil.rmtree(store.root, ignore_errors=True)
    fsync_path(dest.parent)
    sink.files = [*staged, *extra]
    sink.complete = True
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
            path=store.root, hint="rerun those parts with the same options, then finalize",
            param="finalize")
    return [(f, sizes[f]) for f in plan.files]


def _commit(out_dir: Path, dest: Path, plan: ShardPlan, as_file: bool, overwrite: bool) -> None:
    if not as_file:
        replace_dir(out_dir, dest, overwrite)
        return
    if (dest.exists() or dest.is_symlink()) and not overwrite:
        raise DestinationExistsError("appeared while the parts were writing; not replaced",
                                     path=dest)
    rename_onto(out_dir / plan.files[0], dest)
    drop_old_manifest(dest)  # it described what was there before
