"""The options of ``ckpt resume-path`` (:func:`ckpt_cli.ops.resume.survey`):
:class:`ResumePathOptions`, each field the one declaration of a ``ckpt resume-path`` flag and
a ``ckpt_cli.resume_path()`` keyword (light: its ``--help`` builds its flags from it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ckpt_cli.optionspec import option


@dataclass(frozen=True, slots=True)
class ResumePathOptions:
    """How ``ckpt resume-path`` checks that the checkpoint it names is still what was
    verified (declared once: see :mod:`ckpt_cli.optionspec`)."""

    full: bool = option(False, help=(
        "Hash every file against the manifest (default: only files whose size, modification "
        "time or inode changed since the verdict)."))

    @property
    def verify(self) -> Literal["full", "sizes"]:
        """What :func:`~ckpt_cli.ops.resume.survey` checks: ``full`` or ``sizes``."""
        return "full" if self.full else "sizes"
