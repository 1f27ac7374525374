"""``ckpt prune`` on real layouts: what it deletes, what it never deletes, and how it deletes.

Fixtures are written by the real libraries (torch, torch.distributed.checkpoint, transformers'
Trainer, Lightning, DeepSpeed). Just-written files are "recent", so tests that expect deletions
pass ``--grace 0`` (or ``grace=0``); the grace period has its own test.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckpt_cli.errors import CkptError
from ckpt_cli.ops import prune as prune_ops
from ckpt_cli.ops.prune import prune
from ckpt_cli.ops.prune.retention import PrunePolicy
from tests.conftest import requires_deepspeed, run_cli, third_party_quiet
from tests.helpers.makers import hf_trainer_run, megatron_legacy
from tests.ops.prune.conftest import KEEP1, _copy, _json, _names, _status, _why

pytestmark = pytest.mark.requires_torch


# -- fixtures written by the real libraries -------------------------------------------------------


@pytest.fixture(scope="session")
def hf_eval_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' Trainer output: checkpoint-2/4/6, evaluated at each save (eval_loss)."""
    with third_party_quiet():
        return hf_trainer_run(tmp_path_factory.mktemp("hfe") / "out", steps=6, evaluate=True)


@pytest.fixture(scope="session")
def dcp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """step_100/200/300: torch.distributed.checkpoint saves (one process), step in the state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    run = tmp_path_factory.mktemp("dcp") / "run"
    for step in (100, 200, 300):
        sd = {"model": {"w": torch.full((8, 8), float(step))}, "step": step}
        with third_party_quiet():
            dcp.save(sd, storage_writer=FileSystemWriter(str(run / f"step_{step}")),
                     no_dist=True)
    return run


@pytest.fixture(scope="session")
def ds_each_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSpeed ZeRO-1 saving after each of 3 steps: global_step1..3, latest, zero_to_fp32.py."""
    from tests.conftest import HAS_DEEPSPEED

    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    from tests.helpers.makers import deepspeed_checkpoints

    return deepspeed_checkpoints(tmp_path_factory.mktemp("dse"), ["z1-fp32+each"]) / \
        "z1-fp32+each"


# -- the retention rules on real layouts ----------------------------------------------------------


def test_keep_on_the_sample_run(sample_copy: Path) -> None:
    before = {p.name: p.stat().st_size for p in (sample_copy / "export").iterdir()}
    doc = _json(sample_copy, "--keep", "2", "--grace", "0", "--yes")
    assert _status(doc) == {"step_000100": "deleted", "step_000200": "deleted",
                            "step_000300": "kept", "step_000400": "kept"}
    assert _names(sample_copy) == {"step_000300", "step_000400", "export", "latest",
                                   ".ckpt-prune.lock"}
    # Things that are not checkpoints are never touched.
    assert {p.name: p.stat().st_size for p in (sample_copy / "export").iterdir()} == before
    s = doc["summary"]
    assert (s["deleted"], s["failed"], s["skipped"]) == (2, 0, 0)
    assert s["bytes_freed"] == s["bytes_to_free"] > 0
    four = next(c for c in doc["checkpoints"] if c["name"] == "step_000400")
    assert four["kept_by"] == ["keep"] and set(four["protected_by"]) == {"pointer",
                                                                          "newest-valid"}


def test_dry_run_changes_nothing(sample_copy: Path) -> None:
    before = sorted(str(p) for p in sample_copy.rglob("*"))
    doc = _json(sample_copy, "--keep", "1", "--grace", "0", "--dry-run")
    assert doc["dry_run"] is True
    assert _status(doc)["step_000100"] == "would-delete"
    assert doc["summary"]["to_delete"] == 3 and doc["summary"]["deleted"] == 0
    assert sorted(str(p) for p in sample_copy.rglob("*")) == before  # not even a lock file


def test_hf_trainer_keep_best_from_log_history(hf_eval_dir: Path, tmp_path: Path) -> None:
    run = _copy(hf_eval_dir, tmp_path)
    # --metric loss finds eval_loss in trainer_state.json's log_history; max = the worst.
    doc = _json(run, "--keep", "1", "--keep-best", "1", "--metric", "loss", "--mode", "max",
                "--grace", "0", "--yes")
    history = json.loads((hf_eval_dir / "checkpoint-6" / "trainer_state.json").read_text())
    evals = {h["step"]: h["eval_loss"] for h in history["log_history"] if "eval_loss" in h}
    worst = max(evals, key=lambda s: evals[s])
    assert worst != 6, "the fixture's eval_loss should not be worst at the last step"
    assert _status(doc)[f"checkpoint-{worst}"] == "kept"
    assert "best 1 by loss (max)" in _why(doc, f"checkpoint-{worst}")
    assert sorted(_names(run)) == sorted({f"checkpoint-{worst}", "checkpoint-6",
                                          ".ckpt-prune.lock"})
    metrics = {c["name"]: c["metric"] for c in doc["checkpoints"]}
    assert metrics == {f"checkpoint-{s}": pytest.approx(v) for s, v in evals.items()}


def test_hf_trainer_best_model_checkpoint_is_never_deleted(hf_eval_dir: Path,
                                                           tmp_path: Path) -> None:
    run = _copy(hf_eval_dir, tmp_path)
    # The state as the Trainer writes it when checkpoint-2 had the best metric.
    state_file = run / "checkpoint-6" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["best_model_checkpoint"] = str(hf_eval_dir / "checkpoint-2")
    state_file.write_text(json.dumps(state))
    doc = _json(run, "--keep", "1", "--grace", "0", "--yes")
    assert _status(doc) == {"checkpoint-2": "kept", "checkpoint-4": "deleted",
                            "checkpoint-6": "kept"}
    assert "best_model_checkpoint" in _why(doc, "checkpoint-2")


def test_hf_trainer_checkpoint_without_trainer_state_is_kept(hf_trainer_dir: Path,
                                                             tmp_path: Path) -> None:
    run = _copy(hf_trainer_dir, tmp_path)
    (run / "checkpoint-2" / "trainer_state.json").unlink()  # the Trainer writes it last
    doc = _json(run, "--keep", "1", "--grace", "0", "--yes")
    assert _status(doc) == {"checkpoint-2": "kept", "checkpoint-4": "kept"}
    assert "incomplete (no trainer_state.json" in _why(doc, "checkpoint-2")


def test_lightning_keep_best_from_file_names_and_last_link(lightning_metric_dir: Path,
                                                           tmp_path: Path) -> None:
    run = _copy(lightning_metric_dir, tmp_path)
    names = sorted(p.name for p in run.glob("epoch=*.ckpt"))
    losses = {n: float(n.split("train_loss=")[1].removesuffix(".ckpt")) for n in names}
    newest = max(names, key=lambda n: int(n.split("step=")[1].split("-")[0]))
    # Whatever the losses came out as, the lowest or the highest is not the newest.
    mode = "min" if min(losses, key=lambda n: losses[n]) != newest else "max"
    best = (min if mode == "min" else max)(losses, key=lambda n: losses[n])
    assert best != newest and len(set(losses.values())) == 3
    doc = _json(run, "--keep-best", "1", "--metric", "train_loss", "--mode", mode,
                "--grace", "0", "--yes")
    gone = set(names) - {best, newest}
    assert gone and all(_status(doc)[n] == "deleted" for n in gone)
    assert _status(doc)[best] == "kept" and _status(doc)[newest] == "kept"
    assert "last.ckpt names it" in _why(doc, newest)
    assert os.readlink(run / "last.ckpt") == newest and (run / "last.ckpt").exists()


def test_lightning_last_ckpt_copy_is_kept_and_not_counted(lightning_dir: Path,
                                                          tmp_path: Path) -> None:
    run = _copy(lightning_dir, tmp_path)
    doc = _json(run, "--keep", "1", "--grace", "0", "--yes")
    assert _status(doc) == {"epoch=0-step=2.ckpt": "deleted", "epoch=0-step=4.ckpt": "kept",
                            "last.ckpt": "kept"}
    assert "training resumes from it" in _why(doc, "last.ckpt")


def test_dcp_step_dirs(dcp_run: Path, tmp_path: Path) -> None:
    run = _copy(dcp_run, tmp_path)
    # A DCP directory with no step in its name: the step comes from its metadata.
    (run / "step_200").rename(run / "snapshot")
    doc = _json(run, "--keep", "2", "--grace", "0", "--yes")
    by_name = {c["name"]: c for c in doc["checkpoints"]}
    assert by_name["snapshot"]["step"] == 200 and by_name["snapshot"]["step_source"] == "metadata"
    assert [c["name"] for c in doc["checkpoints"]] == ["step_100", "snapshot", "step_300"]
    assert _status(doc) == {"step_100": "deleted", "snapshot": "kept", "step_300": "kept"}


def test_dcp_save_without_metadata_is_kept(dcp_run: Path, tmp_path: Path) -> None:
    run = _copy(dcp_run, tmp_path)
    (run / "step_100" / ".metadata").unlink()  # DCP renames .metadata into place last
    doc = _json(run, "--keep", "1", "--grace", "0", "--yes")
    assert _status(doc)["step_100"] == "kept"
    assert "no .metadata" in _why(doc, "step_100")
    assert _status(doc)["step_200"] == "deleted"


@requires_deepspeed
def test_deepspeed_global_steps_with_latest(ds_each_dir: Path, tmp_path: Path) -> None:
    run = _copy(ds_each_dir, tmp_path)
    assert (run / "latest").read_text().strip() == "global_step3"
    doc = _json(run, "--keep", "1", "--grace", "0", "--yes")
    assert _status(doc) == {"global_step1": "deleted", "global_step2": "deleted",
                            "global_step3": "kept"}
    assert {"zero_to_fp32.py", "latest", "global_step3"} <= _names(run)


@requires_deepspeed
def test_deepspeed_latest_target_is_never_deleted(ds_each_dir: Path, tmp_path: Path) -> None:
    run = _copy(ds_each_dir, tmp_path)
    (run / "latest").write_text("global_step1")  # a resume from an older tag
    doc = _json(run, "--keep", "1", "--grace", "0", "--yes")
    assert _status(doc) == {"global_step1": "kept", "global_step2": "kept",
                            "global_step3": "kept"}
    assert "latest names it" in _why(doc, "global_step1")
    assert "newer than global_step1" in _why(doc, "global_step2")


def test_megatron_tracker_target_is_never_deleted(tmp_path: Path) -> None:
    run = tmp_path / "save"
    for it in (100, 200, 300):
        megatron_legacy(run, iteration=it)
    (run / "latest_checkpointed_iteration.txt").write_text("200")
    doc = _json(run, "--keep", "1", "--grace", "0", "--yes")
    assert _status(doc) == {"iter_0000100": "deleted", "iter_0000200": "kept",
                            "iter_0000300": "kept"}
    assert "latest_checkpointed_iteration.txt names it" in _why(doc, "iter_0000200")


def test_keep_every_older_than_and_max_total_size(sample_copy: Path) -> None:
    old = time.time() - 30 * 86400
    for name in ("step_000100", "step_000200"):
        for p in [sample_copy / name, *(sample_copy / name).rglob("*")]:
            os.utime(p, (old, old), follow_symlinks=False)
    doc = _json(sample_copy, "--keep-every", "200", "--older-than", "7d", "--grace", "0",
                "--dry-run")
    assert _status(doc) == {"step_000100": "would-delete", "step_000200": "kept",
                            "step_000300": "kept", "step_000400": "kept"}
    assert "older than 7d" in _why(doc, "step_000100")
    assert "multiple of 200" in _why(doc, "step_000200")
    sizes = {c["name"]: c["bytes"] for c in doc["checkpoints"]}
    budget = sizes["step_000400"] + sizes["step_000300"]
    doc = _json(sample_copy, "--max-total-size", str(budget), "--grace", "0", "--dry-run")
    assert _status(doc) == {"step_000100": "would-delete", "step_000200": "would-delete",
                            "step_000300": "kept", "step_000400": "kept"}


def test_nothing_to_do_is_success(sample_copy: Path) -> None:
    r = run_cli("prune", sample_copy, "--keep", "10", "--grace", "0")
    assert r.exit_code == 0, r.stderr
    assert "nothing to delete" in r.stdout


# -- never delete ---------------------------------------------------------------------------------


def test_latest_pointer_target_is_never_deleted(sample_copy: Path) -> None:
    (sample_copy / "latest").write_text("step_000200\n")
    doc = _json(sample_copy, "--keep", "1", "--grace", "0", "--yes")
    assert _status(doc) == {"step_000100": "deleted", "step_000200": "kept",
                            "step_000300": "kept", "step_000400": "kept"}
    assert "latest names it" in _why(doc, "step_000200")


def test_last_ckpt_link_target_is_never_deleted(lightning_dir: Path, tmp_path: Path) -> None:
    run = _copy(lightning_dir, tmp_path)
    (run / "last.ckpt").unlink()
    (run / "last.ckpt").symlink_to("epoch=0-step=2.ckpt")
    doc = _json(run, "--keep", "1", "--grace", "0", "--yes")
    assert _status(doc) == {"epoch=0-step=2.ckpt": "kept", "epoch=0-step=4.ckpt": "kept"}
    assert "last.ckpt names it" in _why(doc, "epoch=0-step=2.ckpt")


@pytest.mark.parametrize("pointer,content", [("latest", ""),
                                             ("latest_checkpointed_iteration.txt", "abc")])
def test_unreadable_pointer_deletes_nothing(sample_copy: Path, pointer: str,
                                            content: str) -> None:
    (sample_copy / pointer).write_text(content)
    r = run_cli("prune", sample_copy, "--keep", "1", "--grace", "0", "--yes", "--json")
    assert r.exit_code == 3, r.stderr  # a refusal: cron must hear of it, apart from a failure
    doc = json.loads(r.stdout)
    assert set(_status(doc).values()) == {"kept"}
    assert all("nothing is deleted: cannot tell what" in _why(doc, n) for n in _status(doc))
    assert {"step_000100", "step_000200", "step_000300", "step_000400"} <= _names(sample_copy)


def test_truncated_checkpoint_being_written_is_kept(sample_copy: Path) -> None:
    ck = sample_copy / "step_000200" / "checkpoint.pt"
    ck.write_bytes(ck.read_bytes()[:-1000])  # what a half-written torch.save looks like
    doc = _json(sample_copy, "--keep", "1", "--grace", "0", "--yes")
    assert _status(doc)["step_000200"] == "kept"
    assert "no zip end record" in _why(doc, "step_000200")
    assert _status(doc)["step_000100"] == "deleted"


def test_temporary_and_trash_names_are_never_checkpoints(sample_copy: Path) -> None:
    tmp_names = [".step_000500.ckpt-tmp-0a1b2c", "step_000050.tmp", "step_000060.partial",
                 "000070.orbax-checkpoint-tmp-123", ".step_000080.ckpt-old-0a1b2c"]
    for name in tmp_names:
        shutil.copytree(sample_copy / "step_000100", sample_copy / name)
    r = run_cli("prune", sample_copy, "--keep", "1", "--grace", "0", "--dry-run")
    assert r.exit_code == 0, r.stderr
    assert all(f"leftover {n}: a temporary name" in r.stdout for n in tmp_names)
    doc = _json(sample_copy, "--keep", "1", "--grace", "0", "--yes")
    assert set(doc["leftovers"]) == set(tmp_names)
    assert set(tmp_names) <= _names(sample_copy)
    assert not set(tmp_names) & set(_status(doc))


def test_recently_changed_is_kept(sample_copy: Path) -> None:
    doc = _json(sample_copy, "--keep", "1", "--yes")  # default --grace 10m; all just copied
    assert set(_status(doc).values()) == {"kept"}
    assert "within --grace 10m" in _why(doc, "step_000100")
    # A copy that keeps old modification times still counts as recent (inode-change times).
    old = time.time() - 86400
    for p in [sample_copy / "step_000100", *(sample_copy / "step_000100").rglob("*")]:
        os.utime(p, (old, old))
    doc = _json(sample_copy, "--keep", "1", "--grace", "1h", "--dry-run")
    assert _status(doc)["step_000100"] == "kept"
    # ... while with the grace period over, it may go.
    result = prune(sample_copy, PrunePolicy(keep=1, grace=3600), dry_run=True,
                   now=time.time() + 7200)
    assert result.status(result.plan.decisions[0]) == "would-delete"


@pytest.mark.parametrize("lock", ["step_000100.lock", ".step_000100.lock", "step_000100/.lock"])
def test_writer_lock_file_keeps_the_checkpoint(sample_copy: Path, lock: str) -> None:
    (sample_copy / lock).touch()
    doc = _json(sample_copy, "--keep", "1", "--grace", "0", "--yes")
    assert _status(doc)["step_000100"] == "kept"
    assert f"lock file {lock} present" in _why(doc, "step_000100")
    assert _status(doc)["step_000200"] == "deleted"


def test_lock_held_by_a_writer_process_keeps_the_checkpoint(sample_copy: Path) -> None:
    lock = sample_copy / "step_000100.lock"
    code = ("import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX);"
            " print('locked', flush=True); sys.stdin.read()")
    with subprocess.Popen([sys.executable, "-c", code, str(lock)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as writer:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "locked"
        doc = _json(sample_copy, "--keep", "1", "--grace", "0", "--yes")
        writer.communicate("")
    assert _status(doc)["step_000100"] == "kept"
    assert (sample_copy / "step_000100" / "checkpoint.pt").is_file()


def test_newest_valid_is_kept_when_newer_ones_are_broken(sample_copy: Path) -> None:
    # The newest (DCP) has a corrupt .metadata; the one before is truncated mid-write.
    meta = sample_copy / "step_000400" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])
    ck = sample_copy / "step_000300" / "checkpoint.pt"
    ck.write_bytes(ck.read_bytes()[:-1000])
    doc = _json(sample_copy, "--keep", "1", "--grace", "0", "--yes")
    assert doc["newest_valid"] == "step_000200"
    assert _status(doc) == {"step_000100": "deleted", "step_000200": "kept",
                            "step_000300": "kept", "step_000400": "kept"}
    why = _why(doc, "step_000200")
    # --keep 1 counts only a complete, valid checkpoint: the two broken newer ones do not count.
    assert "the newest valid checkpoint" in why and "newest 1 complete (--keep 1)" in why
    assert "step_000400" in why and "step_000300" in why
    by_name = {c["name"]: c for c in doc["checkpoints"]}
    assert by_name["step_000400"]["valid"] is False and by_name["step_000200"]["valid"] is True


def test_no_valid_checkpoint_deletes_nothing(dcp_run: Path, tmp_path: Path) -> None:
    run = _copy(dcp_run, tmp_path)
    for d in run.iterdir():
        (d / ".metadata").write_bytes(b"\x80\x02garbage")
    doc = _json(run, "--keep", "1", "--grace", "0", "--yes", exit_code=3)  # refused
    assert set(_status(doc).values()) == {"kept"}
    assert any(w["code"] == "nothing-deleted" for w in doc["run_warnings"])
    assert _names(run) >= {"step_100", "step_200", "step_300"}


def test_symlinks_are_never_followed_out_of_the_run(sample_copy: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    shutil.copytree(sample_copy / "step_000100", outside / "step_000050")
    (outside / "precious.txt").write_text("keep me")
    (sample_copy / "step_000050").symlink_to(outside / "step_000050")
    (sample_copy / "step_000100" / "link-out").symlink_to(outside / "precious.txt")
    (sample_copy / "step_000100" / "dir-out").symlink_to(outside)
    doc = _json(sample_copy, "--keep", "1", "--grace", "0", "--yes")
    assert "step_000050" not in _status(doc)
    assert _status(doc)["step_000100"] == "deleted"
    assert (outside / "precious.txt").read_text() == "keep me"
    assert (outside / "step_000050" / "checkpoint.pt").is_file()
    assert (sample_copy / "step_000050").is_symlink()


def test_numbered_files_that_are_not_checkpoints_are_left_alone(sample_copy: Path) -> None:
    for name in ("data_0001.bin", "tokens_2.pt"):
        torch.save({"x": torch.zeros(2)}, sample_copy / name)
    doc = _json(sample_copy, "--keep", "1", "--grace", "0", "--yes")
    assert not {"data_0001.bin", "tokens_2.pt"} & set(_status(doc))
    assert {"data_0001.bin", "tokens_2.pt"} <= _names(sample_copy)


def test_names_too_long_for_a_trash_prefix(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    names = [f"epoch=0-step={s}-{'x' * 220}.ckpt" for s in (100, 200)]
    for name in names:
        torch.save({"w": torch.zeros(2), "global_step": 1}, run / name)
    doc = _json(run, "--keep", "1", "--grace", "0", "--yes")
    assert _status(doc) == {names[0]: "deleted", names[1]: "kept"}
    assert _names(run) == {names[1], ".ckpt-prune.lock"}


def test_pattern_overrides_recognition_and_says_when_ordering_is_by_mtime(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for i, name in enumerate(("alpha.pt", "bravo.pt", "charlie.pt")):
        torch.save({"w": torch.zeros(2)}, run / name)
        t = time.time() - 3600 * (3 - i)
        os.utime(run / name, (t, t))
    (run / "latest").write_text("charlie.pt")
    r = run_cli("prune", run, "--pattern", r"\.pt$", "--keep", "1", "--grace", "0", "--yes")
    assert r.exit_code == 0, r.stderr
    assert "modification time" in r.stderr
    assert _names(run) == {"charlie.pt", "latest", ".ckpt-prune.lock"}
    assert "deleted alpha.pt" in r.stdout and "deleted bravo.pt" in r.stdout


def test_run_dir_without_checkpoints_yet_is_a_quiet_success(tmp_path: Path) -> None:
    # A cron job that starts before training's first save: nothing to do is no error.
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("step 0\n")
    r = run_cli("prune", run, "--keep", "2", "--yes")
    assert r.exit_code == 0 and "note:" in r.stderr and "no checkpoints yet" in r.stderr
    doc = _json(run, "--keep", "2", "--yes")
    assert doc["note"] == "holds no checkpoints yet: nothing to do" and doc["checkpoints"] == []
    assert (run / "train.log").read_text() == "step 0\n"


@pytest.mark.parametrize("target", ["/", "home", "checkpoint"])
def test_refuses_roots_that_cannot_be_meant(sample_copy: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    home = tmp_path / "home"
    shutil.copytree(sample_copy, home)
    monkeypatch.setenv("HOME", str(home))
    path = {"/": Path("/"), "home": home, "checkpoint": sample_copy / "step_000400"}[target]
    before = sorted(str(p) for p in home.rglob("*"))
    r = run_cli("prune", path, "--keep", "1", "--grace", "0", "--yes")
    assert r.exit_code == 2, r.stdout
    lines = r.stderr.strip().splitlines()
    # A checkpoint is refused even with --any-dir: the hint names its run directory.
    hint = str(sample_copy) if target == "checkpoint" else "--any-dir"
    assert lines[0].startswith("ckpt: error:") and hint in lines[-1]
    assert "Traceback" not in r.stderr
    assert sorted(str(p) for p in home.rglob("*")) == before
    if target == "home":
        doc = _json(path, "--keep", "1", "--grace", "0", "--dry-run", "--any-dir")
        assert doc["summary"]["to_delete"] == 3


def test_old_force_is_refused_naming_any_dir(sample_copy: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """--force replaces an output in every command; prune's old --force (deprecated for a
    release) now stops, deleting nothing, and names --any-dir."""
    home = tmp_path / "home"
    shutil.copytree(sample_copy, home)
    before = sorted(str(p) for p in home.rglob("*"))
    monkeypatch.setenv("HOME", str(home))
    r = run_cli("prune", home, "--keep", "1", "--grace", "0", "--yes", "--force")
    assert r.exit_code == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0] == ("ckpt: error: prune has no --force: --force replaces an existing "
                        "output, and prune's old --force is now --any-dir")
    assert "--any-dir" in lines[-1] and "Traceback" not in r.stderr
    assert sorted(str(p) for p in home.rglob("*")) == before
    assert "--force" not in run_cli("prune", "--help").stdout


def test_a_second_prune_waits_for_the_lock(sample_copy: Path) -> None:
    with open(sample_copy / ".ckpt-prune.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        r = run_cli("prune", sample_copy, "--keep", "1", "--grace", "0", "--yes")
        busy = run_cli("prune", sample_copy, "--keep", "1", "--grace", "0", "--yes", "--json")
    assert r.exit_code == 75  # EX_TEMPFAIL: try later, not a usage error (2)
    assert "another ckpt prune is running" in r.stderr
    assert busy.exit_code == 75 and json.loads(busy.stdout)["error"]["kind"] == "busy"
    assert "step_000100" in _names(sample_copy)
    r = run_cli("prune", sample_copy, "--keep", "1", "--grace", "0", "--yes")  # lock released
    assert r.exit_code == 0 and "step_000100" not in _names(sample_copy)


def test_plan_holds_the_lock_until_execute_carries_it_out(sample_copy: Path) -> None:
    """The library's shape: ``plan`` decides (and locks), ``execute`` deletes and unlocks."""
    events: list[str] = []
    with prune_ops.plan(sample_copy, KEEP1) as planned:
        assert [d.entry.name for d in planned.plan.to_delete] == ["step_000100", "step_000200",
                                                                  "step_000300"]
        assert planned.asks and not planned.dry_run
        with pytest.raises(CkptError, match="another ckpt prune is running"):
            prune_ops.plan(sample_copy, KEEP1)
        assert "step_000100" in _names(sample_copy)  # nothing changed by planning
        result = prune_ops.execute(planned, on_event=lambda e: events.append(e.kind))
    assert [result.status(d) for d in result.plan.to_delete] == ["deleted"] * 3
    assert events.count("moved") == 3 and events.count("deleted") == 3
    assert "step_000100" not in _names(sample_copy)
    with prune_ops.plan(sample_copy, KEEP1) as again:  # the lock was released
        assert not again.plan.to_delete and not again.asks


def test_a_declined_plan_changes_nothing(sample_copy: Path) -> None:
    with prune_ops.plan(sample_copy, KEEP1) as planned:
        planned.decline()
        result = prune_ops.execute(planned)
    assert result.declined and not result.outcomes
    assert {"step_000100", "step_000200", "step_000300"} <= _names(sample_copy)
    dry = prune_ops.plan(sample_copy, KEEP1, dry_run=True)
    assert not dry.asks and not prune_ops.execute(dry).outcomes
    assert "step_000100" in _names(sample_copy)
