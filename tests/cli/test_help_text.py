"""``--help`` flows: prose fills each line, examples and tables keep theirs.

Docstrings are hard-wrapped at the source's line length; rendered at another width, every such
break must be gone (a line never ends early when the next word would have fitted), while each
example stays whole on its own line.
"""

from __future__ import annotations

import inspect
import itertools
import re
from typing import Any

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from ckpt_cli.cli.app import app, command_help

COMMANDS = sorted(c.name for c in app.registered_commands if c.name)
WIDTHS = (80, 120)


def _help(args: list[str], width: int) -> list[str]:
    # LINES too: with both set rich takes the size as given, even if it thinks it is a
    # dumb terminal (TERM=dumb with FORCE_COLOR in CI would otherwise mean 80 columns).
    r = CliRunner().invoke(app, [*args, "--help"],
                           env={"NO_COLOR": "1", "COLUMNS": str(width), "LINES": "50"})
    assert r.exit_code == 0, r.output
    return r.stdout.splitlines()


def _description(lines: list[str]) -> list[str]:
    """The lines between ``Usage:`` and the first panel: the command's docstring."""
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("Usage:"))
    end = next(i for i, line in enumerate(lines) if line.startswith("╭"))
    return lines[start + 1:end]


def _verbatim(doc: str) -> list[str]:
    """The docstring's indented lines: examples and tables, each to be shown as one line."""
    return [line.strip() for line in inspect.cleandoc(doc).splitlines()
            if line[:1].isspace() and line.strip()]


def _doc(name: str) -> str:
    command = next(c for c in app.registered_commands if c.name == name)
    assert command.callback is not None and command.callback.__doc__
    return command.callback.__doc__


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", COMMANDS)
def test_prose_flows_to_the_width(name: str, width: int) -> None:
    lines = _description(_help([name], width))
    # typer pads the text one column on each side: it may fill columns 1 to width - 2.
    assert max(len(line.rstrip()) for line in lines) <= width - 1
    for line, following in itertools.pairwise(lines):
        if not line.strip() or not following.strip() or following.startswith("   "):
            continue  # a paragraph's end, or the next line is an example or a table row
        word = following.split()[0]
        assert len(line.rstrip()) + 1 + len(word) > width - 1, (
            f"`ckpt {name} --help` at {width} columns breaks a line before {word!r}, which "
            f"fits:\n{line.rstrip()}\n{following.rstrip()}")


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", COMMANDS)
def test_examples_stay_one_per_line(name: str, width: int) -> None:
    lines = [line.strip() for line in _description(_help([name], width))]
    examples = _verbatim(_doc(name))
    assert any(e.startswith(f"ckpt {name} ") for e in examples)
    for example in examples:
        assert example in lines, f"`ckpt {name} --help` at {width} columns splits {example!r}"


@pytest.mark.parametrize("width", WIDTHS)
def test_root_help_fits(width: int) -> None:
    lines = _help([], width)
    assert max(len(line.rstrip()) for line in lines) <= width
    assert any(line.strip().startswith("Usage: ckpt") for line in lines)


def test_command_help_joins_paragraph_lines_and_keeps_indented_ones() -> None:
    doc = """Summary line.

    A paragraph hard-wrapped
    in the source, over
    three lines.

    Examples:
      ckpt a --one
      ckpt b --two
    Trailing prose
    after the examples.
    """
    assert command_help(doc) == (
        "Summary line.\n\n"
        "A paragraph hard-wrapped in the source, over three lines.\n\n"
        "Examples:\n  ckpt a --one\n  ckpt b --two\nTrailing prose after the examples.")


def _params(name: str) -> list[Any]:
    command = typer.main.get_command(app)
    ctx = command.make_context("ckpt", [name, "--help"], resilient_parsing=True)
    sub = command.get_command(ctx, name)  # type: ignore[attr-defined]
    return [p for p in sub.get_params(sub.make_context(name, [], parent=ctx,
                                                       resilient_parsing=True))
            if not getattr(p, "hidden", False)]


@pytest.mark.parametrize("name", COMMANDS)
def test_help_reads_whole_at_80_columns(name: str) -> None:
    """Nothing cut (``--force,--overw…``, ``docs/json-schema…``), no metavar split over
    lines (``adafact`` / ``or``): every option name, metavar and word of help is whole."""
    lines = _help([name], 80)
    text = "\n".join(lines)
    assert "…" not in text
    assert max(len(line.rstrip()) for line in lines) <= 80
    words = {w for line in lines for w in line.replace("│", " ").split()}
    for p in _params(name):
        for opt in [*p.opts, *p.secondary_opts]:
            if opt.startswith("-"):
                assert opt.rstrip(",") in words or f"{opt}," in words, (name, opt)
        if p.metavar:
            assert p.metavar in words, (name, p.metavar)
        for word in (getattr(p, "help", None) or "").split():
            assert word in words, f"`ckpt {name} --help` at 80 columns breaks {word!r}"
    # <output_location> (convert/consolidate -o) slipped past a pattern without "_".
    assert not re.search(r"<[a-z_ ]+>", text), "a type placeholder instead of a metavar"


@pytest.mark.parametrize("name", COMMANDS)
def test_usage_names_arguments_by_metavar(name: str) -> None:
    usage = next(line.strip() for line in _help([name], 80) if "Usage:" in line)
    assert re.fullmatch(rf"Usage: ckpt {name} \[OPTIONS\]( \[?[A-Z][A-Z_]*(\.\.\.)?\]?)*",
                        usage), usage
    want = {"diff": "A B", "inspect": "PATH", "validate": "PATH", "convert": "SOURCE",
            "consolidate": "SOURCE", "prune": "RUN_DIR", "sample": "DEST", "plan": "",
            "watch": "RUN_DIR", "resume-path": "RUN_DIR", "stats": "PATH"}
    assert usage.removeprefix(f"Usage: ckpt {name} [OPTIONS]").strip() == want[name]


def test_root_help_reads_whole() -> None:
    text = "\n".join(_help([], 80))
    assert "…" not in text and "{" not in text
