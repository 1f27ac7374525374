"""The human tables of ``inspect``: a checkpoint's summary, bytes per group, files, tensors and
module tree, and a run directory's checkpoints. Built with :func:`.human.table` and
:func:`.human.grid`, so they drop columns on a narrow terminal and never cut a name."""

from __future__ import annotations

import datetime as _dt
from typing import Any

from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from ckpt_cli.model import GROUPS, CheckpointIndex, RunListing, TensorInfo
from ckpt_cli.render.human import Col, bar, count, grid, shape, size, table
from ckpt_cli.units import natural_key


def summary_table(index: CheckpointIndex, title: str | None = None) -> Table:
    """The key facts of a checkpoint as a two-column grid."""
    g = grid()
    fmt = index.format + (f" ({index.flavor})" if index.flavor and index.flavor != index.format
                          else "")
    g.add_row("Format", fmt)
    g.add_row("Files", f"{len(index.files)} file{'s' if len(index.files) != 1 else ''}, "
              f"{size(index.file_bytes)} on disk")
    g.add_row("Tensors", f"{len(index.tensors):,}")
    n = index.num_parameters
    g.add_row("Parameters", f"{n:,}" + (f" ({count(n)})" if n >= 1000 else ""))
    tied = index.tied_tensors()
    # Ties matter to the parameter count where a weight is involved; ties among optimizer or
    # callback state (a Lightning checkpoint's scores and paths) are counted, not listed.
    weights = [t for t in tied if any(
        n in index.tensors and index.tensors[n].group == "model"
        for n in (t["name"], t["tied_to"]))]
    others = len(tied) - len(weights)
    if weights or others:
        text = tied_text(weights) if weights else ""
        if others:
            text += ("; " if text else "") + (
                f"{others} among tensors that are not weights (optimizer, callbacks): "
                "no effect on the parameter count")
        g.add_row("Tied", text)
    meta = index.metadata
    step, source = index.step, index.step_source
    facts = [f"step {step:,}" + (" (from the name; none recorded)" if source == "name" else "")
             ] if step is not None else []
    facts += [f"{k} {_fmt(meta[k])}" for k in ("epoch", "lr") if k in meta]
    if facts:
        g.add_row("Training", ", ".join(facts))
    sched = meta.get("scheduler")
    if isinstance(sched, dict) and sched:
        # Where the schedule stands first; torch's private flags say nothing to a reader.
        first = [k for k in ("last_epoch", "_last_lr", "last_batch_iteration", "num_steps")
                 if k in sched]
        rest = [k for k in sched if k not in first and not (
            k.startswith("_") and isinstance(sched[k], bool))]
        g.add_row("Scheduler", ", ".join(f"{k.lstrip('_')} {_fmt(sched[k])}"
                                         for k in (first + rest)[:6]))
    rng = meta.get("rng_states")
    if isinstance(rng, list) and rng:
        g.add_row("RNG state", ", ".join(str(r) for r in rng))
    versions = [f"{k} {meta[k]}" for k in ("ds_version", "pytorch-lightning_version",
                                            "checkpoint_version", "dcp_version") if k in meta]
    if versions:
        g.add_row("Versions", ", ".join(versions))
    dt = {k: v for k, v in index.params_by_dtype.items() if v}
    total = sum(dt.values()) or 1
    if dt:
        # Elements, not parameters: buffers count here too (so the sum can exceed Parameters).
        g.add_row("Dtypes", ", ".join(f"{k} {count(v)} ({100 * v / total:.0f}%)"
                                      for k, v in sorted(dt.items(), key=lambda kv: -kv[1]))
                  + " elements of weights and buffers")
    master = index.layout.get("master_weights")
    if isinstance(master, dict):
        # ZeRO-3: the model states hold placeholders; say where the weights are instead.
        g.add_row("Weights", f"{master['dtype']} master weights in {master['partitions']} "
                  f"flat partitions (optimizer files): {master['parameters']:,} parameters, "
                  f"{size(master['consolidated_bytes'])} once consolidated "
                  "(ckpt consolidate)")
    lay = {k: v for k, v in index.layout.items()
           if v not in (None, [], {}) and k not in ("ranks", "master_weights")}
    if lay:
        g.add_row("Layout", ", ".join(f"{k} {_fmt(v)}" for k, v in lay.items()))
    return g


_TIE_HOW = {"storage": "one storage", "values": "same shape, dtype and sampled bytes"}


def tied_text(tied: list[dict[str, Any]], limit: int = 3) -> str:
    """Tied tensors in a sentence each, saying which are counted once and which twice."""
    parts = []
    for t in tied[:limit]:
        if t["counted_twice"]:
            parts.append(f"{t['name']} may repeat {t['tied_to']} (same shape and dtype; bytes "
                         "not compared): counted twice")
        else:
            parts.append(f"{t['name']} = {t['tied_to']} ({_TIE_HOW.get(t['tie'], t['tie'])}): "
                         "counted once")
    if len(tied) > limit:
        parts.append(f"and {len(tied) - limit} more")
    return "; ".join(parts)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list) and len(v) <= 8:
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def group_table(index: CheckpointIndex) -> Table:
    """Bytes per group with bars: model vs buffers vs optimizer vs the rest."""
    groups = index.bytes_by_group
    total = sum(groups.values()) or 1
    out = table(Col("Group", kind="name"), Col("Bytes", "right"),
                Col("Share", "right", drop=1), Col(kind="bar", drop=0))
    for g in GROUPS:
        n = groups.get(g, 0)
        out.add_row(g, size(n), f"{100 * n / total:.0f}%", bar(n / total))
    return out


def files_table(index: CheckpointIndex, limit: int = 20) -> Table:
    """The checkpoint's files in name order (shard 1 of N first; numbers compared as numbers),
    the first ``limit`` of them, then one row counting the rest."""
    out = table(Col("File", kind="name"), Col("Role", drop=0), Col("Format", drop=1),
                Col("Size", "right", drop=2))
    files = sorted(index.files, key=lambda f: natural_key(f.path))
    for f in files[:limit]:
        out.add_row(f.path, f.role, f.format or "?", size(f.bytes))
    rest = files[limit:]
    if rest:
        out.add_row(f"... {len(rest)} more", "", "", size(sum(f.bytes for f in rest)))
    return out


TENSOR_ROWS = 1000
"""Rows of ``--tensors`` by default: the first and last half each, the rest counted in one row
(a rich table of a million rows costs minutes and gigabytes to lay out)."""


def tensors_table(tensors: list[TensorInfo], limit: int | None = None) -> Table:
    """One row per tensor.

    Args:
        tensors: The tensors, in the order to list them.
        limit: At most this many rows: the first ``limit // 2``, a row counting the rest (their
            parameters and bytes), and the last. None lists every tensor.

    Returns:
        The table.
    """
    out = table(Col("Name", kind="name"), Col("Dtype", drop=4), Col("Shape", drop=3),
                Col("Params", "right", drop=2), Col("Bytes", "right", drop=1),
                Col("Group", drop=0))
    head, hidden = len(tensors), 0
    if limit is not None and len(tensors) > limit:
        head, hidden = limit // 2, len(tensors) - limit
    for t in tensors[:head]:
        out.add_row(t.name, t.dtype, shape(t), f"{t.numel:,}", size(t.nbytes), t.group)
    if hidden:
        rest = tensors[head:head + hidden]
        out.add_row(Text(f"... {hidden:,} more (--all-rows lists every one)", style="dim"), "", "",
                    f"{sum(t.numel for t in rest):,}", size(sum(t.nbytes for t in rest)), "")
        for t in tensors[head + hidden:]:
            out.add_row(t.name, t.dtype, shape(t), f"{t.numel:,}", size(t.nbytes), t.group)
    return out


_GROUP_WORDS = {"buffer": "buffers", "optimizer": "optimizer state", "other": "other"}


def tree_label(n: Any) -> str:
    """What a module tree node holds, counted as the summary counts.

    ``30 tensors, 134.9K params, 543.7 kB (buffers 4.1 kB), 1 tied copy (not counted again)``;
    a node of optimizer state only: ``84 tensors, 1.1 MB optimizer state``.
    """
    parts = [f"{n.tensors:,} tensor{'s' if n.tensors != 1 else ''}"]
    if n.parameters:
        parts.append(f"{count(n.parameters)} params")
    others = [(_GROUP_WORDS.get(g, g), b) for g, b in n.bytes_by_group.items()
              if g != "model" and b]
    if n.bytes:
        text = size(n.bytes)
        if len(others) == 1 and not n.bytes_by_group.get("model"):
            text += f" {others[0][0]}"
        elif others:
            text += " (" + ", ".join(f"{w} {size(b)}" for w, b in others) + ")"
        parts.append(text)
    if n.tied:
        parts.append(f"{n.tied:,} tied cop{'ies' if n.tied != 1 else 'y'} (not counted again)")
    return ", ".join(parts)


def module_tree(node: Any) -> Tree:
    """A rich tree of module prefixes with tensor counts, parameters and bytes."""
    def label(n: Any) -> Text:
        t = Text(n.name, style="bold")
        t.append(f"  {tree_label(n)}", style="dim")
        return t

    tree = Tree(label(node))
    stack = [(node, tree)]
    while stack:
        n, branch = stack.pop()
        stack.extend((child, branch.add(label(child))) for child in n.children.values())
    return tree


RUN_ROWS = 20
"""Rows of a run table by default: the oldest and newest half each, the rest counted."""


def run_table(run: RunListing, limit: int | None = None) -> Table:
    """A run directory's checkpoints, oldest first.

    Args:
        run: The listing.
        limit: At most this many rows: the oldest ``limit // 2``, a row counting the rest,
            and the newest (incomplete and pointed-to entries among the rest are counted
            too). None shows every entry.

    Returns:
        The table.
    """
    out = table(Col("Checkpoint", kind="name"), Col("Step", "right", drop=4),
                Col("Modified", drop=2), Col("Size", "right", drop=3),
                Col("Files", "right", drop=0), Col("Format", drop=1),
                Col("Status", kind="text"))
    entries, hidden = run.entries, []
    if limit is not None and len(entries) > limit:
        head = limit // 2
        hidden = entries[head:len(entries) - (limit - head)]
        entries = [*entries[:head], *entries[len(entries) - (limit - head):]]
    for i, e in enumerate(entries):
        if hidden and i == limit // 2:  # type: ignore[operator]
            out.add_row(*_hidden_row(hidden))
        when = _dt.datetime.fromtimestamp(e.mtime).strftime("%Y-%m-%d %H:%M") if e.mtime else "-"
        status = Text("complete", style="green") if e.complete else Text(
            f"incomplete: {e.reason}", style="red")
        if e.latest:
            status.append(", latest", style="bold")
        out.add_row(e.name, "-" if e.step is None else f"{e.step:,}", when, size(e.bytes),
                    f"{e.files:,}", e.format or "?", status)
    return out


def _hidden_row(hidden: list[Any]) -> tuple[Text | str, ...]:
    """The row standing for entries a run table leaves out: how many, their size, and any
    among them that are incomplete or pointed to (so truncation never hides a problem)."""
    bad = sum(1 for e in hidden if not e.complete)
    latest = [e.name for e in hidden if e.latest]
    status = Text(f"{bad:,} incomplete", style="red") if bad else Text("all complete",
                                                                        style="green")
    if latest:
        status.append(f", latest: {', '.join(latest[:2])}", style="bold")
    status.append(" (--all)", style="dim")
    return (Text(f"... {len(hidden):,} more", style="dim"), "", "",
            size(sum(e.bytes for e in hidden)), f"{sum(e.files for e in hidden):,}", "",
            status)
