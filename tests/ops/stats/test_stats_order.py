"""``stats`` sorts a million names once, by a string key (``_Natural``): its order must be the
natural order of the lists of ``(0, int)``/``(1, str)`` parts it replaced, ties (parts equal
but for leading zeros) in name order, whatever characters the names hold."""

from __future__ import annotations

import random

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
