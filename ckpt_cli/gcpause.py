"""Python's cyclic garbage collector paused while an operation builds millions of records.

A header of a million tensors makes several million small objects (tensor records, figures,
dict entries) that hold no cycles. Each full collection walks all of them, and their
allocation keeps triggering collections: at 10^5 tensors they took a third of ``ckpt stats``'
CPU time, more at 10^6. Reference counting still frees everything as usual; only cycles made
meanwhile (few) wait until the operation ends, when the collector is on again.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector inside the block; restore its state after.

    Yields:
        Nothing; the block runs with automatic collection off (if it was on).
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
