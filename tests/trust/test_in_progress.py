"""Checkpoints under a writer's temporary name are unfinished: never valid, never pruned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckpt_cli.formats.names import in_progress_reason
from tests.conftest import run_cli
from tests.helpers.makers import tiny_state_dict, training_checkpoint

pytestmark = pytest.mark.requires_torch

IN_PROGRESS = ["step_300.orbax-checkpoint-tmp-1700000000", "model.tmp", "tmp-checkpoint-500",
               ".step_300.ckpt-tmp-0123456789ab"]


@pytest.mark.parametrize("name", IN_PROGRESS)
def test_a_directory_named_like_an_unfinished_save_is_incomplete(tmp_path: Path,
                                                                  name: str) -> None:
    d = tmp_path / name
    d.mkdir()
    save_file(tiny_state_dict(), d / "model.safetensors")
    r = run_cli("validate", d, "--json")
    assert r.exit_code == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    codes = [(f["severity"], f["code"]) for c in doc["checkpoints"] for f in c["findings"]]
    assert ("error", "incomplete") in codes
    text = run_cli("validate", d).stdout
    assert "unfinished save" in text or "temporary save" in text


def test_a_file_named_like_an_unfinished_save_is_incomplete(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors.tmp"
    save_file(tiny_state_dict(), p)
    r = run_cli("validate", p)
    assert r.exit_code == 1 and "unfinished save ('.tmp')" in r.stdout


def test_finished_names_stay_valid(tmp_path: Path) -> None:
    # tempfile.mkdtemp() names start with "tmp": a finished checkpoint may live in one.
    for name in ("tmpk3j4h5", "step_300", "checkpoint-500"):
        d = tmp_path / name
        d.mkdir()
        save_file(tiny_state_dict(), d / "model.safetensors")
        if name.startswith("checkpoint-"):
            (d / "trainer_state.json").write_text('{"global_step": 500}')
        r = run_cli("validate", d)
        assert r.exit_code == 0, r.stdout
    assert in_progress_reason("step_300") is None and in_progress_reason("tmpk3j4h5") is None


def test_prune_never_deletes_an_unfinished_save(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    names = ["step_100", "step_200", "step_300.orbax-checkpoint-tmp-1700000000",
             "step_400.tmp"]
    for i, name in enumerate(names, 1):
        (run / name).mkdir()
        torch.save(training_checkpoint(step=100 * i), run / name / "checkpoint.pt")
    r = run_cli("prune", run, "--keep", "1", "--grace", "0s", "--yes")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == [
        "step_200", "step_300.orbax-checkpoint-tmp-1700000000", "step_400.tmp"]
    v = run_cli("validate", run, "--json")
    doc = json.loads(v.stdout)
    assert {c["name"] for c in doc["checkpoints"]} == {"step_200"}
    assert "step_300.orbax-checkpoint-tmp-1700000000" in v.stdout


def test_a_file_entry_under_an_unfinished_name_is_incomplete(tmp_path: Path) -> None:
    # The listing's one-open path for files must apply the same name check as the general one.
    from ckpt_cli.formats.probe import quick_status
    from ckpt_cli.runs import run_entry

    path = tmp_path / "w.orbax-checkpoint-tmp-1.safetensors"
    save_file(tiny_state_dict(), str(path))
    entry = run_entry(path)
    assert entry.format == "safetensors" and entry.complete is False
    assert entry.reason and ".orbax-checkpoint-tmp" in entry.reason
    assert (entry.format, entry.complete, entry.reason) == quick_status(path)
