"""The ``validate --json`` document (docs/json-schema.md, section ``validate``), built from the
result types without rich: the CLI prints it, ``ValidateResult.to_dict()`` returns it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ckpt_cli import documents

if TYPE_CHECKING:
    from ckpt_cli.model import Finding
    from ckpt_cli.ops.validate.result import (
        CheckpointReport,
        CheckResult,
        LatestChoice,
        ManifestResult,
        PartStatus,
        ValidateResult,
    )


def check_dict(c: CheckResult) -> dict[str, Any]:
    """JSON-ready form of one check (findings are listed once, at the checkpoint level)."""
    return {"id": c.id, "title": c.title, "status": c.status, "summary": c.summary,
            "errors": _count(c.findings, "error"), "warnings": _count(c.findings, "warning")}


def manifest_dict(m: ManifestResult) -> dict[str, Any]:
    """JSON-ready form of what was done with the integrity manifest."""
    return {"path": str(m.path), "action": m.action, "algorithm": m.algorithm,
            "files": m.files, "bytes": m.bytes, "seconds": round(m.seconds, 6),
            "threads": m.threads, "bytes_per_second": round(m.throughput),
            "changed": m.changed, "extra": m.extra}


def report_dict(r: CheckpointReport) -> dict[str, Any]:
    """JSON-ready form of one checkpoint's report."""
    owner = {id(f): c.id for c in r.checks for f in c.findings}
    return {"name": r.name, "path": str(r.path), "format": r.format,
            "flavor": r.flavor, "step": r.step, "valid": r.valid,
            "errors": r.errors, "warnings": r.warnings,
            "bytes_read": r.bytes_read, "seconds": round(r.seconds, 6),
            "checks": [check_dict(c) for c in r.checks],
            "findings": [{**f.to_dict(), "check": owner[id(f)]} for f in r.findings],
            "manifest": manifest_dict(r.manifest) if r.manifest else None}


def latest_dict(c: LatestChoice) -> dict[str, Any]:
    """JSON-ready form of ``latest``'s choice."""
    return {"checkpoint": c.name, "path": str(c.path), "step": c.step, "pointer": c.pointer,
            "final_model": c.final_model}


def part_dict(p: PartStatus) -> dict[str, Any]:
    """JSON-ready form of where a split validation stands (``part``, ``finalize``)."""
    return {"index": p.index, "count": p.count, "origin": p.origin, "files": p.files,
            "bytes": p.bytes, "total_files": p.total_files, "plan": p.plan,
            "staging": str(p.staging) if p.staging is not None else None,
            "finalized": p.finalized, "finalized_elsewhere": p.finalized_elsewhere,
            "waiting_for": p.waiting_for}


def result_dict(result: ValidateResult) -> dict[str, Any]:
    """The document without ``schema_version``/``command`` (and ``strict``)."""
    owner = {id(f): c.id for c in result.run_checks for f in c.findings}
    findings = result.findings
    extra: dict[str, Any] = {"part": part_dict(result.part)} if result.part is not None else {}
    if result.latest is not None:
        extra["latest"] = latest_dict(result.latest)
    return {**extra,
        "path": str(result.path), "kind": result.kind, "valid": result.valid,
        "summary": {"checkpoints": len(result.checkpoints),
                    "valid": sum(r.valid for r in result.checkpoints),
                    "invalid": sum(not r.valid for r in result.checkpoints),
                    "errors": _count(findings, "error"),
                    "warnings": _count(findings, "warning"),
                    "bytes_read": sum(r.bytes_read for r in result.checkpoints),
                    "seconds": round(sum(r.seconds for r in result.checkpoints), 6)},
        "checkpoints": [report_dict(r) for r in result.checkpoints],
        "run": documents.run_dict(result.run) if result.run is not None else None,
        "run_checks": [check_dict(c) for c in result.run_checks],
        "final_model": result.final_model,
        "run_findings": [{**f.to_dict(), "check": owner[id(f)]}
                         for c in result.run_checks for f in c.findings],
    }


def _count(findings: Iterable[Finding], severity: str) -> int:
    return sum(1 for f in findings if f.severity == severity)
