"""``ckpt validate``."""


from typing import Annotated

import typer

from ckpt_cli.cli.errors import handled, worded
from ckpt_cli.cli.options import (
    CheckpointArg,
    Common,
    Location,
    common_options,
    from_options,
    local_only,
    output_file,
    use_storage,
)
from ckpt_cli.errors import CkptError
from ckpt_cli.ops.options.validate import ValidateOptions
from ckpt_cli.storage.atomic import check_destination


@common_options("quiet", "storage_option", "json")
@from_options(ValidateOptions)
def validate_cmd(
    path: CheckpointArg,
    junit: Annotated[Location | None, typer.Option(
        "--junit", metavar="FILE", help="Also write a JUnit XML report (one test case per "
                                        "check).",
        parser=output_file)] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show notes, and every "
                                                                  "check of a run.")] = False,
    *,
    options: ValidateOptions,
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
    from ckpt_cli.ops.validate import validate  # lazy: not loaded by ckpt --help

    with handled() as outcome:
        local_only(junit, '--junit')
        if junit is not None:  # before any work: a link, FIFO, device, unwritable place
            check_destination(junit, overwrite=True, parents=True)
        try:
            use_storage(common.storage_option, options.concurrency)
            local_only(path if options.write_manifest else None,
                       "--write-manifest's checkpoint")
            local_only(options.parts_dir, '--parts-dir')  # type: ignore[arg-type]
            with common.progress("validating") as bar:
                result = validate(path, options, progress=bar)
        except (Exception, KeyboardInterrupt) as e:
            if junit is not None:
                _junit_of_error(junit, path, e)
            raise
        outcome.exit_code = code = result.exit_code(strict=options.strict)
        if junit is not None:
            from ckpt_cli.render.junit import write_junit  # lazy: not loaded by ckpt --help

            write_junit(result, junit)
        from ckpt_cli.render.validate import show  # lazy: not loaded by ckpt --help

        show(result, json=common.json, verbose=verbose)
    raise typer.Exit(code)


def _junit_of_error(dest: Location, path: Location, error: BaseException) -> None:
    """``--junit`` when the validation could not run: a report with one failed case naming
    the error, so that a CI step publishing it finds one. The error itself still goes to
    stderr and sets the exit code (``handled()``); a report that cannot be written is said
    on stderr too."""
    from ckpt_cli.render.junit import (  # lazy: not loaded by ckpt --help
        error_junit_xml,
        write_junit_bytes,
    )

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
