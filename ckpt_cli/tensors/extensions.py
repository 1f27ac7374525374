"""The optional compiled kernels of ``ckpt_cli.tensors`` (``setup.py``'s optional extensions),
loaded one way: absent where they were not built, off where the CPU cannot run them or the
user's switch says so; the numpy kernels then do the same work."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def load(name: str, disable_env: str) -> ModuleType | None:
    """The compiled module ``ckpt_cli.tensors.<name>``, or None.

    Args:
        name: The module (``_f16c``, ``_moments``).
        disable_env: An environment variable that, when set, turns it off.

    Returns:
        The module, where it was built, its ``available`` flag is true and ``disable_env`` is
        not set; else None.
    """
    if os.environ.get(disable_env) is not None:
        return None
    try:
        module = importlib.import_module(f"ckpt_cli.tensors.{name}")
    except ImportError:
        return None
    return module if module.available else None
