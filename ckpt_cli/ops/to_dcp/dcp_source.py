"""A DCP directory in either layout (torchtitan's or the recipe's) -> :class:`TrainingState`,
so that ``convert --to dcp`` also moves a run from one layout to the other.

``.metadata`` records, for every flattened key, the path of keys it had in the saved state dict
(``planner_data``): FQNs keep their dots. Non-tensor values (param groups, the scheduler's
state) are read with ckpt's safe unpickler; tensors stay lazy (read chunk by chunk, resharded
to full tensors, when the writer asks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_cli import storage
from ckpt_cli.errors import CorruptCheckpointError, UnsupportedError
from ckpt_cli.formats import read_index
from ckpt_cli.formats.dcp import metadata_file, parse_metadata, storage_map
from ckpt_cli.formats.standins import Opaque
from ckpt_cli.formats.torchzip import parse_zip
from ckpt_cli.ops.to_dcp import optim
from ckpt_cli.ops.to_dcp.state import LazyTensor, TrainingState
from ckpt_cli.ops.to_dcp.torch_dict import lazy_of, plain

_NOT_MODEL = ("optimizer", "optim", "lr_scheduler", "train_state", "rng", "dataloader", "step")


def read_dcp(path: Path) -> TrainingState:
    """Read a DCP checkpoint's training state.

    Args:
        path: The DCP directory.

    Returns:
        The training state (either layout; the model alone if that is all there is).

    Raises:
        UnsupportedError: Optimizer state ckpt cannot place (named).
        CorruptCheckpointError: A value that cannot be read.
    """
    tree = _tree(path)
    titan = "optimizer" in tree or "model" not in tree
    if titan:
        model = {k: v for k, v in tree.items() if isinstance(v, LazyTensor)}
        skipped = [k for k in tree if k not in model and k not in _NOT_MODEL]
    else:
        model = {k: v for k, v in _dict(tree["model"]).items() if isinstance(v, LazyTensor)}
        skipped = [k for k in tree if k not in ("model", *_NOT_MODEL)]
    if not model:
        raise UnsupportedError(f"{path}: no model tensors (neither torchtitan's top-level FQNs "
                               "nor the recipe's 'model')")
    state = TrainingState("dcp", model)
    where = f"{path}: {'optimizer' if titan else 'optim'}"
    if titan and "optimizer" in tree:
        per, groups = _unflatten(_dict(tree["optimizer"]), where)
    elif not titan and "optim" in tree:
        o = _dict(tree["optim"])
        per = {k: _dict(v) for k, v in _dict(o.get("state", {})).items()}
        groups = [_dict(g) for g in _list(o.get("param_groups", []))]
    else:
        per, groups = {}, []
        state.notes.append("no optimizer state in the source: a run resumed from the output "
                           "starts its optimizer afresh")
    shapes = {k: v.shape for k, v in model.items()}
    for fqn, entries in per.items():
        if fqn not in shapes:
            raise UnsupportedError(f"{where}: state for {fqn}, which the model does not hold")
        per[fqn] = {str(k): optim.placed(fqn, shapes[fqn], str(k), v, where)
                    for k, v in entries.items()}
    state.optimizer_state, state.param_groups = per, groups
    state.optimizer = optim.optimizer_name(per, groups)
    sched = tree.get("lr_scheduler")
    state.lr_scheduler = sched if isinstance(sched, dict) else None
    train = _dict(tree.get("train_state", {}))
    state.extra = {str(k): v for k, v in train.items() if k != "step" and isinstance(
        v, (int, float, str)) and not isinstance(v, bool)}
    step = train.get("step", tree.get("step"))
    if isinstance(step, LazyTensor) and step.shape == ():
        step = int(step.load())
    state.step = step if isinstance(step, int) and not isinstance(step, bool) else None
    rng = tree.get("rng")
    state.rng = rng if isinstance(rng, dict) else None
    if skipped:
        state.notes.append("not carried: " + ", ".join(map(str, skipped)))
    return state


def _unflatten(flat: dict[str, Any], where: str
               ) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """``flatten_optimizer_state_dict=True``'s form back to ``get_state_dict``'s: groups are
    the runs of parameters with the same hyperparameters, in order."""
    per: dict[str, dict[str, Any]] = {}
    hps: dict[str, dict[str, Any]] = {}
    for key, v in flat.items():
        head, _, rest = key.partition(".")
        fqn, _, k = rest.rpartition(".")
        if head == "state" and fqn:
            per.setdefault(fqn, {})[k] = v
        elif head == "param_groups" and fqn:
            hps.setdefault(fqn, {})[k] = v
        else:
            raise UnsupportedError(f"{where}: {key!r} is neither state.<fqn>.<key> nor "
                                   "param_groups.<fqn>.<hyperparameter>")
    groups: list[dict[str, Any]] = []
    for fqn, h in hps.items():
        same = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == h),
                    None)
        if same is None:
            groups.append({**h, "params": [fqn]})
        else:
            same["params"].append(fqn)
    return per, groups


def _tree(path: Path) -> dict[str, Any]:
    """The saved state dict rebuilt from ``.metadata``'s key paths: lazy tensors, plain
    values."""
    index = read_index(path, "dcp")
    meta_path = metadata_file(path)
    assert meta_path is not None  # read_index refuses a DCP without it
    fields, _ = parse_metadata(meta_path)
    planner = fields.get("planner_data")
    paths: dict[str, Any] = planner if isinstance(planner, dict) else {}
    where = storage_map(fields.get("storage_data"), path, meta_path)
    root: dict[Any, Any] = {}
    for name, md in fields["state_dict_metadata"].items():
        name = str(name)
        keys = paths.get(name)
        keys = tuple(keys) if isinstance(keys, (tuple, list)) and keys else (name,)
        if isinstance(md, Opaque) and md.qualname.endswith("BytesStorageMetadata"):
            loc = where.get((name, None))
            if loc is None:
                raise CorruptCheckpointError(f"no storage entry for {name!r}", path=meta_path)
            value = plain(_load_object(path, loc), f"{path}: {name}")
        elif name in index.tensors:
            value = lazy_of(index, index.tensors[name])
        else:
            continue
        node = root
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise CorruptCheckpointError(f"{name!r} nests inside a value", path=meta_path)
        node[keys[-1]] = value
    return {str(k): v for k, v in root.items()}


def _load_object(base: Path, loc: tuple[str, int, int, tuple[str, ...]]) -> Any:
    rel, off, length, transforms = loc
    if transforms:
        raise UnsupportedError(f"{base / rel}: item at byte {off} uses storage transforms "
                               f"{list(transforms)}, which ckpt cannot decode yet")
    fd = storage.open_regular(base / rel)
    try:
        return parse_zip(fd, off, length, f"{rel}@{off}").pickle.obj
    finally:
        storage.close(fd)


def _dict(v: Any) -> dict[Any, Any]:
    if isinstance(v, list):
        return dict(enumerate(v))
    return v if isinstance(v, dict) else {}


def _list(v: Any) -> list[Any]:
    if isinstance(v, dict):
        return [v[k] for k in sorted(v)]  # a list DCP flattened item by item
    return list(v) if isinstance(v, (list, tuple)) else []
