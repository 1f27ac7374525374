"""``diff``'s structure: the scope of a comparison (model weights by default), which names
meet on both sides and which are only on one (a tied alias that one side omits is noted), shape
changes, and the FP8 weights paired with their scales to be compared dequantized."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

from ckpt_cli.errors import UsageError
from ckpt_cli.fp8 import scheme as fp8_scheme
from ckpt_cli.model import CheckpointIndex
from ckpt_cli.ops.diff.names import WEIGHT_GROUPS
from ckpt_cli.ops.diff.result import Dequantized, DiffResult, OnlyIn, Rename, TensorDiff


def choose_scope(a: CheckpointIndex, b: CheckpointIndex,
                 everything: bool) -> tuple[set[str], set[str], str, str | None]:
    """Names of each side inside the scope, the scope's name, and a note when it widened."""
    def weights(ix: CheckpointIndex) -> set[str]:
        return {n for n, t in ix.tensors.items() if t.group in WEIGHT_GROUPS}

    if everything:
        return set(a.tensors), set(b.tensors), "all", None
    wa, wb = weights(a), weights(b)
    if not wa and not wb and (a.tensors or b.tensors):
        return (set(a.tensors), set(b.tensors), "all",
                "neither side has model weights, so every tensor is compared")
    return wa, wb, "weights", None


def _aliases(index: CheckpointIndex) -> dict[str, list[str]]:
    """Tensor -> the other tensors viewing exactly the same stored bytes (tied weights)."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for t in index.tensors.values():
        if t.storage is not None:
            sig = (t.storage.file, t.storage.key, t.storage_offset, t.shape, t.stride, t.dtype)
            groups.setdefault(sig, []).append(t.name)
    return {n: [m for m in names if m != n] for names in groups.values() if len(names) > 1
            for n in names}


def _recorded_copies(index: CheckpointIndex) -> dict[str, str]:
    """``{dropped: kept}`` that safetensors' ``save_model`` writes into ``__metadata__``."""
    meta = index.metadata.get("safetensors_metadata")
    if not isinstance(meta, dict):
        return {}
    return {k: v for k, v in meta.items() if isinstance(v, str) and v in index.tensors
            and k not in index.tensors}


def match(result: DiffResult, names_a: dict[str, str], names_b: dict[str, str],
          scope_a: set[str], scope_b: set[str]) -> None:
    ia, ib = result.index_a, result.index_b
    rev_b = {v: k for k, v in names_b.items()}
    # A name is in scope if either side puts it there: groups are guessed from paths, and a
    # weight one reader calls "other" must still meet its counterpart.
    in_scope = {names_a[n] for n in scope_a} | {names_b[n] for n in scope_b}
    glob = result.options.name_glob
    if glob:
        in_scope = {n for n in in_scope if fnmatch.fnmatchcase(n, glob)}
        if not in_scope:
            raise UsageError(f"name_glob {glob!r} matches no tensor on either side",
                             param="name_glob")
    for ix, names, excluded in ((ia, names_a, result.excluded_a),
                                (ib, names_b, result.excluded_b)):
        for orig, norm in names.items():
            if norm not in in_scope:
                g = ix.tensors[orig].group
                excluded[g] = excluded.get(g, 0) + 1
    for orig, norm in names_a.items():
        if norm not in in_scope:
            continue
        ta = ia.tensors[orig]
        ob = rev_b.get(norm)
        if ob is None:
            continue
        tb = ib.tensors[ob]
        group = ta.group if ta.group != "other" else tb.group
        td = TensorDiff(norm, orig, ob, group, ta.dtype, tb.dtype, ta.shape, tb.shape)
        if ta.shape != tb.shape:
            td.status = "shape_changed"
        result.tensors.append(td)
    common = {t.name for t in result.tensors}
    for side, ix, names, other in (("a", ia, names_a, ib), ("b", ib, names_b, ia)):
        aliases = _aliases(ix)
        # The other side may record the copies it dropped ({dropped: kept}, in its own names).
        peer = "b" if side == "a" else "a"
        copies = {renamed(k, result.renames, peer): renamed(v, result.renames, peer)
                  for k, v in _recorded_copies(other).items()}
        only = result.only_a if side == "a" else result.only_b
        for orig, norm in names.items():
            if norm not in in_scope or norm in common:
                continue
            t = ix.tensors[orig]
            shared = [names[m] for m in aliases.get(orig, []) if names[m] in common]
            tied, how = (shared[0], "storage") if shared else (copies.get(norm), "recorded")
            if tied in common:
                only.append(OnlyIn(norm, orig, t.dtype, t.shape, t.group, tied, how))
            else:
                only.append(OnlyIn(norm, orig, t.dtype, t.shape, t.group))


def renamed(name: str, renames: Iterable[Rename], side: str) -> str:
    """Apply one side's renames to any name (for names that are not tensors of the index).

    Args:
        name: A name as that side writes it.
        renames: The renames of a :class:`DiffResult`.
        side: ``a`` or ``b``.

    Returns:
        The name as it is matched.
    """
    for r in renames:
        if r.side == side and name.startswith(r.prefix) and len(name) > len(r.prefix):
            name = name[len(r.prefix):]
    return name


def pair_quantized(result: DiffResult) -> None:
    """Mark the common tensors stored in FP8 with a scale (either side or both) to be compared
    dequantized, and take their scales out of the tensors compared and the one-sided lists."""
    pairings = []
    for ix in (result.index_a, result.index_b):
        has = any(t.dtype in fp8_scheme.FP8_DTYPES for t in ix.tensors.values())
        pairings.append(fp8_scheme.pair_scales(ix.tensors) if has else None)
    pa, pb = pairings
    if pa is None and pb is None:
        return
    taken: tuple[set[str], set[str]] = (set(), set())
    for td in result.tensors:
        qa = pa.pairs.get(td.name_a) if pa is not None else None
        qb = pb.pairs.get(td.name_b) if pb is not None else None
        for label, q, pairing, name, dtype in (("A", qa, pa, td.name_a, td.dtype_a),
                                               ("B", qb, pb, td.name_b, td.dtype_b)):
            if q is None and pairing is not None and dtype in fp8_scheme.FP8_DTYPES:
                module = name.rpartition(".")[0]
                why = next((f.message for f in pairing.findings if f.location is not None
                            and f.location.rpartition(".")[0] == module), None)
                result.fp8_unpaired.append(f"{label}: {why or name + ' has no usable scale'}; "
                                           "compared as stored")
        if (qa is None and qb is None) or td.status == "shape_changed":
            continue
        result.dequantized[td.name] = Dequantized(
            qa.scale.name if qa else None, qa.kind if qa else None,
            qb.scale.name if qb else None, qb.kind if qb else None)
        for side, q, pairing in ((0, qa, pa), (1, qb, pb)):
            if q is None or pairing is None:
                continue
            module = q.weight.name.rpartition(".")[0]
            taken[side].add(q.scale.name)
            taken[side].update(n for n in pairing.activation_scales
                               if n.rpartition(".")[0] == module)
    if not result.dequantized:
        return
    result.tensors = [td for td in result.tensors
                      if td.name_a not in taken[0] and td.name_b not in taken[1]]
    result.scales_a = [n for n in result.index_a.tensors if n in taken[0]]
    result.scales_b = [n for n in result.index_b.tensors if n in taken[1]]
    result.only_a = [o for o in result.only_a if o.original not in taken[0]]
    result.only_b = [o for o in result.only_b if o.original not in taken[1]]
