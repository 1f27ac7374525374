"""A thinning prune killed (SIGKILL) at every kind of point leaves nothing behind after the next
prune: no temporary, no trash, every checkpoint whole or thinned and good (issue 37 item 5)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_cli.formats.names import is_own_temporary
from ckpt_cli.ops.watch import Watcher, WatchEvent, WatchOptions
from tests.conftest import run_cli
from tests.helpers.loads import holds_optimizer_state

pytestmark = pytest.mark.requires_torch

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def _template(run: Path) -> Path:
    """Top-level torch files and step directories holding one, verified (with manifests)."""
    run.mkdir()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    for step in (100, 200, 300, 400):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
        if step % 200:
            torch.save(state, run / f"step_{step:04d}.pt")
        else:
            (run / f"step_{step:06d}").mkdir()
            torch.save(state, run / f"step_{step:06d}" / "checkpoint.pt")
    old = os.path.getmtime(run) - 3600
    for p in [*run.rglob("*"), run]:
        os.utime(p, (old, old))
    assert run_cli("watch", run, "--once", "--settle", "0").exit_code == 0
    return run


def _killed_at(run: Path, at: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.helpers.thin_kill_at", str(run), "1",
                           str(at)], env=ENV, cwd=ROOT, capture_output=True, text=True,
                          check=False)


def _leftovers(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if is_own_temporary(p.name))


def test_a_thinning_killed_at_many_points_leaves_no_temporary_after_the_next_prune(
        tmp_path: Path) -> None:
    template = _template(tmp_path / "template")
    full = tmp_path / "full"
    shutil.copytree(template, full)
    done = _killed_at(full, 10**9)
    assert done.returncode == 3, done.stderr[-2000:]
    changes = int(done.stdout.split()[-1])
    assert changes > 10
    # About 20 points spread over the whole prune, the first and the last included.
    points = sorted({1, changes, *range(1, changes + 1, max(1, changes // 20))})
    left_by_kill = 0
    for at in points:
        run = tmp_path / f"at-{at}"
        shutil.copytree(template, run)
        r = _killed_at(run, at)
        assert r.returncode == -9, (at, r.returncode, r.stderr[-2000:])
        left_by_kill += bool(_leftovers(run))
        nxt = run_cli("prune", run, "--thin-after", "1", "--grace", "0", "--yes")
        assert nxt.exit_code == 0, (at, nxt.output)
        assert _leftovers(run) == [], at
        got: list[WatchEvent] = []
        Watcher(run, WatchOptions(settle=0), got.append).run_pass()
        assert not [e for e in got if e.bad], (at, [(e.path, e.problems) for e in got])
        for name in ("step_0100.pt", "step_000200", "step_0300.pt", "step_000400"):
            f = run / name if name.endswith(".pt") else run / name / "checkpoint.pt"
            state = torch.load(f, weights_only=True)
            assert set(state) >= {"model", "step"}, (at, name)
            assert holds_optimizer_state(state) == (name == "step_000400"), (at, name)
    assert left_by_kill, "no kill point left a temporary: the test kills at the wrong places"
