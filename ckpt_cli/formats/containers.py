"""Understanding the object trees inside torch pickles: names, groups and training metadata.

A torch checkpoint is a tree of dicts and lists with tensors at the leaves. Frameworks wrap the
model's state dict in well-known containers (``model``, ``state_dict``, ``module``...) next to the
optimizer state and scalars such as ``step``. This module flattens such trees into dotted names,
decides which group each tensor belongs to, and pulls out the training metadata.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ckpt_cli.formats.standins import Opaque, TensorRecord

if TYPE_CHECKING:
    from ckpt_cli.model import CheckpointIndex

MODEL_KEYS = ("model", "state_dict", "module", "model_state_dict", "model_state", "network",
              "net", "params", "weights", "ema", "model_ema", "ema_state_dict", "generator",
              "discriminator", "encoder", "decoder")
"""Top-level keys under which frameworks store a model's state dict."""

OPTIMIZER_KEYS = ("optimizer", "optimizer_states", "optimizer_state_dict", "optim", "optimizers",
                  "opt", "optim_state", "opt_state", "optimizer_state", "base_optimizer_state",
                  "single_partition_of_fp32_groups", "fp32_flat_groups", "fp32_groups",
                  "optim_states")
"""Top-level keys under which frameworks store optimizer state."""

OTHER_KEYS = ("lr_scheduler", "lr_schedulers", "scheduler", "schedulers", "rng_state",
              "rng_states", "rng", "random_states", "scaler", "grad_scaler", "loops", "callbacks",
              "sampler", "data_sampler", "opt_param_scheduler", "rerun_state_machine",
              "dataloader", "random_ltd", "loss_scaler", "train_state")
"""Top-level keys that hold neither model weights nor optimizer state."""

_MEGATRON_MODEL = re.compile(r"^model\d+$")
_BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked", "inv_freq",
                    "position_ids", "masked_bias", "token_type_ids", "_float_tensor", "mask")
# Matched as whole components: GPT-2's causal mask is ``h.0.attn.bias``, while
# ``h.0.attn.c_attn.bias`` is a trainable bias.
_BUFFER_COMPONENTS = ("attn.bias",)

_STEP_KEYS = ("step", "global_step", "global_steps", "iteration", "steps", "train_step",
              "num_updates", "iter")
_EPOCH_KEYS = ("epoch", "epochs", "current_epoch")
_VERSION_KEYS = ("pytorch-lightning_version", "ds_version", "checkpoint_version",
                 "torch_version", "transformers_version", "version")
_SCALAR_META = ("global_samples", "consumed_samples", "consumed_train_samples", "skipped_steps",
                "dp_world_size", "mp_world_size", "best_metric", "best_model_score",
                "num_floating_point_operations_so_far", "zero_stage", "partition_count",
                "loss_scale", "cur_scale", "total_flos", "learning_rate", "seed",
                "hparams_name")

_MAX_DEPTH = 128


MAX_NODES = 20_000_000
"""Most tree nodes :func:`walk` visits: a pickle of a few hundred bytes can describe a tree of
2**40 nodes by sharing lists ("billion laughs")."""


def walk(obj: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Yield ``(key path, leaf)`` for every leaf of a pickled tree, depth first, in order.

    Dicts and lists are entered; so are :class:`Opaque` objects that carry state (a pickled
    ``nn.Module`` yields its ``_parameters``/``_buffers``/``_modules`` under plain names).
    A container met a second time (shared, or a cycle) is not entered again: it is yielded
    as a leaf. Tensors shared between names are leaves, so every name still gets its tensor.

    Args:
        obj: The unpickled object.
        prefix: Path of ``obj`` itself.

    Yields:
        Pairs of the key path (strings) and the leaf object.

    Raises:
        ValueError: If the tree has more than :data:`MAX_NODES` nodes.
    """
    stack: list[tuple[tuple[str, ...], Any]] = [(prefix, obj)]
    entered: set[int] = set()
    nodes = 0
    while stack:
        path, node = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise ValueError(f"the pickled object has more than {MAX_NODES:,} parts")
        children = _children(node)
        if children is None or id(node) in entered or len(path) > _MAX_DEPTH:
            yield path, node
            continue
        entered.add(id(node))
        stack.extend(((*path, k), v) for k, v in reversed(children))


def _children(node: Any) -> list[tuple[str, Any]] | None:
    if isinstance(node, dict):
        return [(_key(k), v) for k, v in node.items()]
    if isinstance(node, (list, tuple)) and not _is_scalar_seq(node):
        return [(str(i), v) for i, v in enumerate(node)]
    if isinstance(node, Opaque):
        fields = node.fields()
        if not fields:
            return None
        if any(k in fields for k in ("_parameters", "_buffers", "_modules")):
            out: list[tuple[str, Any]] = []
            for part in ("_parameters", "_buffers", "_modules"):
                sub = fields.get(part)
                if isinstance(sub, dict):
                    out.extend((_key(k), v) for k, v in sub.items() if v is not None)
            return out
        return [(_key(k), v) for k, v in fields.items()]
    return None


def _is_scalar_seq(node: list[Any] | tuple[Any, ...]) -> bool:
    # Sequences of numbers/strings (betas, shapes, name lists) are one leaf, not many.
    return len(node) <= 4096 and all(
        isinstance(v, (int, float, str, bool)) or v is None for v in node)


def _key(k: Any) -> str:
    if isinstance(k, str):
        return k
    if isinstance(k, bytes):
        return k.decode("utf-8", "replace")
    return str(k)


def group_of(path: tuple[str, ...], tensor: TensorRecord | None, default: str = "model") -> str:
    """Decide the group of a tensor from its key path.

    Args:
        path: The tensor's key path in its file's tree.
        tensor: The tensor record, for dtype-based buffer detection.
        default: The group when the path says nothing (the file's role).

    Returns:
        ``model``, ``buffer``, ``optimizer`` or ``other``.
    """
    head = path[0] if path else ""
    if head in OPTIMIZER_KEYS:
        group = "optimizer"
    elif head in OTHER_KEYS:
        group = "other"
    elif head in MODEL_KEYS or _MEGATRON_MODEL.match(head):
        group = "model"
    else:
        group = default
    # A quantized weight holds integers, but it is a weight.
    dtype = tensor.dtype if tensor is not None and tensor.kind != "quantized" else None
    if group == "model" and is_buffer_name(".".join(path), dtype):
        return "buffer"
    return group


def is_buffer_name(name: str, dtype: str | None) -> bool:
    """Whether a model tensor is a buffer rather than a trainable weight (by name or dtype).

    Args:
        name: Dotted tensor name.
        dtype: Canonical dtype code, or None.

    Returns:
        True for well-known buffer names (``running_mean``, ``inv_freq``...) and integer or
        boolean tensors, which cannot be trained.
    """
    if name.endswith(_BUFFER_SUFFIXES) or any(
            name == c or name.endswith("." + c) for c in _BUFFER_COMPONENTS):
        return True
    return dtype is not None and (dtype.startswith(("I", "U")) or dtype == "BOOL")


def file_default_group(tree: Any) -> str:
    """The group for tensors whose path says nothing, judged from the whole tree.

    A torch optimizer state dict (``state`` + ``param_groups``) is optimizer state; anything
    else defaults to model weights.

    Args:
        tree: The unpickled object.

    Returns:
        ``optimizer`` or ``model``.
    """
    if isinstance(tree, dict) and "state" in tree and "param_groups" in tree:
        return "optimizer"
    return "model"


def to_plain(value: Any, limit: int = 256) -> Any:
    """Convert a pickled leaf into a JSON-friendly value.

    Args:
        value: A leaf from :func:`walk`.
        limit: Longest string kept in full.

    Returns:
        ints, floats, strings, bools, None, short lists of those, or a ``<qualname>`` string.
    """
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + "..."
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if isinstance(value, (list, tuple)):
        # One level only: a leaf list of containers is a shared or cyclic node (see walk),
        # and descending into it could take 2**40 steps.
        if _is_scalar_seq(value):
            return [to_plain(v, limit) for v in value]
        return f"<{type(value).__name__} of {len(value)} items>"
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, Opaque):
        num = numpy_scalar(value)
        if num is not None:
            return num
        if value.state is None and len(value.args) == 1 and isinstance(
                value.args[0], (int, float, str, bool)):
            return f"{value.qualname}({value.args[0]!r})"  # an enum member, e.g. a ZeRO stage
        return repr(value)
    if isinstance(value, complex):
        return str(value)
    if isinstance(value, TensorRecord):
        return f"<tensor {value.dtype}{list(value.shape)}>"
    return f"<{type(value).__name__}>"


def numpy_scalar(obj: Opaque) -> float | int | None:
    """Decode a pickled numpy scalar (``numpy.core.multiarray.scalar(dtype, bytes)``).

    Only the bytes are interpreted, by ``numpy.frombuffer``; no pickle code runs.

    Args:
        obj: The stand-in object.

    Returns:
        The number, or None if ``obj`` is not a numeric numpy scalar.
    """
    if not obj.qualname.endswith("multiarray.scalar") or len(obj.args) < 2:
        return None
    dt, raw = obj.args[0], obj.args[1]
    if not isinstance(dt, Opaque) or not dt.args or not isinstance(raw, (bytes, bytearray)):
        return None
    code = dt.args[0]
    if not isinstance(code, str) or not re.fullmatch(r"[<>=|]?[fiub]\d{1,2}", code):
        return None
    import numpy as np  # heavy: numpy

    st = dt.state
    order = st[1] if isinstance(st, tuple) and len(st) > 1 and st[1] in ("<", ">") else ""
    try:
        arr = np.frombuffer(bytes(raw), dtype=np.dtype(order + code.lstrip("<>=|")))
    except (TypeError, ValueError):
        return None
    if arr.size != 1:
        return None
    item = arr[0].item()
    return item if isinstance(item, (int, float)) else None


def extract_metadata(tree: Any) -> dict[str, Any]:
    """Pull training metadata out of a checkpoint's top-level dict.

    Recognises step/epoch/lr under the names Lightning, HF, DeepSpeed, Megatron and hand-written
    loops use, version strings, hyper-parameters, and the learning rate of the optimizer's
    first param group.

    Args:
        tree: The unpickled object.

    Returns:
        A dict with canonical ``step``, ``epoch``, ``lr`` when found, plus other facts by name.
    """
    meta: dict[str, Any] = {}
    if not isinstance(tree, dict):
        return meta
    top = {_key(k): v for k, v in tree.items()}
    for k in _STEP_KEYS:
        v = _number(top.get(k))
        if isinstance(v, int) and not isinstance(v, bool):
            meta.setdefault("step", v)
            if k != "step":
                meta[k] = v
    for k in _EPOCH_KEYS:
        v = _number(top.get(k))
        if v is not None:
            meta.setdefault("epoch", v)
    for k in _VERSION_KEYS + _SCALAR_META:
        v = top.get(k)
        if v is not None and not isinstance(v, (dict, list, TensorRecord)):
            meta[k] = to_plain(v)
    for k in ("lr", "learning_rate"):
        v = _number(top.get(k))
        if v is not None:
            meta.setdefault("lr", v)
    if "lr" not in meta:
        lr = _optimizer_lr(top)
        if lr is not None:
            meta["lr"] = lr
    hp = top.get("hyper_parameters") or top.get("hparams")
    if isinstance(hp, (dict, Opaque)):
        meta["hyper_parameters"] = _plain_mapping(hp)
    args = top.get("args")
    if isinstance(args, Opaque):
        meta["args"] = _plain_mapping(args)
    return meta


def _number(v: Any) -> int | float | None:
    if isinstance(v, Opaque):
        v = numpy_scalar(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v


def _optimizer_lr(top: dict[str, Any]) -> float | None:
    candidates: list[Any] = [top]
    for k in OPTIMIZER_KEYS:
        v = top.get(k)
        candidates.extend(v if isinstance(v, list) else [v])
    for c in candidates:
        if isinstance(c, dict):
            groups = c.get("param_groups")
            if isinstance(groups, list) and groups and isinstance(groups[0], dict):
                lr = _number(groups[0].get("lr"))
                if lr is not None:
                    return float(lr)
    return None


def _plain_mapping(obj: Any) -> dict[str, Any]:
    fields = obj.fields() if isinstance(obj, Opaque) else obj
    out: dict[str, Any] = {}
    for k, v in list(fields.items())[:200]:
        if isinstance(v, (dict, TensorRecord)):
            continue
        out[_key(k)] = to_plain(v)
    return out


STATE_KEYS = ("train_state", "training_state", "trainer_state", "state", "progress",
              "client_state", "extra_state", "app", "meta", "metadata", "loop_state")
"""Keys of dicts that hold a loop's own counters (``{"train_state": {"step": 50}}``, the
torch.distributed.checkpoint recipe), searched for the step and epoch when the top level
has none."""

SCHEDULER_KEYS = ("lr_scheduler", "scheduler", "lr_schedulers", "schedulers",
                  "opt_param_scheduler")
RNG_KEYS = ("rng_state", "rng_states", "rng", "random_states", "rng_tracker_states")
_MAX_SCHEDULER_FIELDS = 32
_MAX_RNG_NAMES = 16


def training_facts(objects: dict[str, Any], tensor_names: Iterable[str]) -> dict[str, Any]:
    """Training metadata found in nested non-tensor leaves, in any format.

    Works on flattened names (``train_state.step``, ``scheduler.last_epoch``), which every
    reader produces alike: a torch.save file, DCP ``bytes`` items (each its own small pickle),
    the separate ``scheduler.pt``/``rng_state.pth`` files of a checkpoint directory.

    Args:
        objects: The index's non-tensor leaves by flattened name.
        tensor_names: The index's tensor names (RNG states are often tensors).

    Returns:
        ``step``/``epoch`` from a training-state dict (:data:`STATE_KEYS`); ``scheduler``:
        the scalar fields of the (first) learning-rate scheduler's state dict; ``rng_states``:
        the names of the RNG states saved. Keys that were not found are absent.
    """
    out: dict[str, Any] = {}
    for key in STATE_KEYS:
        for k in _STEP_KEYS:
            v = _number(objects.get(f"{key}.{k}"))
            if isinstance(v, int) and "step" not in out:
                out["step"] = v
        for k in _EPOCH_KEYS:
            v = _number(objects.get(f"{key}.{k}"))
            if v is not None and "epoch" not in out:
                out["epoch"] = v
    for key in SCHEDULER_KEYS:
        # Lightning keeps a list of schedulers: the first one's state is the one shown.
        for prefix in (f"{key}.", f"{key}.0."):
            fields = {k[len(prefix):]: v for k, v in objects.items()
                      if k.startswith(prefix) and "." not in k[len(prefix):]
                      and _is_plain(v)}
            if fields:
                out["scheduler"] = dict(list(fields.items())[:_MAX_SCHEDULER_FIELDS])
                break
        if "scheduler" in out:
            break
    rng: dict[str, None] = {}
    for name in (*tensor_names, *objects):
        parts = name.split(".")
        if parts[0] in RNG_KEYS and len(rng) < _MAX_RNG_NAMES:
            rng[".".join(parts[:2])] = None
    if rng:
        out["rng_states"] = list(rng)
    return out


def _is_plain(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    return isinstance(v, list) and len(v) <= 64 and all(
        x is None or isinstance(x, (bool, int, float, str)) for x in v)


# The rank files of DeepSpeed and Megatron (mp_rank_00_model_states, zero_pp_rank_0_mp_rank_00_
# optim_states...): their names prefix the entries read from them.
_RANK_PREFIX = re.compile(r"^(?:mp_rank_\d+\S*|(?:bf16_)?zero_pp_rank_\d+_mp_rank_\d+_\w+)$")


def _hyperparameters(name: str) -> bool:
    return ".param_groups." in f".{name}."


def holds_optimizer_state(index: CheckpointIndex) -> bool:
    """Whether a checkpoint holds optimizer state: per-parameter state (Adam's moments, the
    step counts) in tensors or values under an optimizer's key, or an optimizer file ckpt
    could not read (counted by its name). An optimizer's hyperparameters (``param_groups``)
    are no state: an optimizer whose ``state`` is empty (fresh, or thinned by ``prune
    --thin-after``, which keeps them so that a resumed run follows its schedule) holds none,
    in every layout (HF ``optimizer.pt``, Lightning ``optimizer_states``, torch dicts, DCP).
    """
    if any(t.group == "optimizer" and not _hyperparameters(n)
           for n, t in index.tensors.items()):
        return True
    # A file read (its format known) counts by what it holds, above and below.
    if any(f.role == "optimizer" and f.format is None for f in index.files):
        return True
    for key in index.objects:
        if _hyperparameters(key):
            continue
        parts = key.split(".", 2)
        head = parts[1] if len(parts) > 1 and _RANK_PREFIX.match(parts[0]) else parts[0]
        if head in OPTIMIZER_KEYS:
            return True
    return False
