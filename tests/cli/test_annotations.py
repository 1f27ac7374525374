"""The command modules keep real annotations: typer reads every command's signature on every
run, and string annotations (``from __future__ import annotations``) would make it compile and
evaluate each of them again."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import ckpt_cli.cli as cli_pkg
from ckpt_cli.cli.app import app

CLI_DIR = Path(cli_pkg.__file__).parent
COMMAND_MODULES = sorted({inspect.getmodule(c.callback).__name__  # type: ignore[union-attr]
                          for c in app.registered_commands if c.callback is not None})


def _future_annotations(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
               and any(a.name == "annotations" for a in n.names) for n in tree.body)


def test_every_command_is_found() -> None:
    assert len(COMMAND_MODULES) >= 9
    assert "ckpt_cli.cli.inspect" in COMMAND_MODULES


@pytest.mark.parametrize("module", [*COMMAND_MODULES, "ckpt_cli.cli.app"])
def test_command_module_has_no_future_annotations(module: str) -> None:
    path = CLI_DIR / f"{module.rsplit('.', 1)[1]}.py"
    assert not _future_annotations(path), f"{path.name}: drop `from __future__ import annotations`"


def test_command_signatures_hold_objects_not_strings() -> None:
    for c in app.registered_commands:
        assert c.callback is not None
        for p in inspect.signature(c.callback).parameters.values():
            assert not isinstance(p.annotation, str), (c.callback.__name__, p.name)


def _type_checking_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    names |= {a.asname or a.name.split(".")[0] for a in stmt.names}
    return names


def _evaluated_annotations(tree: ast.Module) -> list[tuple[int, ast.expr]]:
    """Annotations Python evaluates at run time in a module without the future import: every
    def's parameters and return (nested defs included, evaluated when the def runs) and
    module- or class-level variable annotations (a function's local ones are never evaluated)."""
    found: list[tuple[int, ast.expr]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                found.extend((child.lineno, p.annotation) for p in params
                             if p is not None and p.annotation is not None)
                if child.returns is not None:
                    found.append((child.lineno, child.returns))
                visit(child, True)
            elif isinstance(child, ast.AnnAssign) and not in_function:
                found.append((child.lineno, child.annotation))
            elif isinstance(child, ast.Lambda):
                continue
            else:
                visit(child, in_function)

    visit(tree, False)
    return found


@pytest.mark.parametrize("path", sorted(CLI_DIR.glob("*.py")), ids=lambda p: p.name)
def test_type_checking_names_are_quoted_where_python_evaluates_them(path: Path) -> None:
    """A name imported only for the type checker, used bare in an annotation Python evaluates,
    is a NameError when that line runs (a nested ``def emit(ev: WatchEvent)`` broke
    ``ckpt watch`` this way)."""
    tree = ast.parse(path.read_text())
    if _future_annotations(path):
        return
    hidden = _type_checking_names(tree)
    bare = [(line, n.id) for line, ann in _evaluated_annotations(tree)
            for n in ast.walk(ann) if isinstance(n, ast.Name) and n.id in hidden]
    assert not bare, f"{path.name}: quote these annotations: {bare}"
