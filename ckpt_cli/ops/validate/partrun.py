"""``validate --part K/N`` run: one checkpoint validated as one part of a split validation
(its receipt written), or finalized when every part's receipt is there. The plan, receipts and
merging are :mod:`.split`'s; it and :mod:`ckpt_cli.parts` load only when a split is asked."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from ckpt_cli.model import RunEntry
from ckpt_cli.ops.validate import split as sp
from ckpt_cli.ops.validate.checkpoint import validate_checkpoint
from ckpt_cli.ops.validate.options import Options, Split
from ckpt_cli.ops.validate.result import CheckpointReport, PartStatus
from ckpt_cli.parts import PartsIncompleteError, PartStore, fingerprint, staging_dir


def validate_split(path: Path, opts: Options, split: Split, *,
                   entry: RunEntry | None = None) -> tuple[CheckpointReport, PartStatus]:
    """Validate one checkpoint as one part of a split validation, or finalize one.

    The part checks its files in depth, writes its receipt, and finalizes if it finds every
    part's receipt there (holding the staging directory's lock): then the report is the
    whole checkpoint's, the manifest is written (if asked and valid) and the staging
    directory is removed. Otherwise the report covers this part's files.

    Args:
        path: The checkpoint.
        opts: How to validate.
        split: The part and where the receipts go.
        entry: Its run-directory entry (``--latest``).

    Returns:
        ``(report, where the split stands)``.

    Raises:
        PartsIncompleteError: Another plan is staged (other options, files or part count),
            or ``--finalize`` found parts missing.
    """

    files = sp.plan_files(path)
    plan = sp.make_plan(path, files, {
        "format": opts.fmt, "quick": opts.quick, "values": opts.values,
        "require": list(opts.require), "write_manifest": opts.write_manifest,
        "manifest_hash": opts.manifest_algorithm if opts.write_manifest else None})
    plan_id = fingerprint(plan)
    root = staging_dir(path)
    if split.parts_dir is not None:
        root = split.parts_dir / root.name
    what = f"the validation of {path.name}"
    part = split.part
    if part is None:
        recorded = PartStore(root, plan_id, 1, what=what).recorded_plan()
        if recorded is None:
            raise PartsIncompleteError(f"nothing to finalize: no part of {what} left a "
                                       "receipt here", path=root,
                                       hint="run the parts with part K/N first", param="part")
        count = recorded.get("parts")
        if not isinstance(count, int) or count < 1:
            raise PartsIncompleteError("unreadable part plan (no part count)", path=root)
    else:
        count = part.count
    store = PartStore(root, plan_id, count, what=what)
    store.join()
    owners = sp.owner_map(files, count)
    status = PartStatus(part.index if part else None, count, part.origin if part else "",
                        total_files=len(files), plan=plan_id, staging=root)
    report: CheckpointReport | None = None
    own: sp.Share | None = None
    if part is not None:
        mine = [rel for rel, _ in files if owners[rel] == part.index]
        sizes = dict(files)
        status.files, status.bytes = len(mine), sum(sizes[r] for r in mine)
        own = sp.Share(owners, part.index, staging=root.name)
        report = validate_checkpoint(path, dataclasses.replace(opts, share=own), entry=entry)
        store.write_receipt(part.index, own.receipt(mine, report))
    with store.lock():
        receipts = store.receipts()
        if part is not None and part.index not in receipts:
            # Another part finalized (and removed the staging directory) after this one
            # wrote its receipt; lock() made the directory again: take it away.
            status.finalized_elsewhere = True
            shutil.rmtree(root, ignore_errors=True)
            assert report is not None
            return report, status
        missing = store.missing(receipts)
        if missing:
            if split.finalize:
                raise store.incomplete(missing)
            status.waiting_for = missing
            assert report is not None
            return report, status
        share = sp.Share(owners, 0, staging=root.name, receipts=receipts,
                         index=own.index if own is not None else None)
        merged = validate_checkpoint(path, dataclasses.replace(opts, share=share,
                                                               on_progress=None), entry=entry)
        shutil.rmtree(root, ignore_errors=True)
    status.finalized = True
    return merged, status
