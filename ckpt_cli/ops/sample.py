"""``ckpt sample``: write a small but real training run to try every command on.

Everything is written by the real libraries: ``torch.save`` training checkpoints (model +
AdamW state + step/epoch/lr + RNG state), a checkpoint saved by torch.distributed.checkpoint
from 4 processes (FSDP2-sharded model and optimizer, gloo on loopback), an HF-style sharded
safetensors export, and a ``latest`` pointer. This module imports torch; it is loaded only by
the ``sample`` command.
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckpt_cli.errors import CkptError, DestinationExistsError
from ckpt_cli.ops.options.sample import SampleOptions as SampleOptions
from ckpt_cli.progress import Progress
from ckpt_cli.storage.atomic import atomic_dir, honour_umask

VOCAB, DIM, LAYERS, HEADS, CONTEXT = 512, 64, 2, 4, 32
STEPS = (100, 200, 300)
DCP_STEP = 400
RANKS = 4


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class TinyGPT(nn.Module):
    """A small GPT-style language model with a tied output head and a causal-mask buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(CONTEXT, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        self.register_buffer("causal_mask", torch.triu(
            torch.full((CONTEXT, CONTEXT), float("-inf")), diagonal=1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for b in self.blocks:
            x = b(x, self.causal_mask[:t, :t])  # type: ignore[index]
        return self.lm_head(self.ln_f(x))  # type: ignore[no-any-return]


def _lr(step: int, total: int = 2 * DCP_STEP, peak: float = 3e-3) -> float:
    warm = 20
    if step < warm:
        return peak * (step + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))


def _train(model: TinyGPT, opt: torch.optim.Optimizer, start: int, stop: int,
           gen: torch.Generator, say: Progress | None = None) -> float:
    loss = torch.tensor(0.0)
    for step in range(start, stop):
        if say is not None:
            say("training", step, DCP_STEP)
        for g in opt.param_groups:
            g["lr"] = _lr(step)
        # A learnable toy task: predict the next token of an arithmetic sequence.
        base = torch.randint(0, VOCAB, (8, 1), generator=gen)
        stride = torch.randint(1, 5, (8, 1), generator=gen)
        seq = (base + stride * torch.arange(CONTEXT + 1)) % VOCAB
        logits = model(seq[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    if say is not None:
        say("training", stop, DCP_STEP)
    return float(loss.detach())


def _config() -> dict[str, Any]:
    return {"architectures": ["TinyGPT"], "model_type": "tiny-gpt", "vocab_size": VOCAB,
            "n_embd": DIM, "n_layer": LAYERS, "n_head": HEADS, "n_positions": CONTEXT,
            "tie_word_embeddings": True, "torch_dtype": "float32"}


def write_sample(dest: Path, options: SampleOptions | None = None, *,
                 progress: Progress | None = None) -> list[Path]:
    """Write the sample run directory.

    Args:
        dest: Directory to create.
        options: How (:class:`SampleOptions`): ``overwrite`` replaces ``dest`` if it exists
            (an earlier sample run only).
        progress: Called as ``progress(stage, step, total)`` before each training step
            (``training``, step of 400), after the last, and at each later stage (``saving
            step 400 with torch.distributed.checkpoint from 4 processes``, the export), with
            the step reached (:class:`ckpt_cli.progress.Progress`: the phase is the stage,
            counted in training steps).

    Returns:
        The checkpoints written, oldest first.

    Raises:
        DestinationExistsError: If ``dest`` exists and ``overwrite`` is False.
    """
    overwrite = (options or SampleOptions()).overwrite
    if dest.exists() and not overwrite:
        raise DestinationExistsError("already exists", path=dest,
                                     hint="pass overwrite to replace it", param="overwrite")
    if overwrite and (dest.exists() or dest.is_symlink()):
        _check_is_a_sample(dest)
    say = progress or (lambda _stage, _step, _total: None)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=_lr(0), weight_decay=0.1)
    written: list[Path] = []
    with atomic_dir(dest, overwrite=overwrite, parents=True) as tmp:
        step, epoch_len = 0, 150
        for target in STEPS:
            loss = _train(model, opt, step, target, gen, say)
            step = target
            d = tmp / f"step_{step:06d}"
            d.mkdir()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "step": step, "epoch": step // epoch_len, "lr": _lr(step - 1),
                        "loss": loss, "config": _config(),
                        "rng_state": torch.get_rng_state()}, d / "checkpoint.pt")
            written.append(dest / d.name)
        loss = _train(model, opt, step, DCP_STEP, gen, say)
        say(f"saving step {DCP_STEP} with torch.distributed.checkpoint from {RANKS} processes",
            DCP_STEP, DCP_STEP)
        dcp_dir = tmp / f"step_{DCP_STEP:06d}"
        _save_dcp(model, opt, dcp_dir, {"step": DCP_STEP, "epoch": DCP_STEP // epoch_len,
                                         "lr": _lr(DCP_STEP - 1), "loss": loss})
        written.append(dest / dcp_dir.name)
        say("exporting HF-style sharded safetensors", DCP_STEP, DCP_STEP)
        _export(model, tmp / "export")
        (tmp / "latest").write_text(dcp_dir.name + "\n")
    return written


def _check_is_a_sample(dest: Path) -> None:
    """``--overwrite`` replaces an earlier sample, never a file or a directory of other things."""
    if dest.is_symlink() or not dest.is_dir():
        kind = "a symbolic link" if dest.is_symlink() else "a file"
        raise DestinationExistsError(f"is {kind}, not a sample run; not replacing it",
                                     path=dest, hint="choose a new directory")
    ours = {f"step_{s:06d}" for s in (*STEPS, DCP_STEP)} | {"export", "latest"}
    # ckpt's own leftovers (a prune's lock, trash, a manifest) may be there too.
    odd = sorted(p.name for p in dest.iterdir()
                 if p.name not in ours and not p.name.startswith((".ckpt-", "ckpt-")))
    if odd:
        shown = ", ".join(odd[:3]) + (f" and {len(odd) - 3} more" if len(odd) > 3 else "")
        raise DestinationExistsError(f"is not a sample run ({shown}); not replacing it",
                                     path=dest, hint="choose a new directory")


def _export(model: TinyGPT, out: Path) -> None:
    from safetensors.torch import save_file  # heavy: safetensors.torch

    out.mkdir()
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
          if k != "lm_head.weight"}  # tied to wte.weight: written once, as HF does
    limit = sum(v.numel() * v.element_size() for v in sd.values()) // 3 + 1
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in sd.items():
        n = t.numel() * t.element_size()
        if shards[-1] and used + n > limit:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += n
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        honour_umask(out / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(v.numel() * v.element_size() for v in sd.values())
    index = {"metadata": {"total_size": total,
                          # As transformers' save_pretrained counts (num_parameters()):
                          # parameters only, the tied head once; buffers are not parameters.
                          "total_parameters": sum(p.numel() for p in model.parameters())},
             "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(_config(), indent=2) + "\n")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _save_dcp(model: TinyGPT, opt: torch.optim.Optimizer, out: Path,
              extra: dict[str, Any]) -> None:
    import torch.multiprocessing as mp  # heavy: torch
    from torch.distributed.checkpoint.state_dict import get_state_dict  # heavy: torch

    msd, osd = get_state_dict(model, opt)
    with tempfile.TemporaryDirectory(prefix="ckpt-sample-") as td:
        full = Path(td) / "full.pt"
        torch.save({"model": msd, "optim": osd}, full)
        # The 4 processes meet on a free port found a moment before (another program can
        # take it in between), and gloo on a busy machine has aborted a worker now and then
        # ("terminate called without an active exception"): one more try, on a new port,
        # into an emptied directory, before the failure is reported.
        for attempt in (1, 2):
            args = (RANKS, str(full), str(out), _free_port(), extra)
            try:
                mp.spawn(_dcp_worker, args=args,  # type: ignore[attr-defined,no-untyped-call]
                         nprocs=RANKS, join=True)
                return
            except mp.ProcessExitedException as e:  # type: ignore[attr-defined]
                if attempt == 2:
                    raise CkptError(f"the 4-process torch.distributed.checkpoint save failed "
                                    f"twice ({e}); nothing was written",
                                    hint="run ckpt sample again") from None
                for f in out.iterdir() if out.is_dir() else ():
                    f.unlink()


def _dcp_worker(rank: int, world: int, full_path: str, out: str, port: int,
                extra: dict[str, Any]) -> None:
    import torch.distributed as dist  # heavy: torch
    import torch.distributed.checkpoint as dcp  # heavy: torch
    from torch.distributed.checkpoint.state_dict import (  # heavy: torch  # heavy: torch
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh  # heavy: torch
    from torch.distributed.fsdp import fully_shard  # heavy: torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = TinyGPT()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=_lr(0), weight_decay=0.1)
        full = torch.load(full_path, weights_only=True)
        set_state_dict(model, opt, model_state_dict=full["model"],
                       optim_state_dict=full["optim"],
                       options=StateDictOptions(full_state_dict=True))
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, **extra},  # type: ignore[attr-defined]
                 checkpoint_id=out)
    finally:
        dist.destroy_process_group()
