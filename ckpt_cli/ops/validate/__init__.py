"""``validate``: is a checkpoint complete, consistent and uncorrupted?

The format readers already record what reading the metadata reveals (offsets, gaps, missing
shards and ranks, unsafe pickle globals). Validation runs them, sorts their findings into
named checks, and adds the checks that need more than metadata: the zip structure and the
CRC-32 of every record of every torch zip (streamed, in parallel), DCP chunk tiling and
decoding, rank-file sets, ``latest`` pointers, resumability, optionally every floating value,
and the integrity manifest. Each checkpoint gets a :class:`CheckpointReport`; a run directory
gets one per checkpoint.

This module is the front door: :func:`validate` checks its options and chooses between one
checkpoint (:mod:`.checkpoint`), a run directory (:mod:`.run`) and a split over processes
(:mod:`.partrun`). The checks are :mod:`.structure`, :mod:`.manifestcheck` and the modules
they call; :mod:`.builder` turns findings into check results; :mod:`.result` holds the types.

Nothing here prints or exits; nothing is written except the manifest when asked.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ckpt_cli import storage
from ckpt_cli.errors import UsageError
from ckpt_cli.formats import allowlist, check_exists, get_reader
from ckpt_cli.manifest import ALGORITHMS
from ckpt_cli.ops import options_of
from ckpt_cli.ops.validate.checkpoint import validate_checkpoint
from ckpt_cli.ops.validate.options import Options, Split, ValidateOptions
from ckpt_cli.ops.validate.partrun import validate_split
from ckpt_cli.ops.validate.result import ValidateResult
from ckpt_cli.ops.validate.run import check_one, validate_run
from ckpt_cli.parts import parse_part
from ckpt_cli.progress import Progress
from ckpt_cli.resolve import resolve
from ckpt_cli.runs import is_final_model_only
from ckpt_cli.storage.reads import BUFFER_SIZE, default_jobs, memory_budget

__all__ = ["REQUIREMENTS", "Options", "Split", "ValidateOptions", "parse_require", "validate",
           "validate_checkpoint", "validate_split"]

REQUIREMENTS = ("optimizer", "step")
"""What ``--require`` accepts."""


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
        raise UsageError(f"require: unknown requirement {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(REQUIREMENTS)}", param="require")
    return tuple(r for r in REQUIREMENTS if r in names)


def validate(path: str | Path, options: ValidateOptions | None = None, *,
             progress: Progress | None = None, **fields: Any) -> ValidateResult:
    """Validate a checkpoint, or every checkpoint of a run directory.

    Args:
        path: A checkpoint file or directory, or a run directory.
        options: What to check (:class:`ValidateOptions`; default: its defaults).
        progress: Called as bytes are read: ``(phase, bytes_done, bytes_total)``, a phase
            per check (``crc32``, ``values``...; in a run, prefixed with the checkpoint's
            name) (:class:`ckpt_cli.progress.Progress`).
        **fields: :class:`ValidateOptions` fields, instead of ``options`` (see
            :func:`ckpt_cli.ops.options_of`).

    Returns:
        The :class:`ValidateResult` (with ``part`` set when split, ``strict`` as given).

    Raises:
        CkptError: The path does not exist or cannot be read, or (for a single checkpoint) its
            format cannot be recognised at all.
        UsageError: Bad options.
        PartsIncompleteError: Finalizing with parts missing or planned differently.
    """
    given = options_of(ValidateOptions, options, fields)
    result = _validate(storage.locate(path), given, progress)
    result.strict = given.strict
    return result


def _validate(p: Path, given: ValidateOptions, progress: Progress | None) -> ValidateResult:
    fmt, latest, quick, values = given.input_format, given.latest, given.quick, given.values
    require, write_manifest, jobs = given.require, given.write_manifest, given.jobs
    manifest_algorithm, pattern, max_memory = (given.manifest_hash, given.pattern,
                                               given.max_memory)
    part, finalize, parts_dir = given.part, given.finalize, given.parts_dir
    allow_globals = given.allow_global
    check_exists(p)
    if manifest_algorithm not in ALGORITHMS:
        raise UsageError(f"manifest_hash must be one of {', '.join(ALGORITHMS)}, "
                         f"not {manifest_algorithm!r}", param="manifest_hash")
    if jobs is not None and jobs < 1:
        raise UsageError("jobs must be at least 1", param="jobs")
    if quick and write_manifest:
        # A manifest vouches for the bytes; --quick never reads them (no CRC pass), so it
        # could record a corrupt file as good.
        raise UsageError("write_manifest needs the full check; drop quick",
                         param=("write_manifest", "quick"))
    budget = memory_budget(max_memory)
    # CRC-32 and hashing threads each hold one buffer: never more of them than fit the budget.
    threads = min(jobs or default_jobs(), max(1, budget // BUFFER_SIZE))
    opts = Options(fmt, quick, values, parse_require(require), write_manifest,
                   manifest_algorithm, threads, progress, budget,
                   allow_globals=allowlist.parse_names(allow_globals))
    split = None
    if part is not None or finalize:
        split = Split(parse_part(part) if isinstance(part, str) else part, finalize,
                      Path(parts_dir) if parts_dir is not None else None)
    elif parts_dir is not None:
        raise UsageError("parts_dir goes with part or finalize",
                         param=("parts_dir", "part", "finalize"))
    if fmt is not None:
        get_reader(fmt)  # an unknown --input-format is a usage error, even for a run dir
    target = resolve(p, input_format=fmt)
    run_dir = target.is_run
    if split is not None and run_dir and not latest:
        raise UsageError("part and finalize split the validation of one checkpoint, and "
                         "this is a run directory of many", path=p,
                         param=("part", "finalize", "latest"),
                         hint="give one checkpoint of the run (e.g. RUN/step_1000), or add "
                              "latest")
    if target.final_model:
        return validate_run(p, opts, latest=latest, pattern=pattern, final_model=True,
                             split=split)
    if run_dir:
        return validate_run(p, opts, latest=latest, pattern=pattern, split=split)
    if latest and fmt is None and is_final_model_only(p):
        # An HF output_dir with its final model and no checkpoint-N: that model is the run's
        # latest (and only) checkpoint; --require optimizer,step still says it cannot resume.
        return validate_run(p, opts, latest=True, pattern=pattern, final_model=True,
                             split=split)
    if latest:
        raise UsageError("latest needs a run directory (a directory of checkpoints)",
                         path=p, param="latest")
    result = ValidateResult(p, "checkpoint")
    result.checkpoints.append(check_one(p, opts, None, split, result))
    return result
