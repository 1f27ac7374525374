"""The commands whose engines live in ``trust/`` (``ckpt resume-path``, ``ckpt watch --once``),
as :mod:`ckpt_cli.api.commands` presents every command (it re-exports these two)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ckpt_cli.api import _args
from ckpt_cli.api._args import PathLike
from ckpt_cli.choices import ThinDtype
from ckpt_cli.ops.options.resume import ResumePathOptions
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
    from ckpt_cli.api.results import ResumePathResult
    from ckpt_cli.ops.resume import survey

    with _args.api_names():
        _args.use_storage(storage_options, None)
        options = ResumePathOptions(full=full)
        run = _args.located(run_dir)
        return ResumePathResult(run, survey(run, verify=options.verify), options.verify)


def watch_once(run_dir: PathLike, *, crc: bool = False, values: bool = False,
               settle: float | str = "1s", abandon_after: float | str = "10m",
               keep: int | None = None, keep_every: int | str | None = None,
               grace: float | str = "10m", thin_after: int | None = None,
               thin_to: ThinDtype | None = None, keep_full_every: int | None = None,
               keep_abandoned: bool = False,
               pattern: str | None = None, on_bad: str | None = None,
               on_bad_timeout: float | str = "5m",
               storage_options: Mapping[str, Any] | None = None,
               on_event: Callable[[WatchEvent], None] | None = None) -> WatchResult:
    """One pass of ``ckpt watch --once``: verify each committed checkpoint of a run, record
    the verdicts in its ledger, apply retention.

    Args:
        run_dir: The run directory (or a directory of runs, or an object-store prefix).
        crc: Read every byte (CRC-32, DCP items), not just the structure.
        values: Also scan tensors for NaN, Inf and all-zero.
        settle: A committed checkpoint must be unchanged this long before it is validated.
        abandon_after: An incomplete checkpoint unchanged this long is reported abandoned.
        keep: Retention after each verified checkpoint: keep the newest N (as :func:`prune`).
        keep_every: Retention: also keep milestones.
        grace: Retention never deletes anything changed within this age.
        thin_after: Retention: thin checkpoints older than the newest N.
        thin_to: ``bf16``: also cast thinned weights to BF16.
        keep_full_every: Never thin checkpoints whose step is a multiple of this.
        keep_abandoned: Retention keeps checkpoints of a timeline a rollback abandoned (by
            default they are deleted; they never count towards ``keep`` or ``keep_every``).
        pattern: A regex saying which entries are checkpoints.
        on_bad: A command run for each bad checkpoint (split like a shell would, never run
            by one) with its path in ``$CKPT_BAD_PATH``.
        on_bad_timeout: Kill an ``on_bad`` command still running after this long.
        storage_options: fsspec options for URLs.
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
    from ckpt_cli.api.results import WatchResult
    from ckpt_cli.errors import CkptError, UsageError
    from ckpt_cli.ops.prune.retention import PrunePolicy
    from ckpt_cli.ops.watch import Watcher, WatchOptions

    with _args.api_names():
        _args.use_storage(storage_options, None)
        policy = None
        if (keep, keep_every, thin_after, thin_to, keep_full_every) != (None,) * 5:
            if pattern is not None and not pattern.strip():
                raise UsageError(f"pattern {pattern!r} is empty", param="pattern")
            policy = PrunePolicy(keep=keep, keep_every=_args.count(keep_every, "keep_every"),
                                 grace=_args.duration(grace, "grace", allow_zero=True) or 0.0,
                                 thin_after=thin_after, thin_to=thin_to,
                                 keep_full_every=keep_full_every,
                                 keep_abandoned=keep_abandoned)
            policy.check()
        options = WatchOptions(
            crc=crc, values=values,
            settle=_args.duration(settle, "settle", allow_zero=True) or 0.0,
            abandon_after=_args.duration(abandon_after, "abandon_after") or 0.0,
            policy=policy, pattern=pattern, on_bad=on_bad,
            on_bad_timeout=_args.duration(on_bad_timeout, "on_bad_timeout") or 0.0,
            report_pending=True)
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

