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


DOCS_PAGES = sorted((ROOT / "docs").rglob("*.md"))
WORD_LIMIT = 1250


@pytest.mark.parametrize("page", DOCS_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_docs_page_is_short(page: Path) -> None:
    """A page a reader finishes: at most 1,250 words (as ``wc -w`` counts: runs of
    non-whitespace); a longer one is split by topic into pages that link each other (issue 46)."""
    words = len(page.read_text().split())
    assert words <= WORD_LIMIT, (
        f"{page.relative_to(ROOT)} has {words:,} words (limit {WORD_LIMIT:,}): split it")


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS_PAGES],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files(page: Path) -> None:
    """Every relative markdown link (``[text](path)``, ``(path#anchor)``) names a file or
    directory that exists, and an anchor a heading of that page (pages split by topic keep
    their links working)."""
    broken = _broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)} links to nothing: {broken}"


def test_the_link_check_sees_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "there.md").write_text("# Title\n\n## A heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](sub/there.md) [ok](sub/there.md#a-heading) [ok](https://x.org/y.md) "
                    "[gone](sub/gone.md) [bad anchor](sub/there.md#nothing) [ok](#local)\n")
    assert _broken_links(page) == ["sub/gone.md", "sub/there.md#nothing"]


def _broken_links(page: Path) -> list[str]:
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor of this page
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve()
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    return broken


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_ci_runs_the_linters_then_the_readme_test_command() -> None:
    """``.ci/run`` lints (ruff over the package, tests and benchmarks; mypy --strict) after
    installing, then ends with the test command README.md states, as written there; no test
    module runs the linters."""
    blocks = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    readme_cmd = blocks[blocks.index("./.ci/run") + 1]
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[-1] == readme_cmd == "python -m pytest -q", (lines[-1], readme_cmd)
    install = max(i for i, ln in enumerate(lines) if "pip install" in ln)
    ruff = lines.index("python -m ruff check ckpt_cli tests bench")
    mypy = lines.index("python -m mypy")
    assert install < ruff < len(lines) - 1 and install < mypy < len(lines) - 1
    assert not list((ROOT / "tests").rglob("test_lint*.py"))
