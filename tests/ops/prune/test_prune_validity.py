"""``ckpt prune``'s "newest valid": a newest checkpoint that reads fine but cannot be loaded, job
directories that are not checkpoints, and metrics and ledgers that decide what is kept.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from ckpt_cli.formats import read_index as formats_read_index
from ckpt_cli.ops import prune as prune_ops
from tests.conftest import Golden, requires_deepspeed, run_cli
from tests.helpers.golden import safetensors_run, stable
from tests.ops.prune.conftest import _copy, _json, _status, _why

pytestmark = pytest.mark.requires_torch


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
