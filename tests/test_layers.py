"""The layering of ckpt_cli (docs: ARCHITECTURE.md), checked statically on import statements.

formats/ holds readers only and imports nothing above it except model, errors, dtypes and
streaming; ops/ returns results and never imports render/ or cli/; render/ never imports cli/.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import ckpt_cli

ROOT = Path(ckpt_cli.__file__).parent
FORMATS_MAY_IMPORT = ("ckpt_cli.formats", "ckpt_cli.model", "ckpt_cli.errors",
                      "ckpt_cli.dtypes", "ckpt_cli.streaming", "ckpt_cli.storage")
# Known exceptions, (module, imported): none left.
KNOWN: set[tuple[str, str]] = set()
# Lazy (function-level) imports from formats/ that reach up: none left (the tie finder,
# formats/ties.py, samples bytes with formats-level reads).
KNOWN_LAZY: set[tuple[str, str]] = set()


def _modules() -> list[tuple[str, Path]]:
    out = []
    for p in sorted(ROOT.rglob("*.py")):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((".".join(parts), p))
    return out


def _imports(name: str, path: Path) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` for every import of ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    top |= {id(n) for s in tree.body if isinstance(s, ast.If) for n in s.body}  # TYPE_CHECKING
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            found.append((mod, id(node) in top))
            # "from ckpt_cli import ties" imports a module too
            found += [(f"{mod}.{a.name}", id(node) in top) for a in node.names
                      if mod == "ckpt_cli"]
    return [(m, t) for m, t in found if m == "ckpt_cli" or m.startswith("ckpt_cli.")]


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


MODULES = _modules()


@pytest.mark.parametrize(("name", "path"), MODULES, ids=[n for n, _ in MODULES])
def test_layer_rules(name: str, path: Path) -> None:
    if not name.endswith("__main__"):  # running it is the CLI
        importlib.import_module(name)
    bad = []
    for mod, top in _imports(name, path):
        if mod in ("ckpt_cli.__init__", "ckpt_cli"):
            continue
        if _under(name, "ckpt_cli.formats") and not any(_under(mod, a)
                                                         for a in FORMATS_MAY_IMPORT):
            if top or (name, mod) not in KNOWN_LAZY:
                bad.append(f"{name} imports {mod}")
        if _under(name, "ckpt_cli.ops") and (_under(mod, "ckpt_cli.render")
                                             or _under(mod, "ckpt_cli.cli")):
            bad.append(f"{name} imports {mod}")
        if _under(name, "ckpt_cli.render") and _under(mod, "ckpt_cli.cli"):
            bad.append(f"{name} imports {mod}")
    bad = [b for b in bad if tuple(b.split(" imports ")) not in KNOWN
           and not any(b.startswith(f"{k} imports {v}") for k, v in KNOWN)]
    assert not bad, bad


def test_ops_do_not_import_each_other() -> None:
    """No command's op module imports another command's op module."""
    ops = {n for n, _ in MODULES if n.startswith("ckpt_cli.ops.") and n.count(".") == 2}
    bad = []
    for name, path in MODULES:
        if not _under(name, "ckpt_cli.ops"):
            continue
        mine = ".".join(name.split(".")[:3])
        for mod, _ in _imports(name, path):
            theirs = ".".join(mod.split(".")[:3])
            if theirs in ops and theirs != mine and (name, theirs) not in OPS_KNOWN:
                bad.append(f"{name} imports {mod}")
    assert not bad, bad


# plan builds on inspect's summary and prune on validate's rank checks (another helper owns
# ops/plan.py and ops/prune.py; see the report of #14 item 3).
OPS_KNOWN = {("ckpt_cli.ops.plan", "ckpt_cli.ops.inspect"),
             ("ckpt_cli.ops.prune", "ckpt_cli.ops.validate")}


def test_the_check_sees_imports() -> None:
    """The checker itself finds relative, lazy and ``from ckpt_cli import x`` imports."""
    found = dict(_imports("ckpt_cli.formats", ROOT / "formats" / "__init__.py"))
    assert found["ckpt_cli.formats.base"] is True
    assert found["ckpt_cli.formats.ties"] is False
