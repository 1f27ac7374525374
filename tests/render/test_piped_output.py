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
    # One cell per character, all aligned: no row is wider than the axis (rows end at their
    # last mark: trailing spaces are stripped).
    assert all(len(line) <= len(axis) for line in plot)
    assert all(line.index("┤" if "┤" in line else "│") == axis.index("└") for line in plot)
    assert not any(line.endswith(" ") for line in lines)
    assert axis.count("─") == 72  # the widest plot: the console is wide, the plot is not
    assert _widest(lines) < 120


# --- narrow terminals: drop or wrap columns, never cut a name, a date or a number ------------

COLUMNS = [60, 100, None]  # None: piped with COLUMNS unset (no wrapping at all)


def _no_trailing_spaces(lines: list[str]) -> None:
    assert not [line for line in lines if line != line.rstrip()], "trailing spaces"


def _nothing_cut(lines: list[str]) -> None:
    """rich's ellipsis sits right after the cut text (``step_000…``, ``0.0…``); the ``… N more``
    rows have it at the start of a word."""
    assert not [line for line in lines if re.search(r"\S…", line)], lines


def _fits(lines: list[str], columns: int | None) -> None:
    """Within the width (findings are one line each, whole, for grep: not wrapped)."""
    if columns is not None:
        assert _widest([x for x in lines if not x.startswith(("error: ", "warning: "))]
                       ) <= columns


def _table_row(lines: list[str], name: str) -> str:
    """The table row of ``name`` (not the heading ``name (latest complete checkpoint)``)."""
    rows = [line for line in lines if re.match(rf"{re.escape(name)}  ", line)]
    assert len(rows) == 1, (name, lines)
    return rows[0]


def _first_column(line: str) -> str:
    return line.split("  ")[0].strip()


def _folded(lines: list[str], name: str) -> bool:
    """Whether ``name`` is the first column of consecutive lines, folded over them whole."""
    for i in range(len(lines)):
        text = ""
        for line in lines[i:]:
            text += _first_column(line)
            if text == name:
                return True
            if not text or not name.startswith(text):
                break
    return False


@pytest.fixture
def long_run(tmp_path: Path) -> tuple[Path, list[str]]:
    """A run of four step directories (safetensors) with known modification times."""
    import torch

    from tests.helpers.makers import tiny_state_dict

    run = tmp_path / "run"
    names = [f"step_{step:06d}" for step in (100, 200, 300, 400)]
    for i, name in enumerate(names):
        d = run / name
        d.mkdir(parents=True)
        sd = tiny_state_dict(seed=i)
        torch.save({"model": sd, "step": 100 * (i + 1)}, d / "checkpoint.pt")
        stamp = 1_796_000_000 + 3600 * i
        for p in (d / "checkpoint.pt", d):
            os.utime(p, (stamp, stamp))
    (run / "latest").write_text(names[-1])
    return run, names


@pytest.mark.parametrize("columns", COLUMNS)
def test_run_table_keeps_names_dates_and_numbers_whole(long_run: tuple[Path, list[str]],
                                                       columns: int | None) -> None:
    run, names = long_run
    lines = _ckpt("inspect", run, columns=columns)
    _fits(lines, columns)
    _nothing_cut(lines)
    _no_trailing_spaces(lines)
    for i, name in enumerate(names):
        row = _table_row(lines, name)
        assert row.split()[1] == f"{100 * (i + 1)}", row  # the step, whole
        when = _dt.datetime.fromtimestamp(1_796_000_000 + 3600 * i).strftime("%Y-%m-%d %H:%M")
        assert when in row, row  # the date: whole, on the row
        assert re.search(r"\d+\.\d kB", row), row  # the size: whole


@pytest.mark.parametrize("columns", COLUMNS)
def test_failing_run_table_row_stays_short(long_run: tuple[Path, list[str]],
                                           columns: int | None) -> None:
    from tests.helpers import damage

    run, names = long_run
    bad = run / names[1] / "checkpoint.pt"
    off, size = damage.zip_payload(bad, "data/2")
    damage.flip(bad, off + size // 2, 0x10)
    lines = _ckpt("validate", run, columns=columns)
    _fits(lines, columns)
    _nothing_cut(lines)
    _no_trailing_spaces(lines)
    row = _table_row(lines, names[1])
    assert "INVALID" in row and "crc-mismatch" in row and len(row) <= 80, row
    # The whole message is printed once, under the table.
    messages = [line for line in lines if "CRC-32 mismatch" in line]
    if columns is None:
        assert len(messages) == 1 and messages[0].startswith("error: checkpoint.pt:"), lines
    else:
        assert sum("CRC-32" in line for line in lines) == 1, lines


def _diff_pair(tmp_path: Path) -> tuple[Path, Path]:
    names = ["model.blocks.0.attn.in_proj_weight", "model.blocks.0.attn.in_proj_bias",
             "model.ln_f.weight", NAMES[-1]]
    rng = np.random.default_rng(0)
    a = {n: rng.standard_normal((4, 8)).astype(np.float32) for n in names}
    b = {n: v + np.float32(1e-3) * (i + 1) for i, (n, v) in enumerate(a.items())}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    return tmp_path / "a.safetensors", tmp_path / "b.safetensors"


@pytest.mark.parametrize("columns", COLUMNS)
def test_diff_tables_keep_names_and_numbers_whole(tmp_path: Path, columns: int | None) -> None:
    import json

    a, b = _diff_pair(tmp_path)
    lines = _ckpt("diff", a, b, "--by-module", columns=columns)
    _fits(lines, columns)
    _nothing_cut(lines)
    _no_trailing_spaces(lines)
    doc = json.loads(subprocess.run(
        [sys.executable, "-m", "ckpt_cli", "diff", str(a), str(b), "--json"],
        capture_output=True, text=True, env=_env(), timeout=120).stdout)
    start = next(i for i, x in enumerate(lines) if x.startswith("Changed tensors"))
    end = next(i for i, x in enumerate(lines) if x.startswith("By module"))
    table = lines[start:end]
    for t in doc["tensors"]:
        name = t["name"]
        if columns is None or len(name) <= columns // 2:
            row = _row(table, name)
        else:  # longer than half the width: folded over lines, every character kept
            assert _folded(table, name), (name, table)
            row = next(x for x in table if name.startswith(_first_column(x)) and
                       _first_column(x))
        # Whichever figures are shown are whole: the relative L2 always is.
        assert f"{t['rel_l2']:.3g}" in row.split(), (row, t["rel_l2"])


def test_escape_sequences_in_names_are_shown_not_obeyed(tmp_path: Path) -> None:
    """A tensor name may hold terminal escapes; every table cell and line writes them out."""
    evil, plain = "evil\x1b[31mred\x1b[0m\x07", "x[red]y[/red]"
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({evil: np.zeros(2, np.float32)}, str(a), metadata={"note": "a\x1b[2Jb"})
    save_file({plain: np.zeros(2, np.float32)}, str(b))
    shown = "evil\\x1b[31mred\\x1b[0m"  # (rich drops a bell where it builds Text itself)
    for args in (("inspect", a, "--tensors"), ("diff", a, b), ("inspect", b, "--tensors")):
        lines = _ckpt(*args)
        text = "\n".join(lines)
        assert "\x1b" not in text and "\x07" not in text, text
    assert shown in _row(_ckpt("inspect", a, "--tensors"), shown)
    assert any(shown in line for line in _ckpt("diff", a, b))
    # rich markup in a name is printed as it is, not interpreted
    assert plain in _row(_ckpt("inspect", b, "--tensors"), plain)
