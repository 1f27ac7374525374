"""What ckpt itself writes beside a run's checkpoints (issue 45 item 7): manifests go with their
checkpoint and orphans are swept, a run before its first save is no error whatever other files
it holds, and a manifest written later never makes a finished checkpoint look recent.

Checkpoints are written by torch (``torch.save``) and ``torch.distributed.checkpoint``; the
manifests and the ledger by ``ckpt watch --once``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from ckpt_cli.manifest import MANIFEST_NAME, MANIFEST_SUFFIX
from ckpt_cli.ops.prune import plan, prune
from ckpt_cli.ops.prune.retention import PrunePolicy
from tests.conftest import run_cli, third_party_quiet

pytestmark = pytest.mark.requires_torch


def _dcp_save(path: Path, step: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with third_party_quiet():
        dcp.save({"model": {"w": torch.full((4, 4), float(step))}, "step": step},
                 storage_writer=FileSystemWriter(str(path)), no_dist=True)


def test_a_deleted_checkpoints_manifest_goes_with_it_and_orphans_are_swept(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for step in range(1, 6):
        torch.save({"w": torch.full((2,), float(step)), "step": step}, run / f"model_{step}.pt")
    r = run_cli("watch", run, "--once", "--settle", "0")
    assert r.exit_code == 0, r.output
    assert all((run / f"model_{s}.pt{MANIFEST_SUFFIX}").is_file() for s in range(1, 6))
    # An orphan an older prune left (its checkpoint is gone), and one of a file that is there.
    (run / f"model_0.pt{MANIFEST_SUFFIX}").write_bytes(
        (run / f"model_1.pt{MANIFEST_SUFFIX}").read_bytes())
    torch.save({"x": torch.zeros(2)}, run / "data_0001.bin")
    (run / f"data_0001.bin{MANIFEST_SUFFIX}").write_text("{}")

    r = run_cli("prune", run, "--keep", "2", "--grace", "0", "--yes", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert {c["name"] for c in doc["checkpoints"] if c["status"] == "deleted"} == {
        "model_1.pt", "model_2.pt", "model_3.pt"}
    assert f"model_0.pt{MANIFEST_SUFFIX}" in doc["trash_removed"]
    manifests = sorted(p.name for p in run.glob(f"*{MANIFEST_SUFFIX}"))
    assert manifests == [f"data_0001.bin{MANIFEST_SUFFIX}", f"model_4.pt{MANIFEST_SUFFIX}",
                         f"model_5.pt{MANIFEST_SUFFIX}"]
    r = run_cli("validate", run / "model_5.pt")
    assert r.exit_code == 0, r.output  # the survivors' manifests still match


def test_a_run_before_its_first_save_is_a_quiet_success_whatever_it_holds(
        tmp_path: Path) -> None:
    # What a cron prune beside a live writer meets before the first save: a dataset shard
    # torch wrote, a log; nothing named like a checkpoint.
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"tokens": torch.arange(8)}, run / "data_0001.bin")
    (run / "train.log").write_text("step 0\n")
    r = run_cli("prune", run, "--keep", "2", "--yes")
    assert r.exit_code == 0 and "holds no checkpoints yet" in r.stderr, r.output
    assert sorted(p.name for p in run.iterdir()) == [".ckpt-prune.lock", "data_0001.bin",
                                                      "train.log"]
    r = run_cli("watch", run, "--once", "--settle", "0")
    assert r.exit_code == 0, r.output

    # Still refused: a directory that is one checkpoint (DCP, a step directory), any flag.
    _dcp_save(tmp_path / "dcp", 7)
    step_dir = tmp_path / "run2" / "step_000100"
    step_dir.mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, step_dir / "data_0001.bin")
    for target in (tmp_path / "dcp", step_dir):
        before = sorted(p.name for p in target.iterdir())
        for extra in ([], ["--any-dir"]):
            r = run_cli("prune", target, "--keep", "1", "--grace", "0", "--yes", *extra)
            assert r.exit_code == 2 and "is itself a checkpoint" in r.stderr, r.output
        assert sorted(p.name for p in target.iterdir()) == before


def test_a_manifest_written_after_the_save_does_not_make_it_recent(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (10, 20, 30):
        _dcp_save(run / f"step_{step}", step)
    time.sleep(1.2)  # the saves' own files are older than the grace below
    r = run_cli("watch", run, "--once", "--settle", "0")
    assert r.exit_code == 0, r.output
    written = max((run / f"step_{s}" / MANIFEST_NAME).stat().st_mtime for s in (10, 20, 30))
    # Judged half a second after the manifests were written, with a one-second grace: the
    # manifests are recent, the checkpoints are not.
    policy = PrunePolicy(keep=1, grace=1.0)
    with plan(run, policy, dry_run=True, now=written + 0.5) as planned:
        recent = [d.entry.name for d in planned.plan.decisions if "recent" in d.protected_by]
        assert recent == []
        assert [d.entry.name for d in planned.plan.to_delete] == ["step_10", "step_20"]
    result = prune(run, policy, now=written + 0.5)
    assert [d.entry.name for d in result.named("deleted")] == ["step_10", "step_20"]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step_")) == ["step_30"]


def test_a_file_written_into_a_checkpoint_still_makes_it_recent(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (10, 20):
        _dcp_save(run / f"step_{step}", step)
    old = time.time() - 3600
    for p in (run / "step_10").iterdir():
        os.utime(p, (old, old))
    # A writer's file (not ckpt's) inside step_10 now: its own time says it may be in use.
    (run / "step_10" / "extra.bin").write_bytes(b"x")
    with plan(run, PrunePolicy(keep=1, grace=60.0), dry_run=True) as planned:
        d = next(d for d in planned.plan.decisions if d.entry.name == "step_10")
        assert "recent" in d.protected_by and not d.delete
