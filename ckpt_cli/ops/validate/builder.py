"""The verdict of one checkpoint's checks: :class:`Builder` collects findings and summaries
per check (pickle globals the user allowed become notes) and turns them into
:class:`CheckResult` rows in :data:`CHECKS` order, with a status from the worst finding."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ckpt_cli.formats import allowlist
from ckpt_cli.formats.base import rel_to
from ckpt_cli.model import Finding
from ckpt_cli.ops.validate.result import CHECKS, CheckResult, Status

RATE_MIN = 64 << 20  # below this, a speed says more about start-up than throughput


def check_result(check_id: str, findings: list[Finding], summary: str) -> CheckResult:
    findings = _dedupe(findings)
    status: Status = ("fail" if any(f.severity == "error" for f in findings) else
                      "warn" if any(f.severity == "warning" for f in findings) else "pass")
    return CheckResult(check_id, status, summary, findings)


def _dedupe(findings: list[Finding]) -> list[Finding]:
    seen: set[tuple[str, str, str | None, str | None]] = set()
    out = []
    for f in findings:
        key = (f.code, f.message, f.file, f.location)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


class Builder:
    """Collects findings per check for one checkpoint."""

    def __init__(self, allowed: tuple[str, ...] = ()) -> None:
        self.allowed = allowed  # --allow-global: these globals' findings become notes
        self.findings: dict[str, list[Finding]] = {}
        self.summaries: dict[str, str] = {}
        self.skipped: dict[str, str] = {}

    def add(self, check_id: str, findings: Iterable[Finding] = (),
            summary: str | None = None) -> None:
        self.findings.setdefault(check_id, []).extend(allowlist.allow(list(findings),
                                                                      self.allowed))
        if summary is not None:
            self.summaries[check_id] = summary

    def skip(self, check_id: str, why: str) -> None:
        self.skipped[check_id] = why

    def results(self) -> list[CheckResult]:
        out = []
        for cid in CHECKS:
            if cid in self.findings:
                out.append(check_result(cid, self.findings[cid], self.summaries.get(cid, "")))
            elif cid in self.skipped:
                out.append(CheckResult(cid, "skip", self.skipped[cid]))
        return out


def has_errors(b: Builder) -> bool:
    return any(f.severity == "error" for fs in b.findings.values() for f in fs)


def rel_path(p: str | Path | None, checkpoint: Path) -> str | None:
    """An error's path relative to the checkpoint (None for the checkpoint directory)."""
    if p is None:
        return None
    base = checkpoint if checkpoint.is_dir() else checkpoint.parent
    q = Path(str(p).split("@", 1)[0])  # DCP items are named file@offset
    if q == base:
        return None
    return rel_to(q, base)
