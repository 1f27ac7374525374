"""``ckpt consolidate``."""


from typing import Annotated, Any

import typer

from ckpt_cli.cli.errors import EXIT_OK
from ckpt_cli.cli.options import (
    STREAMING,
    CastToOpt,
    Common,
    FinalizeOpt,
    ForceOpt,
    Location,
    OutputFormatOpt,
    PartOpt,
    common_options,
    output_location,
    path_argument,
    size_parser,
)


@common_options(*STREAMING)
def consolidate_cmd(
    source: Annotated[Location, path_argument(
        "DCP directory, DeepSpeed checkpoint (global_stepN/ or its save dir with 'latest'), "
        "HF-style shards with an index, or a directory of per-rank files.")],
    output: Annotated[Location, typer.Option(
        "--output", "-o", help="Output directory (or a single .safetensors/.pt file).",
        show_default=False, parser=output_location)],
    output_format: OutputFormatOpt = None,
    # Any: the default is text, and typer parses it as it parses a given value (int | None).
    max_shard_size: Annotated[Any, typer.Option(
        "--max-shard-size", metavar="SIZE", help="Largest output file; 0 for one file.",
        parser=size_parser("--max-shard-size", allow_zero=True))] = "5GB",
    with_optimizer: Annotated[bool, typer.Option(
        "--with-optimizer/--model-only", help="Keep the optimizer state too (to resume on a "
                                              "different world size), or only the model "
                                              "(default).")] = False,
    to: CastToOpt = "keep",
    clamp: Annotated[bool, typer.Option(
        "--clamp", help="With --to fp16: clamp values beyond FP16's range to ±65504 instead "
                        "of refusing.")] = False,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Re-read every output tensor and compare it with its source chunks "
                         "before the output is put in place.")] = False,
    manifest: Annotated[bool, typer.Option(
        "--manifest/--no-manifest", help="Write an integrity manifest that 'ckpt validate' "
                                         "checks.")] = True,
    overwrite: ForceOpt = False,
    part: PartOpt = None,
    finalize: FinalizeOpt = False,
    *,
    common: Common,
) -> None:
    """Merge a rank-sharded checkpoint (DCP, DeepSpeed ZeRO, per-rank files) into few files.

    Assembles every tensor from its chunks or partitions one at a time (memory stays near
    the largest tensor), writes safetensors shards with an HF index, and puts the output in
    place only when complete. DeepSpeed ZeRO 1/2/3 weights are rebuilt in FP32 exactly as
    DeepSpeed's zero_to_fp32 does, without loading any rank's optimizer state whole.

    Examples:
      ckpt consolidate run/step_000400 -o step400-full/
      ckpt consolidate ds_run/global_step1000 -o model/ --to bf16
      ckpt consolidate ds_run -o model/              # follows ds_run/latest
      ckpt consolidate fsdp_ckpt/ --with-optimizer -o resume/ --verify
      ckpt consolidate dcp/ -o full/ --part 2/4
    """
    with common.handled() as outcome:
        from ckpt_cli.ops.consolidate import ConsolidateOptions, consolidate
        with common.progress("consolidating") as bar:
            options = ConsolidateOptions(
                fmt=output_format, max_shard_size=max_shard_size,
                with_optimizer=with_optimizer, to=to,
                clamp=clamp, overwrite=overwrite, verify=verify, manifest=manifest, part=part,
                finalize=finalize, max_memory=common.max_memory)
            r = consolidate(source, output, options, progress=bar)
        outcome.exit_code = EXIT_OK  # written: a closed pipe only loses the summary
        from ckpt_cli.render.consolidate import show

        show(r, json=common.json, quiet=common.quiet)
