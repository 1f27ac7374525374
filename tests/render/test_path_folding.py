"""Long paths in human output at 60 columns fold after a ``/`` (or at a space), never inside a
file or directory name: ``…/checkpoints/`` then ``model_…safetensors``, not ``safetensors_sing``
/ ``le/…`` (issue 46)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from rich.text import Text
from safetensors.numpy import save_file
from typer.testing import CliRunner

from ckpt_cli.cli.app import app
from tests.helpers.golden import safetensors_run

WIDTH = 60
NAMES = ("experiments", "llama_finetune_run_2026_12_06", "checkpoints_after_warmup",
         "model_safetensors_single_file.safetensors")


def _run(*args: str | Path) -> str:
    r = CliRunner().invoke(app, [str(a) for a in args],
                           env={"NO_COLOR": "1", "COLUMNS": str(WIDTH), "TERM": "dumb"})
    assert r.exit_code in (0, 1), r.output
    return r.stdout


def _check(out: str, root: Path, names: tuple[str, ...]) -> None:
    # Findings are one line each, wrapped by the terminal (grep finds them whole).
    lines = [x for x in out.splitlines() if not x.startswith(("warning:", "error:"))]
    assert all(len(line) <= WIDTH for line in lines), out
    for name in (*root.parts[1:], *names):
        # every name of the path is whole on one line, or wider than a line by itself
        assert len(name) > WIDTH or any(name in line for line in lines), (name, out)
    assert any(line.endswith("/") for line in lines), out  # it was folded, after a "/"


@pytest.fixture
def deep(tmp_path: Path) -> Path:
    d = tmp_path.joinpath(*NAMES[:-1])
    d.mkdir(parents=True)
    for name in (NAMES[-1], "other_" + NAMES[-1]):
        save_file({"w": np.arange(16, dtype=np.float32)}, str(d / name))
    return d


@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_one_file(command: str, deep: Path, tmp_path: Path) -> None:
    _check(_run(command, deep / NAMES[-1]), tmp_path, NAMES)


def test_diff(deep: Path, tmp_path: Path) -> None:
    out = _run("diff", deep / NAMES[-1], deep / ("other_" + NAMES[-1]))
    _check(out, tmp_path, (*NAMES, "other_" + NAMES[-1]))


@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_run_directory(command: str, deep: Path, tmp_path: Path) -> None:
    _check(_run(command, safetensors_run(deep)), tmp_path, (*NAMES[:-1], "run"))


def test_prune_on_a_terminal(deep: Path, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal prune prints a table with a headline and a summary (in a log, one plain
    line each, which the log's reader wraps)."""
    from ckpt_cli.cli import prune

    monkeypatch.setattr(prune, "_is_terminal", lambda: True)
    out = _run("prune", safetensors_run(deep), "--keep", "2", "--grace", "0",
               "--dry-run")
    _check(out, tmp_path, (*NAMES[:-1], "run"))
    assert "would delete 2 checkpoint(s)" in " ".join(out.split())


def test_fold_path_text() -> None:
    from ckpt_cli.render.human import fold_path_text

    text = Text("/data/run_a/step_000100/model.safetensors  (safetensors, 5 tensors)")
    assert fold_path_text(text, 30).plain.splitlines() == [
        "/data/run_a/step_000100/", "model.safetensors", "(safetensors, 5 tensors)"]
    # a name wider than a line by itself is cut where the line ends, every character kept
    assert fold_path_text(Text("/x/" + "a" * 25), 10).plain.splitlines() == [
        "/x/", "a" * 10, "a" * 10, "a" * 5]
    assert fold_path_text(Text("short/path"), 60).plain == "short/path"
    assert re.fullmatch(r"a\nb", fold_path_text(Text("a\nb"), 5).plain)
