"""How ``ckpt watch`` waits between passes (``--wake``): polling, or file-system events.

:class:`PollWaker` sleeps; :class:`EventWaker` also wakes when a file under the root changes
(the optional ``watchfiles`` package); :func:`make_waker` picks one for a mode and a root.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckpt_cli import storage
from ckpt_cli.errors import UsageError
from ckpt_cli.manifest import MANIFEST_NAME, MANIFEST_SUFFIX
from ckpt_cli.trust import ledger


class PollWaker:
    """Wake after the timeout, whatever happens: plain polling (the default)."""

    events = False

    def wait(self, timeout: float) -> None:
        """Sleep ``timeout`` seconds."""
        time.sleep(timeout)

    def close(self) -> None:
        """Nothing to release."""


class EventWaker:
    """Wake when a file under the root changes (inotify on Linux, through the optional
    ``watchfiles`` package), or after the timeout.

    Events are only a hint that a pass is worth running now: what a pass decides comes from
    listing the run, as with polling, and ``interval`` still bounds the wait (writes from
    another machine on a network file system raise no event here). The watcher's own writes
    (the ledger, manifests, temporary files) are ignored, so verifying a checkpoint does not
    wake it again.
    """

    events = True

    def __init__(self, root: Path, *, debounce_ms: int = 200, tick_ms: int = 250) -> None:
        import watchfiles  # lazy: optional extra (ckpt[watch])

        self._stop = threading.Event()
        # One watch for the watcher's life (nothing is missed between waits); it hands back
        # an empty set every tick without changes, so a wait can end at its own timeout.
        self._gen: Iterator[set[tuple[Any, str]]] = watchfiles.watch(
            root, watch_filter=_not_own_write, debounce=debounce_ms, step=50,
            rust_timeout=tick_ms, yield_on_timeout=True, raise_interrupt=True,
            stop_event=self._stop)
        next(self._gen, None)  # starts watching now (the first tick)

    def wait(self, timeout: float) -> None:
        """Block until a change under the root (debounced) or about ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            got = next(self._gen, _DONE)
            if got is _DONE:  # the watch ended (stopped): plain sleep
                time.sleep(left)
                return
            if got:
                return

    def close(self) -> None:
        """Stop watching."""
        self._stop.set()
        with contextlib.suppress(Exception):
            self._gen.close()  # type: ignore[attr-defined]


_DONE: Any = object()


def _not_own_write(_change: Any, path: str) -> bool:
    name = os.path.basename(path)
    return not (name.startswith(ledger.LEDGER_NAME) or name == MANIFEST_NAME
                or name.endswith(MANIFEST_SUFFIX) or ".ckpt-tmp-" in name)


Waker = PollWaker | EventWaker
WAKE_MODES = ("auto", "events", "poll")


def make_waker(mode: str, root: Path) -> tuple[Waker, str | None]:
    """The waker for ``--wake`` on ``root``, and a note when ``auto`` fell back to polling.

    ``poll``: polling. ``events``: file-system events (the optional ``watchfiles`` package;
    local directories only). ``auto``: events when ``watchfiles`` is installed and the root is
    local, else polling.

    Raises:
        UsageError: ``events`` where they cannot be had, or an unknown mode.
    """

    if mode not in WAKE_MODES:
        raise UsageError(f"wake must be one of {', '.join(WAKE_MODES)}, not {mode!r}",
                         param="wake")
    if mode == "poll":
        return PollWaker(), None
    if not storage.has_file_system(root):
        if mode == "events":
            raise UsageError("wake events: object storage raises no file events", path=root,
                             param="wake")
        return PollWaker(), None
    try:
        return EventWaker(root), None
    except ImportError:
        if mode == "events":
            raise UsageError("wake events needs the optional watchfiles package",
                             hint="pip install 'ckpt-cli[watch]'", param="wake") from None
        return PollWaker(), None  # auto: polling, as without the extra
    except Exception as e:  # e.g. the inotify watch limit reached: polling still works
        if mode == "events":
            raise UsageError(f"wake events: file events are unavailable here ({e})",
                             path=root, param="wake") from None
        return PollWaker(), f"file events are unavailable here ({e}); polling"
