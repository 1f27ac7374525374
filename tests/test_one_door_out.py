"""Every rename that puts bytes in place goes through the one door out,
``ckpt_cli/storage/atomic.py`` (docs/safety.md, "Where ckpt writes"): its rule for links, FIFOs,
devices and parents then holds for every writer, and a new writer cannot bypass it.

Checked statically, as tests/test_layers.py checks the layering: a call of ``os.replace``,
``os.rename``, ``os.renames`` or ``shutil.move``, or a path's ``.replace(x)``/``.rename(x)``
(one positional argument and no keyword: ``str.replace`` takes two, ``dataclasses.replace``
keywords), anywhere else is a writer doing its own renaming.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ckpt_cli

ROOT = Path(ckpt_cli.__file__).parent
DOOR = "storage/atomic.py"
# Renames that write nothing, by module and count: prune moves a checkpoint it is deleting
# into the run's trash under a name it just found free, and back if it must keep it.
KNOWN = {"ops/prune/deletion.py": 1}
_FUNCS = {("os", "replace"), ("os", "rename"), ("os", "renames"), ("shutil", "move")}


def _renames(tree: ast.AST) -> list[int]:
    """Line numbers of the renaming calls in ``tree``."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        if isinstance(f.value, ast.Name) and (f.value.id, f.attr) in _FUNCS:
            lines.append(node.lineno)
        elif (f.attr in ("replace", "rename") and len(node.args) == 1 and not node.keywords
              and not isinstance(node.args[0], ast.Starred)):
            lines.append(node.lineno)
    return lines


def test_the_check_finds_renames() -> None:
    # The check itself can fail: each form is found, str.replace and dataclasses.replace not.
    src = ("import os, shutil\nos.replace(a, b)\nos.rename(a, b, src_dir_fd=1)\n"
           "shutil.move(a, b)\ntmp.replace(dest)\np.rename(q)\n"
           "s.replace('a', 'b')\ndataclasses.replace(x, y=1)\n")
    assert _renames(ast.parse(src)) == [2, 3, 4, 5, 6]


def test_every_rename_goes_through_the_door() -> None:
    found: dict[str, list[int]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == DOOR:
            continue
        lines = _renames(ast.parse(path.read_text(encoding="utf-8")))
        if lines and len(lines) != KNOWN.get(rel):
            found[rel] = lines
    assert not found, (f"renames outside ckpt_cli/{DOOR} (use atomic_file, atomic_dir, "
                       f"rename_onto or rename_at there): {found}")
    assert (ROOT / DOOR).is_file()
