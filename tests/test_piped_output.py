"""Human output off a terminal: long lines, never a name or date broken across lines.

``ckpt inspect x | grep``, ``| less -S`` and cron mail need every tensor name, path and date
whole on its line; ``COLUMNS``, when set, still gives the width. These run the real CLI in a
subprocess whose stdout is a pipe, with ``COLUMNS`` unset, and stdin either ``/dev/null``
(cron) or a terminal 60 columns wide (an interactive shell piping into ``less``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

NAMES = [
    "model.blocks.0.attn.in_proj_weight",
    "model.blocks.0.attn.in_proj_bias",
    "model.decoder.layers.11.self_attention.query_key_value.weight",
    "model.vision_tower.encoder.layers.23.attention_with_rotary_embeddings.output_projection"
    ".weight_scale_inv",  # 106 characters: longer than a whole 80-column line
]


@contextlib.contextmanager
def _terminal(columns: int = 60) -> Iterator[tuple[int, int]]:
    """A pty (master, slave) sized ``columns`` x 24."""
    pty = pytest.importorskip("pty")
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
        yield master, slave
    finally:
        for fd in (master, slave):
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def _stdin(kind: str) -> Iterator[int]:
    """``/dev/null``, or a terminal 60 columns wide (rich asks stdin's size too)."""
    if kind == "tty":
        with _terminal() as (_master, slave):
            yield slave
        return
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        yield fd
    finally:
        os.close(fd)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE")}
    env["NO_COLOR"] = "1"
    env.update(extra)
    return env


def _ckpt(*args: str | Path, stdin: str = "devnull", columns: int | None = None) -> list[str]:
    """Run ``python -m ckpt_cli ARGS`` with stdout a pipe; its output lines."""
    env = _env() if columns is None else _env(COLUMNS=str(columns))
    with _stdin(stdin) as fd:
        r = subprocess.run([sys.executable, "-m", "ckpt_cli", *map(str, args)], stdin=fd,
                           capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    return r.stdout.splitlines()


def _row(lines: list[str], name: str) -> str:
    """The one line holding ``name`` whole."""
    rows = [line for line in lines if name in line]
    assert len(rows) == 1, (name, lines)
    return rows[0]


def _widest(lines: list[str]) -> int:
    return max(len(line) for line in lines)


@pytest.fixture
def long_names(tmp_path: Path) -> Path:
    path = tmp_path / "long.safetensors"
    save_file({n: np.full((4, 8), i, dtype=np.float32) for i, n in enumerate(NAMES)}, str(path))
    return path


@pytest.mark.parametrize("stdin", ["devnull", "tty"])
def test_inspect_tensors_piped_keeps_names_whole(long_names: Path, stdin: str) -> None:
    lines = _ckpt("inspect", long_names, "--tensors", stdin=stdin)
    for name in NAMES:
        row = _row(lines, name)
        assert row.split()[1:] == ["F32", "[4,", "8]", "32", "128", "Bytes", "model"], row
    # Long lines, but only as long as the content: no padding out to a huge width.
    assert _widest(lines) == max(len(line.rstrip()) for line in lines) < len(NAMES[-1]) + 60


def test_inspect_piped_honours_columns(long_names: Path) -> None:
    lines = _ckpt("inspect", long_names, "--tensors", columns=60)
    assert _widest(lines) <= 60
    assert not any(NAMES[-1] in line for line in lines)


def test_a_terminal_still_gets_its_width(long_names: Path) -> None:
    """Only off a terminal are lines long: on a 60-column terminal the table fits in 60."""
    with _terminal() as (master, slave):
        proc = subprocess.Popen([sys.executable, "-m", "ckpt_cli", "inspect", str(long_names),
                                 "--tensors"], stdin=slave, stdout=slave,
                                stderr=subprocess.PIPE, env=_env(TERM="xterm"))
        os.close(slave)  # the child holds it now: reading ends (EIO) when the child exits
        chunks = []
        with contextlib.suppress(OSError):
            while chunk := os.read(master, 65536):
                chunks.append(chunk)
        _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    # NO_COLOR drops colours, not bold: strip the remaining SGR codes.
    lines = re.sub(r"\x1b\[[0-9;]*m", "", b"".join(chunks).decode()).splitlines()
    assert any(line.startswith("Name ") for line in lines), lines
    assert 40 < _widest(lines) <= 60
    assert not any(NAMES[-1] in line for line in lines)


def test_diff_piped_keeps_names_whole(long_names: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.safetensors"
    save_file({n: np.full((4, 8), i + 0.5, dtype=np.float32) for i, n in enumerate(NAMES)},
              str(other))
    lines = _ckpt("diff", long_names, other, "--by-module")
    for name in NAMES:
        row = _row(lines, name)
        assert "F32" in row and "[4, 8]" in row and "100.0%" in row, row
    assert _widest(lines) == max(len(line.rstrip()) for line in lines) < len(NAMES[-1]) + 100


def test_run_table_piped_keeps_names_and_dates_whole(tmp_path: Path) -> None:
    run = tmp_path / ("run_with_a_long_directory_name_" * 3)
    stamp = 1_700_000_000
    names = [f"step_{step}_of_a_long_experiment_named_llama_70b_sft_lr3e-5_warmup"
             for step in (100, 200)]
    for name in names:
        d = run / name
        d.mkdir(parents=True)
        save_file({"w": np.zeros(4, dtype=np.float32)}, str(d / "model.safetensors"))
        for p in (d / "model.safetensors", d):
            os.utime(p, (stamp, stamp))
    when = _dt.datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M")
    lines = _ckpt("inspect", run)
    assert _row(lines, f"{run}  run directory, 2 checkpoint(s)")
    for step, name in zip((100, 200), names, strict=True):
        rows = [line for line in lines if line.split()[:2] == [name, str(step)]]
        assert len(rows) == 1, lines
        row = rows[0]
        assert row.split()[2:4] == when.split(), row
        assert row.rstrip().endswith("complete"), row


def test_plan_piped_plot_keeps_its_shape() -> None:
    lines = _ckpt("plan", "--params", "7B", "--bandwidth", "10GB/s", "--mtbf", "4h")
    plot = [line for line in lines if "┤" in line or "│" in line]
    axis = _row(lines, "└")
    assert len(plot) == 10  # the plot's 10 rows, none wrapped
    assert {len(line) for line in plot} == {len(axis)}  # one cell per character, all aligned
    assert axis.count("─") == 72  # the widest plot: the console is wide, the plot is not
    assert _widest(lines) < 120
