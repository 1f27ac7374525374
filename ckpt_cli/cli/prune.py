"""``ckpt prune``."""


import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated

import typer

from ckpt_cli.cli.errors import EXIT_FINDINGS, EXIT_OK, EXIT_REFUSED, handled
from ckpt_cli.cli.options import (
    Common,
    DryRunOpt,
    Location,
    YesOpt,
    common_options,
    from_options,
    local_only,
    path_argument,
)
from ckpt_cli.errors import UsageError, visible
from ckpt_cli.ops.options.prune import PruneOptions
from ckpt_cli.optionspec import word

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from ckpt_cli.ops.prune.result import PruneEvent, PruneResult
    from ckpt_cli.ops.prune.retention import PrunePlan


@common_options("storage_option", "json")
@from_options(PruneOptions)
def prune_cmd(
    run_dir: Annotated[Location, path_argument("The run directory whose checkpoints to prune.")],
    *,
    options: PruneOptions,
    old_force: Annotated[bool, typer.Option(
        "--force", hidden=True, help="Refused: --force replaces an output in every command; "
        "prune's old --force is --any-dir.")] = False,
    dry_run: DryRunOpt = False,
    yes: YesOpt = False,
    common: Common,
) -> None:
    """Delete old checkpoints of a run directory by retention rules, safely, even from cron.

    A checkpoint is kept if any rule keeps it. Never deleted: what latest /
    latest_checkpointed_iteration.txt / last.ckpt points to, anything that may still be being
    written (incomplete, changed within --grace, locked), and the newest valid checkpoint.
    After a rollback, higher steps it left behind count for no rule and go. On a
    terminal it shows the plan and asks; elsewhere (cron) it proceeds and logs one line per
    action.

    Examples:
      ckpt prune runs/gpt --keep 5 --dry-run
      ckpt prune runs/gpt --keep 3 --keep-every 10K --yes
      ckpt prune out/ --keep 2 --keep-best 1 --metric eval_loss
      ckpt prune ckpts/ --older-than 7d --max-total-size 2TB
      ckpt prune runs/gpt --keep 5 --json --yes
    """
    with handled() as outcome:
        local_only(options.metrics_file, '--metrics-file')  # type: ignore[arg-type]
        common.use_storage()
        from ckpt_cli.ops.prune import execute, plan  # lazy: not loaded by ckpt --help

        if old_force:
            # --force means one thing in every command (replace an existing output); prune's
            # old --force, deprecated for a release, now stops rather than guess: nothing is
            # deleted.
            raise UsageError("prune has no --force: --force replaces an existing output, and "
                             "prune's old --force is now --any-dir", hint="use --any-dir to "
                             "prune /, $HOME or a directory that does not look like a run")
        if common.json and not yes and not dry_run:
            raise UsageError("--json never asks for confirmation: add --yes to delete, or "
                             "--dry-run to only see the plan")
        options.check()
        view = _View(tty=_is_terminal(), quiet=common.json, dry_run=dry_run)
        try:
            # The plan, shown; the question (not for --yes, --json or cron); then the deletions.
            with plan(run_dir, options, pattern=options.pattern,
                      metrics_file=options.metrics_file, dry_run=dry_run,
                      any_dir=options.any_dir) as planned:
                view.show(planned.plan)
                if (planned.asks and not (yes or common.json or not _interactive())
                        and not view.ask(planned.plan)):
                    planned.decline()
                result = execute(planned, on_event=view.event)
        finally:
            view.stop()
        failed = bool(result.named("failed") or result.trash_failed or result.thin_failed)
        outcome.exit_code = code = (EXIT_OK if result.ok else EXIT_FINDINGS if failed
                                    else EXIT_REFUSED)
        if result.note and not common.json:
            sys.stderr.write(f"ckpt: note: {result.path}: {result.note}\n")
        if common.json:
            from ckpt_cli.render import json as rj  # lazy: not loaded by ckpt --help

            result.caller = "cli"
            rj.emit_result(result)
        else:
            view.finish(result)
        raise typer.Exit(code)


def _interactive() -> bool:
    """Whether someone can answer a prompt (a terminal on stdin); cron and pipes cannot."""
    return sys.stdin.isatty()


def _is_terminal() -> bool:
    """Whether results go to a terminal (a table) or to a log such as cron mail (lines)."""
    from ckpt_cli.render.human import is_tty  # lazy: not loaded by ckpt --help

    return is_tty() and sys.stdout.isatty()


class _View:
    """What the user sees while pruning.

    On a terminal: the plan as a table, a prompt, a progress bar, then a summary. Elsewhere:
    one plain line per decision and per action, as they happen, so that cron mail (or a log)
    holds what was done even if the run is cut short.
    """

    def __init__(self, *, tty: bool, quiet: bool, dry_run: bool) -> None:
        from ckpt_cli.render import human  # lazy: not loaded by ckpt --help

        self.tty, self.quiet, self.dry_run = tty, quiet, dry_run
        self.out, self.err = human.stdout(), human.stderr()
        self.progress: Progress | None = None
        self.task: TaskID | None = None

    def event(self, event: "PruneEvent") -> None:
        """Show one progress event."""
        if self.quiet:
            return
        from ckpt_cli.render.prune import event_line  # lazy: not loaded by ckpt --help

        line = event_line(event)
        if self.tty:
            if event.kind in ("skipped", "failed") and line:
                self.err.print(visible(line, lines=False), soft_wrap=True, markup=False)
            if event.kind in ("deleted", "skipped", "failed"):
                self._advance(event)
        elif line:
            _plain(line, err=event.kind == "failed")

    def show(self, plan: "PrunePlan") -> None:
        """Show the plan: a table on a terminal, else one line per decision kept."""
        if self.quiet:
            return
        from ckpt_cli.render import human  # lazy: not loaded by ckpt --help
        from ckpt_cli.render.prune import (  # lazy: not loaded by ckpt --help
            decisions_table,
            headline,
            leftover_lines,
            plan_line,
        )

        if self.tty:
            self.out.print(human.Folded(headline(plan), style="bold"))
            if plan.decisions:
                self.out.print(decisions_table(plan))
            for line in leftover_lines(plan, dry_run=self.dry_run):
                self.out.print(human.Folded(line, style="yellow"))
        else:
            _plain(headline(plan))
            # Deletions get their line when they happen (or fail), except in a dry run.
            for d in plan.decisions:
                if not d.delete or self.dry_run:
                    _plain(plan_line(d, dry_run=self.dry_run))
            for line in leftover_lines(plan, dry_run=self.dry_run):
                _plain(line)

        human.print_findings([*plan.listing.findings,
                              *(replace(f, message=word(f.message, "cli"))
                                for f in plan.findings)])

    def ask(self, plan: "PrunePlan") -> bool:
        """Ask whether to delete (the plan is on screen already); end of input means no."""
        from ckpt_cli.render.human import size  # lazy: not loaded by ckpt --help

        n = len(plan.to_delete)
        try:
            return typer.confirm(f"Delete {n} checkpoint{'s' if n != 1 else ''} "
                                 f"({size(plan.bytes_to_free)})?", default=False, err=True)
        except typer.Abort:
            return False

    def _advance(self, event: "PruneEvent") -> None:
        from rich.progress import Progress  # heavy: rich

        if self.progress is None:
            self.progress = Progress(console=self.err, transient=True)
            self.progress.start()
            self.task = self.progress.add_task("deleting", total=event.total)
        if self.task is not None:
            self.progress.update(self.task, completed=event.done)

    def stop(self) -> None:
        """Take the progress bar off the screen."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def finish(self, result: "PruneResult") -> None:
        """The closing summary (stdout) and leftover-trash problems (stderr)."""
        from ckpt_cli.render.prune import summary  # lazy: not loaded by ckpt --help

        for name, err in result.trash_failed.items():
            self.err.print(f"ckpt: error: cannot remove leftover trash {name}: {err}",
                           soft_wrap=True, markup=False)
        if self.tty:
            from ckpt_cli.render import human  # lazy: not loaded by ckpt --help

            self.out.print(human.Folded(summary(result)))
        else:
            _plain(summary(result))


def _plain(line: str, *, err: bool = False) -> None:
    stream = sys.stderr if err else sys.stdout
    # One line per decision, whatever a checkpoint's name holds (a newline would forge a
    # line of a cron log, an escape sequence drive the terminal).
    stream.write(visible(line, lines=False) + "\n")
    stream.flush()
