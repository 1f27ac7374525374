"""Every command has help text, examples, and a place in the README."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_cli.cli.app import app
from tests.conftest import run_cli

README = (Path(__file__).parent.parent / "README.md").read_text()
COMMANDS = sorted(c.name for c in app.registered_commands if c.name)


def test_commands_registered() -> None:
    assert {"inspect", "sample"} <= set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_command_has_help_and_examples(name: str) -> None:
    r = run_cli(name, "--help")
    assert r.exit_code == 0
    assert "Examples" in r.stdout
    assert f"ckpt {name}" in r.stdout


@pytest.mark.parametrize("name", COMMANDS)
def test_command_in_readme(name: str) -> None:
    assert f"ckpt {name}" in README, f"README.md does not mention `ckpt {name}`"


def test_readme_has_the_two_newcomer_commands() -> None:
    assert "./.ci/run" in README or ".ci/run" in README
    assert "ckpt sample" in README and "ckpt inspect" in README
