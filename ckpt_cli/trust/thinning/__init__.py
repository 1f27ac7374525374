"""Thinning: rewrite old training checkpoints in place without their optimizer state.

``prune --thin-after K`` keeps the newest K counted checkpoints whole (see
:mod:`ckpt_cli.ops.prune.retention`); older ones that stay keep their weights and training
metadata (step, epoch, loops, scheduler, RNG) and each optimizer's hyperparameters
(``param_groups``: the learning rate its schedule reached, betas, weight decay), but lose the
optimizers' per-parameter state, which is most of a training checkpoint's bytes (Adam: two
FP32 moments per parameter). A run resumed from one follows its schedule; the optimizer
re-creates its state at the next step. ``--thin-to bf16`` also casts the
floating-point weights to BF16. ``--keep-full-every N`` keeps checkpoints whose step is a multiple
of N whole.

What is thinned, and how each rewrite stays atomic:

- Single torch files (``torch.save`` ``.pt``/``.pth``/``.bin``, Lightning ``.ckpt``), and step
  directories holding one (``step_000100/checkpoint.pt``): read with
  ``torch.load(weights_only=True)`` (never executing code from it; a file that needs more is
  left whole), the thinned copy written beside it under a trash name (``.ckpt-trash-NAME.thin-*``,
  which the next prune removes after a kill; inside a step directory a ``.NAME.ckpt-tmp-*``
  name), fsynced, validated and renamed over the original with one ``rename``.
- DCP directories: read with ckpt's own reader, what is kept saved again with DCP's own writer
  (no process group) into a trash-named sibling directory, swapped with the original in one
  ``renameat2(RENAME_EXCHANGE)`` (left whole where the file system cannot).
- HF Trainer ``checkpoint-N``: the optimizer file rewritten without its state (under a
  temporary name, renamed over it); with ``--thin-to bf16`` a copy with BF16 safetensors, an
  updated ``config.json`` and the thinned optimizer file is built beside it and swapped in.
- Object storage: a torch file object replaced with one upload, an HF prefix's optimizer object
  too (one request each).

The run ledger gets a ``thinned`` line with ``"pending": true`` (see :func:`pending`) before the
first change, and the confirming line after, so a thinning killed midway is verified afresh
rather than reported bad, and never resumed from; the next prune settles it whatever its plan
(``ckpt_cli.ops.prune.thin.settle``): confirmed when thinned, a line with ``"undone": true``
(:data:`UNDONE`) when whole.

The code, by layout: :mod:`.base` (what every layout shares: the intent line, the manifest set
aside and written again, the atomic swap of a directory), :mod:`.thin` (:func:`thin_file`, which
picks the layout), :mod:`.torchfile` (a torch file), :mod:`.dcp` (a local DCP directory),
:mod:`.hf` (a local HF ``checkpoint-N``) and :mod:`.objects` (all of them on object storage).
"""

from __future__ import annotations

from ckpt_cli.trust.thinning.base import (
    HF_OPTIMIZER_FILES,
    OPTIMIZER_KEYS,
    PENDING,
    THIN_DTYPES,
    THIN_SUFFIXES,
    UNDONE,
    WEIGHT_KEYS,
    OnStart,
    Thinned,
    can_thin,
    lone_torch_file,
    pending,
    thinned_line,
)
from ckpt_cli.trust.thinning.dcp import NOT_WEIGHTS
from ckpt_cli.trust.thinning.objects import THIN_TAG, tidy
from ckpt_cli.trust.thinning.thin import thin_file

__all__ = ["HF_OPTIMIZER_FILES", "NOT_WEIGHTS", "OPTIMIZER_KEYS", "PENDING", "THIN_DTYPES",
           "THIN_SUFFIXES", "THIN_TAG", "UNDONE", "WEIGHT_KEYS", "OnStart", "Thinned",
           "can_thin", "lone_torch_file", "pending", "thin_file", "thinned_line", "tidy"]
