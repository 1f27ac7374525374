"""A run directory validated: each checkpoint of its listing (or, with ``--latest``, the one
training would resume from, and an HF Trainer's final model last), then the run's own checks:
pointer files and leftovers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ckpt_cli.model import Finding, RunEntry, RunListing
from ckpt_cli.ops.validate.builder import check_result
from ckpt_cli.ops.validate.checkpoint import validate_checkpoint
from ckpt_cli.ops.validate.layoutcheck import directory_pointers, leftover_message
from ckpt_cli.ops.validate.options import Options, Split
from ckpt_cli.ops.validate.partrun import validate_split
from ckpt_cli.ops.validate.result import (
    CheckpointReport,
    LatestChoice,
    ValidateResult,
)
from ckpt_cli.runs import POINTER_FILES, RESUME_POINTERS, list_run, run_entry


def check_one(path: Path, opts: Options, entry: RunEntry | None, split: Split | None,
              result: ValidateResult) -> CheckpointReport:
    if split is None:
        return validate_checkpoint(path, opts, entry=entry)
    report, result.part = validate_split(path, opts, split, entry=entry)
    return report


def validate_run(root: Path, opts: Options, *, latest: bool, pattern: str | None,
                 final_model: bool = False, split: Split | None = None) -> ValidateResult:
    run = list_run(root, pattern)
    result = ValidateResult(root, "run", run=run, final_model=final_model)
    entries = run.entries
    if latest:
        result.latest = choice = _latest_choice(root, run, final_model)
        entries = [e for e in entries if choice is not None and e.name == choice.name]
    for e in entries:
        result.checkpoints.append(check_one(e.path, opts, e, split, result))
    if final_model and (not latest or (result.latest is not None
                                       and result.latest.final_model)):
        # Trained last, so reported last; its own entry so that damage is a finding.
        result.checkpoints.append(_final_model_report(
            check_one(root, opts, run_entry(root, root), split, result)))
    dangling, named = directory_pointers(root)
    # Symlink pointers (Lightning's last.ckpt) are resolved by the listing.
    dangling += [dataclasses.replace(f, severity="error", message=f.message
                                     + ": resuming from it will fail")
                 for f in run.findings if f.code == "dangling-pointer"
                 and f.file not in POINTER_FILES]
    named += [f"{k} -> {v}" for k, v in sorted(run.pointers.items())
              if k not in POINTER_FILES and not any(f.file == k for f in dangling)]
    result.run_checks.append(check_result("latest-pointer", dangling,
                                          ", ".join(named) or "no pointer files"))
    leftover = [Finding("warning", "leftover", leftover_message(name), name)
                for name in run.leftovers]
    result.run_checks.append(check_result(
        "leftovers", leftover,
        "no temporary or trash entries" if not leftover else f"{len(leftover)} leftover(s)"))
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
            report.checks[i] = check_result(c.id, notes, c.summary)
    return report
