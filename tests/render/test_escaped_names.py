"""A checkpoint's name is data: human output writes its control characters out (a newline as
``\\x0a``, an escape as ``\\x1b``), so one name cannot forge a line of a cron log or drive the
terminal; ``--json`` keeps names exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from ckpt_cli.errors import visible
from tests.conftest import run_cli

pytestmark = pytest.mark.requires_torch

FORGED = "step_100-\nkeep step_999 (1 GB): forged\x1b[2K"


def _run(tmp_path: Path, forged: str = FORGED) -> Path:
    run = tmp_path / "run"
    for name in (forged, "step_200", "step_300"):
        (run / name).mkdir(parents=True)
        torch.save({"model": {"w": torch.ones(2)}, "step": 1}, run / name / "checkpoint.pt")
    return run


def test_visible_one_line() -> None:
    assert visible("a\nb\tc\x1b") == "a\nb\tc\\x1b"
    assert visible("a\nb\rc\u2028d\tc\x1b", lines=False) == "a\\x0ab\\x0dc\\u2028d\tc\\x1b"


def test_prune_prints_a_newline_in_a_name_escaped(tmp_path: Path) -> None:
    """A name with a line break is no checkpoint (issue 46: listed as skipped), and the
    warning that says so writes it out escaped."""
    run = _run(tmp_path)
    r = run_cli("prune", run, "--keep", "1", "-n")
    assert r.exit_code == 0, r.output
    assert ("warning: step_100-\\x0akeep step_999 (1 GB): forged\\x1b[2K: a line break in its "
            "name") in r.output
    assert not any(line.startswith("keep step_999") for line in r.output.splitlines())
    assert "\x1b" not in r.output
    doc = json.loads(run_cli("prune", run, "--keep", "1", "-n", "--json").stdout)
    assert FORGED not in {c["name"] for c in doc["checkpoints"]}
    assert FORGED in {w["file"] for w in doc["run_warnings"]}  # --json keeps it exact


def test_the_prune_table_escapes_names(tmp_path: Path) -> None:
    from ckpt_cli.ops.prune import PrunePolicy, plan
    from ckpt_cli.render.prune import decisions_table

    run = _run(tmp_path, "step_100-\x1b[2Kkeep step_999 (1 GB): forged\u2028x")
    planned = plan(run, PrunePolicy(keep=1))
    p = planned.plan
    planned.close()
    console = Console(width=200, record=True, force_terminal=False)
    with console.capture() as cap:
        console.print(decisions_table(p))
    text = cap.get()
    assert "step_100-\\x1b[2Kkeep" in text and "\x1b" not in text
    assert "\\u2028x" in text and "\u2028" not in text
    assert not any(line.lstrip().startswith("keep step_999") for line in text.splitlines())


def test_an_error_naming_a_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "x\nckpt: error: forged.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    r = run_cli("inspect", bad)
    assert r.exit_code == 2, r.output
    assert len(r.stderr.splitlines()) <= 2  # the error, perhaps a hint
    assert r.stderr.startswith("ckpt: error: ") and "x\\x0ackpt: error: forged" in r.stderr


def test_a_finding_naming_a_tensor_is_one_line(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({"a\nerror: forged": torch.ones(4)}, path)
    with open(path, "ab") as f:
        f.write(b"junk")
    r = run_cli("validate", path)
    assert r.exit_code == 1
    assert not any(line.startswith("error: forged") for line in r.output.splitlines())
