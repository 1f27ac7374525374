"""Output of ``ckpt diff``: the summary and tables for people, the JSON document for machines."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckpt_cli.fp8.scheme import expected_error, fraction
from ckpt_cli.ops.diff.result import (
    DiffResult,
    MetaDiff,
    ModuleDiff,
    OnlyIn,
    TensorDiff,
    error_bound,
    quantized_side,
    rel_l2_of,
)
from ckpt_cli.render import human
from ckpt_cli.render.human import note_followed
from ckpt_cli.render.json import emit_result

_STATUS_STYLE = {"equal": "bold green", "different": "bold red"}


# --- people ----------------------------------------------------------------------------------

def _g(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf"
    return f"{x:.3g}"


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _short(v: Any, width: int = 40) -> str:
    text = "-" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))
    return text if len(text) <= width else text[: width - 1] + "…"


def _names(items: list[str], limit: int = 3) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", … {len(items) - limit} more" if len(items) > limit else "")


def summary(r: DiffResult, path_a: str, path_b: str) -> Table:
    """The summary grid: sides, names, scope, tensors, dtypes, metadata and the verdict."""
    grid = human.grid()
    for label, ix, path in (("A", r.index_a, path_a), ("B", r.index_b, path_b)):
        fmt = ix.format + (f" ({ix.flavor})" if ix.flavor and ix.flavor != ix.format else "")
        _add(grid, label, human.Folded(f"{path}  ({fmt}, {_plural(len(ix.tensors), 'tensor')}, "
                                       f"{human.size(ix.file_bytes)})"))
    if r.renames:
        _add(grid, "Names", "; ".join(
            f"{x.side.upper()}: stripped {x.prefix!r} from {_plural(x.tensors, 'name')}"
            f"{' (automatic)' if x.source == 'auto' else ''}" for x in r.renames))
    scope = ("model weights and buffers" if r.scope == "weights" else "all tensors")
    excluded = [f"{side} " + ", ".join(f"{n:,} {g}" for g, n in sorted(ex.items()))
                for side, ex in (("A", r.excluded_a), ("B", r.excluded_b)) if ex]
    if r.options.name_glob:
        scope += f" matching {r.options.name_glob!r}"
    if excluded:
        scope += "; not compared: " + "; ".join(excluded)
        if r.scope == "weights":
            scope += " (--all-tensors compares them)"
    if r.scope_note:
        scope += f" ({r.scope_note})"
    _add(grid, "Scope", scope)
    if r.optimizer_ids:
        _add(grid, "Optimizer", r.optimizer_ids)
    _add(grid, "Tensors", _tensor_line(r))
    if r.same_checkpoint and not r.options.structure_only:
        _add(grid, "Values", f"not read: {r.same_checkpoint}")
    for line in _dtype_lines(r):
        _add(grid, "Dtypes", line)
    only = [(side, items) for side, items in (("A", r.only_a), ("B", r.only_b)) if items]
    for side, items in only:
        text = f"{side}: {_plural(len(items), 'tensor')} ({_names([o.name for o in items])})"
        tied = [o for o in items if o.tied_to]
        if tied:
            text += "; not a difference: " + _names(
                [f"{o.name} is a tied copy of {o.tied_to}" for o in tied])
        _add(grid, "Only in", text)
    if r.dequantized or r.fp8_unpaired:
        _add(grid, "Quantized", _quant_line(r))
    if r.options.metadata:
        _add(grid, "Metadata", _meta_line(r))
    diffs = r.differences()
    verdict = Text("equal" if not diffs else "different", style=_STATUS_STYLE[
        "equal" if not diffs else "different"])
    if diffs:
        verdict.append(": " + ", ".join(diffs))
    elif r.with_status("within_tolerance"):
        verdict.append(" (within tolerance)")
    if r.with_status("skipped"):
        verdict.append(f"; {_plural(len(r.with_status('skipped')), 'tensor')} not compared",
                       style="yellow")
    _add(grid, "Result", verdict)
    return grid


def _quant_line(r: DiffResult) -> str:
    """What was dequantized, the errors, and what is normal (the bound docs/fp8.md states)."""
    rows = [t for t in r.tensors if t.name in r.dequantized]
    unpaired = ("FP8 without a usable scale: " + _names(r.fp8_unpaired, 2)
                if r.fp8_unpaired else "")
    if not rows:
        return unpaired
    side = {"a": "A", "b": "B", "both": "A and B"}[quantized_side(r)]
    layouts = sorted({d.layout or "" for d in r.dequantized.values()} - {""})
    line = (f"{_plural(len(rows), 'FP8 weight')} compared dequantized (weight x scale in "
            f"FP32; quantized in {side}, {', '.join(layouts)} layout)")
    errors = sorted(x for t in rows if (x := rel_l2_of(t)) is not None)
    if errors:
        line += (f"; relative L2 error median {fraction(errors[len(errors) // 2])}, max "
                 f"{fraction(errors[-1])}")
    bounds = ", ".join(f"{lay} {fraction(expected_error(lay))}" for lay in layouts)
    line += (f". Normal for one E4M3 rounding: about 2-4% (3 mantissa bits); the bound "
             f"docs/fp8.md states is {bounds}")
    if side == "A and B":
        line += " (x sqrt(2) where both sides are quantized: two roundings)"
    above = [t.name for t in rows if (x := rel_l2_of(t)) is not None
             and x > error_bound(r.dequantized[t.name])]
    if above:
        line += f"; above it: {_names(above)}"
    scales = len(r.scales_a) + len(r.scales_b)
    if scales:
        line += f"; {_plural(scales, 'scale tensor')} paired with their weights (not additions)"
    return line + (f"; {unpaired}" if unpaired else "")


def quant_table(r: DiffResult, top: int | None) -> Table:
    """The dequantized FP8 weights, largest relative L2 error first."""
    rows = sorted((t for t in r.tensors if t.name in r.dequantized),
                  key=lambda t: (-(x if (x := rel_l2_of(t)) is not None else math.inf), t.name))
    table = human.table(_Col("Tensor", kind="name"), _Col("Layout", drop=3),
                        _Col("Dtype", drop=2), _Col("Max abs", "right", drop=1),
                        _Col("Rel L2", "right", drop=4), _Col("Status", kind="text", drop=0))
    for t in rows[:top] if top else rows:
        dq = r.dequantized[t.name]
        lay = " / ".join(f"{s}: {x}" for s, x in (("A", dq.layout_a), ("B", dq.layout_b)) if x)
        rel = rel_l2_of(t)
        bad = rel is not None and rel > error_bound(dq)
        _add(table, t.name, lay, f"{t.dtype_a}→{t.dtype_b}" if t.dtype_changed else t.dtype_a,
             _g(t.stats.max_abs) if t.stats else "-",
             fraction(rel) if rel is not None else "-",
             Text(t.status.replace("_", " ") + (" (above bound)" if bad else ""),
                  style="yellow" if bad or t.status == "changed" else ""))
    return table


def _tensor_line(r: DiffResult) -> str:
    parts = []
    for status, word in (("identical", "identical"), ("within_tolerance", "within tolerance"),
                         ("changed", "changed"), ("shape_changed", "shape changed"),
                         ("skipped", "skipped"), ("not_compared", "values not compared")):
        n = len(r.with_status(status))
        if n:
            parts.append(f"{n:,} {word}")
    line = f"{len(r.tensors):,} in both" + (": " + ", ".join(parts) if parts else "")
    stats = [t.stats for t in r.tensors if t.stats is not None and not t.stats.raw_only]
    total = sum(s.elements for s in stats)
    changed = sum(s.changed for s in stats)
    if total and changed:
        line += f" ({human.count(changed)} of {human.count(total)} elements differ)"
    raw = sum(1 for t in r.with_status("changed") if t.stats is not None and t.stats.raw_only)
    if raw:
        line += f" ({raw:,} compared byte for byte)"
    reasons = sorted({t.reason for t in r.with_status("skipped") if t.reason})
    if reasons:
        line += f"; skipped because {_names(reasons, 2)}"
    return line


def _dtype_lines(r: DiffResult) -> list[str]:
    pairs: dict[tuple[str, str], list[TensorDiff]] = {}
    for t in r.dtype_changes:
        pairs.setdefault((t.dtype_a, t.dtype_b), []).append(t)
    lines = []
    for (da, db), items in pairs.items():
        line = f"{_plural(len(items), 'tensor')} {da} in A, {db} in B"
        tols = {t.tolerance for t in items if t.tolerance is not None}
        if len(tols) == 1:
            tol = next(iter(tols))
            within = sum(t.status in ("identical", "within_tolerance") for t in items)
            how = (f"{tol.source.removeprefix('dtype:')} rounding"
                   if tol.source.startswith("dtype:") else tol.source)
            line += (f"; values compared within {how} (rtol {tol.rtol:.2g}, atol "
                     f"{tol.atol:.2g}): {within:,} equal")
        lines.append(line)
    user = {t.tolerance for t in r.tensors if t.tolerance and t.tolerance.source == "user"}
    if user and not pairs:
        tol = next(iter(user))
        lines.append(f"tolerance rtol {tol.rtol:.2g}, atol {tol.atol:.2g} (--rtol/--atol)")
    return lines


def _meta_line(r: DiffResult) -> str:
    changed = r.metadata_changes
    only_a = [m.key for m in r.metadata if m.status == "only_in_a" and not m.provenance]
    only_b = [m.key for m in r.metadata if m.status == "only_in_b" and not m.provenance]
    parts = []
    if changed:
        parts.append(f"{len(changed)} changed (" + _names(
            [f"{m.key} {_short(m.a, 16)} → {_short(m.b, 16)}" for m in changed]) + ")")
    elif not r.metadata_notes:
        parts.append("values both sides have are equal")
    for side, keys in (("A", only_a), ("B", only_b)):
        if keys:
            parts.append(f"{len(keys)} only in {side}" + (f" ({keys[0]})" if len(keys) == 1
                                                          else ""))
    parts.extend(f"{m.key} {_short(m.a, 16)} → {_short(m.b, 16)} {_as_tensors(m)} "
                 f"({m.follows}; not a difference)" for m in r.metadata_notes)
    keys = r.provenance_differences
    if keys:
        verb = "differs" if len(keys) == 1 else "differ"
        parts.append(f"{_plural(len(keys), 'provenance key')} {verb} (how ckpt made a file; "
                     f"not a difference): {_names(keys)}")
    return "; ".join(parts)


_BAR = 12
_Col = human.Col
_add = human.add_row
_section = human.section


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def changed_table(r: DiffResult, top: int | None) -> Table:
    """Changed tensors, most changed (relative L2) first, with a bar relative to the largest."""
    rows = r.changed
    finite = [t.rel_l2 for t in rows if math.isfinite(t.rel_l2)]
    scale = max(finite, default=0.0)
    table = human.table(_Col("Tensor", kind="name"), _Col("Dtype", drop=2),
                        _Col("Shape", drop=3), _Col("Changed", "right", drop=6),
                        _Col("Max abs", "right", drop=4), _Col("Mean abs", "right", drop=1),
                        _Col("Rel L2", "right", drop=5), _Col(kind="bar", drop=0))
    for t in rows[:top] if top else rows:
        s = t.stats
        assert s is not None
        dtype = t.dtype_a if not t.dtype_changed else f"{t.dtype_a}→{t.dtype_b}"
        frac = 1.0 if not math.isfinite(t.rel_l2) else (t.rel_l2 / scale if scale else 0.0)
        if s.raw_only:  # packed sub-byte values: only bytes were compared
            _add(table, t.name, dtype, _shape(t.shape_a), _plural(s.changed, "byte"), "-", "-",
                 "-", "")
            continue
        changed = f"{100 * s.changed / s.elements:.1f}%" if s.elements else "-"
        if s.nonfinite_mismatches:
            changed += f" ({s.nonfinite_mismatches:,} NaN/inf)"
        _add(table, t.name, dtype, _shape(t.shape_a), changed, _g(s.max_abs),
                      _g(s.mean_abs), _g(t.rel_l2), human.bar(frac, _BAR))
    return table


def only_table(items: list[OnlyIn], top: int | None) -> Table:
    """Tensors on one side only."""
    table = human.table(_Col("Tensor", kind="name"), _Col("Dtype", drop=2),
                        _Col("Shape", drop=1), _Col("Group", drop=0), _Col("Note", kind="text"))
    for o in items[:top] if top else items:
        note = f"tied copy of {o.tied_to} ({o.tie})" if o.tied_to else ""
        if o.original != o.name:
            note = "; ".join(x for x in (f"stored as {o.original}", note) if x)
        _add(table, o.name, o.dtype, _shape(o.shape), o.group, note)
    return table


def shape_table(items: list[TensorDiff], top: int | None) -> Table:
    """Tensors whose shapes differ."""
    table = human.table(_Col("Tensor", kind="name"), _Col("A", kind="text"),
                        _Col("B", kind="text"))
    for t in items[:top] if top else items:
        _add(table, t.name, f"{t.dtype_a} {_shape(t.shape_a)}",
                      f"{t.dtype_b} {_shape(t.shape_b)}")
    return table


def meta_table(items: list[MetaDiff], top: int | None) -> Table:
    """Non-tensor values that differ (changed first, then one-sided)."""
    table = human.table(_Col("Key", kind="name"), _Col("A", kind="text"),
                        _Col("B", kind="text"))
    def quiet(m: MetaDiff) -> bool:
        return m.provenance or m.follows is not None

    order = sorted(items, key=lambda m: (quiet(m), m.status != "changed"))
    for m in order[:top] if top else order:
        style = None if m.status == "changed" and not quiet(m) else "dim"
        tag = (" (provenance)" if m.provenance else
               f" ({_as_tensors(m)})" if m.follows is not None else "")
        _add(table, m.key + tag, _short(m.a), _short(m.b), style=style)
    return table


def most_changed_modules(mods: list[ModuleDiff], top: int | None) -> list[ModuleDiff]:
    """The ``top`` most changed modules (by relative L2; NaN first), still in model order."""
    if not top or len(mods) <= top:
        return mods
    rank = sorted(range(len(mods)), key=lambda i: (
        -math.inf if math.isnan(mods[i].rel_l2) else -mods[i].rel_l2, i))
    return [mods[i] for i in sorted(rank[:top])]


def module_table(mods: list[ModuleDiff]) -> Table:
    """The per-module roll-up, in model order, bars relative to the most changed module."""
    finite = [m.rel_l2 for m in mods if math.isfinite(m.rel_l2)]
    scale = max(finite, default=0.0)
    table = human.table(_Col("Module", kind="name"), _Col("Tensors", "right", drop=2),
                        _Col("Changed", "right", drop=5), _Col("Only A", "right", drop=3),
                        _Col("Only B", "right", drop=3), _Col("Params", "right", drop=1),
                        _Col("Rel L2", "right", drop=4), _Col(kind="bar", drop=0))
    for m in mods:
        frac = 1.0 if not math.isfinite(m.rel_l2) else (m.rel_l2 / scale if scale else 0.0)
        _add(table, m.name, f"{m.tensors:,}", f"{m.changed:,}", f"{m.only_in_a:,}",
                      f"{m.only_in_b:,}", human.count(m.parameters), _g(m.rel_l2),
                      human.bar(frac, _BAR))
    return table


def _as_tensors(m: MetaDiff) -> str:
    """How a value that follows the tensors follows them: a config's dtype as their dtypes,
    the RNG states' list as their names (``diff`` across ``convert --to dcp``)."""
    if m.key.rpartition(".")[2] in ("dtype", "torch_dtype"):
        return "as the tensors' dtypes"
    return "as the tensors"


def _meta_title(r: DiffResult) -> str:
    """``Metadata (16: 1 difference, 15 not: ...)``: only changed values both sides have make a
    difference; one-sided values, provenance and a dtype that follows the tensors are listed
    but are not one, and the heading says so."""
    n = len(r.metadata)
    real = len(r.metadata_changes)
    one_sided = sum(1 for m in r.metadata if m.status != "changed" and not m.provenance)
    prov = sum(1 for m in r.metadata if m.provenance)
    follows = len(r.metadata_notes)
    dtypes_only = all(_as_tensors(m).endswith("dtypes") for m in r.metadata_notes)
    kinds = [f"{k} {what}" for k, what in (
        (one_sided, "on one side only"), (prov, "provenance"),
        (follows, "following the tensors' dtypes" if dtypes_only else "following the tensors"))
        if k]
    head = f"{real} difference{'s' if real != 1 else ''}"
    return f"Metadata ({n:,}: {head}" + (f"; not differences: {', '.join(kinds)}" if kinds
                                         else "") + ")"


def render(r: DiffResult, path_a: str, path_b: str, *, top: int | None = 20,
           by_module: bool = False, depth: int | None = None,
           console: Console | None = None) -> None:
    """Print the summary and the tables of a diff.

    Args:
        r: The result.
        path_a: A's path as given.
        path_b: B's path as given.
        top: Rows per table (None or 0: all).
        by_module: Add the per-module roll-up.
        depth: Module depth of the roll-up.
        console: Where to print (default stdout).
    """
    out = console or human.stdout()
    top = top or None
    out.print(summary(r, path_a, path_b))

    def shown(n: int) -> int:
        return min(n, top) if top else n

    if r.dequantized and not r.options.structure_only:
        n = len([t for t in r.tensors if t.name in r.dequantized])
        _section(out, f"Dequantized FP8 weights ({n:,}, largest error first)", n, shown(n),
                 quant_table(r, top))
    changed = r.changed
    if changed:
        _section(out, f"Changed tensors ({len(changed):,}, most changed first)", len(changed),
                 shown(len(changed)), changed_table(r, top))
    if r.shape_changes:
        _section(out, f"Shape changes ({len(r.shape_changes):,})", len(r.shape_changes),
                 shown(len(r.shape_changes)), shape_table(r.shape_changes, top))
    for side, items in (("A", r.only_a), ("B", r.only_b)):
        if items:
            _section(out, f"Only in {side} ({len(items):,})", len(items), shown(len(items)),
                     only_table(items, top))
    if r.metadata:
        _section(out, _meta_title(r), len(r.metadata), shown(len(r.metadata)),
                 meta_table(r.metadata, top))
    if by_module:
        mods = r.by_module(depth)
        n = shown(len(mods))
        title = f"By module ({len(mods):,}" + (
            f"; the {n:,} most changed, in model order" if n < len(mods) else "") + ")"
        _section(out, title, len(mods), n,
                 module_table(most_changed_modules(mods, top)))


def print_warnings(r: DiffResult) -> None:
    """Each side's reader findings (warnings and errors) on stderr, labelled A or B."""
    for label, ix in (("A", r.index_a), ("B", r.index_b)):
        human.print_findings(dataclasses.replace(f, file=f"{label}: {f.file}" if f.file
                                                 else label) for f in ix.findings)


def show(r: DiffResult, a: str, b: str, *, json: bool, quiet: bool, top: int, by_module: bool,
         depth: int | None) -> None:
    """Print the result: notes and warnings on stderr, the tables or JSON on stdout."""
    if not quiet:
        note_followed(r.followed_a, "A")
        note_followed(r.followed_b, "B")
        print_warnings(r)
    if json:
        emit_result(r)
    else:
        render(r, a, b, top=top, by_module=by_module, depth=depth)
