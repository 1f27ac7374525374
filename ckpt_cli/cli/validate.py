"""``ckpt validate``."""


from typing import Annotated

import typer

from ckpt_cli.cli.errors import handled, worded
from ckpt_cli.cli.options import (
    STREAMING,
    AllowGlobalOpt,
    CheckpointArg,
    Common,
    FinalizeOpt,
    InputFormatOpt,
    Location,
    PartOpt,
    RunPatternOpt,
    common_options,
    local_only,
    location,
    output_file,
)


@common_options(*STREAMING)
def validate_cmd(
    path: CheckpointArg,
    latest: Annotated[bool, typer.Option(
        "--latest", help="Run directory: validate only the checkpoint training resumes from "
                         "(what latest or last.ckpt names, else the newest step; never an HF "
                         "final model beside checkpoint-N).")] = False,
    values: Annotated[bool, typer.Option("--values", help="Also read every floating tensor: "
                                                          "NaN, Inf, all-zero.")] = False,
    require: Annotated[str | None, typer.Option(
        "--require", metavar="LIST", help="Make missing training state an error: "
                                          "optimizer,step.")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Structure only: skip the CRC-32 pass "
                                                        "and chunk decoding (a manifest is "
                                                        "still verified).")] = False,
    write_manifest: Annotated[bool, typer.Option(
        "--write-manifest", help="Record size and checksum of every file in a manifest "
                                 "inside the checkpoint (only if it is valid).")] = False,
    manifest_hash: Annotated[str, typer.Option(
        "--manifest-hash", metavar="NAME", help="Checksum for --write-manifest: xxh3_128, "
                                                "blake3 or sha256.")] = "xxh3_128",
    strict: Annotated[bool, typer.Option("--strict", help="Warnings fail too "
                                                          "(exit 1).")] = False,
    junit: Annotated[Location | None, typer.Option(
        "--junit", metavar="FILE", help="Also write a JUnit XML report (one test case per "
                                        "check).",
        parser=output_file)] = None,
    jobs: Annotated[int | None, typer.Option(
        "--jobs", "-j", min=1, metavar="N", help="Threads for checksums (default: CPUs, at "
                                                 "most 8).")] = None,
    pattern: RunPatternOpt = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show notes, and every "
                                                                  "check of a run.")] = False,
    part: PartOpt = None,
    finalize: FinalizeOpt = False,
    parts_dir: Annotated[Location | None, typer.Option(
        "--parts-dir", metavar="DIR", help="With --part: keep the parts' receipts in DIR "
                                           "(default: beside the checkpoint).",
        parser=location)] = None,
    input_format: InputFormatOpt = None,
    allow_global: AllowGlobalOpt = None,
    *,
    common: Common,
) -> None:
    """Check that a checkpoint is complete, consistent and uncorrupted.

    Verifies headers, offsets, shard and rank sets, DCP chunk tiling, pickle safety and the
    CRC-32 of every zip record (streamed), and the integrity manifest if there is one. A pickle
    global outside ckpt's allowlist is an error (--allow-global trusts one). Exit status: 0
    valid, 1 problems found, 2 usage error or unreadable path.

    Examples:
      ckpt validate model.safetensors
      ckpt validate run/step_1000 --values --require optimizer,step
      ckpt validate run/ --latest --junit report.xml
      ckpt validate export/ --write-manifest
      torchrun --nproc-per-node 8 -m ckpt_cli validate run/step_1000 --part auto
    """
    from ckpt_cli.ops.validate import validate
    from ckpt_cli.ops.validate.options import ValidateOptions

    with handled() as outcome:
        local_only(junit, '--junit')
        if junit is not None:  # before any work: a link, FIFO, device, unwritable place
            from ckpt_cli.storage.atomic import check_destination

            check_destination(junit, overwrite=True, parents=True)
        try:
            common.use_storage()
            local_only(path if write_manifest else None, "--write-manifest's checkpoint")
            local_only(parts_dir, '--parts-dir')
            with common.progress("validating") as bar:
                options = ValidateOptions(
                    fmt=input_format, latest=latest, quick=quick, values=values,
                    require=require, write_manifest=write_manifest,
                    manifest_algorithm=manifest_hash, jobs=jobs, pattern=pattern, part=part,
                    finalize=finalize, parts_dir=parts_dir, max_memory=common.max_memory,
                    allow_globals=tuple(allow_global or ()))
                result = validate(path, options, progress=bar)
        except (Exception, KeyboardInterrupt) as e:
            if junit is not None:
                _junit_of_error(junit, path, e)
            raise
        result.strict = strict
        outcome.exit_code = code = result.exit_code(strict=strict)
        if junit is not None:
            from ckpt_cli.render.junit import write_junit

            write_junit(result, junit)
        from ckpt_cli.render.validate import show

        show(result, json=common.json, verbose=verbose)
    raise typer.Exit(code)


def _junit_of_error(dest: Location, path: Location, error: BaseException) -> None:
    """``--junit`` when the validation could not run: a report with one failed case naming
    the error, so that a CI step publishing it finds one. The error itself still goes to
    stderr and sets the exit code (``handled()``); a report that cannot be written is said
    on stderr too."""
    from ckpt_cli.errors import CkptError
    from ckpt_cli.render.junit import error_junit_xml, write_junit_bytes

    detail = ""
    if isinstance(error, CkptError):
        _, hint, message = worded(error)
        kind, detail = error.kind, f"hint: {hint}" if hint else ""
    elif isinstance(error, KeyboardInterrupt):
        kind, message = "interrupted", "interrupted"
    elif isinstance(error, MemoryError):
        kind, message = "memory", "out of memory"
    elif isinstance(error, OSError) and error.strerror:
        where = f"{error.filename}: " if isinstance(error.filename, str) else ""
        kind, message = "os", f"{where}{error.strerror}"
    else:
        kind, message = "internal", f"internal error: {type(error).__name__}: {error}"
    try:
        write_junit_bytes(error_junit_xml(path, kind, message, detail), dest)
    except CkptError as e:
        typer.echo(f"ckpt: error: {e}", err=True)
