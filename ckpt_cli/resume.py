"""Deprecated name of :mod:`ckpt_cli.ops.resume` (resume-path's engine moved into ``ops/``).

``ckpt_cli.resume.latest_verified`` was documented; it keeps working for one release, with a
:class:`DeprecationWarning` when a name is taken from here. Import :mod:`ckpt_cli.ops.resume`
(or call :func:`ckpt_cli.resume_path`) instead.
"""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = ("ResumeChoice", "ResumeSurvey", "choose", "latest_verified", "survey")


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"ckpt_cli.resume.{name} moved to ckpt_cli.ops.resume.{name}; the old name "
                  "goes in the next release", DeprecationWarning, stacklevel=2)
    from ckpt_cli.ops import resume  # lazy: the old name, kept for one release

    return getattr(resume, name)
