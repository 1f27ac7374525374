"""A Lightning ``.ckpt`` as a :class:`TrainingState`.

Names. ``state_dict`` is the LightningModule's: its keys start with the attribute that holds
each submodule (``self.net = ...`` gives ``net.weight``). When every key starts with the
same attribute, the module wraps one model, and that attribute (then any ``module.`` /
``_orig_mod.`` wrapper) is dropped, so the FQNs are the wrapped model's own
``named_parameters()`` names; otherwise the keys are kept whole. Either way ``notes`` says so.

Parameter ids. ``optimizer_states[0]`` is a ``torch.optim`` state dict whose integer ids
number the parameters of ``configure_optimizers`` in order, across the groups. Lightning
saves nothing else about them, and the module's code is never run, so the ids are matched
to ``state_dict``'s floating-point tensors in order (``state_dict`` lists each module's
parameters before its buffers, and ``self.parameters()`` follows the same module order),
every moment's shape checked against its tensor. Several param groups are taken group after
group, in the one order of the groups (up to four) that the shapes allow (a head group listed
first); when two orders fit, the file cannot say which parameters each group holds, and the
conversion is refused. Normalisation statistics (``running_mean``,
``running_var``) are known buffers; any other buffer is skipped only where the shapes leave one
way to do so; an ambiguous match, or none, is refused with the reason (a
``configure_optimizers`` that reorders parameters gives no match).
"""

from __future__ import annotations

from itertools import permutations
from pathlib import Path
from typing import Any

from ckpt_cli.errors import CkptError, CorruptCheckpointError, UnsupportedError
from ckpt_cli.formats.names import WRAPPERS
from ckpt_cli.formats.standins import TensorRecord
from ckpt_cli.ops.to_dcp._trees import (
    TorchTree,
    group_ids,
    items,
    map_torch_optimizer,
    plain,
    read_torch,
)
from ckpt_cli.ops.to_dcp.state import TrainingState

_MAX_CELLS = 20_000_000  # ids x tensors the order-preserving match may consider
_EXTRA = ("epoch", "pytorch-lightning_version", "hparams_name")
#: Buffers by their last name component (BatchNorm's statistics): never parameters.
KNOWN_BUFFERS = frozenset({"running_mean", "running_var"})


def read_lightning(path: Path) -> TrainingState:
    """Read a Lightning checkpoint's training state.

    Args:
        path: The ``.ckpt`` file (a ``torch.save`` dict).

    Returns:
        The state: the weights by FQN, the optimizer's state per FQN and its groups, the LR
        scheduler's state, the global step, and epoch, loops and hyperparameters in
        ``extra`` (where plain).

    Raises:
        CkptError: Not a Lightning checkpoint; parameter ids that cannot be matched to names.
        UnsupportedError: Several optimizers, or an optimizer ckpt cannot map.
    """
    if path.is_dir():
        raise CkptError("a directory, not a Lightning .ckpt file", path=path,
                        hint="Lightning's DeepSpeed and FSDP strategies save directories: "
                             "convert it as the DeepSpeed or DCP checkpoint it is")
    tt = read_torch(path)
    top = items(tt.tree)
    if top is None or "state_dict" not in top:
        raise CkptError("not a Lightning checkpoint (no state_dict)", path=path)
    sd = items(top["state_dict"])
    if sd is None:
        raise CorruptCheckpointError("state_dict is not a dict", path=path)
    state = TrainingState(source_format="lightning", model={}, notes=list(tt.hostile))
    rename = _renamer([str(k) for k in sd], state)
    for k, rec in sd.items():
        if isinstance(rec, TensorRecord):
            state.model[rename(str(k))] = tt.lazy(rec, f"state_dict.{k}")
    opts = top.get("optimizer_states")
    if not isinstance(opts, list) or not opts:
        raise CkptError("no optimizer_states (saved with save_weights_only?): converting "
                        "would restart the optimizer", path=path)
    if len(opts) > 1:
        raise UnsupportedError(f"{len(opts)} optimizers (manual optimization): a DCP training "
                               "state holds one", path=path)
    cands = [rename(str(k)) for k, v in sd.items() if isinstance(v, TensorRecord)
             and _floating(v) and str(k).rsplit(".", 1)[-1] not in KNOWN_BUFFERS]
    names = _match_ids(tt, opts[0], cands, state)
    shapes = {n: t.shape for n, t in state.model.items()}
    state.optimizer, state.optimizer_state, state.param_groups = map_torch_optimizer(
        tt, opts[0], names, shapes, where="optimizer_states[0]", adam="Adam")
    scheds = top.get("lr_schedulers")
    if isinstance(scheds, list) and len(scheds) == 1:
        state.lr_scheduler = plain(scheds[0], "lr_schedulers[0]", path)
    elif isinstance(scheds, list) and len(scheds) > 1:
        raise UnsupportedError(f"{len(scheds)} LR schedulers: a DCP training state holds one",
                               path=path)
    gs = top.get("global_step")
    state.step = gs if isinstance(gs, int) and not isinstance(gs, bool) else None
    for k in _EXTRA:
        v = top.get(k)
        if isinstance(v, (int, float, str)) and not isinstance(v, bool):
            state.extra[k] = v
    for k in ("loops", "hyper_parameters"):
        if top.get(k) is not None:
            try:
                state.extra[k] = plain(top[k], k, path)
            except UnsupportedError as e:
                state.notes.append(f"{k} not carried: {e}")
    state.notes.append("rng: Lightning saves no RNG state")
    return state


def _floating(rec: TensorRecord) -> bool:
    return rec.dtype.startswith(("F", "BF", "C"))


def _renamer(keys: list[str], state: TrainingState) -> Any:
    """How state_dict keys become FQNs (see the module's docstring)."""
    firsts = {k.split(".", 1)[0] for k in keys}
    if len(firsts) != 1 or not all("." in k for k in keys):
        state.notes.append("names: state_dict keys kept whole (the LightningModule holds "
                           f"{len(firsts)} top-level attributes)")
        return lambda k: k
    attr = next(iter(firsts)) + "."

    def strip(k: str) -> str:
        k = k[len(attr):]
        for w in WRAPPERS:
            while k.startswith(w):
                k = k[len(w):]
        return k
    state.notes.append(f"names: the LightningModule's one attribute {attr.rstrip('.')!r} "
                       "(and any wrapper) dropped from every key: the wrapped model's FQNs")
    return strip


def _match_ids(tt: TorchTree, osd: Any, cands: list[str],
               state: TrainingState) -> list[list[str]]:
    """Each param group's FQNs: the optimizer's ids matched in order to ``cands``."""
    d = items(osd) or {}
    raw = d.get("param_groups")
    if not isinstance(raw, list):
        raise CorruptCheckpointError("optimizer_states[0] has no param_groups", path=tt.path)
    per_group = group_ids([items(g) or {} for g in raw], "optimizer_states[0]", tt.path)
    sizes = [len(ids) for ids in per_group]
    ids = [pid for g in per_group for pid in g]
    st = items(d.get("state")) or {}
    want: list[tuple[int, ...] | None] = []
    for pid in ids:
        s = items(st.get(pid)) or {}
        rec = next((s[k] for k in ("exp_avg", "momentum_buffer") if
                    isinstance(s.get(k), TensorRecord)), None)
        want.append(tuple(rec.shape) if rec is not None else None)
    have = [state.model[n].shape for n in cands]
    order, chosen = _group_order(want, sizes, have, tt.path)
    if len(ids) != len(cands):
        state.notes.append(f"parameter ids: {len(ids)} matched in order to the floating "
                           f"tensors of state_dict ({len(cands) - len(ids)} skipped as "
                           "buffers or frozen, the only match the moments' shapes allow)")
    else:
        state.notes.append("parameter ids: matched in order to state_dict's floating tensors "
                           "(every moment's shape checked)")
    if order != sorted(order):
        state.notes.append(f"param groups: follow the model in the order {order} (the only "
                           "order the moments' shapes allow)")
    return [[cands[j] for j in ix] for ix in chosen]


def _group_order(want: list[tuple[int, ...] | None], sizes: list[int],
                 have: list[tuple[int, ...]], path: Path) -> tuple[list[int], list[list[int]]]:
    """The one order of the param groups whose ids, group after group, match ``have`` in
    order (see :func:`_align`), and per group the indices into ``have`` it matched.
    ``configure_optimizers`` may list the groups in any order (a head group first), and the
    file does not say which: an order is used only when no other order of the groups names
    the parameters otherwise (empty groups, say, change nothing)."""
    starts = [sum(sizes[:g]) for g in range(len(sizes))]
    fits: dict[tuple[tuple[int, ...], ...], list[int]] = {}
    first: CkptError | None = None
    # Several groups: every order (up to 4 groups, 24 orders), the saved one first; more
    # groups are taken in the saved order only (each order costs a match).
    orders = permutations(range(len(sizes))) if len(sizes) <= 4 else [tuple(range(len(sizes)))]
    for order in orders:
        w = [x for g in order for x in want[starts[g]:starts[g] + sizes[g]]]
        try:
            chosen = iter(_align(w, have, path))
        except CkptError as e:
            first = first or e
            continue
        per_group: list[tuple[int, ...]] = [() for _ in sizes]
        for g in order:
            per_group[g] = tuple(next(chosen) for _ in range(sizes[g]))
        fits.setdefault(tuple(per_group), list(order))
        if len(fits) > 1:
            a, b = fits.values()
            raise CkptError(f"the optimizer's {len(sizes)} param groups fit state_dict's "
                            f"floating tensors in more than one order (groups {a} and {b}) by "
                            "shape: which parameters each group holds cannot be known",
                            path=path)
    if not fits:
        raise first or CkptError("the optimizer's parameter ids cannot be named", path=path)
    (per, saved), = fits.items()
    return saved, [list(ix) for ix in per]


def _align(want: list[tuple[int, ...] | None], have: list[tuple[int, ...]],
           path: Path) -> list[int]:
    """The one order-preserving match of ``want`` (None: any shape) into ``have``."""
    n, m = len(want), len(have)
    if n > m:
        raise CkptError(f"the optimizer holds {n} parameters, state_dict only {m} floating "
                        "tensors: the ids cannot be named", path=path)
    if n == m:
        bad = [i for i in range(n) if want[i] is not None and want[i] != have[i]]
        if not bad:
            return list(range(n))
    if (n + 1) * (m + 1) > _MAX_CELLS:
        raise CkptError(f"the optimizer's {n} parameters and state_dict's {m} floating "
                        "tensors differ in number and are too many to match", path=path)
    # ways[i][j]: matches of want[i:] into have[j:], counted up to 2
    ways = [[0] * (m + 1) for _ in range(n + 1)]
    for j in range(m + 1):
        ways[n][j] = 1
    for i in range(n - 1, -1, -1):
        row, nxt = ways[i], ways[i + 1]
        for j in range(m - 1, -1, -1):
            ok = want[i] is None or want[i] == have[j]
            row[j] = min(2, row[j + 1] + (nxt[j + 1] if ok else 0))
    if ways[0][0] != 1:
        why = "no order-preserving match" if ways[0][0] == 0 else "more than one match"
        raise CkptError(f"the optimizer's {n} parameter ids have {why} to state_dict's {m} "
                        "floating tensors by shape: which parameter each id is cannot be "
                        "known (configure_optimizers reordered them, or buffers look like "
                        "parameters)", path=path)
    out, j = [], 0
    for i in range(n):
        while not ((want[i] is None or want[i] == have[j]) and ways[i + 1][j + 1] == 1):
            j += 1
        out.append(j)
        j += 1
    return out
