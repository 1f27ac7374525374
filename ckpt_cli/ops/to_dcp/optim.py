"""``optimizer.state_dict()``'s integer parameter ids -> FQNs, and what ckpt can carry.

``torch.optim.Optimizer.state_dict()`` numbers the parameters ``0..N-1`` in the order of
``param_groups[*]['params']``; it never records their names. With one group built from
``model.parameters()`` that order is the model's parameter order (``named_parameters()``:
the state dict's order, buffers and tied copies left out). With several groups (decay /
no-decay splits...) the groups' order is the training script's choice, which no file records:
then the order cannot be known and the conversion is refused, as it is when the counts or the
shapes disagree. A per-parameter state ckpt cannot place in a sharded run (a tensor of another
shape than its parameter, a value that is not a tensor or a number) is refused naming it:
never an output that silently restarts the optimizer.
"""

from __future__ import annotations

from typing import Any

from ckpt_cli.errors import UnsupportedError
from ckpt_cli.ops.to_dcp.state import LazyTensor

KNOWN_STATE = {
    "Adam/AdamW": ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "SGD": ("momentum_buffer",),
}
"""The per-parameter state keys of the optimizers ckpt names; other optimizers whose state is
per-parameter tensors of the parameter's shape (or scalars) are carried as they are."""

StateValue = LazyTensor | int | float


def optimizer_name(state: dict[str, dict[str, StateValue]],
                   groups: list[dict[str, Any]]) -> str | None:
    """The ``torch.optim`` class the state looks like: ``AdamW`` (decoupled weight decay),
    ``Adam``, ``SGD``; None when the keys say neither."""
    keys = {k for entries in state.values() for k in entries}
    if "exp_avg" in keys and "exp_avg_sq" in keys:
        return "AdamW" if any(g.get("decoupled_weight_decay") for g in groups) else "Adam"
    if keys <= {"momentum_buffer"} and any("momentum" in g for g in groups):
        return "SGD"
    return None


def map_by_order(params: list[tuple[str, tuple[int, ...]]], state: dict[int, dict[str, Any]],
                 groups: list[dict[str, Any]], where: str
                 ) -> tuple[dict[str, dict[str, StateValue]], list[dict[str, Any]]]:
    """Name an ``optimizer.state_dict()``'s parameters by the model's parameter order.

    Args:
        params: The model's trainable parameters in ``model.parameters()`` order: (FQN,
            shape).
        state: ``optimizer.state_dict()["state"]``: parameter id -> {key: LazyTensor or
            number}.
        groups: ``optimizer.state_dict()["param_groups"]`` (plain values; ``params`` ids).
        where: The source, for messages.

    Returns:
        ``(optimizer_state, param_groups)`` by FQN, as ``TrainingState`` holds them.

    Raises:
        UnsupportedError: The order cannot be known (several groups, counts or shapes
            disagree), or a state entry cannot be placed.
    """
    ids = [i for g in groups for i in _ids(g, where)]
    if len(groups) != 1:
        raise UnsupportedError(
            f"{where}: the optimizer has {len(groups)} param groups; which parameters each "
            "holds is recorded only as integer ids, so their names cannot be known (ckpt maps "
            "ids to names only for one group built from model.parameters())")
    if len(ids) != len(params):
        raise UnsupportedError(
            f"{where}: the optimizer holds {len(ids)} parameters, the model {len(params)} "
            "(buffers and tied copies left out): the order that names them cannot be known "
            "(frozen parameters left out of the optimizer?)")
    if sorted(ids) != list(range(len(ids))):
        raise UnsupportedError(f"{where}: the optimizer's parameter ids are not 0..{len(ids) - 1}"
                               "; the order that names them cannot be known")
    name_of = {i: params[pos] for pos, i in enumerate(ids)}
    named: dict[str, dict[str, StateValue]] = {}
    for i, entries in state.items():
        if not isinstance(i, int) or i not in name_of:
            raise UnsupportedError(f"{where}: optimizer state for parameter id {i!r}, which no "
                                   "param group holds")
        fqn, shape = name_of[i]
        if not isinstance(entries, dict):
            raise UnsupportedError(f"{where}: optimizer state of {fqn} is not a mapping")
        named[fqn] = {str(k): placed(fqn, shape, str(k), v, where) for k, v in entries.items()}
    out_groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [name_of[i][0] for i in _ids(g, where)]} for g in groups]
    return named, out_groups


def _ids(group: dict[str, Any], where: str) -> list[int]:
    ids = group.get("params")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise UnsupportedError(f"{where}: a param group without integer 'params'")
    return ids


def placed(fqn: str, shape: tuple[int, ...], key: str, v: Any, where: str) -> StateValue:
    if isinstance(v, bool) or not isinstance(v, (LazyTensor, int, float)):
        raise UnsupportedError(f"{where}: optimizer state {key!r} of {fqn} is "
                               f"{type(v).__name__}, not a tensor or a number: ckpt cannot "
                               "carry it")
    if isinstance(v, LazyTensor) and v.shape not in ((), shape):
        raise UnsupportedError(
            f"{where}: optimizer state {key!r} of {fqn} has shape {list(v.shape)}, not the "
            f"parameter's {list(shape)}: either the parameter order is not the model's, or "
            "the optimizer keeps factored state that a sharded run cannot place")
    return v
