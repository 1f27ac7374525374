"""Run directories as a whole: HF Trainer output directories (final model + checkpoints),
pointer-led run directories (``latest``, Megatron's tracker) given to commands that need one
checkpoint, and run directories too long to show in full."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckpt_cli import runs
from ckpt_cli.formats import probe
from tests.conftest import HAS_DEEPSPEED, requires_deepspeed, run_cli, third_party_quiet

requires_torch = pytest.mark.requires_torch


def _json(*args: str | Path) -> dict:  # type: ignore[type-arg]
    r = run_cli(*args, "--json")
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout)  # type: ignore[no-any-return]


# -- HF Trainer output directory: final model + checkpoint-N/ ---------------------------------


@pytest.fixture(scope="module")
def hf_output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What Trainer.train() + save_model() + save_state() leave in output_dir."""
    from tests.helpers.makers import hf_trainer_run

    with third_party_quiet():
        return hf_trainer_run(tmp_path_factory.mktemp("hfout") / "out", final=True)


@requires_torch
def test_hf_output_dir_inspect_shows_checkpoints_and_final_model(hf_output: Path) -> None:
    assert (hf_output / "model.safetensors").is_file()  # the final model, by transformers
    doc = _json("inspect", hf_output)
    assert doc["kind"] == "run" and doc["final_model"] is True
    assert [c["name"] for c in doc["checkpoints"]] == ["checkpoint-2", "checkpoint-4"]
    assert all(c["complete"] for c in doc["checkpoints"])
    # The summary is the final model's (the top-level files), not a checkpoint's.
    assert doc["format"] == "dir" and doc["flavor"] == "hf-trainer"
    assert {f["path"] for f in doc["files"]} >= {"model.safetensors", "trainer_state.json"}
    assert not any(f["path"].startswith("checkpoint-") for f in doc["files"])
    assert doc["num_tensors"] > 0 and doc["metadata"]["step"] == 4
    assert not [w for w in doc["warnings"] if w["code"] == "nested-checkpoints"]

    r = run_cli("inspect", hf_output)
    assert r.exit_code == 0, r.output
    assert "run directory, 2 checkpoint(s)" in r.stdout
    assert "checkpoint-2" in r.stdout and "checkpoint-4" in r.stdout
    assert f"{hf_output} (final model)" in r.stdout and "hf-trainer" in r.stdout
    assert "checkpoint directories" not in r.stderr  # listed, so no hint to name them


@requires_torch
def test_hf_output_dir_validate_covers_checkpoints_and_final_model(hf_output: Path,
                                                                  tmp_path: Path) -> None:
    doc = _json("validate", hf_output)
    assert doc["kind"] == "run" and doc["final_model"] is True and doc["valid"] is True
    assert [c["name"] for c in doc["checkpoints"]] == ["checkpoint-2", "checkpoint-4",
                                                       hf_output.name]
    assert doc["checkpoints"][-1]["path"] == str(hf_output)
    # save_model() writes weights only, by design: a note, not a warning, for the final model.
    final = doc["checkpoints"][-1]
    assert [f["severity"] for f in final["findings"] if f["code"] == "no-optimizer"] == ["info"]
    assert run_cli("validate", hf_output, "--strict").exit_code == 0
    # Damage to the final model is found, as a finding of its own report.
    out = tmp_path / "out"
    shutil.copytree(hf_output, out)
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[:len(data) // 2])
    doc = _json("validate", out)
    assert doc["valid"] is False
    by_name = {c["name"]: c for c in doc["checkpoints"]}
    assert by_name["checkpoint-4"]["valid"] and not by_name["out"]["valid"]


@requires_torch
def test_a_damaged_final_model_without_trainer_state_is_still_checked(hf_output: Path,
                                                                      tmp_path: Path) -> None:
    # save_model() alone writes no trainer_state.json: the directory then lists like a run,
    # and a truncated final model must not be passed over as "2 of 2 checkpoints valid".
    out = tmp_path / "out"
    shutil.copytree(hf_output, out)
    (out / "trainer_state.json").unlink(missing_ok=True)
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[:len(data) // 2])
    r = run_cli("validate", out, "--json")
    assert r.exit_code == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["final_model"] is True and doc["valid"] is False
    by_name = {c["name"]: c for c in doc["checkpoints"]}
    assert by_name["checkpoint-4"]["valid"] and not by_name["out"]["valid"]
    r = run_cli("inspect", out)  # describes the final model and names the damage
    assert r.exit_code == 0 and f"{out} (final model)" in r.stdout
    assert "truncated" in r.stdout + r.stderr


@requires_torch
def test_validate_latest_of_an_output_dir_checks_the_newest_checkpoint(hf_output: Path,
                                                                      tmp_path: Path) -> None:
    # The README's CI gate before resuming, on what Trainer.train() + save_model() leave: the
    # final model (weights only, no optimizer, no step) is not what training resumes from.
    gate = ("validate", hf_output, "--latest", "--require", "optimizer,step")
    r = run_cli(*gate)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert ("--latest: checkpoint-4 (step 4, the newest checkpoint by step; the final model "
            "is not checked)") in r.stdout
    doc = _json(*gate)
    assert [c["name"] for c in doc["checkpoints"]] == ["checkpoint-4"] and doc["valid"]
    assert doc["latest"] == {"checkpoint": "checkpoint-4", "path": str(hf_output / "checkpoint-4"),
                             "step": 4, "pointer": None, "final_model": False}
    assert "latest" not in _json("validate", hf_output)  # only with --latest
    # A damaged newest checkpoint fails the gate: no falling back to an older one, which is
    # not what the Trainer would resume from.
    out = tmp_path / "out"
    shutil.copytree(hf_output, out)
    (out / "checkpoint-4" / "optimizer.pt").write_bytes(b"")
    r = run_cli("validate", out, "--latest", "--require", "optimizer,step", "--json")
    assert r.exit_code == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert [c["name"] for c in doc["checkpoints"]] == ["checkpoint-4"]
    assert doc["latest"]["checkpoint"] == "checkpoint-4" and not doc["valid"]


@requires_torch
def test_validate_latest_with_only_a_final_model_says_nothing_resumes(hf_output: Path) -> None:
    # --pattern matching no checkpoint leaves the final model alone: it is checked, and the
    # gate fails because it cannot resume.
    gate = ("validate", hf_output, "--latest", "--pattern", "^nothing$", "--require",
            "optimizer,step")
    r = run_cli(*gate)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert (f"--latest: {hf_output.name} (the final model: no checkpoint beside it to resume "
            "from)") in r.stdout
    doc = json.loads(run_cli(*gate, "--json").stdout)
    assert [c["name"] for c in doc["checkpoints"]] == [hf_output.name]
    assert doc["latest"]["final_model"] is True and doc["latest"]["pointer"] is None


@requires_torch
def test_validate_latest_of_an_output_dir_holding_only_the_final_model(hf_output: Path,
                                                                       tmp_path: Path) -> None:
    # save_strategy="no" (or the checkpoints removed): output_dir holds save_model()'s final
    # model and nothing else. It is the latest (and only) checkpoint: checked as such.
    out = tmp_path / "out"
    shutil.copytree(hf_output, out, ignore=shutil.ignore_patterns("checkpoint-*"))
    assert runs.is_final_model_only(out)
    assert not runs.is_final_model_only(hf_output / "checkpoint-4")
    r = run_cli("validate", out, "--latest")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "--latest: out (the final model: no checkpoint beside it to resume from)" in r.stdout
    doc = _json("validate", out, "--latest")
    assert [c["name"] for c in doc["checkpoints"]] == ["out"] and doc["valid"]
    assert doc["latest"]["final_model"] is True
    # It cannot resume training (weights only): the resume gate says so.
    r = run_cli("validate", out, "--latest", "--require", "optimizer,step")
    assert r.exit_code == 1 and "no optimizer state" in r.stdout
    # Damage to it is found.
    (out / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes()[:-100])
    r = run_cli("validate", out, "--latest")
    assert r.exit_code == 1 and "truncated" in r.stdout + r.stderr
    # A directory that is no output dir (no training_args.bin / trainer_state.json) still
    # needs a run directory.
    for f in ("training_args.bin", "trainer_state.json"):
        (out / f).unlink(missing_ok=True)
    r = run_cli("validate", out, "--latest")
    assert r.exit_code == 2 and "--latest needs a run directory" in r.stderr


@requires_torch
def test_validate_latest_of_a_trainer_dir_without_final_model(hf_trainer_dir: Path) -> None:
    r = run_cli("validate", hf_trainer_dir, "--latest", "--require", "optimizer,step")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "--latest: checkpoint-4 (step 4, the newest checkpoint by step)" in r.stdout
    assert "final model" not in r.stdout


@requires_torch
def test_validate_latest_follows_resume_pointers(megatron_run: Path, sample_run: Path,
                                                 lightning_dir: Path, tmp_path: Path) -> None:
    # Megatron: the tracker names iter_0000100, not the newest iter_0000200.
    doc = _json("validate", megatron_run, "--latest")
    assert [c["name"] for c in doc["checkpoints"]] == ["iter_0000100"]
    assert doc["latest"]["pointer"] == "latest_checkpointed_iteration.txt"
    assert "--latest: iter_0000100 (step 100, named by latest_checkpointed_iteration.txt)" in (
        run_cli("validate", megatron_run, "--latest").stdout)
    # ckpt sample (torch step dirs and a DCP checkpoint): `latest` names the DCP step_000400.
    doc = _json("validate", sample_run, "--latest")
    assert [(c["name"], c["format"]) for c in doc["checkpoints"]] == [("step_000400", "dcp")]
    assert doc["latest"] == {"checkpoint": "step_000400", "path": str(sample_run / "step_000400"),
                             "step": 400, "pointer": "latest", "final_model": False}
    # Lightning: last.ckpt (a copy) is the newest; a last.ckpt link names what it points at.
    doc = _json("validate", lightning_dir, "--latest")
    assert doc["latest"]["checkpoint"] == "last.ckpt" and doc["latest"]["step"] == 4
    linked = tmp_path / "pl"
    shutil.copytree(lightning_dir, linked)
    (linked / "last.ckpt").unlink()
    (linked / "last.ckpt").symlink_to("epoch=0-step=4.ckpt")
    doc = _json("validate", linked, "--latest")
    assert [c["name"] for c in doc["checkpoints"]] == ["epoch=0-step=4.ckpt"]
    assert doc["latest"]["pointer"] == "last.ckpt" and doc["valid"]


@requires_torch
def test_a_checkpoint_of_the_run_is_still_one_checkpoint(hf_output: Path) -> None:
    doc = _json("inspect", hf_output / "checkpoint-4")
    assert doc["kind"] == "checkpoint" and "checkpoints" not in doc


# -- Pointer-led run directories -------------------------------------------------------------


@pytest.fixture
def megatron_run(tmp_path: Path) -> Path:
    from tests.helpers.makers import megatron_legacy

    run = tmp_path / "save"
    for it in (100, 200):
        megatron_legacy(run, tp=1, iteration=it)
    (run / "latest_checkpointed_iteration.txt").write_text("100")  # not the newest
    return run


@requires_torch
def test_convert_follows_megatron_tracker(megatron_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    r = run_cli("convert", megatron_run, "-o", out)
    assert r.exit_code == 0, r.output
    assert "latest_checkpointed_iteration.txt names iter_0000100" in r.stderr
    doc = _json("convert", megatron_run, "-o", tmp_path / "m2.safetensors")
    assert doc["followed"] == {"pointer": "latest_checkpointed_iteration.txt",
                               "checkpoint": "iter_0000100",
                               "path": str(megatron_run / "iter_0000100")}
    assert doc["source"] == str(megatron_run)
    # What was converted is the checkpoint the pointer names, not the newest one (both hold
    # the same weights here: the output's metadata records its source, by name).
    assert doc["metadata"]["ckpt.source"] == "iter_0000100"
    assert _json("diff", out, megatron_run / "iter_0000100")["equal"] is True


@requires_torch
def test_diff_follows_the_pointer_on_each_side(megatron_run: Path) -> None:
    r = run_cli("diff", megatron_run, megatron_run / "iter_0000100")
    assert r.exit_code == 0, r.output
    assert "A: " in r.stderr and "names iter_0000100" in r.stderr
    doc = _json("diff", megatron_run / "iter_0000100", megatron_run)
    assert doc["equal"] is True
    assert doc["followed"]["a"] is None
    assert doc["followed"]["b"]["checkpoint"] == "iter_0000100"


@requires_torch
def test_a_dangling_pointer_is_an_error_naming_it(megatron_run: Path, tmp_path: Path) -> None:
    (megatron_run / "latest_checkpointed_iteration.txt").write_text("300")
    r = run_cli("convert", megatron_run, "-o", tmp_path / "x.safetensors")
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "latest_checkpointed_iteration.txt" in r.stderr and "iter_0000300" in r.stderr
    assert not (tmp_path / "x.safetensors").exists()


@requires_torch
def test_a_run_directory_without_pointer_is_still_refused(megatron_run: Path,
                                                          tmp_path: Path) -> None:
    (megatron_run / "latest_checkpointed_iteration.txt").unlink()
    r = run_cli("convert", megatron_run, "-o", tmp_path / "x.safetensors")
    assert r.exit_code == 2 and "run directory" in r.stderr


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DeepSpeed save directory with global_step1..3 and `latest`, saved by DeepSpeed."""
    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    from tests.helpers.makers import deepspeed_checkpoints

    return deepspeed_checkpoints(tmp_path_factory.mktemp("dsrun"), ["z1-fp32+each"]) / (
        "z1-fp32+each")


@requires_torch
@requires_deepspeed
def test_convert_and_consolidate_follow_deepspeed_latest(ds_run: Path, tmp_path: Path) -> None:
    assert (ds_run / "latest").read_text().strip() == "global_step3"
    assert runs.is_run_dir(ds_run)
    # convert follows `latest` too, and gathers the ZeRO tag it names as consolidate does
    # (issue 24: it used to refuse ZeRO with a pointer to consolidate).
    r = run_cli("convert", ds_run, "-o", tmp_path / "c.safetensors")
    assert r.exit_code == 0 and "run directory" not in r.stderr, r.output
    assert "latest names global_step3" in r.stderr
    doc = _json("consolidate", ds_run, "-o", tmp_path / "z.safetensors")
    assert doc["followed"]["checkpoint"] == "global_step3" and doc["kind"] == "deepspeed"
    assert _json("diff", tmp_path / "c.safetensors", tmp_path / "z.safetensors")["equal"]
    r = run_cli("consolidate", ds_run, "-o", tmp_path / "z2.safetensors")
    assert r.exit_code == 0 and "latest names global_step3" in r.stderr
    d = _json("diff", ds_run, ds_run / "global_step3")
    assert d["equal"] is True and d["followed"]["a"]["checkpoint"] == "global_step3"


# -- Very long run directories ---------------------------------------------------------------


@pytest.fixture(scope="module")
def long_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 small safetensors checkpoints, one of them (step 150) truncated."""
    run = tmp_path_factory.mktemp("long") / "run"
    run.mkdir()
    for i in range(1, 301):
        save_file({"w": np.full((4, 4), i, np.float32)}, str(run / f"step_{i:04d}.safetensors"),
                  metadata={"step": str(i)})
    bad = run / "step_0150.safetensors"
    bad.write_bytes(bad.read_bytes()[:-8])
    (run / "latest").write_text("step_0300.safetensors\n")
    return run


def _table_rows(stdout: str) -> list[str]:
    """The run table's checkpoint rows (the table ends at the first blank line)."""
    table = stdout.split("\n\n", 1)[0]
    return [line for line in table.splitlines() if line.startswith("step_")]


def test_long_run_table_shows_oldest_and_newest_with_a_count(long_run: Path) -> None:
    r = run_cli("inspect", long_run)
    assert r.exit_code == 0, r.output
    rows = _table_rows(r.stdout)
    assert len(rows) == 20
    names = [row.split()[0] for row in rows]
    assert names[:10] == [f"step_{i:04d}.safetensors" for i in range(1, 11)]
    assert names[10:] == [f"step_{i:04d}.safetensors" for i in range(291, 301)]
    hidden = next(line for line in r.stdout.splitlines() if "more" in line)
    # The count, and the incomplete entry among those left out (never hidden silently).
    assert "... 280 more" in hidden and "1 incomplete" in hidden
    assert "run directory, 300 checkpoint(s)" in r.stdout


def test_long_run_all_flag_shows_every_row(long_run: Path) -> None:
    r = run_cli("inspect", long_run, "--all")
    assert r.exit_code == 0, r.output
    rows = _table_rows(r.stdout)
    assert len(rows) == 300 and "more" not in r.stdout
    assert any("step_0150" in row and "incomplete" in row for row in rows)


def test_long_run_json_keeps_every_entry(long_run: Path) -> None:
    doc = _json("inspect", long_run)
    entries = doc["checkpoints"]
    assert [e["step"] for e in entries] == list(range(1, 301))
    assert [e["name"] for e in entries if not e["complete"]] == ["step_0150.safetensors"]
    assert all(e["format"] == "safetensors" and e["files"] == 1 for e in entries)
    assert doc["latest"] == "step_0300.safetensors"
    assert doc["described"] == "step_0300.safetensors"


def test_slow_storage_listing_in_threads_gives_the_same_entries(
        long_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread pool taken for slow storage lists exactly what the sequential path does."""
    def key(e: runs.RunEntry) -> tuple:  # type: ignore[type-arg]
        return (e.name, e.step, e.format, e.bytes, e.files, e.mtime, e.complete, e.reason,
                e.latest)

    sequential = [key(e) for e in runs.list_run(long_run).entries]
    monkeypatch.setattr(runs, "_SLOW_ENTRY", 0.0)  # every probe counts as slow
    monkeypatch.setattr(runs, "_PROBE", 8)
    threaded = [key(e) for e in runs.list_run(long_run).entries]
    assert threaded == sequential and len(threaded) == 300


def test_a_file_entry_reads_like_the_generic_status(long_run: Path) -> None:
    """The one-open status of a file entry agrees with quick_status and tree_scan."""
    for name in ("step_0001.safetensors", "step_0150.safetensors"):
        p = long_run / name
        e = runs.run_entry(p)
        assert (e.format, e.complete, e.reason) == probe.quick_status(p)
        scan = runs.tree_scan(p)
        assert (e.bytes, e.files, e.mtime) == (scan.bytes, scan.files, scan.mtime)
