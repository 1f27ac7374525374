"""Turning errors into one line on stderr and a conventional exit code."""

from __future__ import annotations

import errno
import functools
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from typing import Any, NoReturn

import typer

from ckpt_cli import storage
from ckpt_cli.errors import CkptError, reworded, visible

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
# The command refused to act because acting could be wrong (prune: what training resumes from
# cannot be told, or no checkpoint is known good); nothing was changed.
EXIT_REFUSED = 3
EXIT_INTERNAL = 101
EXIT_INTERRUPTED = 130
# 128 + SIGTERM: stopped by a scheduler, a job's end or `kill` (SIGINT, Ctrl-C, is 130).
EXIT_TERMINATED = 143
_terminated = False


def note_terminated() -> None:
    """Record that SIGTERM arrived (main's handler, which then unwinds like Ctrl-C)."""
    global _terminated
    _terminated = True


def interrupted_code() -> int:
    """The exit code of a command a signal stopped: 143 after SIGTERM, 130 after Ctrl-C."""
    return EXIT_TERMINATED if _terminated else EXIT_INTERRUPTED
# 128 + SIGPIPE, what a shell reports for a program a closed pipe stopped: the output was cut
# short before the command knew its result.
EXIT_BROKEN_PIPE = 141
# OS errors that say the machine's limits were reached, not that ckpt has a bug.
_ENVIRONMENT_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ENOSPC, errno.EDQUOT, errno.EMFILE,
                                 errno.ENFILE, errno.EROFS, errno.EACCES, errno.EPERM,
                                 errno.EIO, errno.ELOOP})


def _say(text: str) -> None:
    # A credential must never reach a terminal or a CI log; a file name's escape sequences
    # are shown, not obeyed.
    text = visible(storage.redact(text), lines=False)  # one line, whatever a name holds
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):
        pass


# The running command's name while it runs with --json (set by json_errors), else None.
_JSON_COMMAND: ContextVar[str | None] = ContextVar("ckpt_json_command", default=None)


def json_errors(name: str, command: Callable[..., None]) -> Callable[..., None]:
    """Register a command's name, so that :func:`handled` can print its ``--json`` errors.

    Wraps the command function (typer reads the signature and help through the wrapper);
    while it runs with its ``json`` parameter true, a failure inside :func:`handled` also
    prints the error document. One call per command, in the app's wiring.

    Args:
        name: The command's name, as the documents' ``command``.
        command: The typer command function.

    Returns:
        The wrapped function.
    """

    @functools.wraps(command)
    def run(**kwargs: Any) -> None:
        token = _JSON_COMMAND.set(name if kwargs.get("json") else None)
        try:
            command(**kwargs)
        finally:
            _JSON_COMMAND.reset(token)

    return run


class _JsonErrors:
    """Prints a failing ``--json`` command's error document, unless it printed one already."""

    def __init__(self) -> None:
        self.command = _JSON_COMMAND.get()
        self.before = 0
        if self.command is not None:
            from ckpt_cli.render import json as rj  # lazy: not loaded by ckpt --help

            self.before = rj.emitted()

    def emit(self, kind: str, message: str, exit_code: int, *, path: str | None = None,
             side: str | None = None, hint: str | None = None, text: str | None = None) -> None:
        if self.command is None:
            return
        from ckpt_cli.render import json as rj  # lazy: not loaded by ckpt --help

        if rj.emitted() != self.before:
            return  # its document is out (or half out): a second one would break the output
        def r(value: str | None) -> str | None:
            return None if value is None else storage.redact(value)

        with suppress(OSError, ValueError):
            rj.emit_error(self.command, {"kind": kind, "message": r(message), "path": r(path),
                                         "side": side, "hint": r(hint),
                                         "text": r(text if text is not None else message)},
                          exit_code)


# Library parameters whose command-line option has another name, per command: the library's
# name (an options-dataclass field, a function parameter) -> the command function's parameter,
# whose flag click knows ("*": every command). Every other library name is the command's
# parameter of that name.
_CLI_NAMES: dict[str, dict[str, str]] = {
    "*": {"storage_options": "storage_option", "allow_globals": "allow_global",
          "filter_glob": "name_glob", "everything": "all_tensors"},
    "validate": {"manifest_algorithm": "manifest_hash", "fmt": "input_format"},
    "inspect": {"fmt": "input_format"},
    "convert": {"fmt": "output_format"},
    "consolidate": {"fmt": "output_format"},
}

# Library parameters the messages word by a short flag.
_SHORT = {"output": "-o"}


def _flags(command: Any, names: Iterable[str]) -> dict[str, str]:
    """Library parameter name -> the flag that sets it, for a click command (else empty).

    A name in ``names`` the command has no option for (a hint naming another command's flag:
    prune's ``--keep-best`` in a retention rule ``watch`` shares) is worded by the rule the
    options follow: ``--`` and the name with dashes (``keep_best`` -> ``--keep-best``), after
    the aliases every command shares. (A run builds only the command it names: the others'
    options cannot be asked.)
    """
    if command is None:
        return {}
    flags: dict[str, str] = {}
    for p in command.params:
        if p.param_type_name == "option" and p.name and p.opts:
            flags[p.name] = next((o for o in p.opts if o.startswith("--")), p.opts[0])
    for aliases in (_CLI_NAMES["*"], _CLI_NAMES.get(command.name or "", {})):
        for library, cli in aliases.items():
            if cli in flags:
                flags[library] = flags[cli]
    flags.update((name, short) for name, short in _SHORT.items() if name in flags)
    for name in names:
        if name not in flags:
            flags[name] = "--" + _CLI_NAMES["*"].get(name, name).replace("_", "-")
    return flags


def _worded(text: str | None, names: Iterable[str], flags: dict[str, str]) -> str | None:
    """``text`` with each whole-word parameter name in ``names`` replaced by its flag (see
    :func:`ckpt_cli.errors.reworded`)."""
    return reworded(text, {n: flags[n] for n in names if n in flags})


def _current_context() -> Any:
    """The click context running now, if any."""
    # typer 0.27+ carries its own copy of click: its context, not click's, is the current one.
    from typer._click.globals import get_current_context  # heavy: typer

    return get_current_context(silent=True)


def worded(e: CkptError, command: Any = None) -> tuple[str, str | None, str]:
    """An error's message, hint and whole line as the command line words them.

    A library error names library parameters (``max_memory``, listed in ``e.params``); here
    they become the command's flags (``--max-memory``).

    Args:
        e: The error.
        command: The click command whose flags to use; by default the one running now.

    Returns:
        ``(message, hint, text)``: ``e.message``, ``e.hint`` and ``str(e)``, flags in place
        of parameter names.
    """
    message, hint, text = e.message, e.hint, str(e)
    if e.params:
        if command is None:
            ctx = _current_context()
            command = None if ctx is None else ctx.command
        flags = _flags(command, e.params)
        message = _worded(message, e.params, flags) or ""
        hint = _worded(hint, e.params, flags)
        text = text[:len(text) - len(e.message)] + message
    return message, hint, text


def _report(e: CkptError, doc: _JsonErrors, command: Any = None) -> NoReturn:
    """A ckpt error: its line (and hint) on stderr, its ``--json`` document, its exit code."""
    message, hint, text = worded(e, command)
    _say(f"ckpt: error: {text}")
    if hint:
        _say(f"hint: {hint}")
    doc.emit(e.kind, message, e.exit_code, path=e.path, side=e.side, hint=hint, text=text)
    raise typer.Exit(e.exit_code) from None


def refused(error: CkptError, command: str | None, cli: Any = None) -> NoReturn:
    """Report an option value refused while the command line was parsed (see
    :mod:`ckpt_cli.cli.options`) exactly as :func:`handled` reports the same error raised
    inside the command.

    Args:
        error: The parser's error.
        command: The command's name when it was given ``--json``, else None.
        cli: The click command whose line was parsed (to word parameters as its flags).

    Raises:
        typer.Exit: Always, with the error's exit code.
    """
    token = _JSON_COMMAND.set(command)
    try:
        _report(error, _JsonErrors(), cli)
    finally:
        _JSON_COMMAND.reset(token)


class Outcome:
    """A command's exit status, set as soon as its result is known (before it is printed).

    Attributes:
        exit_code: The status the command ends with, or None while it is still working.
    """

    def __init__(self) -> None:
        self.exit_code: int | None = None


@contextmanager
def handled() -> Iterator[Outcome]:
    """Run a command body, mapping failures to one stderr line and an exit code.

    ``CkptError`` -> its message (and hint) and ``exit_code``; Ctrl-C -> 130; a closed pipe
    -> quiet exit with the status the command had decided on (``Outcome.exit_code``: a
    ``validate`` with findings piped into ``head`` still exits 1), or 141 when it was cut
    short before knowing it; ``MemoryError`` -> one line, 2; anything else -> 101 with the
    traceback only under ``CKPT_DEBUG=1``. When the command was given ``--json`` and has not
    printed its document, a failure also prints one on stdout:
    ``{schema_version, command, error: {...}, exit_code}``.

    Yields:
        The command's :class:`Outcome`: set ``exit_code`` once the result is known, before
        rendering it, and exit with it after the block.

    Raises:
        typer.Exit: Always, on failure.
    """
    doc = _JsonErrors()
    outcome = Outcome()
    try:
        yield outcome
    except (typer.Exit, typer.Abort):
        raise
    except CkptError as e:
        _report(e, doc)
    except KeyboardInterrupt:
        _say("ckpt: interrupted")
        doc.emit("interrupted", "interrupted", interrupted_code())
        raise typer.Exit(interrupted_code()) from None
    except BrokenPipeError:
        # Output piped into `head` and the like: not an error of ours. Whatever is still
        # buffered (on stdout, or on stderr when it shares the pipe: `2>&1 | head`) goes
        # nowhere, so that flushing it at exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            with suppress(OSError, ValueError):
                os.dup2(devnull, stream.fileno())
        code = outcome.exit_code
        raise typer.Exit(EXIT_BROKEN_PIPE if code is None else code) from None
    except MemoryError as e:
        # The machine's (or ulimit's) memory ran out: a limit, not a bug. Operations that
        # know which tensor it was raise a CkptError naming it; this is the fallback.
        detail = f" ({e})" if str(e) else ""
        _say(f"ckpt: error: out of memory{detail}")
        _say("hint: free memory or raise the limit (ulimit -v)")
        doc.emit("memory", f"out of memory{detail}", EXIT_USAGE,
                 hint="free memory or raise the limit (ulimit -v)")
        raise typer.Exit(EXIT_USAGE) from None
    except Exception as e:
        if isinstance(e, OSError) and e.errno in _ENVIRONMENT_ERRNOS:
            # Limits of the machine, not bugs: a path beyond PATH_MAX, a full disk, too many
            # open files. One line naming the file, exit 2.
            where = f"{e.filename}: " if isinstance(e.filename, str) else ""
            _say(f"ckpt: error: {where}{e.strerror}")
            doc.emit("os", e.strerror or str(e), EXIT_USAGE,
                     path=e.filename if isinstance(e.filename, str) else None,
                     text=f"{where}{e.strerror}")
            raise typer.Exit(EXIT_USAGE) from None
        if os.environ.get("CKPT_DEBUG"):
            raise
        _say(f"ckpt: internal error: {type(e).__name__}: {e} "
             "(set CKPT_DEBUG=1 for the traceback, and please report it)")
        doc.emit("internal", f"{type(e).__name__}: {e}", EXIT_INTERNAL)
        raise typer.Exit(EXIT_INTERNAL) from None
