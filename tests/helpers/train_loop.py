"""A real training loop for ``ckpt stats`` run tests: a small ``nn.Module`` (linear layers, a
LayerNorm, a registered causal-mask buffer of 0 and -inf, optionally a BatchNorm) stepped by
torch's AdamW on a fixed batch, saved with ``torch.save`` every few steps as ``step_N.pt``
(``{"model": state_dict, "optimizer": ..., "step": N}``).

Anomalies are injected the way they happen: a module frozen by ``requires_grad_(False)`` (its
weights stay bit-identical while the others train), or a saved copy altered (x100, a NaN, a
tensor zeroed) while training itself goes on unharmed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

StateDict = dict[str, torch.Tensor]


class Net(torch.nn.Module):
    """Embedding projection, LayerNorm, three hidden layers, a head; a causal-mask buffer."""

    def __init__(self, width: int = 16, batchnorm: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(8, width)
        self.norm = torch.nn.LayerNorm(width)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(3)])
        self.bn = torch.nn.BatchNorm1d(width) if batchnorm else None
        self.head = torch.nn.Linear(width, 4)
        self.register_buffer("causal_mask", torch.full((8, 8), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(x))
        for layer in self.layers:
            h = torch.relu(layer(h))
        if self.bn is not None:
            h = self.bn(h)
        return self.head(h)  # type: ignore[no-any-return]


class Loop:
    """A training run saving checkpoints into ``root``.

    Args:
        root: The run directory (created).
        every: Optimizer steps between two checkpoints.
        seed: Seeds the weights and the batch.
        batchnorm: Put a BatchNorm1d (running stats, an integer step counter) in the net.
    """

    def __init__(self, root: Path, *, every: int = 2, seed: int = 0,
                 batchnorm: bool = False) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        gen = torch.manual_seed(seed)
        self.net = Net(batchnorm=batchnorm)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-2)
        self.x = torch.randn(32, 8, generator=gen)
        self.y = torch.randn(32, 4, generator=gen)
        self.every = every
        self.step = 0
        self.saved: list[Path] = []

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.opt.zero_grad()
            torch.nn.functional.mse_loss(self.net(self.x), self.y).backward()
            self.opt.step()
            self.step += 1

    def checkpoint(self, mutate: Callable[[StateDict], None] | None = None) -> Path:
        """Train ``every`` steps (none before the first checkpoint), then save; ``mutate``
        alters the saved copy only."""
        if self.saved:
            self.train(self.every)
        sd = {k: v.detach().clone() for k, v in self.net.state_dict().items()}
        if mutate is not None:
            mutate(sd)
        path = self.root / f"step_{self.step}.pt"
        torch.save({"model": sd, "optimizer": self.opt.state_dict(), "step": self.step}, path)
        self.saved.append(path)
        return path

    def freeze(self, module: str) -> None:
        """Stop training ``module`` (AdamW skips parameters without a gradient)."""
        self.net.get_submodule(module).requires_grad_(False)


def injected_run(root: Path, *, checkpoints: int = 6, jump_at: int | None = 2,
                 nan_at: int | None = 3, freeze_from: int | None = 4,
                 dead_at: int | None = None) -> Loop:
    """A run of ``checkpoints`` checkpoints with, by checkpoint index: ``layers.1`` saved x100
    at ``jump_at``, one NaN in ``layers.0.weight`` at ``nan_at``, ``layers.2`` frozen from
    ``freeze_from`` on, ``head.weight`` saved zeroed at ``dead_at``. All None: a clean run."""
    loop = Loop(root)
    for k in range(checkpoints):
        if k == freeze_from:
            loop.freeze("layers.2")

        def mutate(sd: StateDict, k: int = k) -> None:
            if k == jump_at:
                sd["layers.1.weight"].mul_(100)
                sd["layers.1.bias"].mul_(100)
            if k == nan_at:
                sd["layers.0.weight"][1, 2] = float("nan")
            if k == dead_at:
                sd["head.weight"].zero_()

        loop.checkpoint(mutate)
    return loop


def load_model(path: Path) -> StateDict:
    """The saved model state dict of a :class:`Loop` checkpoint."""
    sd: StateDict = torch.load(path, map_location="cpu", weights_only=True)["model"]
    return sd


def module_of(name: str) -> str:
    """``ckpt stats``' default roll-up (the tensor's own module), shown without the ``model.``
    prefix the saved dict's key puts before every name."""
    return name.rpartition(".")[0] if "." in name else name
