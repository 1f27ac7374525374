"""Deprecated name of :mod:`ckpt_cli.ops.resume` (resume-path's engine moved into ``ops/``).

``ckpt_cli.resume.latest_verified`` was documented; it keeps working for one release, with a
:class:`DeprecationWarning`. Import :mod:`ckpt_cli.ops.resume` (or call
:func:`ckpt_cli.resume_path`) instead.
"""

from __future__ import annotations

import warnings

from ckpt_cli.ops.resume import ResumeChoice, ResumeSurvey, choose, latest_verified, survey

__all__ = ["ResumeChoice", "ResumeSurvey", "choose", "latest_verified", "survey"]

warnings.warn("ckpt_cli.resume moved to ckpt_cli.ops.resume; the old name goes in the next "
              "release", DeprecationWarning, stacklevel=2)
