"""The ``diff --json`` document (docs/json-schema.md, section ``diff``), built from the result
types without rich: the CLI prints it, ``DiffResult.to_dict()`` returns it."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpt_cli.model import CheckpointIndex
    from ckpt_cli.ops.diff.result import DiffResult, MetaDiff, ModuleDiff, OnlyIn, TensorDiff


def _num(x: float) -> float | None:
    """A statistic for JSON: non-finite values (a change from zero, NaN mismatches) are null."""
    return x if math.isfinite(x) else None


def _side(index: CheckpointIndex, path: str, compared: int,
          excluded: dict[str, int]) -> dict[str, Any]:
    return {"path": path, "format": index.format, "flavor": index.flavor,
            "num_files": len(index.files), "file_bytes": index.file_bytes,
            "num_tensors": len(index.tensors), "num_parameters": index.num_parameters,
            "compared": compared, "excluded": excluded,
            "warnings": [f.to_dict() for f in index.findings]}


def _only(o: OnlyIn) -> dict[str, Any]:
    return {"name": o.name, "original_name": o.original, "dtype": o.dtype,
            "shape": list(o.shape), "group": o.group, "tied_to": o.tied_to, "tie": o.tie}


def tensor_json(t: TensorDiff) -> dict[str, Any]:
    """One common tensor's JSON form (statistics null when values were not compared)."""
    s, tol = t.stats, t.tolerance
    return {
        "name": t.name, "name_a": t.name_a, "name_b": t.name_b, "group": t.group,
        "dtype_a": t.dtype_a, "dtype_b": t.dtype_b, "shape_a": list(t.shape_a),
        "shape_b": list(t.shape_b), "status": t.status, "reason": t.reason,
        "elements": s.elements if s else None,
        "elements_changed": s.changed if s else None,
        "elements_outside_tolerance": s.outside if s else None,
        "nonfinite_mismatches": s.nonfinite_mismatches if s else None,
        "nonfinite_matched": s.nonfinite_matched if s else None,
        "max_abs": _num(s.max_abs) if s and not s.raw_only else None,
        "mean_abs": _num(s.mean_abs) if s and not s.raw_only else None,
        "rel_l2": _num(s.rel_l2) if s and not s.raw_only else None,
        "norm_a": _num(s.norm_a) if s and not s.raw_only else None,
        "norm_b": _num(s.norm_b) if s and not s.raw_only else None,
        "norm_diff": _num(s.norm_diff) if s and not s.raw_only else None,
        "rtol": tol.rtol if tol else None, "atol": tol.atol if tol else None,
        "tolerance": tol.source if tol else None,
    }


def _meta(m: MetaDiff) -> dict[str, Any]:
    return {"key": m.key, "a": m.a, "b": m.b, "status": m.status, "provenance": m.provenance,
            "follows": m.follows}


def _module(m: ModuleDiff) -> dict[str, Any]:
    return {"name": m.name, "tensors": m.tensors, "changed": m.changed,
            "only_in_a": m.only_in_a, "only_in_b": m.only_in_b, "parameters": m.parameters,
            "norm_a": _num(m.norm_a), "norm_b": _num(m.norm_b),
            "norm_diff": _num(m.norm_diff), "rel_l2": _num(m.rel_l2)}


def summary_counts(r: DiffResult) -> dict[str, int]:
    """The ``summary`` object: how many tensors and values fall in each outcome."""
    counts = {s: len(r.with_status(s)) for s in ("identical", "within_tolerance", "changed",
                                                 "shape_changed", "skipped", "not_compared")}
    compared = [t.stats for t in r.tensors if t.stats is not None]
    return {
        "common": len(r.tensors), **counts,
        "only_in_a": len(r.only_a), "only_in_b": len(r.only_b),
        "tied_only_in_a": sum(o.tied_to is not None for o in r.only_a),
        "tied_only_in_b": sum(o.tied_to is not None for o in r.only_b),
        "dtype_changes": len(r.dtype_changes),
        "metadata_changed": len(r.metadata_changes),
        "metadata_only_in_a": sum(m.status == "only_in_a" for m in r.metadata),
        "metadata_only_in_b": sum(m.status == "only_in_b" for m in r.metadata),
        "elements_compared": sum(s.elements for s in compared),
        "elements_changed": sum(s.changed for s in compared),
    }


def document(r: DiffResult) -> dict[str, Any]:
    """The ``diff --json`` document without ``schema_version``/``command``.

    The per-module roll-up is there with ``r.options.by_module`` (at ``r.options.depth``).

    Args:
        r: The result.

    Returns:
        The document (layout in docs/json-schema.md).
    """
    o = r.options
    path_a = r.path_a or str(r.index_a.root)
    path_b = r.path_b or str(r.index_b.root)
    doc: dict[str, Any] = {
        "a": _side(r.index_a, path_a, len(r.tensors) + len(r.only_a), r.excluded_a),
        "b": _side(r.index_b, path_b, len(r.tensors) + len(r.only_b), r.excluded_b),
        "equal": r.equal,
        "differences": r.differences(),
        "scope": r.scope,
        "scope_note": r.scope_note,
        "optimizer_ids": r.optimizer_ids,
        "values_compared": not o.structure_only,
        "metadata_compared": o.metadata,
        "same_checkpoint": r.same_checkpoint,
        "options": {"rtol": o.rtol, "atol": o.atol, "strip_prefixes": list(o.strip_prefix),
                    "auto_names": not o.exact_names, "filter": o.name_glob},
        "renames": [dataclasses.asdict(x) for x in r.renames],
        "summary": summary_counts(r),
        "only_in_a": [_only(x) for x in r.only_a],
        "only_in_b": [_only(x) for x in r.only_b],
        "tensors": [tensor_json(t) for t in r.tensors],
        "followed": {"a": r.followed_a.to_dict() if r.followed_a else None,
                     "b": r.followed_b.to_dict() if r.followed_b else None},
        "metadata": [_meta(m) for m in r.metadata],
        "provenance_differences": r.provenance_differences,
    }
    if o.by_module:
        doc["modules"] = [_module(m) for m in r.by_module(o.depth)]
    if r.dequantized or r.fp8_unpaired:
        doc["quantization"] = quantization_json(r)
    return doc


def quantization_json(r: DiffResult) -> dict[str, Any]:
    """The ``quantization`` object: the FP8 weights compared dequantized and their errors."""
    rows = [t for t in r.tensors if t.name in r.dequantized]
    errors = sorted(x for t in rows if (x := t.finite_rel_l2()) is not None)
    tensors = []
    above = []
    for t in rows:
        dq = r.dequantized[t.name]
        bound = dq.error_bound()
        rel = t.finite_rel_l2()
        if rel is not None and rel > bound:
            above.append(t.name)
        tensors.append({"name": t.name,
                        "a": {"scale": dq.scale_a, "layout": dq.layout_a} if dq.scale_a
                        else None,
                        "b": {"scale": dq.scale_b, "layout": dq.layout_b} if dq.scale_b
                        else None,
                        "status": t.status, "rel_l2": rel,
                        "max_abs": _num(t.stats.max_abs) if t.stats else None,
                        "bound": bound})
    return {"dequantized": len(rows),
            "quantized_side": r.quantized_side(),
            "rel_l2_median": errors[len(errors) // 2] if errors else None,
            "rel_l2_max": errors[-1] if errors else None,
            "above_bound": above,
            "scales_a": r.scales_a, "scales_b": r.scales_b,
            "unpaired": r.fp8_unpaired,
            "tensors": tensors}
