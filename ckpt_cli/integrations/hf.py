"""A ``transformers.TrainerCallback`` that verifies each checkpoint as Trainer saves it.

Usage::

    from ckpt_cli.integrations.hf import CkptVerifyCallback
    trainer = Trainer(..., callbacks=[CkptVerifyCallback()])
    trainer.train(resume_from_checkpoint=latest_verified(args.output_dir))

After each save (``on_save``, which Trainer calls once ``checkpoint-N`` is complete: model,
optimizer, scheduler, RNG state and ``trainer_state.json``), the process that saved it (the
world process zero by default) validates ``checkpoint-N`` (structure; ``crc=True`` for every
byte), writes its manifest and appends the verdict to ``ckpt-ledger.jsonl`` in ``output_dir``.

**Several processes (DDP, FSDP, DeepSpeed).** Trainer calls ``on_save`` on every rank right
after that rank's part of the save, with no barrier in between, and every rank writes its own
``rng_state_R.pth`` into ``checkpoint-N``. So all ranks first meet at accelerate's
``wait_for_everyone`` (the barrier Trainer itself uses), and only then does rank 0 verify: the
checkpoint is whole and its manifest lists every rank's file. The other ranks go on training
without waiting for the verdict (their next collective waits for rank 0), except with
``stop_on_bad=True``: then the ranks agree on whether to stop (any verifying rank that found
its checkpoint bad stops them all), so that every rank stops at the same step (a rank stopping
alone would leave the others waiting in a collective).

**Multi-node with ``save_on_each_node=True``.** Each node's local process zero writes its own
copy of ``checkpoint-N`` to that node's ``output_dir`` and rotates it there. The callback
verifies on the process that saves (``args.should_save``: the world-process-zero by default,
each node's local process zero with ``save_on_each_node``), so every node's copy is validated,
gets its own ledger and manifest, and its rotation keeps that node's last verified copy.

**Rotation.** Trainer deletes old checkpoints in ``_save_checkpoint`` (``rotate_checkpoints``)
*before* ``on_save`` runs, keeping the newest and ``state.best_model_checkpoint``. Without a
``metric_for_best_model``, this callback sets ``state.best_model_checkpoint`` to the newest
*verified* checkpoint, so the next rotation keeps it even when the save after it turns out bad
(with ``save_total_limit=1``, Trainer then keeps two: the newest and the last verified; at
the end of training it keeps the last verified one). When a resumed run begins, the checkpoint
it resumed from is protected before the first save (an explicit resume from an earlier step
too: never a name from the loaded ``best_model_checkpoint``, nor a higher step of the timeline
it left, which its own saves are about to reuse); a fresh run protects the ledger's newest
verified checkpoint. So failing saves right after a resume never rotate the resume point away.
A bad save under the protected name hands the protection back to the ledger's newest verified
checkpoint. With ``metric_for_best_model`` and a
``save_total_limit`` Trainer protects only its best checkpoint, so the callback refuses that
combination at ``on_train_begin`` (ValueError) rather than let rotation delete the last
verified checkpoint. A bad checkpoint is reported on the logger and, with
``stop_on_bad=True``, stops training.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ckpt_cli.ops.resume import latest_verified
from ckpt_cli.ops.watch import verify_checkpoint
from ckpt_cli.trust import ledger

log = logging.getLogger(__name__)


class CkptVerifyCallback(TrainerCallback):
    """Verify each saved checkpoint on the process that saved it, record it in the run
    ledger, protect the last verified one from ``save_total_limit`` rotation.

    Args:
        crc: Check every byte (CRC-32) rather than structure only.
        values: Also scan values for NaN / Inf.
        stop_on_bad: Set ``control.should_training_stop`` when a checkpoint is bad.
        protect: Keep the last verified checkpoint from rotation (see the module notes).
    """

    def __init__(self, *, crc: bool = False, values: bool = False, stop_on_bad: bool = False,
                 protect: bool = True) -> None:
        self.crc = crc
        self.values = values
        self.stop_on_bad = stop_on_bad
        self.protect = protect
        self.last_verified: str | None = None
        self.entries: list[ledger.LedgerEntry] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if (self.protect and args.save_total_limit is not None and args.save_total_limit > 0
                and args.metric_for_best_model is not None):
            raise ValueError(
                "CkptVerifyCallback: with metric_for_best_model, Trainer's save_total_limit "
                "rotation protects only the best checkpoint and could delete the last verified "
                "one; drop save_total_limit (use ckpt watch --keep N, which counts only "
                "verified checkpoints) or pass protect=False")
        if self.protect and args.metric_for_best_model is None:
            # A resumed run: the trainer_state.json it loaded was written before its own save
            # was verified, so the best_model_checkpoint it names means nothing here. What the
            # run resumed from is what it falls back on until one of its own saves is verified
            # (an explicit resume from an earlier step too: the higher steps of the timeline it
            # left are about to be saved again, under the same names); else the newest
            # checkpoint the ledger verified.
            self.last_verified = _resumed_from(args, state) or _newest_verified(args)
            if self.last_verified is not None:
                state.best_model_checkpoint = self.last_verified
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        many = _distributed(args)
        if many:
            _wait_for_everyone()  # every rank's files (rng_state_R.pth) are in checkpoint-N
        stop = False
        if _saves(args, state):
            stop = self._verify(args, state)
        if self.stop_on_bad and many:
            stop = _any_process(stop)
        if stop:
            control.should_training_stop = True
        return control

    def _verify(self, args: Any, state: Any) -> bool:
        """Rank 0's part of ``on_save``; whether training should stop."""
        run = Path(args.output_dir)
        path = run / f"checkpoint-{state.global_step}"
        if not path.is_dir():
            return False
        # fresh: a checkpoint-N saved again (a run resumed from an older step) must not be
        # judged by the manifest of the earlier save.
        entry = verify_checkpoint(run, path, crc=self.crc, values=self.values,
                                  step=state.global_step, fresh=True)
        self.entries.append(entry)
        if entry.good:
            self.last_verified = os.fspath(path)
        else:
            log.error("ckpt: checkpoint %s is bad: %s", path, "; ".join(entry.problems))
            if self.last_verified == os.fspath(path):
                # A bad save under the very name protected: the verified save is gone, and
                # the name must not be protected for it; the ledger knows what is left.
                self.last_verified = _newest_verified(args)
        if self.protect and self.last_verified is not None and args.metric_for_best_model is None:
            state.best_model_checkpoint = self.last_verified
        return self.stop_on_bad and not entry.good


def _resumed_from(args: Any, state: Any) -> str | None:
    """The ``checkpoint-N`` of ``output_dir`` the run resumed from (Trainer loaded its
    ``trainer_state.json``, so ``state.global_step`` is N at ``on_train_begin``), or None
    (a fresh run, or a resume from elsewhere, which rotation never deletes)."""
    step = int(getattr(state, "global_step", 0) or 0)
    path = Path(args.output_dir) / f"checkpoint-{step}"
    return os.fspath(path) if step > 0 and path.is_dir() else None


def _newest_verified(args: Any) -> str | None:
    """The newest checkpoint the run ledger verified (and still matches), as a path."""
    newest = latest_verified(args.output_dir) if os.path.isdir(args.output_dir) else None
    if newest is None or not newest.name.startswith("checkpoint-"):
        return None
    return os.fspath(Path(args.output_dir) / newest.name)


def _distributed(args: Any) -> bool:
    """Whether this Trainer runs as several processes."""
    return int(getattr(args, "world_size", 1) or 1) > 1


def _wait_for_everyone() -> None:
    from accelerate import PartialState  # lazy: distributed runs only (Trainer's dependency)

    PartialState().wait_for_everyone()


def _saves(args: Any, state: Any) -> bool:
    """Whether this process wrote ``checkpoint-N`` (and so verifies it): Trainer's own
    ``should_save`` (world process zero, or each node's local process zero with
    ``save_on_each_node``)."""
    should = getattr(args, "should_save", None)
    return bool(state.is_world_process_zero if should is None else should)


def _any_process(flag: bool) -> bool:
    """Whether ``flag`` is set on any process (every process must call this)."""
    from accelerate.utils import gather_object  # lazy: distributed runs only (Trainer's dependency)

    return any(bool(f) for f in gather_object([flag]))
