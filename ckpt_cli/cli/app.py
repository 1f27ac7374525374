"""The ``ckpt`` application: wires each command module to a subcommand."""

from __future__ import annotations

import inspect
from typing import Annotated

import typer

from ckpt_cli import __version__
from ckpt_cli.cli.consolidate import consolidate_cmd
from ckpt_cli.cli.convert import convert_cmd
from ckpt_cli.cli.diff import diff_cmd
from ckpt_cli.cli.errors import json_errors
from ckpt_cli.cli.inspect import inspect_cmd
from ckpt_cli.cli.plan import plan_cmd
from ckpt_cli.cli.prune import prune_cmd
from ckpt_cli.cli.sample import sample_cmd
from ckpt_cli.cli.validate import validate_cmd

app = typer.Typer(
    name="ckpt",
    help="Inspect, validate, diff, convert, consolidate and prune deep-learning checkpoints.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)


def command_help(doc: str | None) -> str:
    """A command's docstring as the help text typer prints, with its paragraphs flowed.

    Docstrings are hard-wrapped at the source's line length. In rich markup mode typer keeps
    every line break after the first paragraph, so at any other terminal width lines would
    break mid-sentence. Here the lines of a paragraph are joined (rich then wraps them to the
    terminal); an indented line (an example, a table row) stays a line of its own, so write
    examples indented and keep them short enough for 80 columns (76 characters).

    Args:
        doc: The docstring (None: no help).

    Returns:
        Paragraphs separated by blank lines, each one line of prose, plus indented lines.
    """
    paragraphs = []
    for paragraph in inspect.cleandoc(doc or "").split("\n\n"):
        lines: list[str] = []
        for line in paragraph.splitlines():
            if lines and not line[:1].isspace() and not lines[-1][:1].isspace():
                lines[-1] += " " + line.strip()
            else:
                lines.append(line.rstrip())
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ckpt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Inspect, validate, diff, convert, consolidate and prune deep-learning checkpoints."""


for _name, _command in (("inspect", inspect_cmd), ("validate", validate_cmd),
                        ("diff", diff_cmd), ("convert", convert_cmd),
                        ("consolidate", consolidate_cmd), ("prune", prune_cmd),
                        ("plan", plan_cmd), ("sample", sample_cmd)):
    # json_errors: a failing command given --json prints an error document on stdout.
    app.command(_name, help=command_help(_command.__doc__))(json_errors(_name, _command))


def main() -> None:
    """Console-script entry point (also ``python -m ckpt_cli``)."""
    import signal

    # SIGTERM (from cron, a scheduler or `kill`) unwinds like Ctrl-C, so writers clean up.
    def _term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    app(prog_name="ckpt")
