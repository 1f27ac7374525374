"""One checkpoint validated: read its metadata (a file named like a format is read as that
format), run the content checks, the commit markers, leftovers, ``--values`` and the manifest,
and assemble the :class:`CheckpointReport`. A checkpoint that cannot be read is a report with a
failed ``readable`` check."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from ckpt_cli.errors import (
    CkptError,
    CorruptCheckpointError,
    UnknownFormatError,
    UnsafeCheckpointError,
    UnsupportedError,
    ZipConflictError,
)
from ckpt_cli.formats import dcp, read_index
from ckpt_cli.formats.directory import NESTED_CHECKPOINTS
from ckpt_cli.formats.probe import LINK_OUT, quick_status
from ckpt_cli.gcpause import collections_paused
from ckpt_cli.model import CheckpointIndex, Finding, RunEntry
from ckpt_cli.ops.validate.builder import RATE_MIN, Builder, has_errors, rel_path
from ckpt_cli.ops.validate.layoutcheck import leftover_findings
from ckpt_cli.ops.validate.manifestcheck import check_manifest
from ckpt_cli.ops.validate.options import Options
from ckpt_cli.ops.validate.result import CheckpointReport
from ckpt_cli.ops.validate.structure import deep_checks
from ckpt_cli.ops.validate.valuecheck import ValueScan, scan_values
from ckpt_cli.storage.reads import OpenFiles, default_jobs
from ckpt_cli.units import format_size

_EXTENSION_FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch",
                      ".bin": "torch", ".ckpt": "torch"}


def _read(path: Path, fmt: str | None) -> CheckpointIndex:
    """Read a checkpoint's metadata; a file named like a format is read as that format anyway.

    Detection is by content. When content matches nothing but the name says what the file
    should be (``model.safetensors`` whose header is destroyed), validating it as that format
    tells the user what is wrong with it, rather than only that it is unrecognised.
    """
    try:
        return read_index(path, fmt)
    except UnknownFormatError:
        guess = _EXTENSION_FORMATS.get(path.suffix.lower()) if path.is_file() else None
        if guess is None or fmt is not None:
            raise
        return read_index(path, guess)


def validate_checkpoint(path: Path, opts: Options | None = None, *,
                        entry: RunEntry | None = None) -> CheckpointReport:
    """Validate one checkpoint (a file or a checkpoint directory).

    Args:
        path: The checkpoint.
        opts: How to validate (defaults: structure and CRC, nothing written).
        entry: Its run-directory entry, when validating a run.

    Returns:
        The :class:`CheckpointReport`. A checkpoint that cannot be read is a report with a
        failed ``readable`` check, not an exception.

    Raises:
        CkptError: Only when validating a single checkpoint (``entry`` is None) whose path
            cannot be read at all or whose format is unrecognisable: a usage problem rather
            than a finding.
    """
    with dcp.keep_storage_maps(), collections_paused():  # .metadata parsed once; gcpause
        return _validate_checkpoint(path, opts or Options(jobs=default_jobs()), entry)


def _validate_checkpoint(path: Path, opts: Options, entry: RunEntry | None
                         ) -> CheckpointReport:
    outer = opts.on_progress
    if outer is not None:  # name the checkpoint: a run directory reports many in turn
        def labelled(label: str, done: int, total: int) -> None:
            outer(f"{path.name}: {label}", done, total)

        opts = dataclasses.replace(opts, on_progress=labelled)
    t0 = time.perf_counter()
    report = CheckpointReport(path)
    b = Builder(opts.allow_globals)
    index: CheckpointIndex | None = None
    try:
        if opts.share is not None and opts.share.index is not None:
            index = opts.share.index  # the finalizing part read it already
        elif entry is not None and entry.reason is not None and LINK_OUT in entry.reason:
            # The listing found a link out of the run: nothing of it is read or echoed.
            b.add("readable", [Finding("error", "link-out-of-run", entry.reason, None)],
                  "not read")
        else:
            index = _read(path, opts.fmt)
            if opts.share is not None:
                opts.share.index = index
    except (CorruptCheckpointError, UnsafeCheckpointError, UnsupportedError) as e:
        b.add("readable", [Finding("error", "unreadable", e.message, rel_path(e.path, path))],
              "could not read the checkpoint's metadata")
        if isinstance(e, ZipConflictError):  # readers could disagree: say how, where
            b.add("zip-structure", [Finding("error", e.code, e.message,
                                            rel_path(e.path, path))],
                  "records two readers would read differently")
    except CkptError as e:
        if entry is None:
            raise  # a single unreadable or unrecognisable path: a usage error, exit 2
        b.add("readable", [Finding("error", "unreadable", e.message,
                                   rel_path(e.path, path))], "could not read")
    if index is not None and entry is not None:
        # Validated as part of a run: the checkpoints below are reported in turn.
        index.findings = [f for f in index.findings if f.code != NESTED_CHECKPOINTS]
    if index is not None:
        report.index = index
        report.format, report.flavor = index.format, index.flavor
        step = index.metadata.get("step")
        report.step = step if isinstance(step, int) and not isinstance(step, bool) else None
        try:
            with OpenFiles() as files:
                report.bytes_read += deep_checks(b, index, path, files, opts)
            if opts.values and opts.share is not None:
                vf, stats = scan_values(index, on_progress=opts.on_progress,
                                        select=opts.share.owns_tensor,
                                        done_elsewhere=opts.share.values_elsewhere,
                                        collect=opts.share.values,
                                        max_memory=opts.max_memory, threads=opts.jobs)
                b.add("values", vf, _values_summary(stats))
                report.bytes_read += stats.bytes
            elif opts.values:
                vf, stats = scan_values(index, on_progress=opts.on_progress,
                                        max_memory=opts.max_memory, threads=opts.jobs)
                b.add("values", vf, _values_summary(stats))
                report.bytes_read += stats.bytes
            else:
                b.skip("values", "not requested (--values reads every floating tensor)")
        except CkptError as e:  # a file vanished or an I/O error while reading data
            bad = Finding("error", "read-error", e.message, rel_path(e.path, path))
            b.add("readable", [bad])
            if opts.share is not None and not opts.share.final:
                opts.share.aborted = bad
    else:
        for cid in ("complete", "resumable", "values"):
            b.skip(cid, "not run: the checkpoint could not be read")
        if entry is not None and entry.step is not None:
            report.step = entry.step
    _complete(b, path, index, entry)
    left = leftover_findings(path, ignore=opts.share.staging if opts.share else None)
    b.add("leftovers", left, f"{len(left)} leftover(s)" if left else "none")
    report.manifest = check_manifest(b, path, opts, has_errors=has_errors(b))
    if report.manifest is not None:
        report.bytes_read += report.manifest.bytes
    report.checks = b.results()
    report.seconds = time.perf_counter() - t0
    return report


def _complete(b: Builder, path: Path, index: CheckpointIndex | None,
              entry: RunEntry | None) -> None:
    """Commit markers: what the run listing's quick status says, unless already explained."""
    if entry is not None:
        complete, reason = entry.complete, entry.reason
    else:
        _fmt, complete, reason = quick_status(path)
    if index is None and not complete:
        return  # the read error says more than the quick status
    if complete:
        b.add("complete", [], "commit markers present")
        return
    if has_errors(b):
        # Damage found above also fails the quick commit-marker test; say so without
        # counting the same problem twice.
        b.add("complete", [Finding("warning", "incomplete", f"looks unfinished ({reason}); "
                                   "see the errors above", None)], "looks unfinished")
        return
    b.add("complete", [Finding("error", "incomplete", f"the save did not finish: {reason}",
                               None)], "the save did not finish")


def _values_summary(stats: ValueScan) -> str:
    rate = (f", {stats.bytes / stats.seconds / 1e9:.2f} GB/s" if stats.seconds > 0
            and stats.bytes > RATE_MIN else "")
    skipped = f", {stats.skipped} not examinable" if stats.skipped else ""
    return f"{stats.tensors:,} floating tensor(s), {format_size(stats.bytes)}{rate}{skipped}"
