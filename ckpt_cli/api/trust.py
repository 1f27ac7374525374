"""The commands whose engines live in ``trust/`` (``ckpt resume-path``, ``ckpt watch --once``),
as :mod:`ckpt_cli.api.commands` presents every command (it re-exports these two)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ckpt_cli.api import _args
from ckpt_cli.api._args import PathLike
from ckpt_cli.api.results import ResumePathResult, WatchResult
from ckpt_cli.choices import ThinDtype
from ckpt_cli.errors import CkptError
from ckpt_cli.ops.options.resume import ResumePathOptions
from ckpt_cli.ops.options.watch import WatchOptions
from ckpt_cli.ops.resume import survey
from ckpt_cli.ops.watch import Watcher, retention
from ckpt_cli.optionspec import documented

if TYPE_CHECKING:
    from ckpt_cli.api.results import ResumePathResult, WatchResult
    from ckpt_cli.ops.watch import WatchEvent


@_args.deprecated_keywords(ResumePathOptions)
@documented(ResumePathOptions)
def resume_path(run_dir: PathLike, *, full: bool = False,
                storage_options: Mapping[str, Any] | None = None) -> ResumePathResult:
    """The newest verified checkpoint of a run: the one to resume from (``ckpt resume-path``).

    Verified means its run-ledger verdict (``watch_once``, ``ckpt watch``, the training
    callbacks) is good and it still matches its manifest.

    Args:
        run_dir: The run directory, or a URL.
        {options}
        storage_options: fsspec options for URLs.

    Returns:
        The :class:`~ckpt_cli.api.results.ResumePathResult`: ``path`` (None when there is
        none: ``ok`` False), ``step``, ``rejected`` (with why), ``ignored`` and
        ``unreadable_lines`` (ledger lines passed over); ``to_dict()`` is
        ``ckpt resume-path --json``'s document.

    Raises:
        CkptError: An unreadable run directory or ledger.

    Example:
        >>> ckpt_cli.resume_path("demo-run").path
    """

    with _args.api_names():
        _args.use_storage(storage_options, None)
        options = ResumePathOptions(full=full)
        run = _args.located(run_dir)
        return ResumePathResult(run, survey(run, verify=options.verify), options.verify)


@documented(WatchOptions)
def watch_once(run_dir: PathLike, *, crc: bool = False, values: bool = False,
               settle: float | str = 1.0, abandon_after: float | str = 600.0,
               keep: int | None = None, keep_every: int | str | None = None,
               grace: float | str = 600.0, thin_after: int | None = None,
               thin_to: ThinDtype | None = None, keep_full_every: int | str | None = None,
               keep_abandoned: bool = False, pattern: str | None = None,
               on_bad: str | None = None, on_bad_timeout: float | str = 300.0,
               storage_options: Mapping[str, Any] | None = None,
               on_event: Callable[[WatchEvent], None] | None = None) -> WatchResult:
    """One pass of ``ckpt watch --once``: verify each committed checkpoint of a run, record
    the verdicts in its ledger, apply retention.

    Durations take seconds or text (``"10m"``); counts, numbers or text (``"10K"``).

    Args:
        run_dir: The run directory (or a directory of runs, or an object-store prefix).
        {options}
        storage_options: fsspec options for URLs (``{"endpoint_url": ...}``).
        on_event: Called with each :class:`~ckpt_cli.ops.watch.WatchEvent` as it happens.

    Returns:
        The :class:`~ckpt_cli.api.results.WatchResult`: ``events``, ``bad``, ``ok``;
        ``to_dict()["events"]`` holds the lines ``ckpt watch --once --json`` prints.

    Raises:
        CkptError: ``run_dir`` is not a directory.
        UsageError: Bad retention options.

    Example:
        >>> r = ckpt_cli.watch_once("demo-run")
        >>> r.ok, r.verified
    """

    with _args.api_names():
        _args.use_storage(storage_options, None)
        options = WatchOptions(
            crc=crc, values=values,
            settle=_args.duration(settle, "settle", allow_zero=True) or 0.0,
            abandon_after=_args.duration(abandon_after, "abandon_after") or 0.0,
            keep=keep, keep_every=_args.count(keep_every, "keep_every"),
            grace=_args.duration(grace, "grace", allow_zero=True) or 0.0,
            thin_after=thin_after, thin_to=thin_to,
            keep_full_every=_args.count(keep_full_every, "keep_full_every"),
            keep_abandoned=keep_abandoned, pattern=pattern, on_bad=on_bad,
            on_bad_timeout=_args.duration(on_bad_timeout, "on_bad_timeout") or 0.0,
            report_pending=True)
        retention(options)  # bad retention options first, before looking at the directory
        root = _args.located(run_dir)
        if not root.is_dir():
            raise CkptError("not a directory", path=root)
        result = WatchResult(root)

        def emit(event: WatchEvent) -> None:
            result.events.append(event)
            if on_event is not None:
                on_event(event)

        Watcher(root, options, emit).run_pass()
        return result
