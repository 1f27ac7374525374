"""DeepSpeed ZeRO 1/2/3 checkpoints as a :class:`TrainingState`.

The weights are the FP32 master copy and the moments Adam's ``exp_avg``/``exp_avg_sq``, both
gathered per parameter from the flat optimizer partitions of every rank by
:func:`ckpt_cli.formats.zero.plan_zero` (the plan ``consolidate`` uses, bit-equal to
``zero_to_fp32``); nothing is read until the writer loads a tensor. The rest comes from the
pickles, read safely:

* Parameter groups: the inner optimizer's ``param_groups`` (``base_optimizer_state`` for
  ZeRO 1/2 and the BF16 optimizer, ``optimizer_state_dict`` for ZeRO-3). Each of its
  parameters is one flat partition (ZeRO-3: one per sub-group), numbered across the groups in
  order; flat partition ``i`` holds the parameters ``param_shapes[i]`` names, in order. So
  group ``g``'s FQNs are those of its partitions, and every parameter of a partition shares
  the partition's ``step``.
* Step, LR scheduler and the rest: the model-states file (``global_steps``,
  ``lr_scheduler``, ``ds_config``...).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli.errors import CorruptCheckpointError, UnsupportedError
from ckpt_cli.formats import deepspeed as ds_format
from ckpt_cli.formats.standins import TensorRecord
from ckpt_cli.formats.zero import MOMENTS, ParamPlan, PieceReader, plan_zero, resolve_tag
from ckpt_cli.ops.to_dcp._trees import TorchTree, items, plain, read_torch
from ckpt_cli.ops.to_dcp.state import LazyTensor, TrainingState
from ckpt_cli.tensors.select import hostile_warning

if TYPE_CHECKING:
    import numpy as np

#: What the optimizer state of a partition may hold (Adam/AdamW as torch and DeepSpeed's
#: FusedAdam/CPUAdam keep it).
ADAM_KEYS = frozenset({"step", *MOMENTS})

#: The hyperparameters torch's Adam/AdamW keep in every param group besides ``lr``,
#: ``betas``, ``eps`` and ``weight_decay``, with torch's defaults. DeepSpeed's own Adam
#: (CPUAdam, FusedAdam) records none of them, and the state dict of the torch optimizer that
#: resumes asks ``dcp.load`` for each one.
TORCH_ADAM_DEFAULTS: dict[str, bool | None] = {
    "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
    "differentiable": False, "fused": None}

#: Model-states entries carried in ``extra`` when present.
_EXTRA = ("global_samples", "skipped_steps", "ds_version", "dp_world_size", "mp_world_size",
          "epoch", "iteration")


def read_deepspeed(path: Path) -> TrainingState:
    """Read a DeepSpeed ZeRO 1/2/3 checkpoint's training state.

    Args:
        path: A tag directory (``global_stepN``) or a save directory with ``latest``.

    Returns:
        The state: FP32 master weights (plus buffers and frozen parameters) by FQN, Adam's
        moments and step per FQN, the param groups with their FQNs, the LR scheduler's state,
        the global step.

    Raises:
        CkptError: Not a ZeRO checkpoint, missing or damaged rank files.
        UnsupportedError: An optimizer other than Adam/AdamW (its state is named), model
            parallelism, MoE, an elastic checkpoint without param groups.
    """
    tag = resolve_tag(path)
    model_files, optim_files, _ = ds_format.rank_files(tag)
    if not model_files or not optim_files:
        raise CorruptCheckpointError("no model-states or optimizer-states files", path=tag)
    model = read_torch(model_files[0])
    top = items(model.tree) or {}
    opt0 = read_torch(optim_files[0])
    osd = items((items(opt0.tree) or {}).get("optimizer_state_dict")) or {}
    stage = _stage(osd)
    inner = items(osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state"))
    if inner is None or not isinstance(inner.get("param_groups"), list):
        raise UnsupportedError("the optimizer states hold no param_groups (an elastic ZeRO "
                               "checkpoint?): the groups' hyperparameters are unknown",
                               path=opt0.path)
    flat_states = _flat_states(inner, opt0)
    plan = plan_zero(tag, moments=True)
    reader = PieceReader()
    by_name = {t.name: t for t in plan.tensors}
    shapes = top.get("param_shapes")
    if not isinstance(shapes, list) or len(shapes) != len(flat_states):
        raise CorruptCheckpointError(f"param_shapes lists {len(shapes or [])} flat group(s), "
                                     f"the optimizer {len(flat_states)}", path=model.path)
    state = TrainingState(source_format="deepspeed", model={})
    weakref.finalize(state, reader.close)  # the rank files stay open while the state lives
    for t in plan.tensors:
        if t.kind != "moment":
            state.model[t.name] = _lazy(reader, t, to_f32=t.kind == "buffer")
    for alias, owner in plan.aliases.items():
        state.model[alias] = state.model[owner]
    groups = _groups(inner, shapes, flat_states, opt0, model.path)
    for g, (hyper, flat_ids) in enumerate(groups):
        fqns: list[str] = []
        # DeepSpeed's FusedAdam counts steps in the param group, not in the state
        group_step = (hyper.pop("step", None)
                      if any("step" not in flat_states[i] for i in flat_ids) else None)
        if group_step is not None:
            state.notes.append(f"param group {g}: its step moved into each parameter's state "
                               "(torch's Adam keeps it there)")
        for i in flat_ids:
            names = list((items(shapes[i]) or {}).keys())
            step = flat_states[i].get("step", group_step)
            if step is None or isinstance(step, bool) or not isinstance(
                    step, (TensorRecord, int, float)):
                raise UnsupportedError(f"param group {g}: no step recorded beside the moments "
                                       "(Adam's bias correction needs it)", path=opt0.path)
            for name in names:
                per: dict[str, LazyTensor | int | float] = {}
                for m in MOMENTS:
                    mt = by_name.get(f"optimizer.state.{name}.{m}")
                    if mt is None:
                        raise CorruptCheckpointError(f"param group {g}: no {m} for {name}",
                                                     path=tag)
                    per[m] = _lazy(reader, mt)
                per["step"] = (opt0.lazy(step, f"step of flat group {i}")
                               if isinstance(step, TensorRecord) else step)
                state.optimizer_state[str(name)] = per
                fqns.append(str(name))
        state.param_groups.append({**hyper, "params": fqns})
    state.optimizer = _optimizer_name(top.get("ds_config"), state.param_groups, state)
    _torch_groups(state)
    sched = top.get("lr_scheduler")
    if sched is not None:
        state.lr_scheduler = plain(sched, "lr_scheduler", model.path)
        _scheduler_note(state, top.get("ds_config"), model.path)
    state.step = plan.step
    for k in _EXTRA:
        v = top.get(k)
        if isinstance(v, (int, float, str)) and not isinstance(v, bool):
            state.extra[k] = v
    state.extra["zero_stage"] = plan.stage
    state.extra["world_size"] = plan.world_size
    _notes(state, plan.notes, plan.unsafe, top, osd)
    return state


def _stage(osd: dict[Any, Any]) -> int | None:
    v = osd.get("zero_stage")
    if isinstance(v, int):
        return v
    args = getattr(v, "args", None)  # ZeroStageEnum(3) as the safe unpickler records it
    return args[0] if isinstance(args, tuple) and args and isinstance(args[0], int) else None


def _flat_states(inner: dict[Any, Any], opt0: TorchTree) -> list[dict[Any, Any]]:
    """Rank 0's optimizer state per flat partition, refused unless it is Adam's."""
    raw = inner.get("state")
    st = items(raw)
    states = [items(st[k]) or {} for k in sorted(st)] if st is not None else (
        [items(v) or {} for v in raw] if isinstance(raw, list) else None)
    if not states:
        raise UnsupportedError("the optimizer state is empty (no step was taken?): there are "
                               "no moments to carry", path=opt0.path)
    keys = {str(k) for s in states for k in s}
    if not keys <= ADAM_KEYS or not set(MOMENTS) <= keys:
        raise UnsupportedError(
            f"the optimizer state holds {', '.join(sorted(keys))}: only Adam/AdamW "
            "(exp_avg, exp_avg_sq, step) is mapped from ZeRO partitions, and dropping it "
            "would silently restart the optimizer", path=opt0.path)
    return states


def _groups(inner: dict[Any, Any], shapes: list[Any], flat_states: list[dict[Any, Any]],
            opt0: TorchTree, model_path: Path) -> list[tuple[dict[str, Any], list[int]]]:
    """Each param group's hyperparameters and the flat partitions it holds."""
    out = []
    first = 0
    for g, raw in enumerate(inner["param_groups"]):
        group = items(raw)
        if group is None or not isinstance(group.get("params"), list):
            raise CorruptCheckpointError(f"param group {g} is malformed", path=opt0.path)
        n = len(group["params"])
        hyper = {str(k): plain(v, f"param_groups[{g}].{k}", opt0.path)
                 for k, v in group.items() if k != "params"}
        out.append((hyper, list(range(first, first + n))))
        first += n
    if first != len(flat_states) or first != len(shapes):
        raise CorruptCheckpointError(
            f"the param groups hold {first} flat partition(s); the optimizer state has "
            f"{len(flat_states)} and param_shapes {len(shapes)}", path=model_path)
    return out


def _scheduler_note(state: TrainingState, cfg: Any, path: Path) -> None:
    """Say whose scheduler state it is: a config-built scheduler is DeepSpeed's own
    (``WarmupLR``: ``{"last_batch_iteration": N}``), not a ``torch.optim.lr_scheduler``."""
    conf = items((items(cfg) or {}).get("scheduler"))
    if conf is None:
        state.notes.append("lr_scheduler: the client scheduler's state_dict, as saved")
        return
    kind = str(conf.get("type", "?"))
    state.extra["lr_scheduler_config"] = plain(conf, "ds_config.scheduler", path)
    state.notes.append(f"lr_scheduler: DeepSpeed's {kind} state, not a torch LR scheduler's; "
                       "its type and params are in extra['lr_scheduler_config']")


def _lazy(reader: PieceReader, t: ParamPlan, *, to_f32: bool = False) -> LazyTensor:
    """A planned tensor, read with positioned reads when loaded (a floating buffer saved in
    BF16/FP16 restored to FP32, as zero_to_fp32 does)."""
    cast = to_f32 and t.dtype in ("BF16", "F16")

    def load() -> np.ndarray:
        arr = reader.read(t)
        if not cast:
            return arr
        import numpy as np  # heavy: numpy

        return arr.astype(np.float32)  # exact: every BF16/FP16 value is an FP32 value
    return LazyTensor("F32" if cast else t.dtype, t.shape, load)


def _optimizer_name(cfg: Any, groups: list[dict[str, Any]], state: TrainingState) -> str:
    """``AdamW`` or ``Adam``: what the groups say (torch >= 2.6 records
    ``decoupled_weight_decay``), else the config's optimizer (DeepSpeed's ``Adam`` is AdamW
    unless ``adam_w_mode`` is false), else AdamW, noted."""
    flags = {g.get("decoupled_weight_decay") for g in groups}
    if flags == {True}:
        return "AdamW"
    if flags == {False}:
        return "Adam"
    opt = items((items(cfg) or {}).get("optimizer")) or {}
    kind = str(opt.get("type", "")).lower()
    params = items(opt.get("params")) or {}
    if kind in ("adamw", "cpuadamw", "fusedadamw"):
        return "AdamW"
    if kind in ("adam", "cpuadam", "fusedadam"):
        return "AdamW" if params.get("adam_w_mode", True) else "Adam"
    state.notes.append("optimizer: not named in the checkpoint (a client optimizer); taken to "
                       "be AdamW from its state")
    return "AdamW"


def _torch_groups(state: TrainingState) -> None:
    """Give each param group the keys torch's Adam/AdamW keep (:data:`TORCH_ADAM_DEFAULTS`,
    ``decoupled_weight_decay``), which DeepSpeed's own Adam lacks, and ``betas`` as a tuple;
    drop its ``bias_correction`` when true (torch's Adam always corrects), else note it."""
    filled: set[str] = set()
    for g, group in enumerate(state.param_groups):
        defaults = {**TORCH_ADAM_DEFAULTS, "decoupled_weight_decay": state.optimizer == "AdamW"}
        for k, v in defaults.items():
            if k not in group:
                group[k] = v
                filled.add(k)
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
        if group.get("bias_correction", True) is True:
            group.pop("bias_correction", None)
        else:
            state.notes.append(f"param group {g}: DeepSpeed's Adam ran without bias correction; "
                               "torch's Adam always corrects, so resumed updates differ")
    if filled:
        state.notes.append(f"param groups: torch's Adam defaults filled in for "
                           f"{', '.join(sorted(filled))} (DeepSpeed's own Adam records none)")


def _notes(state: TrainingState, plan_notes: list[str], unsafe: dict[Path, list[str]],
           top: dict[Any, Any], osd: dict[Any, Any]) -> None:
    module = items(top.get("module")) or {}
    low = sorted({r.dtype for r in module.values()
                  if isinstance(r, TensorRecord) and r.dtype in ("BF16", "F16")})
    state.notes.append("model: the FP32 master weights from the optimizer partitions"
                       + (f"; the module's {'/'.join(low)} copies dropped" if low else ""))
    if any(isinstance(r, TensorRecord) and r.dtype in ("BF16", "F16")
           for n, r in module.items() if n in (top.get("buffer_names") or [])):
        state.notes.append("buffers saved in BF16/FP16 restored to FP32, as zero_to_fp32 does")
    if osd.get("dynamic_loss_scale") is True:
        state.notes.append("FP16 dynamic loss scaler state not carried (DCP loops scale "
                           "their own)")
    state.notes.extend(plan_notes)
    for p, quals in unsafe.items():
        state.notes.append(hostile_warning(p, quals).message)
    if "random_rng_state" not in top and "rng" not in top:
        state.notes.append("rng: DeepSpeed saved no RNG state")
