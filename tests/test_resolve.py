"""One resolver (``ckpt_cli.resolve``): every command takes a path as the same thing, a run, a
run with a resume pointer or one checkpoint (#47).

The directories are what the real libraries leave: transformers' Trainer output_dir (its
``checkpoint-N/`` and, after ``save_model()``, the final model beside them), Lightning's
``lightning_logs/version_0/checkpoints/`` tree, ``torch.save`` files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ckpt_cli.errors import UsageError
from ckpt_cli.resolve import resolve
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.makers import tiny_state_dict

pytestmark = pytest.mark.requires_torch

READERS = ("inspect", "validate", "stats")


def _json(*args: Any) -> tuple[int, dict[str, Any]]:
    r = run_cli(*args, "--json")
    return r.exit_code, json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}


def _every_command(path: Path, out: Path, other: Path) -> dict[str, Any]:
    """Each reading command on ``path``: {command: result}."""
    return {"inspect": run_cli("inspect", path), "validate": run_cli("validate", path),
            "stats": run_cli("stats", path), "diff": run_cli("diff", other, path),
            "convert": run_cli("convert", path, "-o", out / "c.safetensors"),
            "consolidate": run_cli("consolidate", path, "-o", out / "m")}


@pytest.fixture(scope="module")
def trainer_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Trainer.train() + save_model() + save_state(): checkpoint-2/, checkpoint-4/ and the
    final model (model.safetensors, config.json, training_args.bin) in output_dir."""
    from tests.helpers.makers import hf_trainer_run

    with third_party_quiet():
        return hf_trainer_run(tmp_path_factory.mktemp("hfout") / "out", final=True)


@pytest.fixture(scope="module")
def lightning_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Lightning project: lightning_logs/version_0/checkpoints/ as Lightning lays it out."""
    from tests.helpers.makers import lightning_run

    root = tmp_path_factory.mktemp("pl") / "project"
    with third_party_quiet():
        lightning_run(root / "lightning_logs" / "version_0" / "checkpoints")
    return root


def test_an_hf_trainer_output_dir_is_a_run_for_every_command(trainer_out: Path) -> None:
    t = resolve(trainer_out)
    assert (t.kind, t.final_model) == ("run", True) and "HF Trainer" in t.reason
    # stats read it as one checkpoint (the final model and training_args.bin); now it gives
    # the per-step table over checkpoint-N, as inspect and validate list them.
    code, doc = _json("stats", trainer_out)
    assert code == 0 and doc["mode"] == "run", doc
    assert [c["name"] for c in doc["checkpoints"]] == ["checkpoint-2", "checkpoint-4"]
    code, doc = _json("inspect", trainer_out)
    assert code == 0 and doc["kind"] == "run"
    code, doc = _json("validate", trainer_out)
    assert {"checkpoint-2", "checkpoint-4"} <= {c["name"] for c in doc["checkpoints"]}
    # One checkpoint of it is one checkpoint everywhere.
    assert resolve(trainer_out / "checkpoint-2").kind == "checkpoint"
    code, doc = _json("stats", trainer_out / "checkpoint-2")
    assert code == 0 and doc["mode"] == "checkpoint"


def test_a_directory_above_runs_names_them(lightning_root: Path, tmp_path: Path) -> None:
    want = "holds runs: lightning_logs/version_0/checkpoints/; pass one of them"
    with pytest.raises(UsageError, match="holds runs: lightning_logs/version_0/checkpoints/"):
        resolve(lightning_root)
    for cmd, r in _every_command(lightning_root, tmp_path, lightning_root).items():
        assert r.exit_code == 2 and "Traceback" not in r.stderr, (cmd, r.output)
        assert want in r.stderr and "unrecognised directory" not in r.stderr, (cmd, r.stderr)
    # prune used to take it for a run before its first save (exit 0, nothing to do).
    r = run_cli("prune", lightning_root, "--keep", "1", "-n")
    assert r.exit_code == 2 and want in r.stderr, r.output
    # The run itself is a run.
    assert resolve(lightning_root / "lightning_logs" / "version_0" / "checkpoints").kind == "run"


def test_a_project_of_checkpoints_and_best_names_both(lightning_root: Path,
                                                      tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    shutil.copytree(lightning_root / "lightning_logs" / "version_0" / "checkpoints",
                    proj / "checkpoints")
    (proj / "best").mkdir()
    save_file(tiny_state_dict(), proj / "best" / "model.safetensors")
    r = run_cli("inspect", proj)
    assert r.exit_code == 2
    assert "holds runs: checkpoints/ (and checkpoints: best/); pass one of them" in r.stderr
    r = run_cli("stats", proj)
    assert r.exit_code == 2 and "holds runs: checkpoints/" in r.stderr


def test_watch_finds_a_run_below_a_lightning_project(lightning_root: Path,
                                                     tmp_path: Path) -> None:
    from ckpt_cli.ops.watch import run_dirs

    assert run_dirs(lightning_root) == [lightning_root / "lightning_logs" / "version_0"
                                        / "checkpoints"]


def _loose(d: Path, names: list[str]) -> Path:
    d.mkdir()
    for i, n in enumerate(names):
        torch.save(tiny_state_dict(seed=i), d / n)
    return d


def test_unrelated_files_are_refused_not_merged(tmp_path: Path) -> None:
    names = ["bert.pt", "gpt.pt", "mlp.pt", "resnet.pt", "unet.pt", "vit.pt"]
    d = _loose(tmp_path / "loose", names)
    other = tmp_path / "other.safetensors"
    save_file(tiny_state_dict(), other)
    with pytest.raises(UsageError, match="holds 6 unrelated checkpoint files"):
        resolve(d)
    (tmp_path / "out").mkdir()
    for cmd, r in _every_command(d, tmp_path / "out", other).items():
        assert r.exit_code == 2, (cmd, r.output)
        assert ("holds 6 unrelated checkpoint files (bert.pt, gpt.pt, mlp.pt, resnet.pt, "
                "unet.pt, vit.pt), not one checkpoint; pass one of them") in r.stderr, cmd
        assert "#2" not in r.output
    assert not list((tmp_path / "out").iterdir())
    # --input-format dir still reads them as one checkpoint: the user asked for it.
    r = run_cli("inspect", d, "--input-format", "dir")
    assert r.exit_code == 0, r.output


def test_step_named_files_are_a_run(tmp_path: Path) -> None:
    d = _loose(tmp_path / "run", ["model_100.pt", "model_200.pt", "model_300.pt"])
    assert resolve(d).kind == "run"
    code, doc = _json("stats", d)
    assert code == 0 and [c["step"] for c in doc["checkpoints"]] == [100, 200, 300]


def test_parts_of_one_checkpoint_still_read_as_one(tmp_path: Path) -> None:
    # Per-rank files (consolidate merges them by key), HF shards and a training checkpoint's
    # weights beside its optimizer are one checkpoint each, as FORMATS.md describes them.
    sd = tiny_state_dict()
    names = list(sd)
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for r in range(2):
        torch.save({k: sd[k] for k in names[r::2]}, ranks / f"rank_{r}.pt")
    assert resolve(ranks).kind == "checkpoint"
    train = tmp_path / "train"
    train.mkdir()
    save_file(sd, train / "model.safetensors")
    torch.save({"state": {}, "param_groups": []}, train / "optimizer.pt")
    torch.save({"x": torch.ones(1)}, train / "ema.pt")
    assert resolve(train).kind == "checkpoint"


def test_pointer_runs(sample_run: Path) -> None:
    # ckpt sample's run: `latest` names step_000400. Commands that read one checkpoint read
    # it; commands that describe a run list the run.
    t = resolve(sample_run)
    assert t.kind == "pointer" and t.followed is not None
    assert t.checkpoint() == sample_run / "step_000400" and t.is_run
    assert "latest names step_000400" in t.reason
