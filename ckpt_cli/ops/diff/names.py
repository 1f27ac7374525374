"""``diff``'s name matching: the wrapper prefixes (DDP, torch.compile, training dicts) stripped
so that the two sides' names meet, and which names a comparison covers by default."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ckpt_cli.errors import (
    UsageError,
)
from ckpt_cli.formats import names
from ckpt_cli.model import CheckpointIndex
from ckpt_cli.ops.diff.result import (
    Rename,
)

if TYPE_CHECKING:
    pass

WRAPPERS: tuple[str, ...] = (*names.WRAPPERS, *names.CONTAINERS)
"""Name prefixes that wrappers and containers add (:mod:`ckpt_cli.formats.names`)."""

WEIGHT_GROUPS: tuple[str, ...] = ("model", "buffer")
"""Groups compared by default."""


def _strip(names: dict[str, str], prefix: str) -> tuple[dict[str, str], int] | None:
    """Remove ``prefix`` from every current name carrying it; None if two names would merge."""
    out: dict[str, str] = {}
    changed = 0
    for orig, cur in names.items():
        if cur.startswith(prefix) and len(cur) > len(prefix):
            out[orig] = cur[len(prefix):]
            changed += 1
        else:
            out[orig] = cur
    if len(set(out.values())) != len(out):
        return None
    return out, changed


def _chain(names: dict[str, str], key: set[str]) -> list[tuple[str, dict[str, str], int]]:
    """The wrappers a side carries, outermost first: each prefixes every name in ``key``."""
    chain: list[tuple[str, dict[str, str], int]] = []
    current = names
    for _ in range(8):  # wrappers nest a few levels at most (module._orig_mod.model.)
        cur = [current[o] for o in key]
        prefix = next((w for w in WRAPPERS
                       if cur and all(n.startswith(w) and len(n) > len(w) for n in cur)), None)
        if prefix is None:
            break
        stripped = _strip(current, prefix)
        if stripped is None:
            break
        current, count = stripped
        chain.append((prefix, current, count))
    return chain


def normalise(index_a: CheckpointIndex, index_b: CheckpointIndex, scope_a: Iterable[str],
              scope_b: Iterable[str], strip_prefixes: Iterable[str] = (), *,
              auto: bool = True) -> tuple[dict[str, str], dict[str, str], list[Rename]]:
    """Map each side's tensor names to the names they are matched by.

    ``strip_prefixes`` are removed from both sides first (from every name that starts with
    one). Then, with ``auto``, the wrapper prefixes of :data:`WRAPPERS` that a side carries on
    all its in-scope model weights are candidates for removal; the combination that makes the
    most in-scope names match wins, provided it beats removing nothing (so ``model.`` is only
    stripped when one side has it and the other does not).

    Args:
        index_a: Side A.
        index_b: Side B.
        scope_a: A's names inside the comparison's scope.
        scope_b: B's names inside the scope.
        strip_prefixes: Prefixes to remove on both sides.
        auto: Whether to strip wrapper prefixes automatically.

    Returns:
        ``(A's original -> normalised, B's original -> normalised, renames applied)``.

    Raises:
        UsageError: If a requested prefix would give two tensors of one side the same name.
    """
    sa, sb = set(scope_a), set(scope_b)
    names = {"a": {n: n for n in index_a.tensors}, "b": {n: n for n in index_b.tensors}}
    renames: list[Rename] = []
    for prefix in strip_prefixes:
        if not prefix:
            continue
        for side in ("a", "b"):
            stripped = _strip(names[side], prefix)
            if stripped is None:
                raise UsageError(f"stripping {prefix!r} from {side.upper()}'s names would give "
                                 "two tensors the same name")
            names[side], count = stripped
            if count:
                renames.append(Rename(side, prefix, count, "option"))
    if not auto:
        return names["a"], names["b"], renames

    def key(scope: set[str], ix: CheckpointIndex) -> set[str]:
        # Wrappers are judged on the weights: in --all, optimizer state sits beside them.
        weights = {n for n in scope if ix.tensors[n].group in WEIGHT_GROUPS}
        return weights or scope

    chain_a = _chain(names["a"], key(sa, index_a))
    chain_b = _chain(names["b"], key(sb, index_b))

    def score(i: int, j: int) -> int:
        ma = chain_a[i - 1][1] if i else names["a"]
        mb = chain_b[j - 1][1] if j else names["b"]
        return len({ma[n] for n in sa} & {mb[n] for n in sb})

    base = score(0, 0)
    options = [(score(i, j), i, j) for i in range(len(chain_a) + 1)
               for j in range(len(chain_b) + 1)]
    # Most matches first, then the fewest prefixes removed, then by the prefixes' names: keys
    # that do not depend on which side is A, so diff(B, A) mirrors diff(A, B).
    options.sort(key=lambda o: (-o[0], o[1] + o[2], max(o[1], o[2]),
                                sorted([p for p, _, _ in chain_a[:o[1]]]
                                       + [p for p, _, _ in chain_b[:o[2]]])))
    best, i, j = options[0]
    if best <= base:
        return names["a"], names["b"], renames
    renames += [Rename("a", p, c, "auto") for p, _, c in chain_a[:i]]
    renames += [Rename("b", p, c, "auto") for p, _, c in chain_b[:j]]
    return (chain_a[i - 1][1] if i else names["a"], chain_b[j - 1][1] if j else names["b"],
            renames)
