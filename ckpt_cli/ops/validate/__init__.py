"""``validate``: is a checkpoint complete, consistent and uncorrupted?

The format readers already record what reading the metadata reveals (offsets, gaps, missing
shards and ranks, unsafe pickle globals). This module runs them, sorts their findings into
named checks, and adds the checks that need more than metadata: the zip structure and the
CRC-32 of every record of every torch zip (streamed, in parallel), DCP chunk tiling and
decoding, rank-file sets, ``latest`` pointers, resumability, optionally every floating value,
and the integrity manifest. Each checkpoint gets a :class:`CheckpointReport`; a run directory
gets one per checkpoint.

Nothing here prints or exits; nothing is written except the manifest when asked.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli import storage
from ckpt_cli.errors import (
    CkptError,
    CorruptCheckpointError,
    UnknownFormatError,
    UnsafeCheckpointError,
    UnsupportedError,
    UsageError,
    ZipConflictError,
)
from ckpt_cli.formats import (
    allowlist,
    check_exists,
    dcp,
    get_reader,
    read_index,
)
from ckpt_cli.formats.base import rel_to
from ckpt_cli.formats.directory import NESTED_CHECKPOINTS
from ckpt_cli.formats.probe import quick_status
from ckpt_cli.fp8 import check_quantized
from ckpt_cli.manifest import (
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    Verification,
    compute_manifest,
    manifest_path,
    read_manifest,
    verify_manifest,
    write_manifest,
)
from ckpt_cli.model import CheckpointIndex, Finding, RunEntry, RunListing
from ckpt_cli.ops import options_of
from ckpt_cli.ops.validate.dcpcheck import check_dcp
from ckpt_cli.ops.validate.layoutcheck import (
    directory_pointers,
    ds_world,
    leftover_findings,
    leftover_message,
    pointer_findings,
    rank_findings,
    resumable_findings,
    stray_shards,
)
from ckpt_cli.ops.validate.options import ValidateOptions
from ckpt_cli.ops.validate.result import (
    CHECKS,
    CheckpointReport,
    CheckResult,
    LatestChoice,
    ManifestResult,
    Status,
    ValidateResult,
)
from ckpt_cli.ops.validate.strays import stray_pickle_findings
from ckpt_cli.ops.validate.valuecheck import ValueScan, scan_values
from ckpt_cli.ops.validate.zipcheck import CrcTask, check_zip, crc_tasks, verify_crcs
from ckpt_cli.runs import (
    POINTER_FILES,
    RESUME_POINTERS,
    holds_final_model,
    is_final_model_only,
    is_run_dir,
    list_run,
    run_entry,
)
from ckpt_cli.storage.reads import (
    BUFFER_SIZE,
    MEMORY_BUDGET,
    OpenFiles,
    ProgressFn,
    default_jobs,
    memory_budget,
)
from ckpt_cli.units import format_size

if TYPE_CHECKING:
    from ckpt_cli.ops.validate.result import PartStatus
    from ckpt_cli.ops.validate.split import Share
    from ckpt_cli.parts import Part

REQUIREMENTS = ("optimizer", "step")
"""What ``--require`` accepts."""

# Reader finding codes -> the check they belong to (unknown codes go to "readable").
_CODE_CHECK: dict[str, str] = {
    **dict.fromkeys(("duplicate-key", "bad-metadata", "bad-entry", "unknown-dtype", "bad-shape",
                     "bad-offsets", "misaligned", "size-mismatch", "gap", "overlap", "truncated",
                     "trailing-bytes"), "safetensors-header"),
    **dict.fromkeys(("missing-storage", "short-storage", "view-out-of-bounds",
                     "unreferenced-storage", "tensor-kind"), "storages"),
    **dict.fromkeys(("compressed-entry", "big-endian"), "zip-structure"),
    **dict.fromkeys(("unsafe-global", "unknown-global", "non-allowlisted-global",
                     "torchscript-archive", "unscanned-pickle"), "pickle-safety"),
    **dict.fromkeys(("missing-shard", "bad-shard", "missing-tensor", "wrong-shard",
                     "unindexed-tensor", "total-size", "bad-index", "duplicate-tensor"),
                    "shard-index"),
    **dict.fromkeys(("missing-file", "chunk-out-of-bounds", "missing-chunk"), "dcp-storage"),
    "bad-item": "dcp-chunks",
    "chunk-tiling": "dcp-tiling",
    **dict.fromkeys(("world-size", "missing-rank", "missing-rank-file"), "rank-files"),
    "missing-weights": "complete",
}
_FORMAT_CODE_CHECK = {("megatron", "missing-file"): "rank-files"}
_RATE_MIN = 64 << 20  # below this, a speed says more about start-up than throughput
_EXTENSION_FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch",
                      ".bin": "torch", ".ckpt": "torch"}


@dataclass(frozen=True, slots=True)
class Options:
    """How to validate (see :func:`validate`)."""

    fmt: str | None = None
    quick: bool = False
    values: bool = False
    require: tuple[str, ...] = ()
    write_manifest: bool = False
    manifest_algorithm: str = DEFAULT_ALGORITHM
    jobs: int = 1
    on_progress: ProgressFn | None = None
    max_memory: int = MEMORY_BUDGET
    share: Share | None = None
    allow_globals: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Split:
    """A validation split over processes: ``--part``, ``--finalize``, ``--parts-dir``."""

    part: Part | None = None
    finalize: bool = False
    parts_dir: Path | None = None


def parse_require(spec: str | Iterable[str] | None) -> tuple[str, ...]:
    """Parse ``--require optimizer,step``.

    Args:
        spec: Comma-separated names, or an iterable of names.

    Returns:
        The requirements, deduplicated, in :data:`REQUIREMENTS` order.

    Raises:
        UsageError: For an unknown requirement.
    """
    if spec is None:
        return ()
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names = {s.strip().lower() for s in items if s.strip()}
    unknown = sorted(names - set(REQUIREMENTS))
    if unknown:
        raise UsageError(f"--require: unknown requirement {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(REQUIREMENTS)}")
    return tuple(r for r in REQUIREMENTS if r in names)


def validate(path: str | Path, options: ValidateOptions | None = None, *,
             on_progress: ProgressFn | None = None, **fields: Any) -> ValidateResult:
    """Validate a checkpoint, or every checkpoint of a run directory.

    Args:
        path: A checkpoint file or directory, or a run directory.
        options: What to check (:class:`ValidateOptions`; default: its defaults).
        on_progress: ``(label, done, total)`` progress callback, in bytes.
        **fields: :class:`ValidateOptions` fields, instead of ``options`` (see
            :func:`ckpt_cli.ops.options_of`).

    Returns:
        The :class:`ValidateResult` (with ``part`` set when split).

    Raises:
        CkptError: The path does not exist or cannot be read, or (for a single checkpoint) its
            format cannot be recognised at all.
        UsageError: Bad options.
        PartsIncompleteError: Finalizing with parts missing or planned differently.
    """
    given = options_of(ValidateOptions, options, fields)
    fmt, latest, quick, values = given.fmt, given.latest, given.quick, given.values
    require, write_manifest, jobs = given.require, given.write_manifest, given.jobs
    manifest_algorithm, pattern, max_memory = (given.manifest_algorithm, given.pattern,
                                               given.max_memory)
    part, finalize, parts_dir = given.part, given.finalize, given.parts_dir
    allow_globals = given.allow_globals
    p = storage.locate(path)
    check_exists(p)
    if manifest_algorithm not in ALGORITHMS:
        raise UsageError(f"--manifest-hash must be one of {', '.join(ALGORITHMS)}, "
                         f"not {manifest_algorithm!r}")
    if jobs is not None and jobs < 1:
        raise UsageError("--jobs must be at least 1")
    if quick and write_manifest:
        # A manifest vouches for the bytes; --quick never reads them (no CRC pass), so it
        # could record a corrupt file as good.
        raise UsageError("--write-manifest needs the full check; drop --quick")
    budget = memory_budget(max_memory)
    # CRC-32 and hashing threads each hold one buffer: never more of them than fit the budget.
    threads = min(jobs or default_jobs(), max(1, budget // BUFFER_SIZE))
    opts = Options(fmt, quick, values, parse_require(require), write_manifest,
                   manifest_algorithm, threads, on_progress, budget,
                   allow_globals=allowlist.parse_names(allow_globals))
    split = None
    if part is not None or finalize:
        from ckpt_cli.parts import parse_part

        split = Split(parse_part(part) if isinstance(part, str) else part, finalize,
                      Path(parts_dir) if parts_dir is not None else None)
    elif parts_dir is not None:
        raise UsageError("--parts-dir goes with --part or --finalize")
    if fmt is not None:
        get_reader(fmt)  # an unknown --input-format is a usage error, even for a run dir
    run_dir = fmt is None and (holds_final_model(p) or is_run_dir(p))
    if split is not None and run_dir and not latest:
        raise UsageError("--part and --finalize split the validation of one checkpoint, and "
                         "this is a run directory of many", path=p,
                         hint="give one checkpoint of the run (e.g. RUN/step_1000), or add "
                              "--latest")
    if fmt is None and holds_final_model(p):
        return _validate_run(p, opts, latest=latest, pattern=pattern, final_model=True,
                             split=split)
    if run_dir:
        return _validate_run(p, opts, latest=latest, pattern=pattern, split=split)
    if latest and fmt is None and is_final_model_only(p):
        # An HF output_dir with its final model and no checkpoint-N: that model is the run's
        # latest (and only) checkpoint; --require optimizer,step still says it cannot resume.
        return _validate_run(p, opts, latest=True, pattern=pattern, final_model=True,
                             split=split)
    if latest:
        raise UsageError("--latest needs a run directory (a directory of checkpoints)",
                         path=p)
    result = ValidateResult(p, "checkpoint")
    result.checkpoints.append(_one(p, opts, None, split, result))
    return result


def _one(path: Path, opts: Options, entry: RunEntry | None, split: Split | None,
         result: ValidateResult) -> CheckpointReport:
    if split is None:
        return validate_checkpoint(path, opts, entry=entry)
    report, result.part = validate_split(path, opts, split, entry=entry)
    return report


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
    import shutil

    from ckpt_cli.ops.validate import split as sp
    from ckpt_cli.ops.validate.result import PartStatus
    from ckpt_cli.parts import PartsIncompleteError, PartStore, fingerprint, staging_dir

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
                                       hint="run the parts with --part K/N first")
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


def _validate_run(root: Path, opts: Options, *, latest: bool, pattern: str | None,
                  final_model: bool = False, split: Split | None = None) -> ValidateResult:
    run = list_run(root, pattern)
    result = ValidateResult(root, "run", run=run, final_model=final_model)
    entries = run.entries
    if latest:
        result.latest = choice = _latest_choice(root, run, final_model)
        entries = [e for e in entries if choice is not None and e.name == choice.name]
    for e in entries:
        result.checkpoints.append(_one(e.path, opts, e, split, result))
    if final_model and (not latest or (result.latest is not None
                                       and result.latest.final_model)):
        # Trained last, so reported last; its own entry so that damage is a finding.
        result.checkpoints.append(_final_model_report(
            _one(root, opts, run_entry(root), split, result)))
    dangling, named = directory_pointers(root)
    # Symlink pointers (Lightning's last.ckpt) are resolved by the listing.
    dangling += [dataclasses.replace(f, severity="error", message=f.message
                                     + ": resuming from it will fail")
                 for f in run.findings if f.code == "dangling-pointer"
                 and f.file not in POINTER_FILES]
    named += [f"{k} -> {v}" for k, v in sorted(run.pointers.items())
              if k not in POINTER_FILES and not any(f.file == k for f in dangling)]
    result.run_checks.append(_result("latest-pointer", dangling,
                                     ", ".join(named) or "no pointer files"))
    leftover = [Finding("warning", "leftover", leftover_message(name), name)
                for name in run.leftovers]
    result.run_checks.append(_result("leftovers", leftover, "no temporary or trash entries"
                                     if not leftover else f"{len(leftover)} leftover(s)"))
    if not run.entries and not (latest and final_model):
        # (A final model alone is what --latest checks: see _latest_choice.)
        result.run_checks[0].findings.append(Finding(
            "error", "no-checkpoints", "the run directory holds no checkpoint", None))
        result.run_checks[0].status = "fail"
    return result


def _latest_choice(root: Path, run: RunListing, final_model: bool) -> LatestChoice | None:
    """What ``--latest`` checks: the checkpoint training would resume from.

    A resume pointer (``latest``, Megatron's tracker, a ``last.ckpt`` link) wins where the
    layout has one; else the newest checkpoint by step (HF Trainer resumes from the highest
    ``checkpoint-N``). An HF Trainer ``output_dir``'s final model is never the choice while a
    checkpoint lies beside it: ``save_model()`` writes weights only, and training resumes from
    the checkpoints.
    """
    if not run.entries:
        # Nothing beside the final model: check what there is, so that --require still says
        # that nothing here can resume. (No checkpoint at all is the run check's error.)
        return LatestChoice(root.name, root, None, final_model=True) if final_model else None
    chosen = next((e for e in run.entries if e.name == run.latest), None)
    pointer = None
    if chosen is not None:
        pointer = next((k for k in (*RESUME_POINTERS, *sorted(run.pointers))
                        if run.pointers.get(k) == chosen.name), None)
    else:
        chosen = run.entries[-1]
    return LatestChoice(chosen.name, chosen.path, chosen.step, pointer,
                        final_model_skipped=final_model)


def _final_model_report(report: CheckpointReport) -> CheckpointReport:
    """A final model (``trainer.save_model()``) holds weights only by design: that it cannot
    resume training is a note, not a warning (the checkpoints beside it resume)."""
    for i, c in enumerate(report.checks):
        if c.id == "resumable" and any(f.code == "no-optimizer" for f in c.findings):
            notes = [dataclasses.replace(
                f, severity="info", message="the final model holds weights only (as "
                "save_model() writes it); resume from the checkpoints beside it")
                if f.code == "no-optimizer" else f for f in c.findings]
            report.checks[i] = _result(c.id, notes, c.summary)
    return report


def _result(check_id: str, findings: list[Finding], summary: str) -> CheckResult:
    findings = _dedupe(findings)
    status: Status = ("fail" if any(f.severity == "error" for f in findings) else
                      "warn" if any(f.severity == "warning" for f in findings) else "pass")
    return CheckResult(check_id, status, summary, findings)


def _dedupe(findings: list[Finding]) -> list[Finding]:
    seen: set[tuple[str, str, str | None, str | None]] = set()
    out = []
    for f in findings:
        key = (f.code, f.message, f.file, f.location)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


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


class _Builder:
    """Collects findings per check for one checkpoint."""

    def __init__(self, allowed: tuple[str, ...] = ()) -> None:
        self.allowed = allowed  # --allow-global: these globals' findings become notes
        self.findings: dict[str, list[Finding]] = {}
        self.summaries: dict[str, str] = {}
        self.skipped: dict[str, str] = {}

    def add(self, check_id: str, findings: Iterable[Finding] = (),
            summary: str | None = None) -> None:
        self.findings.setdefault(check_id, []).extend(allowlist.allow(list(findings),
                                                                      self.allowed))
        if summary is not None:
            self.summaries[check_id] = summary

    def skip(self, check_id: str, why: str) -> None:
        self.skipped[check_id] = why

    def results(self) -> list[CheckResult]:
        out = []
        for cid in CHECKS:
            if cid in self.findings:
                out.append(_result(cid, self.findings[cid], self.summaries.get(cid, "")))
            elif cid in self.skipped:
                out.append(CheckResult(cid, "skip", self.skipped[cid]))
        return out


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
    opts = opts or Options(jobs=default_jobs())
    outer = opts.on_progress
    if outer is not None:  # name the checkpoint: a run directory reports many in turn
        def labelled(label: str, done: int, total: int) -> None:
            outer(f"{path.name}: {label}", done, total)

        opts = dataclasses.replace(opts, on_progress=labelled)
    t0 = time.perf_counter()
    report = CheckpointReport(path)
    b = _Builder(opts.allow_globals)
    index: CheckpointIndex | None = None
    try:
        if opts.share is not None and opts.share.index is not None:
            index = opts.share.index  # the finalizing part read it already
        else:
            index = _read(path, opts.fmt)
            if opts.share is not None:
                opts.share.index = index
    except (CorruptCheckpointError, UnsafeCheckpointError, UnsupportedError) as e:
        b.add("readable", [Finding("error", "unreadable", e.message, _rel_path(e.path, path))],
              "could not read the checkpoint's metadata")
        if isinstance(e, ZipConflictError):  # readers could disagree: say how, where
            b.add("zip-structure", [Finding("error", e.code, e.message,
                                            _rel_path(e.path, path))],
                  "records two readers would read differently")
    except CkptError as e:
        if entry is None:
            raise  # a single unreadable or unrecognisable path: a usage error, exit 2
        b.add("readable", [Finding("error", "unreadable", e.message,
                                   _rel_path(e.path, path))], "could not read")
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
                report.bytes_read += _deep_checks(b, index, path, files, opts)
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
            bad = Finding("error", "read-error", e.message, _rel_path(e.path, path))
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
    report.manifest = _manifest(b, path, opts, has_errors=_has_errors(b))
    if report.manifest is not None:
        report.bytes_read += report.manifest.bytes
    report.checks = b.results()
    report.seconds = time.perf_counter() - t0
    return report


def _has_errors(b: _Builder) -> bool:
    return any(f.severity == "error" for fs in b.findings.values() for f in fs)


def _rel_path(p: str | Path | None, checkpoint: Path) -> str | None:
    """An error's path relative to the checkpoint (None for the checkpoint directory)."""
    if p is None:
        return None
    base = checkpoint if checkpoint.is_dir() else checkpoint.parent
    q = Path(str(p).split("@", 1)[0])  # DCP items are named file@offset
    if q == base:
        return None
    return rel_to(q, base)


def _deep_checks(b: _Builder, index: CheckpointIndex, path: Path, files: OpenFiles,
                 opts: Options) -> int:
    """Sort the reader's findings into checks and run the checks beyond metadata.

    Returns:
        Bytes streamed.
    """
    exact_ranks = index.format == "deepspeed" and ds_world(index) is not None
    for f in _collapse_truncation(index.findings):
        if exact_ranks and f.code == "missing-rank":
            continue  # _deepspeed_ranks names each missing file instead
        if f.code == "bad-item" and not opts.quick:
            continue  # check_dcp decodes every item (the reader only the small ones)
        cid = _FORMAT_CODE_CHECK.get((index.format, f.code)) or _CODE_CHECK.get(f.code,
                                                                                "readable")
        b.add(cid, [f])
    fmts = {f.format for f in index.files}
    b.add("readable", [], f"{index.format}"
          + (f" ({index.flavor})" if index.flavor and index.flavor != index.format else "")
          + f": {len(index.tensors):,} tensors in {len(index.files):,} file(s)")
    if "safetensors" in fmts:
        n = sum(1 for f in index.files if f.format == "safetensors")
        b.add("safetensors-header", [], f"{n} safetensors header(s)")
    if "hf-index" == index.format or any(f.role == "index" for f in index.files):
        b.add("shard-index", stray_shards(index),
              f"{index.layout.get('shards', 0)} shard(s) named by the index")
    if fmts & {"torch", "torch-legacy"}:
        refs = {(t.storage.file, t.storage.key) for t in index.tensors.values() if t.storage}
        b.add("storages", [], f"{len(refs):,} storage(s) referenced")
    tasks: list[CrcTask] = []
    crc_files: list[str] = []  # the files of the CRC records, in the order they are checked
    share = opts.share
    if share is not None:
        share.check_aborted()
    zips = _torch_zips(b, index, files, tasks, share, crc_files)
    dcp_items = _dcp_checks(b, index, path, files, tasks, opts, crc_files)
    records = len(tasks) + (share.external_records(crc_files) if share is not None else 0)
    if zips or dcp_items:
        what = ", ".join(x for x in (f"{zips} torch file(s)" if zips else "",
                                     f"{dcp_items:,} DCP item(s)" if dcp_items else "") if x)
        b.add("zip-structure", [], f"{what}, {records:,} record(s)" if records else what)
    if "torch-legacy" in fmts and not zips and not dcp_items:
        b.skip("crc32", "legacy torch files carry no checksums (a manifest can guard them)")
    streamed = 0
    if zips or dcp_items:
        if opts.quick:
            b.skip("crc32", "skipped (--quick)")
        else:
            total = sum(t.size for t in tasks)
            t0 = time.perf_counter()
            found = verify_crcs(tasks, threads=opts.jobs, on_progress=opts.on_progress)
            dt = time.perf_counter() - t0
            if share is not None:
                found, total, dt = share.merge_crc(crc_files, tasks, found, dt)
            streamed = total
            rate = f", {total / dt / 1e9:.2f} GB/s" if dt > 0 and total > _RATE_MIN else ""
            b.add("crc32", found, f"{records:,} record(s), {format_size(total)}{rate}")
    strays = stray_pickle_findings(index, path)
    if strays:
        b.add("pickle-safety", strays)
    if strays or fmts & {"torch", "torch-legacy", "pickle", "dcp"}:
        found = b.findings.get("pickle-safety", [])
        worst = {f.severity for f in found}
        script = any(f.code == "torchscript-archive" for f in found)
        b.add("pickle-safety", [], "only allowlisted globals" if not found else
              "a TorchScript archive: torch.load runs its code" if script else
              "globals that run code if loaded unsafely" if "error" in worst else
              "unknown globals (not imported, not executed)" if "warning" in worst else
              f"{len(found)} data-holder global(s) outside torch's allowlist, read as data")
    for cid, got in (("rank-files", rank_findings(index, path)),
                     ("latest-pointer", pointer_findings(index, path))):
        if got is not None:
            b.add(cid, *got)
    b.add("resumable", *resumable_findings(index, opts.require))
    quant = check_quantized(index)
    if quant is not None:
        b.add("quantization", *quant)
    return streamed


def _collapse_truncation(findings: list[Finding]) -> list[Finding]:
    """One finding per truncated file instead of one per DCP chunk past its end."""
    out: list[Finding] = []
    first: dict[str | None, Finding] = {}
    count: dict[str | None, int] = {}
    for f in findings:
        if f.code != "chunk-out-of-bounds":
            out.append(f)
            continue
        count[f.file] = count.get(f.file, 0) + 1
        if f.file not in first:
            first[f.file] = f
            out.append(f)
    return [dataclasses.replace(f, message=f"{f.message}; {count[f.file] - 1:,} more chunk(s) "
                                "of this file too") if f.code == "chunk-out-of-bounds"
            and count[f.file] > 1 else f for f in out]


def _torch_zips(b: _Builder, index: CheckpointIndex, files: OpenFiles,
                tasks: list[CrcTask], share: Share | None, crc_files: list[str]) -> int:
    """Zip structure of every torch zip file of the checkpoint; collects CRC tasks (of this
    part's files, with ``--part``: the other parts' come from their receipts)."""
    owners: dict[tuple[str, str], list[str]] = {}
    for t in index.tensors.values():
        if t.storage is not None:
            owners.setdefault((t.storage.file, t.storage.key), []).append(t.name)
    n = 0
    disabled: list[str] = []
    for f in index.files:
        if f.format != "torch":
            continue
        n += 1
        if share is not None and not share.owns(f.path):
            w = share.elsewhere(f.path)
            if w is not None:
                b.add("zip-structure", w.zips)
                if w.crc_disabled:
                    disabled.append(f.path)
                crc_files.append(f.path)
            continue
        path = index.path_of(f.path)
        fd = files.open(path, path)
        size = storage.size_of(fd)
        zr = check_zip(fd, 0, size, rel=f.path)
        b.add("zip-structure", zr.findings)
        if zr.crc_disabled:
            disabled.append(f.path)

        def describe(record: str, rel: str = f.path) -> str:
            key = record.rsplit("/data/", 1)[-1] if "/data/" in record else None
            names = owners.get((rel, key), []) if key else []
            if not names:
                return ""
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            return f"storage of {names[0]}{more}"

        tasks.extend(crc_tasks(zr, rel=f.path, fd=fd, start=0, describe=describe))
        if share is not None:
            w = share.work(f.path)
            w.zips, w.crc_disabled = list(zr.findings), zr.crc_disabled
            crc_files.append(f.path)
    if disabled:
        b.add("crc32", [Finding("info", "crc-disabled",
                                "written with CRC-32 turned off (every CRC is 0): its bytes "
                                "cannot be verified; a manifest can guard them", p)
                        for p in disabled])
    return n


def _dcp_checks(b: _Builder, index: CheckpointIndex, path: Path, files: OpenFiles,
                tasks: list[CrcTask], opts: Options, crc_files: list[str]) -> int:
    """DCP placement, tiling and decoding for the checkpoint or its DCP subdirectories."""
    targets: list[tuple[CheckpointIndex, Path, str]] = []
    if index.format == "dcp":
        targets.append((index, path, ""))
    elif path.is_dir():
        for sub in sorted(q for q in path.iterdir() if q.is_dir()):
            if dcp.metadata_file(sub) is None:
                continue
            try:
                targets.append((dcp.DCPReader().read_index(sub), sub, sub.name + "/"))
            except CkptError:
                continue  # the directory reader reported it (bad-subdir)
    items = 0
    for sub_index, directory, prefix in targets:
        share = opts.share
        rep = check_dcp(sub_index, directory, files, prefix=prefix, decode=not opts.quick,
                        only=share.owns if share is not None else None)
        if share is not None:
            share.merge_dcp(rep)
            crc_files.extend(rep.item_files)
        b.add("dcp-storage", rep.storage, f"{rep.placed:,} item(s) in {rep.files} file(s)")
        b.add("dcp-tiling", [], f"{rep.tensors:,} tensor(s)")
        b.add("pickle-safety", rep.pickles)
        if opts.quick:
            b.skip("dcp-chunks", "skipped (--quick)")
        else:
            note = (f"; {rep.undecoded} compressed item(s) not decoded" if rep.undecoded
                    else "")
            b.add("dcp-chunks", rep.chunks, f"{rep.items:,} item(s) decoded{note}")
            b.add("zip-structure", rep.zips)
        tasks.extend(rep.crc)
        items += rep.items
    return items


def _complete(b: _Builder, path: Path, index: CheckpointIndex | None,
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
    if _has_errors(b):
        # Damage found above also fails the quick commit-marker test; say so without
        # counting the same problem twice.
        b.add("complete", [Finding("warning", "incomplete", f"looks unfinished ({reason}); "
                                   "see the errors above", None)], "looks unfinished")
        return
    b.add("complete", [Finding("error", "incomplete", f"the save did not finish: {reason}",
                               None)], "the save did not finish")


def _values_summary(stats: ValueScan) -> str:
    rate = (f", {stats.bytes / stats.seconds / 1e9:.2f} GB/s" if stats.seconds > 0
            and stats.bytes > _RATE_MIN else "")
    skipped = f", {stats.skipped} not examinable" if stats.skipped else ""
    return f"{stats.tensors:,} floating tensor(s), {format_size(stats.bytes)}{rate}{skipped}"


def _manifest(b: _Builder, path: Path, opts: Options, *,
              has_errors: bool) -> ManifestResult | None:
    """Verify the manifest if there is one; write one if asked and the checkpoint is valid."""
    mpath = manifest_path(path)
    try:
        existing = read_manifest(path)
    except CkptError as e:
        b.add("manifest", [Finding("error", "bad-manifest", e.message, mpath.name)],
              "the manifest is unreadable")
        return ManifestResult(mpath, "unreadable")
    result = ManifestResult(mpath, "absent")
    verification: Verification | None = None
    share = opts.share
    partial = share is not None and not share.final  # one part: its own files only
    if existing is not None:
        try:
            verification = verify_manifest(
                path, jobs=opts.jobs, on_progress=opts.on_progress, manifest=existing,
                hasher=share.hasher(existing.algorithm, jobs=opts.jobs,
                                    on_progress=opts.on_progress) if share else None)
        except CkptError as e:
            b.add("manifest", [Finding("error", "manifest-unverifiable", e.message,
                                       _rel_path(e.path, path))], "could not hash the files")
            return ManifestResult(mpath, "unreadable", existing.algorithm)
        assert verification is not None
        result = ManifestResult(mpath, "verified", existing.algorithm)
        result.add_stats(verification.stats)
        result.changed = sorted([*verification.changed, *verification.missing,
                                 *(r for r, _, _ in verification.resized)])
        result.extra = verification.extra
        bad = len(result.changed)
        rate = f", {result.throughput / 1e9:.2f} GB/s" if result.bytes > _RATE_MIN else ""
        listed = len(existing.files)
        if partial:  # of this part's files: the others are compared by their parts
            listed = len(set(existing.files) & set(verification.actual)) + bad
        b.add("manifest", verification.findings(mpath.name),
              f"{listed - bad} of {listed} file(s) {'of this part ' if partial else ''}match "
              f"({existing.algorithm}{rate})")
    if not opts.write_manifest:
        if existing is None:
            b.skip("manifest", "none (--write-manifest records one)")
        return result
    damaged = verification is not None and bool(
        verification.changed or verification.resized or verification.missing)
    if has_errors or damaged:
        why = ("the checkpoint has errors" if has_errors else
               "the existing manifest disagrees with the files")
        b.add("manifest", [Finding("error", "manifest-not-written",
                                   f"manifest not written: {why}", mpath.name)])
        result.action = "not-written"
        return result
    if (verification is not None and verification.ok and existing is not None
            and existing.algorithm == opts.manifest_algorithm):
        manifest = existing  # unchanged files, same checksum: keep the original record
        written, stats = mpath, None
    else:
        try:
            manifest, stats = compute_manifest(
                path, algorithm=opts.manifest_algorithm, jobs=opts.jobs,
                on_progress=opts.on_progress,
                hasher=share.hasher(opts.manifest_algorithm, jobs=opts.jobs,
                                    on_progress=opts.on_progress) if share else None)
            if partial:
                result.action, result.algorithm = "pending", manifest.algorithm
                result.add_stats(stats)
                b.add("manifest", [], f"hashed {len(manifest.files)} file(s) of this part "
                      f"({manifest.algorithm}); {mpath.name} is written when every part is "
                      "done")
                return result
            written, manifest, _ = write_manifest(path, manifest=manifest)
        except CkptError as e:  # one unwritable checkpoint must not end a run's validation
            b.add("manifest", [Finding("error", "manifest-not-written",
                                       f"manifest not written: {e.message}", mpath.name)])
            result.action = "not-written"
            return result
    result.action = "written" if stats is not None else "verified"
    result.algorithm = manifest.algorithm
    result.add_stats(stats)
    rate = f", {stats.throughput / 1e9:.2f} GB/s" if stats and stats.bytes > _RATE_MIN else ""
    b.add("manifest", [], f"{'wrote' if stats else 'kept'} {written.name}: "
          f"{len(manifest.files)} file(s), {manifest.algorithm}{rate}")
    return result
