"""The results of the commands whose engines live in ``trust/`` (``resume-path``, ``watch
--once``): what the CLI prints and the Python API returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli.documents import Documented

if TYPE_CHECKING:
    from ckpt_cli.ops.resume import ResumeChoice, ResumeSurvey
    from ckpt_cli.ops.watch import WatchEvent


@dataclass(slots=True)
class ResumePathResult(Documented):
    """The checkpoint to resume a run from (``ckpt resume-path``).

    Attributes:
        run: The run directory.
        survey: What the ledger offered and what was passed over, with why
            (:class:`~ckpt_cli.ops.resume.ResumeSurvey`).
        verify: ``sizes`` or ``full`` (every file hashed against its manifest).
    """

    run: Path
    survey: ResumeSurvey
    verify: str = "sizes"

    command = "resume-path"

    @property
    def choice(self) -> ResumeChoice | None:
        """The newest verified checkpoint that still matches its manifest, or None."""
        return self.survey.choice

    @property
    def path(self) -> Path | None:
        """The checkpoint to resume from, or None."""
        return self.choice.path if self.choice is not None else None

    @property
    def step(self) -> int | None:
        """Its step, from the run ledger."""
        return self.choice.entry.step if self.choice is not None else None

    @property
    def rejected(self) -> list[tuple[str, str]]:
        """``(path, why)`` of the checkpoints the ledger trusted that failed the re-check
        (newer than the choice; all of them when there is none)."""
        return list(self.survey.rejected)

    @property
    def ignored(self) -> list[str]:
        """Ledger paths ignored because they name no checkpoint directly in the run."""
        return list(self.survey.ignored)

    @property
    def unreadable_lines(self) -> int:
        """Ledger lines that could not be read (torn by a crash, edited by hand): skipped."""
        return self.survey.unreadable

    @property
    def ok(self) -> bool:
        """Whether there is a checkpoint to resume from (exit status 0)."""
        return self.choice is not None

    def json_body(self) -> dict[str, Any]:
        """The ``resume-path --json`` document without ``schema_version`` and ``command``."""
        return {"run": str(self.run), "path": str(self.path) if self.path else None,
                "step": self.step, "verify": self.verify,
                "rejected": [{"path": p, "problem": why} for p, why in self.rejected],
                "ignored": self.ignored, "unreadable_lines": self.unreadable_lines}


@dataclass(slots=True)
class WatchResult(Documented):
    """One pass of ``ckpt watch --once`` over a run (or a directory of runs).

    Attributes:
        run: The directory watched.
        events: What the pass had to say, in order: ``verified``, ``abandoned``, ``pruned``,
            ``error``, ``pending`` (one JSON line each with ``--json``).
    """

    run: Path
    events: list[WatchEvent] = field(default_factory=list)

    command = "watch"

    @property
    def bad(self) -> list[WatchEvent]:
        """The events reporting a bad checkpoint or a failure."""
        return [e for e in self.events if e.bad]

    @property
    def ok(self) -> bool:
        """Whether nothing bad was found (exit status 0)."""
        return not self.bad

    @property
    def verified(self) -> list[str]:
        """The checkpoints verified good in this pass (relative to their run)."""
        return [e.path for e in self.events
                if e.event == "verified" and not e.bad and e.path is not None]

    def json_body(self) -> dict[str, Any]:
        """``{run, ok, events}``: ``events`` holds the lines ``watch --once --json`` prints,
        one object per event."""
        return {"run": str(self.run), "ok": self.ok,
                "events": [e.to_json() for e in self.events]}
