"""``ckpt watch --on-bad``: run the user's command for a bad checkpoint, never through a shell.

The command is split with :func:`shlex.split` and gets the checkpoint's path only in its
environment (``CKPT_BAD_PATH``, ``CKPT_RUN_DIR``); it runs in a session of its own, and past its
timeout its whole process group is killed. :class:`HookResult` says how it ended.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli.optionspec import Caller, spelled

BAD_ENV = "CKPT_BAD_PATH"


@dataclass(frozen=True, slots=True)
class HookResult:
    """How an ``--on-bad`` command ended.

    Attributes:
        command: Its first word (argv[0]), as given.
        status: Its exit status (negative: the signal that ended it); None when it could not
            be started.
        timed_out: It ran past its timeout and was killed.
        error: Why it could not be started (the OS's message), else None.
    """

    command: str
    status: int | None = None
    timed_out: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        """It started, finished in time and exited 0."""
        return self.status == 0 and not self.timed_out and self.error is None

    def describe(self, caller: Caller = "python") -> str:
        """One phrase saying what went wrong (or that it exited 0), naming the option as
        ``caller`` does (``--on-bad`` or ``on_bad``)."""
        if self.error is not None:
            text = f"`on_bad` command {self.command!r} could not be started: {self.error}"
        elif self.timed_out:
            text = f"`on_bad` command {self.command!r} timed out and was killed"
        elif self.status is not None and self.status < 0:
            text = f"`on_bad` command {self.command!r} was ended by signal {-self.status}"
        else:
            text = f"`on_bad` command {self.command!r} exited with status {self.status}"
        return text.replace("`on_bad`", spelled("on_bad", caller), 1)

    def to_json(self) -> dict[str, Any]:
        """The outcome as a JSON object."""
        return {"command": self.command, "status": self.status, "timed_out": self.timed_out,
                "error": self.error}


def run_on_bad(command: str, path: Path, run: Path, *, timeout: float = 300.0) -> HookResult:
    """Run ``--on-bad``: argv from :func:`shlex.split`, the path only in the environment.

    It runs in a session of its own, with its standard output sent to standard error (stdout
    carries ``--json`` lines); past ``timeout`` seconds its whole process group is killed.

    Returns:
        How it ended (:attr:`HookResult.ok` when it exited 0 in time).
    """
    argv = shlex.split(command)
    if not argv:
        return HookResult(command="", status=0)
    env = dict(os.environ, **{BAD_ENV: str(path), "CKPT_RUN_DIR": str(run)})
    try:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=2,
                                start_new_session=True)
    except OSError as e:
        return HookResult(command=argv[0], error=e.strerror or str(e))
    try:
        return HookResult(command=argv[0], status=proc.wait(timeout=timeout))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return HookResult(command=argv[0], status=proc.returncode, timed_out=True)
    finally:
        if proc.returncode is None:  # interrupted (Ctrl-C, SIGTERM): leave nothing behind
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
