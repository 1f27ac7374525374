"""``diff --all`` across ``convert --to dcp``: an optimizer named by integer ids on one side
(``optimizer.state.0.exp_avg``, a plain ``torch.save`` training dict) met with one named by
FQNs on the other (``optimizer.state.<fqn>.exp_avg``, ``optim.state.<fqn>.exp_avg``: DCP).

``optimizer.state_dict()`` numbers the parameters in ``param_groups[*]['params']`` order and
never records their names; convert names them by the model's parameter order
(:func:`ckpt_cli.ops.to_dcp.optim.map_by_order`, reused here, with its refusals: several
groups, counts or shapes that disagree). When that naming puts the id side's entries on the
FQN side's names, the id side's names are matched to them, whatever the two containers are
called; the result says so (``DiffResult.optimizer_ids``). Any other pair is left as it is.
"""

from __future__ import annotations

import re
from typing import Any

from ckpt_cli.errors import UnsupportedError
from ckpt_cli.model import CheckpointIndex
from ckpt_cli.ops.diff.names import _chain
from ckpt_cli.ops.to_dcp import optim
from ckpt_cli.ops.to_dcp.state import LazyTensor

_BY_ID = re.compile(r"^((?:[^.]+\.)*?)state\.(\d+)\.([^.]+)$")
_BY_FQN = re.compile(r"^((?:[^.]+\.)*?)state\.(.+)\.([^.]+)$")

Entry = tuple[str, str, str]
"""(container prefix, parameter id or FQN, state key) of one optimizer-state tensor."""


def _entries(ix: CheckpointIndex, scope: set[str]) -> tuple[dict[str, Entry], dict[str, Entry]]:
    """The in-scope optimizer-state tensors named by id, and those named by FQN."""
    by_id: dict[str, Entry] = {}
    by_fqn: dict[str, Entry] = {}
    for n in scope:
        if ix.tensors[n].group != "optimizer":
            continue
        m = _BY_ID.match(n)
        if m:
            by_id[n] = (m[1], m[2], m[3])
        elif m := _BY_FQN.match(n):
            by_fqn[n] = (m[1], m[2], m[3])
    return by_id, by_fqn


def _parameters(ix: CheckpointIndex) -> list[tuple[str, tuple[int, ...]]]:
    """The model weights in the index's (state dict's) order, without tied copies."""
    out: list[tuple[str, tuple[int, ...]]] = []
    seen: set[tuple[Any, ...]] = set()
    for t in ix.tensors.values():
        if t.group != "model":
            continue
        if t.storage is not None:
            sig = (t.storage.file, t.storage.key, t.storage_offset, t.shape, t.stride, t.dtype)
            if sig in seen:
                continue
            seen.add(sig)
        out.append((t.name, tuple(t.shape)))
    return out


def _groups(ix: CheckpointIndex, container: str) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = []
    while (f"{container}param_groups.{len(groups)}.params") in ix.objects:
        groups.append({"params": ix.objects[f"{container}param_groups.{len(groups)}.params"]})
    return groups


def match_ids(index_a: CheckpointIndex, index_b: CheckpointIndex, names_a: dict[str, str],
              names_b: dict[str, str], scope_a: set[str], scope_b: set[str]) -> str | None:
    """Match an id-named optimizer on one side to an FQN-named one on the other.

    Renames the id side's entries in ``names_a``/``names_b`` (original -> matched name) to
    the FQN side's matched names.

    Args:
        index_a: Side A.
        index_b: Side B.
        names_a: A's original -> matched names (changed in place).
        names_b: B's, likewise.
        scope_a: A's names in the comparison's scope.
        scope_b: B's names in the scope.

    Returns:
        A note for the result: the ids matched by parameter order, or why they were not;
        None when the pair is not such a pair (nothing changed).
    """
    ea, eb = _entries(index_a, scope_a), _entries(index_b, scope_b)
    for side, (ids, fqns_here), (other_ids, fqns) in (("A", ea, eb), ("B", eb, ea)):
        if ids and not fqns_here and fqns and not other_ids:
            ix, names, peer = ((index_a, names_a, names_b) if side == "A"
                               else (index_b, names_b, names_a))
            return _match(side, ix, ids, fqns, names, peer)
    return None


def _match(side: str, ix: CheckpointIndex, ids: dict[str, Entry], fqns: dict[str, Entry],
           names: dict[str, str], peer: dict[str, str]) -> str | None:
    # Lazy: only for an id/FQN pair.
    containers = {c for c, _, _ in ids.values()}
    other = "B" if side == "A" else "A"
    if len(containers) != 1 or len({c for c, _, _ in fqns.values()}) != 1:
        return None  # several optimizers on a side: not what convert writes
    container = containers.pop()
    wanted = {f for _, f, _ in fqns.values()}
    params = _parameters(ix)
    # The model's names as the FQN side writes them: the fewest wrappers/containers removed.
    stages = [{n: n for n in ix.tensors}] + [c[1] for c in _chain(
        {n: n for n in ix.tensors}, {n for n, _ in params})]
    stage = next((s for s in stages if wanted <= {s[n] for n, _ in params}), None)
    why = f"{side}'s optimizer names parameters by id, {other}'s by name; not matched: "
    if stage is None:
        return why + f"{other}'s parameter names are not {side}'s model weights"
    placeholder: dict[int, tuple[str, str]] = {}
    state: dict[int, dict[str, Any]] = {}
    for orig, (_, pid, key) in ids.items():
        t = ix.tensors[orig]
        lazy = LazyTensor(t.dtype, tuple(t.shape), _unread)
        state.setdefault(int(pid), {})[key] = lazy
        placeholder[id(lazy)] = (orig, key)
    try:
        named, _ = optim.map_by_order([(stage[n], s) for n, s in params], state,
                                      _groups(ix, container), f"{side}: {ix.root}")
    except UnsupportedError as e:
        return why + str(e)
    target = {(f, k): o for o, (_, f, k) in fqns.items()}
    taken = set(names.values())
    matched = 0
    for fqn, entries in named.items():
        for key, value in entries.items():
            orig, _ = placeholder[id(value)]
            peer_orig = target.get((fqn, key))
            if peer_orig is None or peer[peer_orig] in taken:
                continue
            names[orig] = peer[peer_orig]
            matched += 1
    if not matched:
        return None
    return (f"{side}'s optimizer ids ({container}state.<id>) matched to {other}'s names by the "
            f"model's parameter order ({len(params)} parameters), as convert --to dcp names "
            f"them: {matched} tensors")


def _unread() -> Any:
    raise AssertionError("diff never loads an optimizer placeholder")
