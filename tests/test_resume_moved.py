"""``ckpt_cli.resume`` (documented in 0.x) still imports, with a DeprecationWarning, and gives
the same functions as ``ckpt_cli.ops.resume`` (#47 moved the engine into ops/)."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_the_old_module_name_warns_and_gives_the_same_functions() -> None:
    sys.modules.pop("ckpt_cli.resume", None)
    with pytest.warns(DeprecationWarning, match=r"ckpt_cli\.ops\.resume"):
        old = importlib.import_module("ckpt_cli.resume")
    new = importlib.import_module("ckpt_cli.ops.resume")
    for name in ("latest_verified", "choose", "survey"):
        assert getattr(old, name) is getattr(new, name)
