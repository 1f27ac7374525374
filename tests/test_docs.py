"""Every command has help text, examples, a page in docs/ that documents each of its options,
and a place in the README, which stays short (issue 39)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckpt_cli.cli.app import app
from tests.conftest import run_cli

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
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
    assert f"(docs/{name}.md)" in README, f"README.md does not link docs/{name}.md"


def _options(name: str) -> list[str]:
    import typer

    from ckpt_cli.cli.app import build

    cmd = typer.main.get_command(build(name)).commands[name]  # type: ignore[attr-defined]
    return [o for p in cmd.params if p.param_type_name == "option" and not p.hidden
            for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_is_documented_on_its_page(name: str) -> None:
    """A command or option that no page documents fails here."""
    page = ROOT / "docs" / f"{name}.md"
    assert page.is_file(), f"no docs/{name}.md"
    text = page.read_text()
    missing = [o for o in _options(name) if f"`{o}`" not in text]
    assert not missing, f"docs/{name}.md does not document {missing}"


def test_readme_is_short_and_links_every_page() -> None:
    assert len(README.splitlines()) <= 300
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in README, f"README.md does not link docs/{page.name}"


def test_version_is_the_package_metadata() -> None:
    from importlib.metadata import version

    r = run_cli("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"ckpt {version('ckpt-cli')}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{version("ckpt-cli")}"' in pyproject
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{version('ckpt-cli')}] - " in changelog


def test_readme_has_the_two_newcomer_commands() -> None:
    assert "./.ci/run" in README or ".ci/run" in README
    assert "ckpt sample" in README and "ckpt inspect" in README


def test_sample_duration_is_the_same_in_help_and_readme() -> None:
    """One measured figure, not "about 15 seconds" in one place and "15-60 s" in another."""
    r = run_cli("sample", "--help")
    said = re.search(r"Takes (\d+-\d+) seconds", " ".join(r.stdout.split()))
    assert said, r.stdout
    page = (ROOT / "docs" / "sample.md").read_text()
    assert f"ckpt sample demo-run            # {said[1]} s;" in page
    assert f"It takes {said[1]} seconds" in page


def test_quick_start_leaves_nothing_for_git() -> None:
    """The quick start's ``ckpt sample demo-run`` writes into the clone: git ignores it; and
    no stray empty file sits at the repository's root."""
    root = Path(__file__).parent.parent
    dest = re.search(r"ckpt sample (\S+) && ckpt inspect", README)
    assert dest, "the quick start runs ckpt sample"
    ignored = (root / ".gitignore").read_text().split()
    assert f"{dest[1].rstrip('/')}/" in ignored
    assert not [p.name for p in root.iterdir() if p.is_file() and p.stat().st_size == 0]
