"""Turning errors into one line on stderr and a conventional exit code."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import typer

from ckpt_cli.errors import CkptError

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 101
EXIT_INTERRUPTED = 130


def _say(text: str) -> None:
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):
        pass


@contextmanager
def handled() -> Iterator[None]:
    """Run a command body, mapping failures to one stderr line and an exit code.

    ``CkptError`` -> its message (and hint) and ``exit_code``; Ctrl-C -> 130; a closed pipe
    -> quiet exit; anything else -> 101 with the traceback only under ``CKPT_DEBUG=1``.

    Raises:
        typer.Exit: Always, on failure.
    """
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except CkptError as e:
        _say(f"ckpt: error: {e}")
        if e.hint:
            _say(f"hint: {e.hint}")
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        _say("ckpt: interrupted")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except BrokenPipeError:
        # Output piped into `head` and the like: not an error of ours. Whatever is still
        # buffered (on stdout, or on stderr when it shares the pipe: `2>&1 | head`) goes
        # nowhere, so that flushing it at exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            with suppress(OSError, ValueError):
                os.dup2(devnull, stream.fileno())
        raise typer.Exit(EXIT_OK) from None
    except Exception as e:
        if os.environ.get("CKPT_DEBUG"):
            raise
        _say(f"ckpt: internal error: {type(e).__name__}: {e} "
             "(set CKPT_DEBUG=1 for the traceback, and please report it)")
        raise typer.Exit(EXIT_INTERNAL) from None
