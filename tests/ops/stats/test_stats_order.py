"""``stats`` sorts a million names once, by a string key (``_Natural``): its order must be the
natural order of the lists of ``(0, int)``/``(1, str)`` parts it replaced, ties (parts equal
but for leading zeros) in name order, whatever characters the names hold."""

from __future__ import annotations

import random
from pathlib import Path

from ckpt_cli.ops.stats import _Natural

PARTS = ["", "a", "ab", "b", "B", "0", "00", "1", "01", "2", "9", "10", "100", "1a", "x\x00",
         "x\x01y", "x\x02", "x", "\u0663", "\u00e9", "a b"]


def _old(name: str) -> list[tuple[int, int | str]]:
    return [(0, int(p)) if p.isdigit() else (1, p) for p in name.split(".")]


def test_string_key_orders_as_the_natural_parts() -> None:
    rnd = random.Random(46)
    for _ in range(2000):
        names = list({".".join(rnd.choice(PARTS) for _ in range(rnd.randint(1, 4)))
                      for _ in range(30)})
        rnd.shuffle(names)
        want = sorted(sorted(names), key=_old)  # ties in name order
        natural = _Natural()
        got = sorted(names, key=natural)
        if natural.ties:
            got = sorted(sorted(names), key=natural)
        assert got == want


def test_leading_zeros_are_flagged_as_possible_ties() -> None:
    natural = _Natural()
    assert natural("layers.1.w") < natural("layers.10.w")
    assert not natural.ties
    assert natural("layers.01.w") == natural("layers.1.w")
    assert natural.ties


def test_modules_are_shown_in_natural_order_when_nested(tmp_path: Path) -> None:
    """Modules are taken in the order their tensors are met unless one is nested in another
    (``a.b.c.w`` is met before ``a.b.w``) or names tie: the order is the sorted one always."""
    import numpy as np
    from safetensors.numpy import save_file

    from ckpt_cli.ops.stats import StatsOptions, stats
    from ckpt_cli.ops.stats.result import module_of

    rnd = random.Random(7)
    parts = ["a", "b", "0", "1", "2", "10", "w", "x\x01y", "a b", ""]
    nested = 0
    for i in range(40):
        names = sorted({".".join(rnd.choice(parts) for _ in range(rnd.randint(1, 4)))
                        for _ in range(12)})
        path = tmp_path / f"m{i}.safetensors"
        save_file({n: np.full(1, k, np.float32) for k, n in enumerate(names)}, str(path))
        natural = _Natural()
        every = sorted(sorted(names), key=natural)
        first = list(dict.fromkeys(module_of(n, None) for n in every))
        want = sorted(first, key=natural)
        nested += want != first
        cs = stats(path, StatsOptions(no_cache=True)).checkpoints[0]
        assert [t.name for t in cs.tensors] == every
        assert [m.name for m in cs.modules] == want
        assert sum(m.tensors for m in cs.modules) == len(names)
    assert nested  # the case the shortcut must not take
