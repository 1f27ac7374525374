"""Output of ``ckpt prune``: the JSON document, the decisions table, and plain log lines.

On a terminal the plan is a rich table; otherwise (cron) every decision and every action is one
plain line, so the mail cron sends reads as a log.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from rich.table import Table
from rich.text import Text

from ckpt_cli.formats.names import TRASH_PREFIX
from ckpt_cli.ops.prune.result import PruneEvent, PruneResult
from ckpt_cli.ops.prune.retention import Decision, PrunePlan
from ckpt_cli.optionspec import word
from ckpt_cli.render import human
from ckpt_cli.render.human import size


def prune_doc(result: PruneResult) -> dict[str, Any]:
    """The ``--json`` document of a prune, without ``schema_version`` and ``command``:
    ``result.json_body()`` (see docs/json-schema.md, section ``prune``)."""
    return result.json_body()


def _reasons(d: Decision) -> str:
    """A decision's reasons, options named as the command line's flags (``--keep 2``)."""
    return "; ".join(word(r, "cli") for r in d.reasons)


def decisions_table(plan: PrunePlan) -> Table:
    """One row per checkpoint, oldest first: step, age, size, keep or delete, and why."""
    col = human.Col
    table = human.table(col("Checkpoint", kind="name"), col("Step", "right", drop=2),
                        col("Modified", drop=0), col("Size", "right", drop=1), col("Action"),
                        col("Why", kind="text"))
    for d in plan.decisions:
        e = d.entry
        when = _dt.datetime.fromtimestamp(e.mtime).strftime("%Y-%m-%d %H:%M") if e.mtime else "-"
        action = (Text("delete", style="red") if d.delete else Text("thin", style="yellow")
                  if d.thin else Text("keep", style="green"))
        table.add_row(e.name, "-" if e.step is None else f"{e.step:,}", when, size(e.bytes),
                      action, _reasons(d))
    return table


def plan_line(d: Decision, *, dry_run: bool) -> str:
    """A decision as one plain log line: ``keep NAME (SIZE): why`` (``thin``, ``delete``; in
    a dry run ``would thin``, ``would delete``)."""
    verb = ("delete" if d.delete else "thin" if d.thin else "keep")
    if dry_run and verb != "keep":
        verb = f"would {verb}"
    return f"{verb} {d.entry.name} ({size(d.entry.bytes)}): {_reasons(d)}"


def leftover_lines(plan: PrunePlan, *, dry_run: bool) -> list[str]:
    """One line per temporary or trash name in the run directory.

    Trash (``.ckpt-trash-*``) is what an interrupted prune renamed aside: this run removes it
    (the removal gets its own line). Other temporary names may be writes in progress and are
    never touched.
    """
    out = []
    for name in plan.listing.leftovers:
        if name.startswith(TRASH_PREFIX):
            if dry_run:
                out.append(f"would remove leftover trash {name} (from an interrupted prune)")
        else:
            out.append(f"leftover {name}: a temporary name (a write in progress or "
                       "interrupted); never deleted by prune")
    return out


def event_line(event: PruneEvent) -> str | None:
    """An action as one plain log line (None for events that are not actions)."""
    if event.kind == "trash":
        return f"removed leftover trash {event.name} (from an interrupted prune)"
    if event.kind == "thinned":
        return f"thinned {event.name}: {word(event.detail or '', 'cli')}"
    if event.kind == "thin-skipped":
        return f"left {event.name} whole: {word(event.detail or '', 'cli')}"
    d = event.decision
    if event.kind not in ("deleted", "skipped", "failed"):
        return None
    what = f"{event.name} ({size(d.entry.bytes)})" if d else str(event.name)
    if event.kind == "deleted":
        return f"deleted {what}: {_reasons(d)}" if d else f"deleted {what}"
    if event.kind == "skipped":
        return f"skipped {what}: kept after all, {word(event.detail or '', 'cli')}"
    return f"FAILED to delete {what}: {word(event.detail or '', 'cli')}"


def headline(plan: PrunePlan) -> str:
    """What the plan does, in one line."""
    n = len(plan.decisions)
    return (f"{plan.listing.root}: {n} checkpoint{'s' if n != 1 else ''} "
            f"({size(plan.bytes_total)}), "
            f"{len(plan.kept)} kept, {len(plan.to_delete)} to delete "
            f"({size(plan.bytes_to_free)})"
            + (f", {sum(d.thin for d in plan.decisions)} to thin"
               if plan.policy.thin_after is not None else ""))


def summary(result: PruneResult) -> str:
    """What happened, in one line."""
    plan = result.plan

    objects = sum(len(k) for k in result.keys.values())
    n_up = len(result.stale_uploads)
    uploads = "" if not n_up else (
        f"; would abort {n_up} unfinished multipart upload(s) (a killed write's)"
        if result.dry_run else
        f"; aborted {len(result.uploads_aborted)} of {n_up} unfinished multipart upload(s)")
    what = (f"{len(plan.to_delete)} checkpoint(s)"
            + (f" ({objects:,} objects)" if result.keys else ""))
    versions = ("; the bucket is versioned: deleted objects stay as noncurrent versions, and "
                "cost money, until a lifecycle rule expires them" if result.versioned else "")
    thin = ""
    if result.thinned:
        before = sum(t.bytes_before for t in result.thinned.values())
        thin = (f"; thinned {len(result.thinned)} checkpoint(s), {size(before)} -> "
                f"{size(before - result.bytes_saved)}, saved {size(result.bytes_saved)}")
    if not plan.to_delete and not result.stale_uploads:
        return f"nothing to delete in {result.path}{thin}"
    if result.dry_run:
        return (f"dry run: would delete {what}, freeing {size(plan.bytes_to_free)}; nothing "
                f"was deleted{uploads}{versions}")
    if result.declined:
        return "nothing was deleted"
    parts = [f"deleted {len(result.named('deleted'))} checkpoint(s), freed "
             f"{size(result.bytes_freed)}", f"{len(plan.kept)} kept"]
    parts += [f"{len(result.named(status))} {status}" for status in ("skipped", "failed")
              if result.named(status)]
    return "; ".join(parts) + uploads + versions + thin
