"""Retention after a rollback (issue 45 item 4): the higher steps a resume from an earlier step
left behind take no place of ``--keep``; ``--keep N`` holds N checkpoints of the current timeline
and the rollback origin survives the watcher's retention.

Runs are written by the real DCP training loop (tests/helpers/dcp_loop.py: ``step_2`` ...
``step_12`` and a ``latest`` pointer, then resumed from ``step_6``, saving ``step_8`` again in
place); verdicts by ``ckpt watch --once``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckpt_cli.ops.resume import choose
from tests.conftest import run_cli
from tests.trust.test_watch import ENV, ROOT, watch_once

pytestmark = pytest.mark.requires_torch


def _loop(run: Path, saves: int, *extra: str) -> None:
    r = subprocess.run([sys.executable, "-m", "tests.helpers.dcp_loop", str(run), str(saves),
                        *extra], env=ENV, cwd=ROOT, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]


def _rolled_back(run: Path) -> None:
    """Saves 2..12 verified, then a resume from step_6 that saved step_8 again."""
    _loop(run, 6)
    code, events, err = watch_once(run)
    assert code == 0 and len(events) == 6, (events, err)
    _loop(run, 4, "--resume-from", "6")
    assert (run / "latest").read_text().strip() == "step_8"


def _plan(run: Path, *args: str) -> dict[str, dict[str, Any]]:
    r = run_cli("prune", run, "--grace", "0", "--json", *args)
    assert r.exit_code == 0, r.output
    return {c["name"]: c for c in json.loads(r.stdout)["checkpoints"]}


def test_keep_n_holds_n_checkpoints_of_the_current_timeline(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _rolled_back(run)
    code, events, err = watch_once(run)  # verifies the new step_8
    assert code == 0 and [(e["path"], e["verdict"]) for e in events] == [("step_8", "good")], err

    plan = _plan(run, "--keep", "2", "--dry-run")
    assert {n for n, c in plan.items() if c["action"] == "keep"} == {"step_6", "step_8"}
    for name in ("step_10", "step_12"):
        assert plan[name]["action"] == "delete"
        assert plan[name]["reasons"][0].startswith(
            "abandoned by the rollback to step 6: step_8 (step 8) was saved after it"), plan[name]
    assert "newest 2 complete (--keep 2)" in plan["step_6"]["reasons"]

    # --keep-abandoned keeps them, and they still take no place of --keep.
    plan = _plan(run, "--keep", "2", "--keep-abandoned", "--dry-run")
    assert {n for n, c in plan.items() if c["action"] == "keep"} == {
        "step_6", "step_8", "step_10", "step_12"}
    assert plan["step_12"]["kept_by"] == ["keep-abandoned"]

    plan = _plan(run, "--keep", "2", "--yes")
    assert {n for n, c in plan.items() if c["status"] == "deleted"} == {
        "step_2", "step_4", "step_10", "step_12"}
    assert sorted(p.name for p in run.glob("step_*")) == ["step_6", "step_8"]
    choice = choose(run, verify="full")
    assert choice is not None and choice.path == run / "step_8"
    assert (run / "latest").read_text().strip() == "step_8"


def test_the_watchers_retention_keeps_the_rollback_origin(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _rolled_back(run)
    (run / "latest").unlink()  # as a loop that keeps no pointer: steps alone order the run
    kept = tmp_path / "kept"
    shutil.copytree(run, kept, symlinks=True)
    # --keep-abandoned: the abandoned steps stay, outside the count of three.
    code, events, err = watch_once(kept, "--keep", "3", "--grace", "0", "--keep-abandoned")
    assert code == 0, err
    assert next(e for e in events if e["event"] == "pruned")["deleted"] == ["step_2"]
    assert sorted(p.name for p in kept.glob("step_*")) == [
        "step_10", "step_12", "step_4", "step_6", "step_8"]
    code, events, err = watch_once(run, "--keep", "3", "--grace", "0")
    assert code == 0, err
    assert [(e["path"], e["verdict"]) for e in events if e["event"] == "verified"] == [
        ("step_8", "good")]
    pruned = next(e for e in events if e["event"] == "pruned")
    assert sorted(pruned["deleted"]) == ["step_10", "step_12", "step_2"]
    # The current timeline's newest three: the re-saved step_8 and the rollback origin step_6.
    assert sorted(p.name for p in run.glob("step_*")) == ["step_4", "step_6", "step_8"]
    choice = choose(run)
    assert choice is not None and choice.path == run / "step_8"
