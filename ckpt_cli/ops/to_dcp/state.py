"""The training state of a run, as every source reader gives it and the DCP writer takes it.

Names are fully qualified parameter names (FQNs) as ``model.named_parameters()`` gives them
on the training side, without any framework wrapper (``module.``, ``_forward_module.``,
``model.`` of a Lightning/DeepSpeed container). Tensors are lazy: a reader says what a tensor
is (dtype, shape) and how to load it, and the writer loads one at a time, so memory stays
bounded by the largest tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Loader = Callable[[], np.ndarray]
"""Reads one tensor's values (the whole tensor, in ``dtype``, C order)."""


@dataclass(frozen=True)
class LazyTensor:
    """A tensor known by its metadata, read when the writer asks.

    Attributes:
        dtype: Canonical dtype code (``F32``, ``BF16``... as :mod:`ckpt_cli.dtypes` names them).
        shape: The tensor's full (unsharded) shape.
        load: Returns the values as a numpy array of ``shape`` in the numpy dtype
            :func:`ckpt_cli.dtypes.numpy_dtype` maps ``dtype`` to (``ml_dtypes.bfloat16`` for
            BF16). A 0-d tensor loads as a 0-d array. Tied weights may share one loader.
        pieces: Optionally, the same values as flat arrays in row-major order, a bounded
            piece at a time (the writer uses it instead of ``load``, so that a large tensor
            never sits in memory whole).
        crc: The CRC-32 of the tensor's bytes (C order), where the source records it for
            exactly these bytes and its reader checks it as it reads (a torch zip's storage
            entry): the writer's archive takes it instead of computing it again.
    """

    dtype: str
    shape: tuple[int, ...]
    load: Loader
    pieces: Callable[[], Iterator[np.ndarray]] | None = None
    crc: int | None = None


@dataclass
class TrainingState:
    """What a resumed run needs, read from one source checkpoint.

    Attributes:
        source_format: The source's framework (``deepspeed``, ``hf-trainer``, ``lightning``,
            ``torch``, ``dcp``).
        model: FQN -> weight. For mixed-precision sources, the FP32 master weights where the
            source has them (say so in ``notes``); buffers included under their FQNs.
        optimizer: ``torch.optim`` class name (``AdamW``, ``Adam``, ``SGD``...).
        optimizer_state: FQN -> per-parameter state (``exp_avg``, ``exp_avg_sq``, ``step``,
            ``momentum_buffer``...), each a :class:`LazyTensor` or a Python scalar, in the form
            ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives.
        param_groups: The optimizer's groups, each with its hyperparameters (``lr``,
            ``betas``, ``eps``, ``weight_decay``...) and ``params``: the FQNs it holds, in order.
        lr_scheduler: The LR scheduler's ``state_dict()`` (plain Python values), if the
            source saved one.
        step: The global step the source was saved at, if known.
        rng: RNG states by name (``python``, ``numpy``, ``cpu``, ``cuda``), as the source
            saved them, if it did.
        extra: Other plain values worth carrying (epoch, ``trainer_state.json`` fields...).
        notes: What the conversion had to decide or could not carry (one line each), for the
            result and the docs (``FP32 master weights used; BF16 copies dropped``).
    """

    source_format: str
    model: dict[str, LazyTensor]
    optimizer: str | None = None
    optimizer_state: dict[str, dict[str, LazyTensor | int | float]] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    lr_scheduler: dict[str, Any] | None = None
    step: int | None = None
    rng: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
