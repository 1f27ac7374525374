"""``ckpt`` run by its ``main()`` in a fresh interpreter, to see what a command imports."""

from __future__ import annotations

import os
import subprocess
import sys


def ckpt_in_child(*argv: str, report: str) -> subprocess.CompletedProcess[str]:
    """Run ``ckpt ARGV`` in a new Python process, then write ``report`` to its stderr.

    ``report`` is a Python expression evaluated after ``main()`` returned or exited; it may
    read ``sys`` and ``code`` (the ``SystemExit`` code, None if main returned).
    """
    code = ("import sys\n"
            "from ckpt_cli.cli.app import main\n"
            f"sys.argv = ['ckpt', *{list(argv)!r}]\n"
            "code = None\n"
            "try:\n    main()\n"
            "except SystemExit as e:\n    code = e.code\n"
            f"sys.stderr.write({report})\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "NO_COLOR": "1"})
