"""A Lightning ``ModelCheckpoint`` that verifies each checkpoint as it is saved.

Usage::

    from ckpt_cli.integrations.lightning import VerifiedModelCheckpoint
    trainer = Trainer(callbacks=[VerifiedModelCheckpoint(dirpath="ckpts", save_top_k=2)])
    trainer.fit(model, ckpt_path=latest_verified("ckpts"))

Lightning calls a plain ``Callback``'s ``on_save_checkpoint`` *before* the file is written (to
add to the checkpoint dict), and runs checkpoint callbacks after every other callback, so no
other hook sees a save complete. This subclass of ``ModelCheckpoint`` (itself a ``Callback``)
does its work right after ``trainer.save_checkpoint`` returns (the file is written and the
strategy's barrier passed): on global rank zero it validates the file, writes its manifest and
appends the verdict to ``ckpt-ledger.jsonl`` in ``dirpath``; then every rank meets at the
strategy's barrier, so none goes on before the verdict is recorded.

**Rotation.** ``save_top_k`` removes checkpoints through ``_remove_checkpoint``; this class
refuses to remove the last verified checkpoint (it is left in place and logged), so rotation
never deletes it, even when the newer saves are bad. ``last.ckpt`` (``save_last=True``) is
verified at each save too, and so can be resumed from, but it does not count as that
protected checkpoint: the next save overwrites it in place. At ``setup`` the run ledger is read,
so a resumed run protects its newest verified checkpoint (the resume point) from the start.

**Thinned checkpoints.** One that ``ckpt prune --thin-after`` rewrote has no optimizer state,
which Lightning refuses to resume from (``KeyError``). When the run ledger records the thinning,
this callback lets ``fit(ckpt_path=thinned)`` resume with fresh optimizers (weights, step,
loops and schedulers restored), with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from ckpt_cli.formats.names import is_last_copy, step_from_name
from ckpt_cli.manifest import manifest_path
from ckpt_cli.ops.resume import choose
from ckpt_cli.ops.watch import verify_checkpoint
from ckpt_cli.trust import ledger

log = logging.getLogger(__name__)


class VerifiedModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that verifies and records every save and protects the last verified
    checkpoint from ``save_top_k`` rotation.

    Args:
        crc: Check every byte (CRC-32) rather than structure only.
        values: Also scan values for NaN / Inf.
        **kwargs: ``ModelCheckpoint``'s arguments (``dirpath`` is required).
    """

    def __init__(self, *args: Any, crc: bool = False, values: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.crc = crc
        self.values = values
        self.last_verified: str | None = None
        self.entries: list[ledger.LedgerEntry] = []
        self._thinned_resume: dict[str, Any] | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Also read the run ledger: the newest verified checkpoint (the resume point of a
        resumed run) is the one rotation must keep until a newer save is verified."""
        super().setup(trainer, pl_module, stage)
        if self.last_verified is None and self.dirpath and os.path.isdir(self.dirpath):
            choice = choose(self.dirpath)
            if choice is not None and not is_last_copy(choice.path.name):
                self.last_verified = os.path.abspath(choice.path)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any,
                           checkpoint: dict[str, Any]) -> None:
        """Resuming from a checkpoint ``prune --thin-after`` thinned (the run ledger says so):
        it has no ``optimizer_states``, which Lightning refuses (``KeyError``); the optimizers
        start afresh instead (filled in at ``on_fit_start``, once they exist)."""
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        path = getattr(trainer, "ckpt_path", None)
        if "optimizer_states" not in checkpoint and path and ledger.thinned_on_purpose(
                Path(path)):
            self._thinned_resume = checkpoint
            log.warning("ckpt: %s was thinned (no optimizer state): resuming with a fresh "
                        "optimizer", path)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_fit_start(trainer, pl_module)
        thinned = self._thinned_resume
        if thinned is not None:
            # Fresh optimizers' own state: what Lightning restores is then a new optimizer.
            thinned["optimizer_states"] = [o.state_dict() for o in trainer.optimizers]
            self._thinned_resume = None

    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if trainer.is_global_zero:
            path = Path(filepath)
            step = step_from_name(path.name)
            # fresh: last.ckpt (save_last=True) is written again at every save, under the
            # same name: the manifest of the previous save must not judge the new bytes.
            entry = verify_checkpoint(path.parent, path, crc=self.crc, values=self.values,
                                      step=step if step is not None else trainer.global_step,
                                      fresh=True)
            self.entries.append(entry)
            if entry.good and not is_last_copy(path.name):
                # last.ckpt is not what protects: the next save overwrites it in place.
                self.last_verified = os.path.abspath(filepath)
            else:
                log.error("ckpt: checkpoint %s is bad: %s", filepath, "; ".join(entry.problems))
        trainer.strategy.barrier("ckpt-verify")

    def _remove_checkpoint(self, trainer: Any, filepath: str) -> None:
        if self.last_verified is not None and os.path.abspath(filepath) == self.last_verified:
            log.warning("ckpt: keeping %s: it is the last verified checkpoint", filepath)
            return
        super()._remove_checkpoint(trainer, filepath)
        if trainer.is_global_zero:
            with contextlib.suppress(OSError):  # its manifest goes with it
                if not os.path.exists(filepath):
                    manifest_path(Path(filepath)).unlink(missing_ok=True)
