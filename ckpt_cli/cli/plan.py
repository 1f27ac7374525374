"""``ckpt plan``."""


from typing import TYPE_CHECKING

from ckpt_cli.cli.errors import EXIT_OK, handled
from ckpt_cli.cli.options import JsonOpt, QuietOpt, from_options, local_only
from ckpt_cli.ops.options.plan import PlanOptions

if TYPE_CHECKING:
    from rich.console import Console

@from_options(PlanOptions)
def plan_cmd(
    *,
    options: PlanOptions,
    quiet: QuietOpt = False,
    json: JsonOpt = False,
) -> None:
    """Plan checkpointing: checkpoint size, write time, optimal interval, storage and files.

    Bytes per parameter of a training checkpoint (--params; inference: the weights only):

      precision   weights  fp32 master  adam/adamw  sgd  adafactor
      fp32        4        0            8           4    0
      bf16        2        0            4           2    0
      mixed       2        4            8           4    0

    Training = weights + master + optimizer state (175B in fp32 with Adam: 12 x 175B = 2.1 TB);
    gradients, RNG and scheduler state are not counted.

    The optimal interval is Young's sqrt(2CM) and Daly's higher-order refinement, where C is
    the time one checkpoint blocks training (the write, or with --async-save the copy to host
    memory) and M the MTBF; the time lost counts checkpoint stalls plus rework after failures.

    Examples:
      ckpt plan --params 175B --precision fp32 --bandwidth 10GB/s --mtbf 4h
      ckpt plan --params 70B --measure-dir /lustre/ckpt --gpus 1024 --gpu-mtbf 5y
      ckpt plan --params 7B --bandwidth 2GB/s --mtbf 12h --keep 5 --interval 30m
      ckpt plan --from-path run/step_1 --bandwidth 2GB/s --mtbf 12h --async-save
    """
    from rich.markup import escape  # heavy: rich

    from ckpt_cli.ops.plan import plan  # lazy: not loaded by ckpt --help
    from ckpt_cli.render.human import size as human_size  # lazy: not loaded by ckpt --help

    with handled() as outcome:
        local_only(options.measure_dir, '--measure-dir')  # type: ignore[arg-type]
        err = None if quiet or json else _stderr()

        def progress(_phase: str, done: int, total: int) -> None:
            if err is not None and done == 0:
                err.print(f"[dim]plan:[/] measuring: writing {human_size(total)} to "
                          f"{escape(str(options.measure_dir))} and fsyncing ...")

        result = plan(options, progress=progress)
        result.caller = "cli"  # its notes name --flags, in the --json document too
        outcome.exit_code = EXIT_OK
        from ckpt_cli.render.plan import show  # lazy: not loaded by ckpt --help

        show(result, json=json, quiet=quiet, err=err)

def _stderr() -> "Console":
    from ckpt_cli.render import human  # lazy: not loaded by ckpt --help

    return human.stderr()
