"""The ``ckpt`` application: wires each command module to a subcommand."""

from __future__ import annotations

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
    app.command(_name)(json_errors(_name, _command))


def main() -> None:
    """Console-script entry point (also ``python -m ckpt_cli``)."""
    import signal

    # SIGTERM (from cron, a scheduler or `kill`) unwinds like Ctrl-C, so writers clean up.
    def _term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    app(prog_name="ckpt")
