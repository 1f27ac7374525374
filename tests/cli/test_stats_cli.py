"""``ckpt stats`` on the command line: exit codes, one-line errors for bad values, the ``--json``
documents of both modes, ``--plot`` without matplotlib, plain output when piped."""

from __future__ import annotations

import importlib.util
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli
from tests.helpers.train_loop import injected_run

pytestmark = pytest.mark.requires_torch

ROOT = Path(__file__).resolve().parents[2]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

ENVELOPE = {"schema_version", "command"}
COMMON = ENVELOPE | {"path", "mode", "scope", "depth", "read", "part", "anomalies", "findings"}
RUN_KEYS = COMMON | {"jump", "checkpoints", "skipped", "last_good"}
CHECKPOINT_KEYS = COMMON | {"format", "step", "tensors", "modules"}
READ_KEYS = {"bytes", "seconds", "kernel", "cached_tensors", "computed_tensors", "cache_dir"}
FIGURES = {"numel", "mean", "std", "min", "max", "absmax", "l2", "zeros", "nan", "inf"}
TENSOR_KEYS = FIGURES | {"name", "dtype", "shape", "group", "tiny", "dequantized_with",
                         "same_as", "error"}
MODULE_KEYS = FIGURES | {"name", "tensors", "tiny", "update_l2", "update_ratio"}
ANOMALY_KEYS = {"step", "checkpoint", "module", "kind", "message"}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("CKPT_CACHE_DIR", str(d))
    return d


@pytest.fixture
def clean(tmp_path: Path) -> Path:
    injected_run(tmp_path / "clean", checkpoints=3, jump_at=None, nan_at=None,
                 freeze_from=None)
    return tmp_path / "clean"


@pytest.fixture
def sick(tmp_path: Path) -> Path:
    injected_run(tmp_path / "sick", checkpoints=5, jump_at=2, nan_at=3, freeze_from=4)
    return tmp_path / "sick"


def _one_line_error(r: Any) -> str:
    """The error line of a failed run: exit 2, no traceback, one ``ckpt: error:`` line (a
    ``hint:`` line may follow), nothing on stdout."""
    assert r.exit_code == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert lines and lines[0].startswith("ckpt: error: "), r.stderr
    assert all(ln.startswith("hint: ") for ln in lines[1:]), r.stderr
    return str(lines[0])


def test_exit_codes(clean: Path, sick: Path, tmp_path: Path, cache: Path) -> None:
    ok = run_cli("stats", clean)
    assert ok.exit_code == 0, ok.stderr
    assert "No anomaly found." in ok.stdout
    bad = run_cli("stats", sick)
    assert bad.exit_code == 1, bad.stderr
    assert "norm-jump" in bad.stdout and "frozen" in bad.stdout and "nan" in bad.stdout
    # a gate: quiet still says it with the status
    assert run_cli("stats", sick, "--quiet").exit_code == 1
    _one_line_error(run_cli("stats", tmp_path / "missing"))


@pytest.mark.parametrize(("args", "says"), [
    (("--jump", "1"), "--jump"),
    (("--jump", "0.5"), "--jump"),
    (("--jump", "nan"), "--jump"),
    (("--jump", "inf"), "--jump"),
    (("--jump", "-3"), "--jump"),
    (("--jump", "x"), "--jump"),
    (("--sort", "bogus"), "--sort"),
    (("--depth", "0"), "--depth"),
    (("--every", "0"), "--every"),
    (("--last", "0"), "--last"),
    (("--top", "-1"), "--top"),
    (("--jobs", "0"), "--jobs"),
    (("--part", "3/2"), "--part"),
    (("--part", "1/2", "--no-cache"), "--part"),
    (("--cache-dir", "s3://bucket/cache"), "--cache-dir"),
    (("--filter", "nothing.matches.*"), "--name-glob"),  # the old flag, the new name
    (("--pattern", "("), "--pattern"),
])
def test_bad_values_are_one_line_errors(clean: Path, cache: Path, args: tuple[str, ...],
                                        says: str) -> None:
    line = _one_line_error(run_cli("stats", clean, *args))
    assert says in line
    assert not cache.exists()  # refused before anything was read


def test_a_missing_path_and_a_fifo_are_one_line_errors(tmp_path: Path, cache: Path) -> None:
    line = _one_line_error(run_cli("stats", tmp_path / "nope"))
    assert "nope" in line and "no such file" in line
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    line = _one_line_error(run_cli("stats", fifo))
    assert "fifo.pt" in line and "FIFO" in line


def test_a_fifo_in_a_run_is_skipped_not_waited_on(clean: Path, cache: Path) -> None:
    os.mkfifo(clean / "step_99.pt")
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "ckpt_cli", "stats", str(clean), "--json"],
                       capture_output=True, env=env, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr.decode()
    doc = json.loads(p.stdout)
    assert [c["step"] for c in doc["checkpoints"]] == [0, 2, 4]  # not a checkpoint: not read


def test_part_without_the_cache_names_the_flags(clean: Path, cache: Path) -> None:
    line = _one_line_error(run_cli("stats", clean, "--part", "1/2", "--no-cache"))
    assert "--part" in line and "--no-cache" in line and "--cache-dir" in line
    assert "cache=False" not in line and "cache_dir" not in line


def _keys(doc: dict[str, Any], want: set[str], where: str) -> None:
    assert set(doc) == want, f"{where}: {sorted(set(doc) ^ want)}"


def test_json_of_a_run(sick: Path, cache: Path) -> None:
    r = run_cli("stats", sick, "--json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    _keys(doc, RUN_KEYS, "top level")
    assert doc["command"] == "stats" and doc["mode"] == "run" and doc["scope"] == "weights"
    _keys(doc["read"], READ_KEYS, "read")
    assert doc["part"] is None and doc["jump"] == 2.0 and doc["skipped"] == []
    first_bad = doc["checkpoints"][2]  # the x100 at the third checkpoint
    assert doc["last_good"] == {k: doc["checkpoints"][1][k] for k in ("name", "path", "step")}
    assert first_bad["step"] == min(a["step"] for a in doc["anomalies"])
    assert len(doc["checkpoints"]) == 5
    for c in doc["checkpoints"]:
        _keys(c, {"name", "path", "step", "format", "modules"}, "checkpoint")
        for m in c["modules"]:
            _keys(m, MODULE_KEYS, "module")
    assert doc["anomalies"]
    for a in doc["anomalies"]:
        assert ANOMALY_KEYS <= set(a)
        assert set(a) - ANOMALY_KEYS  # the figures that triggered it


def test_json_of_one_checkpoint(sick: Path, cache: Path) -> None:
    r = run_cli("stats", sick / "step_6.pt", "--json", "--hist")
    assert r.exit_code == 1  # its NaN
    doc = json.loads(r.stdout)
    _keys(doc, CHECKPOINT_KEYS, "top level")
    assert doc["mode"] == "checkpoint" and doc["step"] == 6 and doc["format"] == "torch"
    for t in doc["tensors"]:
        _keys(t, TENSOR_KEYS | {"hist"}, "tensor")
    for m in doc["modules"]:
        _keys(m, MODULE_KEYS | {"hist"}, "module")
    assert [(a["module"], a["kind"]) for a in doc["anomalies"]] == [("layers.0", "nan")]


def test_json_error_document(clean: Path, cache: Path) -> None:
    r = run_cli("stats", clean, "--jump", "1", "--json")
    assert r.exit_code == 2
    doc = json.loads(r.stdout)
    assert doc["command"] == "stats" and doc["exit_code"] == 2
    assert doc["error"]["kind"] == "usage" and "--jump" in doc["error"]["message"]


def test_plot_without_matplotlib_fails_before_reading(clean: Path, cache: Path,
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as where the extra is not installed
                        lambda name, *a: None if name == "matplotlib" else found(name, *a))
    line = _one_line_error(run_cli("stats", clean, "--plot", tmp_path / "trends.png"))
    assert "--plot" in line and "matplotlib" in line
    assert not cache.exists() and not (tmp_path / "trends.png").exists()


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_plot_draws_the_trends(sick: Path, cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "trends.png"
    r = run_cli("stats", sick, "--plot", out)
    assert r.exit_code == 1, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = tmp_path / "trends.svg"
    assert run_cli("stats", sick, "--plot", svg, "--depth", "2").exit_code == 1
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "norm-jump" in text  # the anomaly is marked
    assert not list(tmp_path.glob(".trends*"))  # no temporary left behind


def test_plot_refuses_a_single_checkpoint_and_other_suffixes(clean: Path, cache: Path,
                                                             tmp_path: Path) -> None:
    one = sorted(p for p in clean.iterdir() if p.name.startswith("step"))[-1]
    for args in ((clean, "--plot", tmp_path / "t.jpg"), (one, "--plot", tmp_path / "t.png")):
        line = _one_line_error(run_cli("stats", *args))
        assert "--plot" in line
    assert not (tmp_path / "t.png").exists()


def _sgr(out: bytes) -> set[bytes]:
    return set(re.findall(rb"\x1b\[[0-9;?]*[A-Za-z]", out))


def _colours(out: bytes) -> set[int]:
    """SGR colour parameters (30-49, 90-107) in ``out``."""
    codes = {int(c) for seq in re.findall(rb"\x1b\[([0-9;]*)m", out)
             for c in seq.split(b";") if c}
    return {c for c in codes if 30 <= c <= 49 or 90 <= c <= 107}


def _run_on(sick: Path, *, tty: bool, no_color: bool) -> bytes:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    env.update(PYTHONPATH=str(ROOT), COLUMNS="120", TERM="xterm-256color")
    if no_color:
        env["NO_COLOR"] = "1"
    cmd = [sys.executable, "-m", "ckpt_cli", "stats", str(sick)]
    if not tty:
        p = subprocess.run(cmd, capture_output=True, env=env, timeout=120, cwd=ROOT)
        assert p.returncode == 1, p.stderr.decode()
        return p.stdout + p.stderr
    main, sub = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=sub, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    os.close(sub)
    out = b""
    while True:
        try:
            chunk = os.read(main, 1 << 16)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    assert proc.wait(timeout=120) == 1
    return out


def test_piped_output_is_plain(sick: Path, cache: Path) -> None:
    for no_color in (False, True):
        out = _run_on(sick, tty=False, no_color=no_color)
        assert b"norm-jump" in out and _sgr(out) == set(), no_color
    # on a terminal it is coloured, unless NO_COLOR says not to
    assert _colours(_run_on(sick, tty=True, no_color=False))
    coloured = _run_on(sick, tty=True, no_color=True)
    assert b"norm-jump" in coloured and _colours(coloured) == set()
