"""``ckpt prune`` crash safety: interrupted and failed deletions, and the re-checks between
planning and deleting (a victim that changed, got locked or got named by a pointer; mount
points; writers racing prunes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ckpt_cli.ops import prune as prune_ops
from ckpt_cli.ops.prune import PruneEvent, prune
from ckpt_cli.ops.prune import local as prune_local
from ckpt_cli.ops.prune.retention import PrunePlan, PrunePolicy
from ckpt_cli.runs import list_run
from tests.conftest import run_cli
from tests.ops.prune.conftest import KEEP1, _json, _names, _status, _why

pytestmark = pytest.mark.requires_torch

HELPERS = Path(__file__).parents[2] / "helpers"


# -- crash safety and re-checks -------------------------------------------------------------------


def test_interrupted_prune_leaves_trash_that_the_next_run_removes(
        sample_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def half_then_interrupt(root: Any, name: str) -> str | None:
        next(p for p in (sample_copy / name).rglob("*") if p.is_file()).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(prune_local, "remove_child", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        prune(sample_copy, KEEP1)
    monkeypatch.undo()
    # No half-deleted checkpoint under a checkpoint name: every victim was renamed aside
    # before the first file went, so all of them are trash now.
    trash = [".ckpt-trash-step_000100", ".ckpt-trash-step_000200", ".ckpt-trash-step_000300"]
    listing = list_run(sample_copy)
    assert sorted(listing.leftovers) == trash
    assert [e.name for e in listing.entries] == ["step_000400"]
    r = run_cli("prune", sample_copy, "--keep", "1", "--grace", "0", "--dry-run")
    assert all(f"would remove leftover trash {t}" in r.stdout for t in trash)
    result = prune(sample_copy, KEEP1)
    assert result.trash_removed == trash and result.ok
    assert _names(sample_copy) == {"step_000400", "export", "latest", ".ckpt-prune.lock"}
    r = run_cli("prune", sample_copy, "--keep", "1", "--grace", "0")
    assert r.exit_code == 0 and "trash" not in r.stdout


def test_failed_deletion_exits_1(sample_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prune_local, "remove_child",
                        lambda root, name: f"cannot remove {name}: EIO")
    r = run_cli("prune", sample_copy, "--keep", "1", "--grace", "0")
    assert r.exit_code == 1
    assert "FAILED to delete step_000100" in r.stderr and "next prune" in r.stderr
    assert "3 failed" in r.stdout


def _prune_with_hook(run: Path, hook: Any, policy: PrunePolicy = KEEP1) -> Any:
    def confirm(plan: PrunePlan) -> bool:
        hook(plan)
        return True

    return prune(run, policy, confirm=confirm)


def test_victim_that_changed_after_planning_is_kept(sample_copy: Path) -> None:
    def writer(plan: PrunePlan) -> None:
        assert [d.entry.name for d in plan.to_delete] == ["step_000100", "step_000200",
                                                           "step_000300"]
        (sample_copy / "step_000200" / "extra.pt").write_bytes(b"new data")

    result = _prune_with_hook(sample_copy, writer)
    assert result.outcomes["step_000200"].status == "skipped"
    assert "changed since planning" in (result.outcomes["step_000200"].detail or "")
    assert (sample_copy / "step_000200" / "extra.pt").is_file()
    assert result.outcomes["step_000100"].status == "deleted" and result.ok


def test_victim_that_latest_names_after_planning_is_kept(sample_copy: Path) -> None:
    result = _prune_with_hook(sample_copy,
                              lambda plan: (sample_copy / "latest").write_text("step_000300"))
    assert result.outcomes["step_000300"].status == "skipped"
    assert "now latest names it" in (result.outcomes["step_000300"].detail or "")
    assert (sample_copy / "step_000300" / "checkpoint.pt").is_file()


def test_victim_locked_after_planning_is_kept(sample_copy: Path) -> None:
    result = _prune_with_hook(sample_copy,
                              lambda plan: (sample_copy / "step_000100.lock").touch())
    assert result.outcomes["step_000100"].status == "skipped"
    assert "step_000100" in _names(sample_copy)


def test_victim_written_while_being_moved_aside_is_put_back(
        sample_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_rename = os.rename

    def rename_then_write(src: Any, dst: Any, **kw: Any) -> None:
        real_rename(src, dst, **kw)
        if src == "step_000100":  # a writer with an open handle keeps writing
            (sample_copy / dst / "late.pt").write_bytes(b"late")

    monkeypatch.setattr(prune_ops.os, "rename", rename_then_write)
    result = prune(sample_copy, KEEP1)
    assert result.outcomes["step_000100"].status == "skipped"
    assert "put back" in (result.outcomes["step_000100"].detail or "")
    assert (sample_copy / "step_000100" / "late.pt").is_file()
    assert (sample_copy / "step_000100" / "checkpoint.pt").is_file()


def test_a_mount_point_inside_a_checkpoint_is_not_entered(
        sample_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mnt = sample_copy / "step_000100" / "mnt"
    mnt.mkdir()
    (mnt / "other-filesystem.txt").write_text("not ours")
    real_fstat = os.fstat

    def fstat(fd: int) -> Any:  # what fstat says of a directory another file system is on
        st = real_fstat(fd)
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/mnt"):
            return os.stat_result((*st[:2], st.st_dev + 1, *st[3:]))
        return st

    monkeypatch.setattr(prune_ops.os, "fstat", fstat)
    result = prune(sample_copy, KEEP1)
    assert result.outcomes["step_000100"].status == "failed"
    assert "another file system is mounted there" in (result.outcomes["step_000100"].detail
                                                      or "")
    assert (sample_copy / ".ckpt-trash-step_000100" / "mnt" / "other-filesystem.txt").is_file()
    assert result.outcomes["step_000200"].status == "deleted"


def test_a_bind_mount_inside_a_checkpoint_keeps_it(sample_copy: Path, tmp_path: Path) -> None:
    # A bind mount from the same file system has the run directory's device number: only the
    # mount table tells it apart. Deleting through it would delete files outside the run.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    mnt = sample_copy / "step_000100" / "data"
    mnt.mkdir()
    if subprocess.run(["mount", "--bind", str(outside), str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here (not root, or no mount permission)")
    try:
        doc = _json(sample_copy, "--keep", "1", "--grace", "0", "--dry-run")
        assert _status(doc)["step_000100"] == "kept"
        assert "mounted inside it" in _why(doc, "step_000100")
        result = prune(sample_copy, KEEP1)
        assert "step_000100" not in result.outcomes  # kept by the plan, never touched
        assert (outside / "precious.txt").read_text() == "keep me"
        assert (sample_copy / "step_000100" / "checkpoint.pt").is_file()
        assert result.outcomes["step_000200"].status == "deleted"
    finally:  # wherever a failing prune may have moved it (ismount misses same-fs binds)
        for point in prune_ops.mounts_inside(str(sample_copy)):
            subprocess.run(["umount", point], check=False)
    assert (outside / "precious.txt").read_text() == "keep me"


def test_writer_creates_a_checkpoint_while_prune_runs(tmp_path: Path) -> None:
    """Deterministic interleaving with a real writer process: after planning, a new checkpoint
    is half-written; in the middle of the deletions it is finished and ``latest`` moves to it."""
    run = tmp_path / "run"
    run.mkdir()
    writer = [sys.executable, str(HELPERS / "ckpt_writer.py"), str(run)]
    subprocess.run([*writer, "100", "4"], check=True, capture_output=True, timeout=120)
    started: list[subprocess.Popen[str]] = []

    def after_planning(plan: PrunePlan) -> None:
        assert [d.entry.name for d in plan.to_delete] == ["step_000100", "step_000200",
                                                           "step_000300"]
        # Start step 500; its first shard lands before deletions begin.
        p = subprocess.Popen([*writer, "500", "1", "--pause", "0.5"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        started.append(p)
        first_shard = run / "step_000500" / "model_part0.pt"
        while not first_shard.exists():
            assert p.poll() is None, p.communicate()
            time.sleep(0.01)

    def on_event(event: PruneEvent) -> None:
        if event.kind == "deleted" and event.name == "step_000100":
            out, err = started[0].communicate(timeout=120)
            assert started[0].returncode == 0 and out.strip() == "ok", err

    result = prune(run, KEEP1, confirm=lambda plan: after_planning(plan) is None,
                   on_event=on_event)
    assert started and started[0].returncode == 0
    assert result.ok and len(result.named("deleted")) == 3
    assert (run / "latest").read_text().strip() == "step_000500"
    assert sorted(p.name for p in (run / "step_000500").iterdir()) == [
        "model_part0.pt", "model_part1.pt", "model_part2.pt"]
    assert _names(run) == {"step_000400", "step_000500", "latest", ".ckpt-prune.lock"}


def test_writer_process_racing_repeated_prunes(tmp_path: Path) -> None:
    """Free-running: a writer saves 12 checkpoints while prunes run back to back. Whatever the
    interleaving, the writer never loses a file, latest always names a whole checkpoint, and
    the prunes never fail."""
    run = tmp_path / "run"
    run.mkdir()
    writer = [sys.executable, str(HELPERS / "ckpt_writer.py"), str(run)]
    subprocess.run([*writer, "100", "3"], check=True, capture_output=True, timeout=120)
    results = []
    with subprocess.Popen([*writer, "400", "12", "--pause", "0.05"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as p:
        while p.poll() is None:
            results.append(prune(run, PrunePolicy(keep=2, grace=0)))
        out, err = p.communicate()
    assert p.returncode == 0 and out.strip() == "ok", err
    assert len(results) > 1 and all(r.ok for r in results)
    results.append(prune(run, PrunePolicy(keep=2, grace=0)))
    assert (run / "latest").read_text().strip() == "step_001500"
    assert sorted(p.name for p in run.glob("step_*")) == ["step_001400", "step_001500"]
    assert not [p for p in run.iterdir() if p.name.startswith(".ckpt-trash-")]
