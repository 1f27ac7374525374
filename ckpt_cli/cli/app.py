"""The ``ckpt`` application: wires each command module to a subcommand."""


import functools
import importlib
import inspect
import os
import re
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperArgument, TyperCommand

from ckpt_cli import storage
from ckpt_cli.cli.errors import json_errors, note_terminated, refused, worded
from ckpt_cli.cli.options import Refused
from ckpt_cli.errors import CkptError

# Each subcommand, in --help's order: its name, and the module and function that implement it.
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("inspect", "inspect", "inspect_cmd"), ("validate", "validate", "validate_cmd"),
    ("diff", "diff", "diff_cmd"), ("stats", "stats", "stats_cmd"),
    ("convert", "convert", "convert_cmd"),
    ("consolidate", "consolidate", "consolidate_cmd"), ("prune", "prune", "prune_cmd"),
    ("plan", "plan", "plan_cmd"), ("sample", "sample", "sample_cmd"),
    ("watch", "watch", "watch_cmd"), ("resume-path", "watch", "resume_path_cmd"))


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


def _metavar(param: Any) -> str:
    """An argument's name in usage and help: its metavar, else its name in capitals."""
    var = str(param.metavar or (param.name or "").upper())
    if param.nargs != 1:
        var += "..."
    return var if param.required else f"[{var}]"


class CkptCommand(TyperCommand):
    """A command whose ``--help`` reads whole at 80 columns.

    typer 0.27-0.28 print parameters in a table of six columns (marker, long names, short
    names, negative names, metavar, help): at 80 columns the help is squeezed to a few
    characters and long names, metavars and words are cut (``--force,--overw…``,
    ``docs/json-schema…``). Here typer prints the usage and the description, and the
    parameters are two columns: names and metavar, never cut, and the help, wrapped (a word
    longer than its column is folded, never cut). Usage lines name arguments by their
    metavar (``PATH``, ``A B``), not typer's ``{path}``.
    """

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        """``[OPTIONS] A B``: the arguments by metavar."""
        pieces = [self.options_metavar] if self.options_metavar else []
        return pieces + [_metavar(p) for p in self.get_params(ctx)
                         if isinstance(p, TyperArgument)]

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None,
                     **extra: Any) -> Any:
        """Parse ``args``; a value click refuses (a URL :func:`location` cannot use, ``--jobs
        abc``) is one ``ckpt: error:`` line, exit 2, like every other usage error, and for
        ``validate --junit FILE`` a JUnit file naming the error is written as well."""
        # typer 0.27+ carries its own copy of click: its exceptions, not click's, are raised.
        from typer._click import exceptions as click_errors  # heavy: typer

        raw = list(args)
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click_errors.MissingParameter as e:
            if self.name == "validate":
                self._write_junit(raw, e.format_message())
            raise
        except Refused as e:
            # A value one of cli/options.py's parsers refused: worded and reported as the
            # same error raised inside the command would be (its --json document included).
            if self.name == "validate":
                self._write_junit(raw, worded(e.error, self)[2])
            refused(e.error, self.name if "--json" in raw else None, self)
        except click_errors.BadParameter as e:
            self._refused(raw, e.format_message())
        except click_errors.UsageError as e:
            if self.name == "validate" and not isinstance(e, click_errors.NoArgsIsHelpError):
                self._write_junit(raw, e.format_message())
            raise

    def _refused(self, raw: list[str], message: str) -> None:
        from ckpt_cli.storage import redact  # lazy: not loaded by ckpt --help

        if self.name == "validate":
            self._write_junit(raw, message)
        typer.echo(f"ckpt: error: {redact(message)}", err=True)
        raise typer.Exit(2)

    def _write_junit(self, raw: list[str], message: str) -> None:
        """``--junit FILE`` from the raw arguments, written with one failed case (the error)."""
        takes_value = {name for p in self.params if isinstance(p, typer.core.TyperOption)
                       and not p.is_flag for name in p.opts + p.secondary_opts}
        junit, path, i = None, "", 0
        while i < len(raw):
            arg = raw[i]
            if arg.startswith("--junit="):
                junit = arg.split("=", 1)[1]
            elif arg in takes_value:
                if arg == "--junit" and i + 1 < len(raw):
                    junit = raw[i + 1]
                i += 1
            elif not arg.startswith("-") and not path:
                path = arg
            i += 1

        if not junit or junit == "-" or not storage.names_local_path(junit):
            return  # ("-" is refused as a --junit file: no file named "-" either)

        from ckpt_cli.render.junit import (  # lazy: not loaded by ckpt --help
            error_junit_xml,
            write_junit_bytes,
        )

        try:
            write_junit_bytes(error_junit_xml(path, "usage", message), Path(junit))
        except CkptError as e:
            typer.echo(f"ckpt: error: {e}", err=True)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """typer's usage and description, then the parameters in two columns."""
        params: list[Any] = [p for p in self.get_params(ctx) if not getattr(p, "hidden", False)]
        for p in params:  # typer then prints no parameter panels of its own
            p.hidden = True
        try:
            super().format_help(ctx, formatter)
        finally:
            for p in params:
                p.hidden = False
        _print_parameters(ctx, params)


# typer names a metavar-less option's value by its type (``<location>``, ``<int range>``).
_TYPE_NAME = re.compile(r"<([a-z_ ]+)>")
_TYPE_METAVARS = {"location": "PATH", "output_location": "OUT", "output_file": "FILE",
                  "int range": "N", "integer": "N", "float": "X", "float range": "X",
                  "text": "TEXT"}


def _print_parameters(ctx: typer.Context, params: list[Any]) -> None:
    """The Arguments and the Options panels of a command's help."""
    from rich.console import Console  # heavy: rich
    from rich.panel import Panel  # heavy: rich
    from rich.text import Text  # heavy: rich
    from typer import rich_utils  # heavy: typer

    from ckpt_cli.render.human import Col, table  # lazy: not loaded by ckpt --help

    console = Console(width=rich_utils.MAX_WIDTH, force_terminal=rich_utils.FORCE_TERMINAL,
                      color_system=rich_utils.COLOR_SYSTEM, highlight=False)
    for title, kind in (("Arguments", True), ("Options", False)):
        rows = table(Col(kind="value"), Col(kind="text"), show_header=False)
        for p in params:
            record = p.get_help_record(ctx) if isinstance(p, TyperArgument) == kind else None
            if record is None:
                continue
            names, help_text = record
            names = _metavar(p).strip("[]") if kind else _TYPE_NAME.sub(
                lambda m: _TYPE_METAVARS.get(m[1], m[1].upper().replace(" ", "_")), names)
            cell = Text()
            for i, word in enumerate(names.split(" ")):
                flag = word.startswith("-") or word == "/"
                cell.append((" " if i else "") + word,
                            style="bold cyan" if flag and not kind else "bold yellow")
            text, _, tail = help_text.rpartition("  [")
            line = Text(text or help_text)
            if text and tail.endswith("]"):
                line.append(" [" + tail, style="dim")
            rows.add_row(cell, line)
        if rows.rows:
            console.print(Panel(rows, border_style="dim", title=title, title_align="left"))


def _version(value: bool) -> None:
    if value:
        from ckpt_cli import __version__  # lazy: reads package metadata, only for --version

        typer.echo(f"ckpt {__version__}")
        raise typer.Exit()


def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Inspect, validate, diff, convert, consolidate and prune deep-learning checkpoints."""


def build(only: str | None = None) -> typer.Typer:
    """The ``ckpt`` application, with every subcommand or only the one named ``only``.

    typer turns every registered command's signature into click parameters on each run
    (about 2 ms a command), and each command module costs its import: a run that names its
    command builds that one alone. The group, its root options and the command's usage,
    help and errors are the same either way.
    """

    app = typer.Typer(
        name="ckpt",
        help="Inspect, validate, diff, convert, consolidate and prune deep-learning checkpoints.",
        no_args_is_help=True,
        rich_markup_mode="rich",
        context_settings={"help_option_names": ["-h", "--help"]},
        pretty_exceptions_enable=False,
    )
    app.callback()(_root)
    for name, module, function in COMMANDS:
        if only is not None and name != only:
            continue
        command = getattr(importlib.import_module(f"ckpt_cli.cli.{module}"), function)
        # json_errors: a failing command given --json prints an error document on stdout.
        app.command(name, cls=CkptCommand, help=command_help(command.__doc__))(
            json_errors(name, command))
    return app


@functools.cache
def _whole_app() -> typer.Typer:
    return build()


def __getattr__(name: str) -> Any:
    # ``app``: the whole application (tests, docs, completions), built at first use.
    if name == "app":
        return _whole_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def named_command(argv: list[str]) -> str | None:
    """The subcommand a command line names first (``ckpt inspect ...``), else None: root
    options first, no command, an unknown one or shell completion need the whole app."""

    if not argv or any(k.startswith("_CKPT_COMPLETE") for k in os.environ):
        return None
    return argv[0] if argv[0] in {name for name, _, _ in COMMANDS} else None


def main() -> None:
    """Console-script entry point (also ``python -m ckpt_cli``)."""

    # SIGTERM (from cron, a scheduler or `kill`) unwinds like Ctrl-C, so writers clean up.
    def _term(signum: int, frame: object) -> None:
        note_terminated()  # exit 143, not Ctrl-C's 130
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    only = named_command(sys.argv[1:])
    helping = not sys.argv[1:] or bool({"--help", "-h"} & set(sys.argv[1:]))
    piped_to_null = helping and _stdout_is_devnull()  # a stat only when help is asked for
    try:
        (build(only) if only else _whole_app())(prog_name="ckpt")
    except SystemExit as e:
        # typer prints help with rich, whose closed-pipe handler (`ckpt --help | head -1`)
        # points stdout at /dev/null and exits 1, the findings code; the help was asked for
        # and printed as far as the reader wanted it: exit 0. (Commands handle their own
        # closed pipes, cli/errors.py.)
        if e.code == 1 and helping and not piped_to_null and _stdout_is_devnull():
            raise SystemExit(0) from None
        raise


def _stdout_is_devnull() -> bool:
    """Whether stdout was pointed at /dev/null (what a closed pipe's handler does)."""

    try:
        st, null = os.fstat(sys.__stdout__.fileno()), os.stat(os.devnull)  # type: ignore[union-attr]
    except (OSError, ValueError, AttributeError):
        return False
    return (st.st_rdev, st.st_ino) == (null.st_rdev, null.st_ino)
