"""The step a DCP checkpoint's ``train_state`` records (torchtitan's ``TrainState``).

torchtitan saves ``train_state.step`` as a 0-d int32 tensor, the PyTorch recipe's loops (and
``ckpt convert --to dcp --dcp-layout recipe``) as a plain int; either is the checkpoint's
step. Reading the tensor's value is one small positioned read of its chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckpt_cli import dtypes, storage
from ckpt_cli.errors import CkptError
from ckpt_cli.model import CheckpointIndex

KEY = "train_state.step"


def train_step(index: CheckpointIndex, locate_chunk: Callable[..., Any]) -> dict[str, int]:
    """``{"step": N}`` from ``train_state.step`` (object or 0-d integer tensor), else ``{}``.

    Args:
        index: A DCP checkpoint's index, its tensors and objects read.
        locate_chunk: :func:`ckpt_cli.formats.dcp.locate_chunk` (passed in: the DCP reader
            imports this module).

    Returns:
        The step, for :func:`ckpt_cli.formats.containers.extract_metadata`'s input.
    """
    value = index.objects.get(KEY)
    if isinstance(value, int) and not isinstance(value, bool):
        return {"step": value}
    t = index.tensors.get(KEY)
    if t is None or t.shape != () or not t.dtype.startswith(("I", "U")) or len(t.chunks) != 1:
        return {}
    fds: dict[str, storage.Handle] = {}

    def fd_of(rel: str) -> storage.Handle:
        if rel not in fds:
            fds[rel] = storage.open_regular(index.path_of(rel))
        return fds[rel]

    try:
        info = locate_chunk(index, fd_of, t, t.chunks[0])
        if info.file is None or info.offset is None:
            return {}
        size = dtypes.DTYPES[t.dtype].itemsize
        raw = storage.pread(fd_of(info.file), size, info.offset)
        if len(raw) != size:
            return {}
        return {"step": int.from_bytes(raw, "little", signed=t.dtype.startswith("I"))}
    except (CkptError, OSError):
        return {}  # the tiling and chunk checks report a damaged chunk
    finally:
        for h in fds.values():
            storage.close(h)
