"""An HF Trainer ``checkpoint-N`` directory as a :class:`TrainingState`.

``optimizer.pt`` is a ``torch.optim`` state dict: parameters are integer ids, numbered across
the param groups in order. Trainer builds those groups itself (``Trainer.create_optimizer``):
group 0 holds the trainable parameters ``get_decay_parameter_names`` picks (weight decay),
group 1 the other trainable ones (no decay), each in ``model.named_parameters()`` order.
The same order is rebuilt here: the model class ``config.json`` names is instantiated on
torch's ``meta`` device (no weights, no memory; a class of the installed ``transformers``
only, never remote code), and the installed Trainer's own ``get_decay_parameter_names``
splits it. The mapping is refused, with the reason, whenever it cannot be known: no
``config.json``, remote code, transformers missing, or groups whose sizes or moment shapes do
not match (a custom optimizer, frozen parameters, another grouping rule).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from ckpt_cli.errors import CkptError, CorruptCheckpointError, UnsupportedError
from ckpt_cli.formats import get_reader
from ckpt_cli.model import CheckpointIndex
from ckpt_cli.ops.to_dcp._trees import (
    items,
    lazy_of,
    map_torch_optimizer,
    plain,
    read_torch,
    rng_value,
)
from ckpt_cli.ops.to_dcp.state import TrainingState

_WEIGHTS = (("model.safetensors", "safetensors"), ("model.safetensors.index.json", "hf-index"),
            ("pytorch_model.bin", "torch"), ("pytorch_model.bin.index.json", "hf-index"))
_MAX_JSON = 64 << 20


def read_hf_trainer(path: Path) -> TrainingState:
    """Read an HF Trainer ``checkpoint-N`` directory's training state.

    Args:
        path: The ``checkpoint-N`` directory.

    Returns:
        The state: the model's weights, AdamW's (or SGD's) state per FQN, Trainer's two
        param groups with their FQNs, the LR scheduler's state, the global step, the RNG
        states, and ``trainer_state.json`` (without its log history) in ``extra``.

    Raises:
        CkptError: Not a Trainer checkpoint, or the parameter order cannot be known (the
            message says why).
        UnsupportedError: An optimizer ckpt cannot map (its state is named).
    """
    if not path.is_dir():
        raise CkptError("not an HF Trainer checkpoint directory", path=path)
    if not (path / "optimizer.pt").is_file():
        tags = sorted(p.name for p in path.glob("global_step*") if p.is_dir())
        fsdp = sorted(p.name for p in path.glob("optimizer_*") if p.is_dir())
        hint = (f"Trainer ran DeepSpeed: its optimizer state is in {tags[-1]}/; convert "
                "that as a DeepSpeed checkpoint" if tags else
                f"Trainer ran FSDP: its optimizer state is the DCP directory {fsdp[-1]}/"
                if fsdp else None)
        raise CkptError("no optimizer.pt: converting would restart the optimizer", path=path,
                        hint=hint)
    state = TrainingState(source_format="hf-trainer", model={})
    index = _weights(path)
    names, shapes, tied, version = _trainer_groups(path)
    for name, info in index.tensors.items():
        state.model[name] = lazy_of(index, info)
    for alias, owner in tied.items():
        if alias not in state.model and owner in state.model:
            state.model[alias] = state.model[owner]
    missing = [n for g in names for n in g if n not in state.model]
    if missing:
        raise CkptError(f"the model's parameters {', '.join(missing[:5])} are not in the "
                        "saved weights (saved under other names?)", path=path)
    for n, shp in shapes.items():
        if n in state.model and state.model[n].shape != shp:
            raise CkptError(f"{n} is saved as {list(state.model[n].shape)}, the model "
                            f"declares {list(shp)}", path=path)
    opt = read_torch(path / "optimizer.pt")
    state.notes.extend(opt.hostile)
    state.optimizer, state.optimizer_state, state.param_groups = map_torch_optimizer(
        opt, opt.tree, names, shapes, where="optimizer.pt", adam="AdamW")
    if (path / "scheduler.pt").is_file():
        sched = read_torch(path / "scheduler.pt")
        state.notes.extend(sched.hostile)
        state.lr_scheduler = plain(sched.tree, "scheduler.pt", sched.path)
    else:
        state.notes.append("lr_scheduler: no scheduler.pt")
    ts = _json(path / "trainer_state.json")
    if isinstance(ts.get("global_step"), int):
        state.step = ts["global_step"]
    state.extra["trainer_state"] = {k: v for k, v in ts.items() if k != "log_history"}
    if isinstance(ts.get("epoch"), (int, float)):
        state.extra["epoch"] = ts["epoch"]
    state.rng = _rng(path, state)
    state.notes.append("parameter ids named by Trainer's grouping (decay, then no decay, in "
                       f"named_parameters order) of the config's model, transformers {version}")
    saved = _json(path / "config.json").get("transformers_version")
    if isinstance(saved, str) and saved != version:
        state.notes.append(f"saved by transformers {saved}; grouped by {version} (the group "
                           "sizes and every moment's shape matched)")
    if tied:
        state.notes.append("tied weights carried under every name: "
                           + ", ".join(f"{a} = {o}" for a, o in tied.items()))
    return state


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    if path.stat().st_size > _MAX_JSON:
        raise CorruptCheckpointError("larger than 64 MiB", path=path)
    try:
        out = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"not valid JSON ({e})", path=path) from None
    if not isinstance(out, dict):
        raise CorruptCheckpointError("not a JSON object", path=path)
    return out


def _weights(path: Path) -> CheckpointIndex:
    for fname, fmt in _WEIGHTS:
        if (path / fname).is_file():
            return get_reader(fmt).read_index(path / fname)
    raise CkptError("no model weights (model.safetensors or pytorch_model.bin)", path=path)


def _trainer_groups(path: Path) -> tuple[list[list[str]], dict[str, tuple[int, ...]],
                                         dict[str, str], str]:
    """Trainer's param groups' FQNs, the parameters' shapes, tied aliases, transformers'
    version: from the config's model built on the meta device."""
    cfg = _json(path / "config.json")
    if not cfg:
        raise CkptError("no config.json: the model, and so the order of the optimizer's "
                        "parameter ids, cannot be known", path=path)
    if "auto_map" in cfg:
        raise UnsupportedError("config.json names remote code (auto_map): ckpt does not run "
                               "it, so the optimizer's parameter order cannot be known",
                               path=path / "config.json")
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else None
    if not isinstance(arch, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", arch):
        raise CkptError("config.json names no single model class (architectures): the order "
                        "of the optimizer's parameter ids cannot be known",
                        path=path / "config.json")
    try:
        import torch  # heavy: torch
        import transformers  # lazy: optional extra, not required
        from transformers import AutoConfig, Trainer  # lazy: optional extra, not required
    except ImportError:
        raise CkptError("transformers is not installed: the order of the optimizer's "
                        "parameter ids cannot be known", path=path,
                        hint="pip install transformers") from None
    cls = getattr(transformers, arch, None)
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise UnsupportedError(f"config.json's model class {arch} is not one transformers "
                               f"{transformers.__version__} has", path=path / "config.json")
    from transformers.utils import logging as hf_logging  # lazy: optional extra, not required

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)  # its remarks on the config are not ours
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False,
                                            local_files_only=True)
        with torch.device("meta"):
            model = cls(config)
        # Trainer's own rule, from the installed transformers (it does not use self)
        decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    except Exception as e:  # a config this transformers cannot build: say so, in one line
        msg = (str(e).splitlines() or [""])[0][:200]
        raise CkptError(f"could not build {arch} from config.json on the meta device "
                        f"({type(e).__name__}: {msg})", path=path) from None
    finally:
        hf_logging.set_verbosity(level)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = [[n for n, _ in named if n in decay], [n for n, _ in named if n not in decay]]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    owner: dict[int, str] = {}
    tied: dict[str, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in owner:
            tied[n] = owner[id(p)]
            shapes.setdefault(n, tuple(p.shape))
        else:
            owner[id(p)] = n
    return names, shapes, tied, transformers.__version__


def _rng(path: Path, state: TrainingState) -> dict[str, Any] | None:
    """``rng_state.pth`` (one process) or ``rng_state_<rank>.pth`` (several)."""
    if (path / "rng_state.pth").is_file():
        tt = read_torch(path / "rng_state.pth")
        state.notes.extend(tt.hostile)
        one: dict[str, Any] = rng_value(items(tt.tree) or {}, tt, "rng_state.pth")
        return one
    ranks = sorted((int(m.group(1)), p) for p in path.glob("rng_state_*.pth")
                   if (m := re.fullmatch(r"rng_state_(\d+)\.pth", p.name)))
    if not ranks:
        state.notes.append("rng: no rng_state*.pth")
        return None
    state.notes.append(f"rng: one state per rank ({len(ranks)} ranks), under rank<N>")
    out = {}
    for r, p in ranks:
        tt = read_torch(p)
        state.notes.extend(tt.hostile)
        out[f"rank{r}"] = rng_value(items(tt.tree) or {}, tt, p.name)
    return out
