"""The ``prune --json`` document (docs/json-schema.md, section ``prune``), built from the result
types without rich: the CLI prints it, ``PruneResult.to_dict()`` returns it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpt_cli import documents, storage
from ckpt_cli.optionspec import word

if TYPE_CHECKING:
    from ckpt_cli.ops.prune.result import PruneResult
    from ckpt_cli.ops.prune.retention import Decision


def prune_doc(result: PruneResult) -> dict[str, Any]:
    """The ``--json`` document of a prune (see docs/json-schema.md, section ``prune``), without
    ``schema_version`` and ``command``.

    Args:
        result: What the prune planned and did.

    Returns:
        The document body (``emit`` adds ``schema_version`` and ``command``).
    """
    plan = result.plan
    doc: dict[str, Any] = {"path": str(result.path), "dry_run": result.dry_run,
                           "declined": result.declined}
    doc.update(documents.run_dict(plan.listing))
    doc["run_warnings"] += [{**f.to_dict(), "message": word(f.message, result.caller)}
                            for f in plan.findings]
    doc["checkpoints"] = [_decision_dict(result, d) for d in plan.decisions]
    pol = plan.policy
    doc["policy"] = {"keep": pol.keep, "keep_every": pol.keep_every, "keep_best": pol.keep_best,
                     "metric": pol.metric, "mode": pol.mode, "older_than": pol.older_than,
                     "max_total_size": pol.max_total_size, "grace": pol.grace,
                     "keep_abandoned": pol.keep_abandoned,
                     "pattern": result.pattern,
                     "metrics_file": str(result.metrics_file) if result.metrics_file else None}
    doc["newest_valid"] = plan.newest_valid
    doc["note"] = result.note
    remote = not storage.has_file_system(result.path)
    root = result.path
    doc["object_store"] = None if not remote else {
        "versioned": result.versioned,
        "objects_to_delete": sum(len(k) for k in result.keys.values()),
        "keys": {name: [storage.key_url(root, k) for k in keys]
                 for name, keys in result.keys.items()},
        "stale_uploads": [storage.key_url(root, k) for k, _ in result.stale_uploads],
        "uploads_aborted": [storage.key_url(root, k) for k in result.uploads_aborted],
    }
    doc["trash_removed"] = result.trash_removed
    doc["trash_failed"] = result.trash_failed
    doc["summary"] = {
        "checkpoints": len(plan.decisions),
        "kept": len(plan.kept),
        "to_delete": len(plan.to_delete),
        "deleted": len(result.named("deleted")),
        "skipped": len(result.named("skipped")),
        "failed": len(result.named("failed")),
        "bytes_total": plan.bytes_total,
        "bytes_to_free": plan.bytes_to_free,
        "bytes_freed": result.bytes_freed,
    }
    doc["thinning"] = None if pol.thin_after is None else {
        "thin_after": pol.thin_after, "thin_to": pol.thin_to,
        "keep_full_every": pol.keep_full_every,
        "to_thin": [d.entry.name for d in plan.decisions if d.thin],
        "thinned": {name: {"dropped": t.dropped, "dtype": t.dtype,
                           "bytes_before": t.bytes_before, "bytes_after": t.bytes_after}
                    for name, t in result.thinned.items()},
        "skipped": {name: word(why, result.caller) for name, why in result.thin_skipped.items()},
        "bytes_saved": result.bytes_saved,
    }
    return doc


def _decision_dict(result: PruneResult, d: Decision) -> dict[str, Any]:
    out = documents.run_entry_dict(d.entry)
    outcome = result.outcomes.get(d.entry.name)
    out.update({"action": "delete" if d.delete else "keep", "status": result.status(d),
                "kept_by": d.kept_by, "protected_by": d.protected_by,
                "reasons": [word(r, result.caller) for r in d.reasons],
                "metric": d.metric, "valid": d.valid,
                "detail": word(outcome.detail, result.caller) if outcome and outcome.detail
                else None})
    return out
