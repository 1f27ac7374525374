"""Every command has help text, examples, and a place in the README."""

from __future__ import annotations

import re
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


def test_sample_duration_is_the_same_in_help_and_readme() -> None:
    """One measured figure, not "about 15 seconds" in one place and "15-60 s" in another."""
    r = run_cli("sample", "--help")
    said = re.search(r"Takes (\d+-\d+) seconds", " ".join(r.stdout.split()))
    assert said, r.stdout
    assert f"ckpt sample demo-run            # {said[1]} s;" in README
    assert f"It takes {said[1]} seconds" in README


def test_quick_start_leaves_nothing_for_git() -> None:
    """The quick start's ``ckpt sample demo-run`` writes into the clone: git ignores it; and
    no stray empty file sits at the repository's root."""
    root = Path(__file__).parent.parent
    dest = re.search(r"ckpt sample (\S+) && ckpt inspect", README)
    assert dest, "the quick start runs ckpt sample"
    ignored = (root / ".gitignore").read_text().split()
    assert f"{dest[1].rstrip('/')}/" in ignored
    assert not [p.name for p in root.iterdir() if p.is_file() and p.stat().st_size == 0]
