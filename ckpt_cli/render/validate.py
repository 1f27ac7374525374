"""Human report of ``validate``: one row per check, one line per problem, a verdict.

A single checkpoint gets its checks (status, id, what was verified) and then its problems,
one line each: ``error: FILE:LOCATION: explanation``. A run directory gets one row per
checkpoint, the run's own checks, and the problems grouped by checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckpt_cli.parts import describe_parts
from ckpt_cli.render import human
from ckpt_cli.render import json as rj

if TYPE_CHECKING:
    from ckpt_cli.ops.validate.result import (
        CheckpointReport,
        CheckResult,
        LatestChoice,
        PartStatus,
        ValidateResult,
    )

_STATUS = {"pass": ("ok", "green"), "warn": ("warn", "yellow"), "fail": ("FAIL", "bold red"),
           "skip": ("skip", "dim")}


def _status(status: str) -> Text:
    word, style = _STATUS[status]
    return Text(word, style=style)


def checks_table(checks: list[CheckResult]) -> Table:
    """Status, id and summary of each check."""
    table = human.table(human.Col("status"), human.Col("check"), human.Col("summary", kind="text"),
                        show_header=False)
    for c in checks:
        table.add_row(_status(c.status), c.id, c.summary)
    return table


def _headline(r: CheckpointReport) -> Text:
    t = Text(str(r.path), style="bold")
    facts = [x for x in (r.format and (r.format + (f" ({r.flavor})" if r.flavor and
                                                   r.flavor != r.format else "")),
                         f"step {r.step}" if r.step is not None else None) if x]
    if r.index is not None:
        facts.append(f"{len(r.index.files)} file(s), {human.size(r.index.file_bytes)}")
    if facts:
        t.append("  " + ", ".join(facts), style="dim")
    return t


def _verdict(errors: int, warnings: int, what: str) -> Text:
    counts = f"{errors} error{'s' if errors != 1 else ''}, {warnings} warning" + (
        "s" if warnings != 1 else "")
    if errors:
        return Text(f"INVALID: {what} ({counts})", style="bold red")
    return Text(f"valid: {what} ({counts})", style="bold green" if not warnings else "bold")


def render(result: ValidateResult, console: Console, *, verbose: bool = False) -> None:
    """Print the report of a validation.

    Args:
        result: What ``validate`` returned.
        console: Where to print (stdout: the report is the command's result).
        verbose: Also print notes (info findings), and every check of each checkpoint of a
            run directory.
    """
    min_sev = "info" if verbose else "warning"
    if result.kind == "checkpoint":
        r = result.checkpoints[0]
        console.print(human.Folded(_headline(r)))
        console.print(checks_table(r.checks))
        if any(_shown(f.severity, min_sev) for f in r.findings):
            console.print()
            human.print_findings(r.findings, console=console, min_severity=min_sev)
        console.print()
        console.print(human.Folded(_verdict(r.errors, r.warnings, r.name)))
    else:
        _render_run(result, console, verbose=verbose, min_sev=min_sev)
    if result.part is not None:
        console.print(Text(part_line(result.part), style="bold"))


def part_line(p: PartStatus) -> str:
    """One line: which part this was, and what is left to do."""
    share = (f"part {p.index}/{p.count}: {p.files} of {p.total_files} file(s), "
             f"{human.size(p.bytes)}" if p.index is not None else
             f"finalize: {p.count} part(s)")
    if p.finalized:
        return f"{share}; every part is done: the report covers all {p.total_files} file(s)"
    if p.finalized_elsewhere:
        return f"{share}; done (another part merged the report)"
    return (f"{share} done; waiting for {describe_parts(p.waiting_for)} (the last part to "
            "finish, or --finalize, merges the report)")


def latest_line(c: LatestChoice) -> str:
    """One line: which checkpoint ``--latest`` chose, and why."""
    step = f"step {c.step:,}, " if c.step is not None else ""
    if c.final_model:
        return (f"--latest: {c.name} (the final model: no checkpoint beside it to resume "
                "from)")
    why = (f"named by {c.pointer}" if c.pointer is not None else
           "the newest checkpoint by step")
    skipped = "; the final model is not checked" if c.final_model_skipped else ""
    return f"--latest: {c.name} ({step}{why}{skipped})"


def _shown(severity: str, min_sev: str) -> bool:
    order = {"info": 0, "warning": 1, "error": 2}
    return order[severity] >= order[min_sev]


def _render_run(result: ValidateResult, console: Console, *, verbose: bool,
                min_sev: str) -> None:
    n = len(result.checkpoints)
    console.print(human.Folded(f"{result.path}  run directory, {n} checkpoint(s) validated",
                               style="bold"))
    if result.latest is not None:
        console.print(Text(latest_line(result.latest)))
    col = human.Col
    table = human.table(col("Checkpoint", kind="name"), col("Step", "right", drop=3),
                        col("Format", drop=0), col("Result"), col("Errors", "right", drop=2),
                        col("Warnings", "right", drop=1), col("First problem", kind="text"))
    for r in result.checkpoints:
        first = next((f for f in r.findings if f.severity == "error"), None) or next(
            (f for f in r.findings if f.severity == "warning"), None)
        # A short form (its code); every message is printed in full once, below the table.
        more = r.errors + r.warnings - 1
        problem = "" if first is None else first.code + (f" (+{more:,})" if more > 0 else "")
        result_text = Text("valid", style="green") if r.valid else Text("INVALID",
                                                                         style="bold red")
        table.add_row(r.name, "-" if r.step is None else f"{r.step:,}", r.format or "?",
                      result_text, str(r.errors), str(r.warnings),
                      problem)
    console.print(table)
    console.print()
    console.print(checks_table(result.run_checks))
    for c in result.run_checks:
        human.print_findings(c.findings, console=console, min_severity=min_sev)
    for r in result.checkpoints:
        if verbose:
            console.print()
            console.print(human.Folded(_headline(r)))
            console.print(checks_table(r.checks))
        if any(_shown(f.severity, min_sev) for f in r.findings):
            if not verbose:
                console.print()
                console.print(human.Folded(r.name, style="bold"))
            human.print_findings(r.findings, console=console, min_severity=min_sev)
    console.print()
    errors = sum(r.errors for r in result.checkpoints) + sum(
        1 for c in result.run_checks for f in c.findings if f.severity == "error")
    warnings = sum(r.warnings for r in result.checkpoints) + sum(
        1 for c in result.run_checks for f in c.findings if f.severity == "warning")
    bad = sum(not r.valid for r in result.checkpoints)
    what = (f"{n - bad} of {n} checkpoint(s) valid" if n else "no checkpoints")
    console.print(human.Folded(_verdict(errors, warnings, what)))


def show(result: ValidateResult, *, json: bool, verbose: bool) -> None:
    """The command's output: the JSON document (``result.to_dict()``'s, ``strict`` as the
    result says), or the human report on stdout."""
    if json:
        rj.emit_result(result)
    else:
        render(result, human.stdout(), verbose=verbose)
