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
from typing import Any

import pytest
import torch

from ckpt_cli.errors import CkptError
from ckpt_cli.formats import read_index as formats_read_index
from ckpt_cli.ops import prune as prune_ops
from ckpt_cli.ops.prune import PruneEvent, prune
from ckpt_cli.ops.prune import local as prune_local
from ckpt_cli.ops.prune.retention import PrunePlan, PrunePolicy
from ckpt_cli.runs import list_run
from tests.conftest import Golden, requires_deepspeed, run_cli, third_party_quiet
from tests.helpers.golden import safetensors_run, stable
from tests.helpers.makers import hf_trainer_run, lightning_run, megatron_legacy

pytestmark = pytest.mark.requires_torch

HELPERS = Path(__file__).parents[2] / "helpers"
KEEP1 = PrunePolicy(keep=1, grace=0)


def _json(path: Path, *args: str, exit_code: int = 0) -> dict[str, Any]:
    r = run_cli("prune", path, *args, "--json")
    assert r.exit_code == exit_code, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def _status(doc: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["status"] for c in doc["checkpoints"]}


def _why(doc: dict[str, Any], name: str) -> str:
    return "; ".join(next(c["reasons"] for c in doc["checkpoints"] if c["name"] == name))


def _names(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def _copy(src: Path, tmp_path: Path, name: str = "run") -> Path:
    dest = tmp_path / name
    shutil.copytree(src, dest, symlinks=True)
    return dest


# -- fixtures written by the real libraries -------------------------------------------------------


@pytest.fixture(scope="session")
def hf_eval_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' Trainer output: checkpoint-2/4/6, evaluated at each save (eval_loss)."""
    with third_party_quiet():
        return hf_trainer_run(tmp_path_factory.mktemp("hfe") / "out", steps=6, evaluate=True)


@pytest.fixture(scope="session")
def lightning_metric_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Lightning: epoch=E-step=S-train_loss=X.ckpt at steps 2, 4, 6 and a last.ckpt symlink."""
    with third_party_quiet():
        return lightning_run(tmp_path_factory.mktemp("plm") / "ckpts", steps=6,
                             filename="{epoch}-{step}-{train_loss:.4f}", save_last="link")


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
        result = prune_ops.execute(planned, on_progress=lambda e: events.append(e.kind))
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

    def on_progress(event: PruneEvent) -> None:
        if event.kind == "deleted" and event.name == "step_000100":
            out, err = started[0].communicate(timeout=120)
            assert started[0].returncode == 0 and out.strip() == "ok", err

    result = prune(run, KEEP1, confirm=lambda plan: after_planning(plan) is None,
                   on_progress=on_progress)
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


# -- the command line -----------------------------------------------------------------------------


def test_cron_output_is_one_plain_line_per_action(sample_copy: Path) -> None:
    r = run_cli("prune", sample_copy, "--keep", "2", "--grace", "0")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "4 checkpoints" in lines[0] and "2 kept, 2 to delete" in lines[0]
    assert [ln.split(" ")[:2] for ln in lines[1:-1]] == [
        ["keep", "step_000300"], ["keep", "step_000400"], ["deleted", "step_000100"],
        ["deleted", "step_000200"]]
    assert lines[-1].startswith("deleted 2 checkpoint(s), freed ")
    assert "\x1b" not in r.stdout and "━" not in r.stdout


def test_terminal_asks_and_declining_changes_nothing(sample_copy: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt_cli.cli import prune as prune_cli

    monkeypatch.setattr(prune_cli, "_interactive", lambda: True)
    r = run_cli("prune", sample_copy, "--keep", "1", "--grace", "0", input="n\n")
    assert r.exit_code == 0
    assert "Delete 3 checkpoints" in r.stderr and "nothing was deleted" in r.stdout
    assert "step_000100" in _names(sample_copy)
    r = run_cli("prune", sample_copy, "--keep", "1", "--grace", "0", input="")  # EOF = no
    assert r.exit_code == 0 and "step_000100" in _names(sample_copy)
    r = run_cli("prune", sample_copy, "--keep", "1", "--grace", "0", input="y\n")
    assert r.exit_code == 0 and "step_000100" not in _names(sample_copy)
    r = run_cli("prune", sample_copy, "--keep", "1", "--grace", "0", "--yes")  # nothing left
    assert r.exit_code == 0 and "Delete" not in r.stderr


@pytest.mark.parametrize("args,fragment", [
    ([], "say what to keep"),
    (["--keep", "0"], "--keep must be at least 1"),
    (["--keep-best", "2"], "--keep-best needs --metric"),
    (["--keep-best", "1", "--metric", "nope"], "no checkpoint has a value for --metric nope"),
    (["--keep", "1", "--mode", "best"], "--mode must be min or max"),
    (["--max-total-size", "2XB"], "unknown unit"),
    (["--older-than", "soon"], "cannot parse --older-than"),
    (["--older-than", "7"], "--older-than '7' needs a unit: 7d (days), 7h (hours), 7m "),
    (["--keep", "1", "--grace", "10"], "--grace '10' needs a unit"),
    (["--keep", "1", "--json"], "--json never asks for confirmation"),
    (["--keep", "1", "--pattern", "("], "--pattern is not a valid regular expression"),
    (["--keep", "1", "--metrics-file", "/nonexistent.csv", "--keep-best", "1", "--metric", "x"],
     "cannot read the metrics file"),
])
def test_usage_errors_are_one_line_and_exit_2(sample_copy: Path, args: list[str],
                                              fragment: str) -> None:
    def tree() -> list[str]:
        return sorted(str(p) for p in sample_copy.rglob("*") if p.name != ".ckpt-prune.lock")

    before = tree()
    r = run_cli("prune", sample_copy, "--grace", "0", *args)
    assert r.exit_code == 2, (r.stdout, r.stderr)
    assert fragment in r.stderr.splitlines()[0]
    assert "Traceback" not in r.stderr
    assert tree() == before


def test_metrics_file_csv_from_a_lightning_logger(sample_copy: Path) -> None:
    (sample_copy / "metrics.csv").write_text(
        "epoch,step,train_loss,val_loss\n0,100,2.0,\n0,100,,1.5\n0,200,,0.9\n0,300,,1.2\n"
        "0,400,,1.1\n")
    doc = _json(sample_copy, "--keep", "1", "--keep-best", "1", "--metric", "val_loss",
                "--metrics-file", str(sample_copy / "metrics.csv"), "--grace", "0", "--yes")
    assert _status(doc) == {"step_000100": "deleted", "step_000200": "kept",
                            "step_000300": "deleted", "step_000400": "kept"}
    assert {c["name"]: c["metric"] for c in doc["checkpoints"]}["step_000300"] == 1.2


def test_json_schema(sample_copy: Path) -> None:
    doc = _json(sample_copy, "--keep", "1", "--grace", "0", "--dry-run")
    assert doc["schema_version"] == 1 and doc["command"] == "prune"
    assert set(doc) >= {"path", "dry_run", "declined", "policy", "checkpoints", "latest",
                        "pointers", "leftovers", "run_warnings", "newest_valid",
                        "trash_removed", "trash_failed", "summary"}
    assert doc["policy"] == {"keep": 1, "keep_every": None, "keep_best": None, "metric": None,
                             "mode": "min", "older_than": None, "max_total_size": None,
                             "keep_abandoned": False,
                             "grace": 0.0, "pattern": None, "metrics_file": None}
    entry_keys = {"name", "path", "step", "step_source", "format", "bytes", "files", "mtime",
                  "complete", "reason", "latest", "metrics", "action", "status", "kept_by",
                  "protected_by", "reasons", "metric", "valid", "detail"}
    assert all(set(c) == entry_keys for c in doc["checkpoints"])
    assert set(doc["summary"]) == {"checkpoints", "kept", "to_delete", "deleted", "skipped",
                                   "failed", "bytes_total", "bytes_to_free", "bytes_freed"}


def test_prune_does_not_import_torch(sample_run: Path) -> None:
    from tests.ops.inspect.test_inspect_cli import _imports_torch

    imported, tail = _imports_torch("prune", str(sample_run), "--keep", "1", "--dry-run")
    assert not imported, tail
    assert "EXIT=0" in tail, tail



def test_dangling_or_zeroed_pointer_deletes_nothing(sample_copy: Path) -> None:
    for content in (b"step_000999\n", b"\x00" * 16):
        (sample_copy / "latest").write_bytes(content)
        r = run_cli("prune", sample_copy, "--keep", "1", "--grace", "0", "--yes", "--json")
        assert r.exit_code == 3, r.stderr
        assert set(_status(json.loads(r.stdout)).values()) == {"kept"}
    assert {"step_000100", "step_000200", "step_000300"} <= _names(sample_copy)


def test_pointer_naming_a_file_inside_a_checkpoint(sample_copy: Path) -> None:
    (sample_copy / "latest").unlink()
    (sample_copy / "latest").symlink_to("step_000200/checkpoint.pt")
    doc = _json(sample_copy, "--keep", "1", "--grace", "0", "--dry-run")
    assert "latest names it" in _why(doc, "step_000200")
    assert _status(doc)["step_000200"] == "kept"


def test_steps_decide_order_whatever_the_mtimes(tmp_path: Path) -> None:
    run = tmp_path / "w"
    run.mkdir()
    for i in range(1, 13):
        torch.save({"model": {"w": torch.ones(2)}}, run / f"epoch{i}.pt")
    torch.save({"model": {"w": torch.ones(2)}}, run / "last.pt")  # no step anywhere
    torch.save({"model": {"w": torch.ones(2)}}, run / "model.final.pt")  # no step either
    # Restored or synced files: modification times in name order, not in step order.
    for j, name in enumerate(sorted(p.name for p in run.iterdir())):
        os.utime(run / name, (1000 + j, 1000 + j))
    doc = _json(run, "--keep", "2", "--grace", "0", "--pattern", r"(epoch(?P<step>\d+)|"
                r"last|model\.final)\.pt$", "--dry-run")
    status = _status(doc)
    assert status["epoch11.pt"] == status["epoch12.pt"] == "kept"
    assert status["epoch10.pt"] == "would-delete"
    assert status["model.final.pt"] == "kept"
    assert "cannot be ordered" in _why(doc, "model.final.pt")


# -- a newest checkpoint that reads fine but cannot be loaded is not "the newest valid" --------


def test_hf_checkpoint_without_its_weights_is_not_valid(hf_trainer_dir: Path,
                                                       tmp_path: Path) -> None:
    run = _copy(hf_trainer_dir, tmp_path)
    weights = [p for p in (run / "checkpoint-4").iterdir()
               if p.name.startswith(("model", "pytorch_model"))]
    assert weights
    for p in weights:
        p.unlink()
    r = run_cli("validate", run / "checkpoint-4")
    assert r.exit_code == 1 and "without model weights" in r.output, r.output
    doc = _json(run, "--keep", "1", "--grace", "0", "--dry-run")
    assert _status(doc)["checkpoint-2"] == "kept" and "newest valid" in _why(doc, "checkpoint-2")


def test_hf_shards_with_a_gap_and_no_index(tmp_path: Path) -> None:
    from tests.helpers.makers import hf_sharded, tiny_state_dict

    d = tmp_path / "checkpoint-9"
    d.mkdir()
    hf_sharded(d, tiny_state_dict(), max_shard_size=600)
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) >= 3
    (d / "model.safetensors.index.json").unlink()
    shards[1].unlink()
    found = {(f.code, f.file) for f in formats_read_index(d).findings}
    assert ("missing-shard", shards[1].name) in found
    assert prune_ops.quick_validate(d) is not None


@requires_deepspeed
def test_deepspeed_tags_missing_model_states(ds_dir: Path, tmp_path: Path) -> None:
    for name, doomed in (("z3-fp32", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
                         ("z2-fp32", "mp_rank_00_model_states.pt")):
        run = _copy(ds_dir / name, tmp_path, name)
        tag = run / (run / "latest").read_text().strip()
        (tag / doomed).unlink()
        assert prune_ops.quick_validate(tag) is not None, name
        assert run_cli("validate", tag).exit_code == 1, name


def test_sweep_job_directories_are_not_checkpoints(tmp_path: Path) -> None:
    # Hydra multirun: 0/, 1/, 2/ each hold a job's config and log (and maybe a model file).
    sweep = tmp_path / "multirun"
    for i in range(3):
        job = sweep / str(i)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "config.yaml").write_text("lr: 0.1\n")
        (job / "main.log").write_text("done\n")
        torch.save({"w": torch.ones(2)}, job / "model.pt")
    r = run_cli("prune", sweep, "--keep", "1", "--grace", "0", "--yes")
    # Not a run: the one resolver refuses a directory whose entries each hold a checkpoint of
    # their own, naming them (a cron job pointed at the sweep says so at once, instead of
    # "nothing yet" for ever), and nothing is deleted.
    assert r.exit_code == 2, r.output
    assert "holds checkpoints: 0/, 1/, 2/; pass one of them" in r.stderr, r.stderr
    assert all((sweep / str(i) / f).is_file() for i in range(3)
               for f in ("main.log", "model.pt", ".hydra/config.yaml"))
    # An empty run directory (before the first save) is still nothing to do: a note, exit 0.
    (tmp_path / "fresh").mkdir()
    r = run_cli("prune", tmp_path / "fresh", "--keep", "1", "--grace", "0", "--yes")
    assert r.exit_code == 0 and "holds no checkpoints yet" in r.stderr, r.output


def test_absolute_pointer_through_a_symlinked_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for i in (1, 2, 3):
        (run / f"step_{i}").mkdir(parents=True)
        torch.save({"model": {"w": torch.ones(2)}, "step": i}, run / f"step_{i}" / "model.pt")
    (tmp_path / "link").symlink_to(run)
    (run / "latest").symlink_to(tmp_path / "link" / "step_2")
    doc = _json(run, "--keep", "1", "--grace", "0", "--dry-run")
    assert "latest names it" in _why(doc, "step_2")
    assert _status(doc)["step_1"] == "would-delete"
    assert run_cli("validate", run, "--latest").exit_code == 0


@requires_deepspeed
def test_lightning_deepspeed_strategy_checkpoints(ds_dir: Path, tmp_path: Path) -> None:
    # Lightning's DeepSpeedStrategy saves epoch=E-step=S.ckpt/ as a DeepSpeed save directory
    # of one tag named "checkpoint" (plus latest and zero_to_fp32.py).
    src = ds_dir / "z2-fp32"
    tag = src / (src / "latest").read_text().strip()
    run = tmp_path / "ckpts"
    for step in (2, 4, 6):
        d = run / f"epoch=0-step={step}.ckpt"
        shutil.copytree(tag, d / "checkpoint")
        (d / "latest").write_text("checkpoint")
        (d / "zero_to_fp32.py").write_text("# script\n")
    r = run_cli("validate", run)
    assert r.exit_code == 0 and "3 of 3" in r.output, r.output
    doc = _json(run, "--keep", "1", "--grace", "0", "--dry-run")
    assert _status(doc) == {"epoch=0-step=2.ckpt": "would-delete",
                            "epoch=0-step=4.ckpt": "would-delete",
                            "epoch=0-step=6.ckpt": "kept"}
    out = tmp_path / "o.safetensors"
    assert run_cli("consolidate", run / "epoch=0-step=6.ckpt", "-o", out).exit_code == 0


def test_metrics_logged_a_step_before_the_checkpoint(lightning_metric_dir: Path,
                                                     tmp_path: Path) -> None:
    # Lightning's CSVLogger logs validation at step S-1 for the checkpoint named step=S.
    run = _copy(lightning_metric_dir, tmp_path)
    csv_file = tmp_path / "metrics.csv"
    csv_file.write_text("epoch,step,val_loss\n0,1,0.9\n1,3,0.5\n2,5,0.7\n")
    doc = _json(run, "--keep", "1", "--keep-best", "1", "--metric", "val_loss",
                "--metrics-file", str(csv_file), "--grace", "0", "--dry-run")
    step4 = next(n for n in _status(doc) if "step=4" in n)
    assert "best 1 by val_loss" in _why(doc, step4) and "0.5" in _why(doc, step4)


def test_weights_in_a_subdirectory_count(hf_trainer_dir: Path, tmp_path: Path) -> None:
    # HF Trainer + DeepSpeed ZeRO-3 without gathered weights keeps them only in global_stepN/;
    # Accelerate save hooks write unet/diffusion_pytorch_model.safetensors.
    run = _copy(hf_trainer_dir, tmp_path)
    ckpt = run / "checkpoint-4"
    for p in list(ckpt.iterdir()):
        if p.name.startswith(("model", "pytorch_model")):
            p.unlink()
    (ckpt / "global_step4").mkdir()
    tag = ckpt / "global_step4"
    torch.save({"module": {"w": torch.ones(2)}}, tag / "mp_rank_00_model_states.pt")
    (ckpt / "latest").write_text("global_step4")
    codes = {f.code for f in formats_read_index(ckpt).findings}
    assert "missing-weights" not in codes
    assert prune_ops.quick_validate(ckpt) is None


def test_a_metric_from_another_step_is_not_borrowed(tmp_path: Path) -> None:
    # save_steps=200, eval_steps=300: the eval at 300 judged the step-300 model, which no
    # checkpoint holds; it must not be credited to checkpoint 400.
    run = tmp_path / "run"
    for step in (200, 400, 600):
        (run / f"step_{step}").mkdir(parents=True)
        torch.save({"model": {"w": torch.ones(2)}, "step": step}, run / f"step_{step}" / "m.pt")
    metrics = tmp_path / "m.csv"
    metrics.write_text("step,eval_loss\n300,0.1\n")
    r = run_cli("prune", run, "--keep", "1", "--keep-best", "1", "--metric", "eval_loss",
                "--metrics-file", metrics, "--grace", "0", "--dry-run")
    assert r.exit_code == 2 and "no checkpoint has a value" in r.stderr, r.output


def test_a_skipped_job_directory_is_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (100, 200, 300):
        (run / str(step)).mkdir(parents=True)
        torch.save({"model": {"w": torch.ones(2)}}, run / str(step) / "model.pt")
    (run / "100" / "config.yaml").write_text("lr: 1\n")
    doc = _json(run, "--keep", "1", "--grace", "0", "--dry-run")
    assert set(_status(doc)) == {"200", "300"}
    assert any(w["code"] == "job-dir-skipped" and w["file"] == "100"
               for w in doc["run_warnings"]), doc["run_warnings"]


def test_golden_dry_run_json(tmp_path: Path, golden: Golden) -> None:
    """``prune --dry-run --json`` is a contract: the same run dir gives the same plan."""
    run = safetensors_run(tmp_path)
    r = run_cli("prune", run, "--keep", "2", "--grace", "0", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    golden("prune_dry_run.json", json.loads(r.stdout), stable(tmp_path))
    assert len(list(run.iterdir())) == 5  # a dry run deletes nothing


@pytest.mark.parametrize("option,example", [
    ("--older-than", "7d"), ("--keep-every", "10K"), ("--max-total-size", "10GB"),
    ("--grace", "7d"), ("--metric", None), ("--pattern", None),
])
def test_an_empty_value_is_refused_not_a_dropped_rule(sample_copy: Path, option: str,
                                                      example: str | None) -> None:
    # `--older-than ""` used to drop the rule: --keep 1 alone then deleted three checkpoints.
    args = ["--keep", "1", option, "", "--dry-run"]
    if option != "--grace":
        args += ["--grace", "0"]
    r = run_cli("prune", sample_copy, *args)
    assert r.exit_code == 2, r.stdout + r.stderr
    line = f"{option} '' is empty" + (f"; e.g. {example}" if example else "")
    assert line in r.stderr
    assert "would-delete" not in r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize("age", ["6M", "10M", "1mo"])
def test_capital_m_is_not_minutes_in_prune(sample_copy: Path, age: str) -> None:
    for option in ("--older-than", "--grace"):
        r = run_cli("prune", sample_copy, "--keep", "1", option, age, "--dry-run",
                    *(["--grace", "0"] if option == "--older-than" else []))
        assert r.exit_code == 2, r.stdout
        assert "months are not accepted" in r.stderr


def test_keep_trusts_the_run_ledger(sample_copy: Path) -> None:
    from ckpt_cli.trust.ledger import LedgerEntry, append

    # The watcher found step_000300 bad and has not verified step_000400 yet: --keep 1 keeps
    # both (not counted) and step_000200, the newest good one; step_000100 goes.
    def line(name: str, step: int, verdict: str) -> LedgerEntry:
        return LedgerEntry(path=name, step=step, time=time.time(), event="verified",
                           verdict=verdict, bytes=1,
                           problems=("shard corrupted",) if verdict == "bad" else ())

    append(sample_copy, [line("step_000100", 100, "good"), line("step_000200", 200, "good"),
                         line("step_000300", 300, "bad")])
    doc = _json(sample_copy, "--keep", "1", "--grace", "0", "--yes")
    assert _status(doc) == {"step_000100": "deleted", "step_000200": "kept",
                            "step_000300": "kept", "step_000400": "kept"}
    assert "ledger verdict is bad" in _why(doc, "step_000300")
    assert "newest 1 complete (--keep 1)" in _why(doc, "step_000200")
    assert (sample_copy / "ckpt-ledger.jsonl").is_file()
