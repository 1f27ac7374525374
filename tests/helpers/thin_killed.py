"""Run ``prune --thin-after`` on a run directory and SIGKILL the process at a chosen point of
a DCP thinning (run as a subprocess: nothing of Python's cleanup runs, as in a real kill).

``python -m tests.helpers.thin_killed RUN THIN_AFTER WHERE``; WHERE is ``writing`` (DCP's
writer has written the data files of the thinned copy, not its ``.metadata``) or ``swapped``
(the thinned copy is in place, the original not yet removed, the manifest not rewritten).
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any


def _die(*_args: Any, **_kwargs: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    warnings.simplefilter("ignore")
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from ckpt_cli.ops.prune import prune
    from ckpt_cli.ops.prune.retention import PrunePolicy
    from ckpt_cli.trust.thinning import base as thinning

    run, after, where = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if where == "writing":
        FileSystemWriter.finish = _die  # type: ignore[method-assign]
    else:
        real = thinning._swap_in

        def swap_then_die(*args: Any, **kwargs: Any) -> Any:
            thinning._manifest_again = _die  # type: ignore[assignment]
            return real(*args, **kwargs)

        thinning._swap_in = swap_then_die  # type: ignore[assignment]
        thinning.shutil.rmtree = _die  # type: ignore[assignment]
    prune(run, PrunePolicy(thin_after=after, grace=0))
    sys.exit(3)  # not killed: the test fails on this status


if __name__ == "__main__":
    main()
