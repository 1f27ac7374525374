"""Pieces of the small Lightning runs the integration tests train (in-process and under
torchrun): a tiny module, and a callback that damages a save right after Lightning wrote it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def truncate_half(path: Path) -> None:
    """Cut a file to half its size (a save that went wrong)."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def tiny_module(optimizers: Callable[[Any], Any] | None = None) -> Any:
    """A LightningModule: one ``Linear(4, 8)``, the mean square of its output as the loss,
    Adam at lr 0.01, or what ``optimizers(parameters)`` returns for
    ``configure_optimizers`` (an optimizer with its scheduler, say)."""
    import lightning as L
    import torch

    class Mod(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 8)

        def training_step(self, batch: Any, _i: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            if optimizers is not None:
                return optimizers(self.parameters())
            return torch.optim.Adam(self.parameters(), lr=0.01)

    return Mod()


def save_breaker(breaks: Callable[[Any, Path], bool]) -> Any:
    """A Callback that wraps ``trainer.save_checkpoint``: every call saves as usual (every
    rank calls it; rank 0 writes), then the file is cut in half where
    ``breaks(trainer, file)`` holds."""
    from lightning.pytorch.callbacks import Callback

    class BreakSave(Callback):  # type: ignore[misc]
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            real = trainer.save_checkpoint

            def save(filepath: str, *a: Any, **kw: Any) -> None:
                real(filepath, *a, **kw)
                if breaks(trainer, Path(filepath)):
                    truncate_half(Path(filepath))

            trainer.save_checkpoint = save

    return BreakSave()


def fit_tiny(callbacks: list[Any], *, steps: int, samples: int, **trainer_kw: Any) -> Any:
    """Train :func:`tiny_module` (made after ``torch.manual_seed(0)``) on CPU for ``steps``
    steps over ``samples`` random 4-vectors in batches of 4, with ``callbacks``, no logger
    and no progress bar; ``trainer_kw`` go to ``lightning.Trainer`` (``devices``,
    ``strategy``). Returns the trainer."""
    import lightning as L
    import torch

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(samples, 4)),
                                         batch_size=4)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", callbacks=callbacks, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, **trainer_kw)
    torch.manual_seed(0)
    trainer.fit(tiny_module(), loader)
    return trainer
