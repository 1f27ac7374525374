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
