"""Human output stays bounded however many tensors or findings a checkpoint has (issue 46
item 3): ``inspect --tensors`` of thousands of tensors prints its first and last rows and one
row counting the rest (``--all`` and ``--json`` keep every one); every command that prints
per-entry findings counts repeats past ``REPEATS_SHOWN``; ``--json`` stays complete.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckpt_cli.model import Finding
from ckpt_cli.render import human
from ckpt_cli.render.human import REPEATS_SHOWN
from ckpt_cli.render.inspect_tables import TENSOR_ROWS
from tests.conftest import run_cli


def _many(path: Path, n: int) -> Path:
    save_file({f"layers.{i}.weight": np.full((2,), i, np.float32) for i in range(n)}, path)
    return path


def test_inspect_tensors_lists_the_first_and_last_rows_of_a_long_list(tmp_path: Path) -> None:
    n = TENSOR_ROWS + 1500
    path = _many(tmp_path / "m.safetensors", n)
    r = run_cli("inspect", path, "--tensors")
    assert r.exit_code == 0, r.output
    rows = [x.split()[0] for x in r.stdout.splitlines() if x.startswith("layers.")]
    everything = run_cli("inspect", path, "--tensors", "--all")
    every_row = [x.split()[0] for x in everything.stdout.splitlines()
                 if x.startswith("layers.")]
    assert len(every_row) == n
    half = TENSOR_ROWS // 2
    assert rows == every_row[:half] + every_row[-half:]
    more = [x for x in r.stdout.splitlines() if "more (--all-rows lists every one)" in x]
    assert len(more) == 1 and "... 1,500 more" in more[0]
    assert "3,000" in more[0]  # the parameters of the rows left out: 1,500 tensors of 2
    assert len(r.stdout.splitlines()) < TENSOR_ROWS + 40
    doc = json.loads(run_cli("inspect", path, "--tensors", "--json").stdout)
    assert len(doc["tensors"]) == n


def test_a_short_tensor_list_is_listed_whole(tmp_path: Path) -> None:
    path = _many(tmp_path / "m.safetensors", TENSOR_ROWS)
    r = run_cli("inspect", path, "--tensors")
    assert len([x for x in r.stdout.splitlines() if x.startswith("layers.")]) == TENSOR_ROWS
    assert "more (--all" not in r.stdout


def _index_with_missing_names(d: Path, missing: int) -> Path:
    d.mkdir()
    shard = "model-00001-of-00001.safetensors"
    save_file({f"layers.{i}.w": np.ones(4, np.float32) for i in range(10)}, d / shard)
    weight_map = {f"layers.{i}.w": shard for i in range(10 + missing)}
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


@pytest.mark.parametrize("command", ["inspect", "validate", "stats"])
def test_a_broken_index_of_many_entries_prints_a_bounded_number_of_lines(
        tmp_path: Path, command: str) -> None:
    d = _index_with_missing_names(tmp_path / "hf", 30_000)
    args = [command, d] + (["--no-cache"] if command == "stats" else [])
    r = run_cli(*args)
    assert r.exit_code in (0, 1), r.output
    lines = r.output.splitlines()
    assert len(lines) < 80, len(lines)
    if command != "stats":  # stats does not report index findings (it reads values)
        named = [x for x in lines if x.startswith("error:") and "layers." in x]
        assert len(named) == REPEATS_SHOWN
        assert "error: ... and 29,990 more missing-tensor findings (--json lists every one)" \
            in lines


def test_json_keeps_every_finding_of_a_broken_index(tmp_path: Path) -> None:
    d = _index_with_missing_names(tmp_path / "hf", 30_000)
    doc = json.loads(run_cli("inspect", d, "--json").stdout)
    assert sum(f["code"] == "missing-tensor" for f in doc["warnings"]) == 30_000


def test_messages_of_one_kind_are_counted_past_the_first_few(
        capsys: pytest.CaptureFixture[str]) -> None:
    warnings = [Finding("warning", "unsafe-source", f"rank {i}: its pickle would run code")
                for i in range(REPEATS_SHOWN + 25)]
    human.print_messages([*warnings, Finding("error", "other", "one of another kind")])
    err = capsys.readouterr().err.splitlines()
    assert [x for x in err if x.startswith("warning: rank")] == [
        f"warning: rank {i}: its pickle would run code" for i in range(REPEATS_SHOWN)]
    assert "error: one of another kind" in err
    assert "warning: ... and 25 more unsafe-source findings (--json lists every one)" in err
    assert len(err) == REPEATS_SHOWN + 2
