"""``ckpt consolidate``."""


from typing import Annotated

import typer

from ckpt_cli.cli.errors import EXIT_OK, handled
from ckpt_cli.cli.options import (
    Common,
    Location,
    common_options,
    from_options,
    output_location,
    path_argument,
    use_storage,
)
from ckpt_cli.ops.options.consolidate import ConsolidateOptions


@common_options("quiet", "storage_option", "json")
@from_options(ConsolidateOptions)
def consolidate_cmd(
    source: Annotated[Location, path_argument(
        "DCP directory, DeepSpeed checkpoint (global_stepN/ or its save dir with 'latest'), "
        "HF-style shards with an index, or a directory of per-rank files.")],
    output: Annotated[Location, typer.Option(
        "--output", "-o", help="Output directory (or a single .safetensors/.pt file).",
        show_default=False, parser=output_location)],
    *,
    options: ConsolidateOptions,
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
    with handled() as outcome:
        use_storage(common.storage_option, options.concurrency)
        from ckpt_cli.ops.consolidate import consolidate  # lazy: not loaded by ckpt --help

        with common.progress("consolidating") as bar:
            r = consolidate(source, output, options, progress=bar)
        r.caller = "cli"  # its notes name --flags, in the --json document too
        outcome.exit_code = EXIT_OK  # written: a closed pipe only loses the summary
        from ckpt_cli.render.consolidate import show  # lazy: not loaded by ckpt --help

        show(r, json=common.json, quiet=common.quiet)
