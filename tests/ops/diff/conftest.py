"""Fixtures and helpers the diff test modules share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import run_cli


def _json(*args: str | Path, code: int = 0) -> dict[str, Any]:
    r = run_cli("diff", *args, "--json")
    assert r.exit_code == code, r.stdout + r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]
