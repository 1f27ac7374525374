"""``ckpt sample``."""


from typing import Annotated

from ckpt_cli.cli.errors import EXIT_OK, handled
from ckpt_cli.cli.options import (
    JsonOpt,
    Location,
    QuietOpt,
    from_options,
    local_only,
    path_argument,
)
from ckpt_cli.errors import DestinationExistsError
from ckpt_cli.ops.options.sample import SampleOptions


@from_options(SampleOptions)
def sample_cmd(
    dest: Annotated[Location, path_argument("Directory to create.")],
    *,
    options: SampleOptions,
    quiet: QuietOpt = False,
    json: JsonOpt = False,
) -> None:
    """Write a small, real training run to try the other commands on.

    Trains a tiny GPT for 400 steps and saves torch.save checkpoints (model + AdamW state +
    step/epoch/lr) at steps 100-300, a checkpoint written by torch.distributed.checkpoint from
    4 processes at step 400, an HF-style sharded safetensors export and a `latest` pointer.
    Takes 20-90 seconds, depending on the CPU cores and what else runs (measured: 20-25 s on
    16 cores, 27-29 s on 2 idle cores, 47 s on 1, 67-87 s on 2 busy ones).

    Examples:
      ckpt sample demo-run
      ckpt inspect demo-run
    """
    with handled() as outcome:
        local_only(dest, 'the sample run')
        if dest.exists() and not options.overwrite:
            # Before importing torch (1.5 s, 230 MB) for nothing; write_sample checks again.
            raise DestinationExistsError("already exists", path=dest,
                                         hint="pass --overwrite to replace it")
        from ckpt_cli.cli.progress import step_progress  # lazy: not loaded by ckpt --help
        from ckpt_cli.ops.sample import write_sample  # lazy: not loaded by ckpt --help

        with step_progress("sample", enabled=not (quiet or json)) as progress:
            written = write_sample(dest, options, progress=progress)
        outcome.exit_code = EXIT_OK
        from ckpt_cli.render.sample import show  # lazy: not loaded by ckpt --help

        show(dest, written, json=json)
