"""What ckpt leaves behind as a process: its exit status when stdout closes, its files' modes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import damage
from tests.helpers.makers import training_checkpoint

pytestmark = pytest.mark.requires_torch

ENV = {**os.environ, "NO_COLOR": "1", "COLUMNS": "100"}


def _closed_stdout(*args: str | Path) -> subprocess.CompletedProcess[bytes]:
    """Run ``ckpt ARGS`` with stdout a pipe whose reader is gone (``| head`` that exited)."""
    r, w = os.pipe()
    os.close(r)  # the first write to stdout fails with EPIPE
    try:
        return subprocess.run([sys.executable, "-m", "ckpt_cli", *map(str, args)],
                              stdout=w, stderr=subprocess.PIPE, env=ENV, timeout=120)
    finally:
        os.close(w)


@pytest.fixture
def bad_pt(tmp_path: Path) -> Path:
    p = tmp_path / "bad.pt"
    torch.save(training_checkpoint(), p)
    off, size = damage.zip_payload(p, "data/1")
    damage.flip(p, off + size - 1)
    return p


@pytest.fixture
def good_pt(tmp_path: Path) -> Path:
    p = tmp_path / "good.pt"
    torch.save(training_checkpoint(), p)
    return p


@pytest.mark.parametrize("json", [False, True])
def test_findings_exit_1_even_when_stdout_closes(bad_pt: Path, json: bool) -> None:
    p = _closed_stdout("validate", bad_pt, *(["--json"] if json else []))
    assert p.returncode == 1, p.stderr
    assert b"Traceback" not in p.stderr and b"Exception ignored" not in p.stderr


def test_a_valid_file_exits_0_when_stdout_closes(good_pt: Path) -> None:
    assert _closed_stdout("validate", good_pt).returncode == 0
    assert _closed_stdout("inspect", good_pt).returncode == 0


def test_diff_keeps_its_status_when_stdout_closes(good_pt: Path, bad_pt: Path) -> None:
    other = good_pt.with_name("other.pt")
    sd = training_checkpoint()
    sd["step"] = 101
    torch.save(sd, other)
    assert _closed_stdout("diff", good_pt, other).returncode == 1
    assert _closed_stdout("diff", good_pt, good_pt).returncode == 0


def test_validate_piped_into_head(bad_pt: Path) -> None:
    """The pipeline of the report: ``ckpt validate bad.pt | head -1`` under pipefail."""
    cmd = (f"set -o pipefail; {sys.executable} -m ckpt_cli validate '{bad_pt}' --verbose "
           "| head -1")
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, env=ENV, timeout=120)
    assert p.returncode == 1, p.stderr
    assert p.stdout.decode().startswith(str(bad_pt))


def test_every_file_of_the_sample_has_the_umask_mode(sample_run: Path) -> None:
    """``ckpt sample``'s HF export (written by safetensors) was 0600; the rest 0644."""
    from ckpt_cli.storage.atomic import umask

    want = 0o666 & ~umask()
    modes = {p.relative_to(sample_run).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in sample_run.rglob("*") if p.is_file()}
    assert any(n.startswith("export/") and n.endswith(".safetensors") for n in modes)
    assert {n: oct(m) for n, m in modes.items() if m != want} == {}


def test_umask_is_read_without_changing_it() -> None:
    from ckpt_cli.storage.atomic import umask

    old = os.umask(0o027)
    try:
        assert umask() == 0o027
        assert umask() == 0o027
    finally:
        os.umask(old)


@pytest.mark.parametrize(("decided", "code"), [(None, 141), (0, 0), (1, 1)])
def test_a_closed_pipe_exits_with_the_decided_status(decided: int | None, code: int) -> None:
    """141 (as a shell reports SIGPIPE) when the command was cut short before its result."""
    prog = ("import typer\n"
            "from ckpt_cli.cli.errors import handled\n"
            "try:\n"
            "    with handled() as outcome:\n"
            f"        outcome.exit_code = {decided}\n"
            "        raise BrokenPipeError\n"
            "except typer.Exit as e:\n"
            "    raise SystemExit(e.exit_code)\n")
    p = subprocess.run([sys.executable, "-c", prog], capture_output=True, timeout=60)
    assert p.returncode == code, p.stderr
    assert p.stderr == b""


@pytest.mark.parametrize("args", [["--help"], ["inspect", "--help"], ["convert", "-h"], []])
def test_help_exits_0_when_stdout_closes(args: list[str]) -> None:
    """``ckpt --help | head -1``: the help was printed as far as it was read (issue 39;
    rich's own handler exited 1, the findings code)."""
    p = _closed_stdout(*args)
    assert p.returncode == 0, p.stderr
    assert b"Traceback" not in p.stderr
    cmd = f"set -o pipefail; {sys.executable} -m ckpt_cli --help | head -1"
    assert subprocess.run(["bash", "-c", cmd], capture_output=True, env=ENV,
                          timeout=120).returncode == 0


@pytest.mark.parametrize(("sig", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_watch_stopped_by_a_signal_exits_with_its_code(tmp_path: Path, sig: str,
                                                       code: int) -> None:
    """A watcher stopped by its job (SIGTERM) exits 143, by Ctrl-C 130: the conventional
    codes, as every other command (issue 39; it exited 0)."""
    import signal
    import time

    run = tmp_path / "run"
    run.mkdir()
    torch.save(training_checkpoint(), run / "step_100.pt")
    p = subprocess.Popen([sys.executable, "-m", "ckpt_cli", "watch", str(run), "--interval",
                          "0.2s"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    try:
        deadline = time.monotonic() + 60
        while not (run / "ckpt-ledger.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # its first pass is done
        p.send_signal(getattr(signal, sig))
        assert p.wait(60) == code
    finally:
        if p.poll() is None:
            p.kill()
        _, err = p.communicate()
    assert b"Traceback" not in err
