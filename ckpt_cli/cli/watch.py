"""``ckpt watch`` and ``ckpt resume-path``."""


import dataclasses
import sys
from typing import TYPE_CHECKING, Annotated, Any

import orjson
import typer

from ckpt_cli.cli.errors import EXIT_FINDINGS, EXIT_OK, interrupted_code
from ckpt_cli.cli.options import (
    Common,
    Location,
    common_options,
    duration_parser,
    from_options,
    path_argument,
)
from ckpt_cli.errors import CkptError, UsageError, visible
from ckpt_cli.ops.options.resume import ResumePathOptions
from ckpt_cli.ops.options.watch import WatchOptions
from ckpt_cli.storage import redact

if TYPE_CHECKING:
    from ckpt_cli.ops.watch import WatchEvent


@common_options("storage_option", "json")
@from_options(WatchOptions)
def watch_cmd(
    run_dir: Annotated[Location, path_argument(
        "The run directory (or a directory of runs, or an object-store prefix) to follow.")],
    once: Annotated[bool, typer.Option(
        "--once", help="One pass, then exit (for cron): 1 if a bad checkpoint was found. "
        "Checkpoints not judged yet (settling, locked, being written) are named.")] = False,
    # Any: the default is text, parsed by typer as a given value is (seconds, a float).
    interval: Annotated[Any, typer.Option(
        "--interval", metavar="AGE", parser=duration_parser("--interval"),
        help="Time between passes (the longest, with file "
        "events).")] = "5s",
    wake: Annotated[str, typer.Option(
        "--wake", metavar="MODE", help="auto: also run a pass as soon as files change, where "
        "the optional watchfiles package can tell (local directories), else poll; events: "
        "require that; poll: only every --interval.")] = "auto",
    *,
    options: WatchOptions,
    common: Common,
) -> None:
    """Verify each checkpoint of a run as training writes it; record verdicts in the run ledger.

    A checkpoint is validated once its format's commit marker is there (DCP .metadata, an HF
    index or model file with trainer_state.json, a complete torch file) and it stopped
    changing; a half-written one never is. Good ones get a manifest; every verdict is a line of
    ckpt-ledger.jsonl in the run directory, which is also the watcher's state across restarts.
    A bad checkpoint is reported at once (stderr, a JSON line with --json, --on-bad). With
    --keep / --keep-every / --thin-after, retention runs after each verified checkpoint (as
    ckpt prune).

    Examples:
      ckpt watch runs/gpt --keep 3
      ckpt watch runs/ --once --json
      ckpt watch s3://bucket/run --interval 30s
    """
    with common.handled() as outcome:
        from ckpt_cli.ops.watch import Watcher, retention  # lazy: not loaded by ckpt --help

        opts = dataclasses.replace(options, report_pending=once, caller="cli")
        retention(opts)  # bad retention options first, before looking at the directory
        every: float = interval
        from ckpt_cli.ops.watch.wake import WAKE_MODES  # lazy: not loaded by ckpt --help

        if wake not in WAKE_MODES:
            raise UsageError(f"--wake must be one of {', '.join(WAKE_MODES)}, not {wake!r}")

        if not run_dir.is_dir():
            raise CkptError("not a directory", path=run_dir)
        bad = 0

        def emit(ev: "WatchEvent") -> None:
            nonlocal bad
            bad += ev.bad
            _emit(ev, common.json)

        watcher = Watcher(run_dir, opts, emit)
        from ckpt_cli.ops.watch.wake import PollWaker, make_waker  # lazy: not loaded by ckpt --help

        waker, note = make_waker(wake, run_dir) if not once else (PollWaker(), None)
        if note:
            sys.stderr.write(f"ckpt watch: {note}\n")
        try:
            for _ in watcher.loop(every, passes=1 if once else None, waker=waker):
                pass
        except KeyboardInterrupt:
            if once:
                raise
            # SIGTERM (a sidecar stopped with its job) or Ctrl-C: the normal way to stop a
            # watcher; the ledger is already durable, so it ends quietly, with the signal's
            # conventional code (143 or 130) as every command a signal stops.
            outcome.exit_code = interrupted_code()
            raise typer.Exit(outcome.exit_code) from None
        outcome.exit_code = EXIT_FINDINGS if bad else EXIT_OK
    raise typer.Exit(outcome.exit_code)


def _emit(ev: "WatchEvent", json: bool) -> None:
    if json:
        sys.stdout.buffer.write(orjson.dumps(ev.to_json()) + b"\n")
        sys.stdout.flush()
        if not ev.bad:
            return  # a bad one also gets its stderr line, below

    # One line per event, whatever a checkpoint's name holds (--json keeps names exact).
    where = visible(redact(f"{ev.run}/{ev.path}" if ev.path else ev.run), lines=False)
    if ev.event == "pruned" and not json:
        line = f"ckpt watch: {where}: retention deleted {', '.join(ev.deleted) or 'nothing'}"
        if ev.thinned:
            line += f", thinned {', '.join(ev.thinned)}"
        if ev.problems:
            line += f" ({ev.problems[0]})"
        print(visible(line, lines=False), flush=True)
    elif ev.event == "ignored" and not json:
        why = ev.problems[0] if ev.problems else "ignored"
        sys.stderr.write(visible(f"ckpt watch: warning: {where}: {why}", lines=False) + "\n")
        sys.stderr.flush()
    elif ev.event == "pending" and not json:
        pending = ev.pending or {}
        print(visible(f"ckpt watch: pending: {where}: {pending.get('state', 'pending')} "
                      f"({pending.get('detail', '')}); not checked in this pass", lines=False),
              flush=True)
    elif ev.bad:
        why = ev.problems[0] if ev.problems else "bad"
        label = "abandoned" if ev.event == "abandoned" else ("error" if ev.event == "error"
                                                            else "BAD")
        sys.stderr.write(visible(f"ckpt watch: {label}: {where}: {why}", lines=False) + "\n")
        sys.stderr.flush()
    elif not json:
        step = f" (step {ev.step})" if ev.step is not None else ""
        print(f"ckpt watch: verified: {where}{step}", flush=True)


@common_options("storage_option", "json")
@from_options(ResumePathOptions)
def resume_path_cmd(
    run_dir: Annotated[Location, path_argument("The run directory.")],
    *,
    options: ResumePathOptions,
    common: Common,
) -> None:
    """Print the newest verified checkpoint of a run: the one to resume from.

    Verified means its ledger verdict (ckpt watch, the training callbacks) is good and it is
    still what was verified: every file present with its recorded size, any file whose size,
    modification time or inode changed since hashed against the manifest (--full: every
    file), its index read cleanly. Checkpoints of a timeline abandoned by a resume from an
    earlier step are passed over. Exit 1 with a message when there is none.

    Examples:
      ckpt resume-path runs/gpt
      python train.py --resume "$(ckpt resume-path runs/gpt)"
    """
    with common.handled() as outcome:
        from ckpt_cli.ops.resume import survey  # lazy: not loaded by ckpt --help

        found = survey(run_dir, verify=options.verify)
        choice = found.choice
        outcome.exit_code = EXIT_OK if choice is not None else EXIT_FINDINGS
        if common.json:
            from ckpt_cli.api.results import ResumePathResult  # lazy: not loaded by ckpt --help

            doc = ResumePathResult(run_dir, found, options.verify).document()
            sys.stdout.buffer.write(orjson.dumps(doc) + b"\n")

        _say_ignored("ckpt", found.ignored, found.unreadable)
        for p, why in found.rejected:
            sys.stderr.write(visible(f"ckpt: skipped {p}: {why}", lines=False) + "\n")
        if choice is None:
            sys.stderr.write(visible(f"ckpt: {run_dir}: no verified checkpoint to resume from "
                                     "(none in the ledger is good and unchanged; run ckpt watch "
                                     "--once)", lines=False) + "\n")
        elif not common.json:
            print(visible(str(choice.path), lines=False))
    raise typer.Exit(outcome.exit_code)


def _say_ignored(who: str, ignored: "tuple[str, ...] | list[str]", unreadable: int) -> None:
    """The ledger lines passed over, one warning each on stderr (resume-path and watch say
    the same)."""

    for p in ignored:
        sys.stderr.write(visible(f"{who}: warning: the ledger names {p!r}, which is not a "
                                 "checkpoint directly in the run: ignored", lines=False) + "\n")
    if unreadable:
        sys.stderr.write(f"{who}: warning: {unreadable} ledger line"
                         f"{'s' if unreadable != 1 else ''} could not be read (torn by a "
                         "crash or edited by hand): ignored\n")
