"""``ckpt prune`` on the command line (cron output, prompts, usage errors, JSON) and pointers and
steps that decide what is kept.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.ops.prune.conftest import _json, _names, _status, _why

pytestmark = pytest.mark.requires_torch


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
