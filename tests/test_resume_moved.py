"""``ckpt_cli.resume`` (documented in 0.x) still gives resume-path's functions, with a
DeprecationWarning, the same objects as ``ckpt_cli.ops.resume`` (#47 moved the engine)."""

from __future__ import annotations

import pytest

import ckpt_cli.ops.resume as new
import ckpt_cli.resume as old


@pytest.mark.parametrize("name", ["latest_verified", "choose", "survey", "ResumeChoice"])
def test_the_old_module_name_warns_and_gives_the_same_objects(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"ckpt_cli\.ops\.resume\.{name}"):
        got = getattr(old, name)
    assert got is getattr(new, name)


def test_the_old_module_name_knows_only_those_names() -> None:
    with pytest.raises(AttributeError):
        _ = old.nothing_here
