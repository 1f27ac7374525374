"""Side files (manifest, ledger, config, trainer state, index, pointer) are read one guarded
way: FIFOs, devices and sockets refused at once, each kind read up to its cap.

The commands run in subprocesses with a timeout and a memory limit, so that a regression (a
read that waits for a FIFO's writer, or reads a sparse 5 GiB file whole) fails the test
instead of hanging the suite or the machine.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ckpt_cli import storage
from ckpt_cli.errors import CorruptCheckpointError
from ckpt_cli.manifest import read_manifest
from ckpt_cli.trust.ledger import read_ledger

pytestmark = pytest.mark.requires_torch

ENV = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
SPARSE = 5 << 30  # the size of the sparse side files: never read whole
MEMORY = 3 << 30  # address-space limit of the commands run here


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def _run(*args: str | Path, timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ckpt_cli", *map(str, args)], env=ENV,
                       capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL, preexec_fn=_limit_memory)
    return r, time.monotonic() - t0


def _within_a_second(call: Callable[[], Any]) -> BaseException | None:
    """Run ``call`` in a thread; the exception it raised, failing if it takes over a second
    (a blocked FIFO open or read would never return)."""
    out: list[BaseException | None] = []

    def body() -> None:
        try:
            call()
            out.append(None)
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(1.0)
    assert out, "still blocked after a second"
    return out[0]


def _weights(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    save_file({"a.weight": torch.ones(4, 4)}, d / "model.safetensors")
    return d


def _run_dir(root: Path) -> Path:
    run = root / "run"
    for step in (100, 200):
        (run / f"step_{step}").mkdir(parents=True)
        torch.save({"model": {"w": torch.ones(2)}, "step": step},
                   run / f"step_{step}" / "checkpoint.pt")
    return run


# 1. FIFOs and devices where side files belong.


@pytest.mark.parametrize("special", ["fifo", "dev-zero", "socket"])
@pytest.mark.parametrize("kind", sorted(storage.CAPS))
def test_read_side_refuses_special_files_within_a_second(tmp_path: Path, special: str,
                                                         kind: str) -> None:
    p = tmp_path / "side"
    sock = None
    if special == "fifo":
        os.mkfifo(p)
    elif special == "dev-zero":
        p.symlink_to("/dev/zero")
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(p))
    try:
        e = _within_a_second(lambda: storage.read_side(p, kind))
    finally:
        if sock is not None:
            sock.close()
    assert isinstance(e, CorruptCheckpointError), e
    assert "not a regular file" in str(e) and str(p) in str(e)


def test_manifest_and_ledger_readers_refuse_a_fifo_within_a_second(tmp_path: Path) -> None:
    d = _weights(tmp_path / "ck")
    os.mkfifo(d / "ckpt-manifest.json")
    os.mkfifo(d / "ckpt-ledger.jsonl")
    e = _within_a_second(lambda: read_manifest(d))
    assert isinstance(e, CorruptCheckpointError) and "(a FIFO)" in str(e)
    e = _within_a_second(lambda: read_ledger(d))
    assert isinstance(e, CorruptCheckpointError) and "(a FIFO)" in str(e)


@pytest.mark.parametrize("layout", ["directory", "file"])
def test_validate_refuses_a_fifo_manifest(tmp_path: Path, layout: str) -> None:
    d = _weights(tmp_path / "ck")
    target = d if layout == "directory" else d / "model.safetensors"
    manifest = (d / "ckpt-manifest.json" if layout == "directory"
                else d / "model.safetensors.ckpt-manifest.json")
    os.mkfifo(manifest)
    r, _ = _run("validate", target, timeout=30)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{manifest.name}: not a regular file (a FIFO)" in r.stdout


def test_validate_refuses_a_manifest_linked_to_dev_zero(tmp_path: Path) -> None:
    d = _weights(tmp_path / "ck")
    (d / "ckpt-manifest.json").symlink_to("/dev/zero")
    r, took = _run("validate", d, timeout=30)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ckpt-manifest.json: not a regular file (a character device)" in r.stdout
    assert took < 20


@pytest.mark.parametrize("command", [("resume-path",), ("watch", "--once"),
                                     ("prune", "--keep", "1", "-n")])
def test_a_fifo_ledger_is_refused(tmp_path: Path, command: tuple[str, ...]) -> None:
    run = _run_dir(tmp_path)
    os.mkfifo(run / "ckpt-ledger.jsonl")
    r, _ = _run(command[0], run, *command[1:], timeout=30)
    # watch reports a pass that failed as its own error line (exit 1), the others exit 2
    assert r.returncode == (1 if command[0] == "watch" else 2), r.stdout + r.stderr
    assert r.stderr.startswith(f"ckpt{' watch' if command[0] == 'watch' else ''}: error: ")
    assert "ckpt-ledger.jsonl: not a regular file (a FIFO)" in r.stderr


# 2. Each kind read up to its cap.


@pytest.mark.parametrize("kind", sorted(storage.CAPS))
def test_each_kind_is_refused_past_its_cap_with_the_cap_named(tmp_path: Path,
                                                              kind: str) -> None:
    p = tmp_path / "side"
    p.write_bytes(b"{}")
    assert storage.read_side(p, kind) == b"{}"
    cap = storage.CAPS[kind]
    os.truncate(p, cap)
    assert len(storage.read_side(p, kind) or b"") == cap  # the cap itself is allowed
    os.truncate(p, cap + 1)
    with pytest.raises(CorruptCheckpointError, match=r"over the (\d+ MiB|4 KiB) cap") as e:
        storage.read_side(p, kind)
    assert str(p) in str(e.value)
    assert storage.read_side(tmp_path / "missing", kind) is None


def test_json_nesting_is_bounded_without_recursion() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(CorruptCheckpointError, match="nests deeper than 64 levels"):
        storage.parse_json(deep, what="config.json", path="x")
    with pytest.raises(CorruptCheckpointError, match="nests deeper than 64 levels"):
        storage.parse_json(b"[" * 65 + b"]" * 65, what="config.json", path="x")
    assert storage.parse_json(b"[" * 64 + b"]" * 64, what="config.json", path="x") is not None


@pytest.mark.parametrize("command", ["validate", "inspect"])
def test_a_sparse_config_beside_fp8_weights_is_not_read(tmp_path: Path, command: str) -> None:
    d = tmp_path / "fp8"
    d.mkdir()
    save_file({"l.weight": torch.randn(256, 256).to(torch.float8_e4m3fn),
               "l.weight_scale_inv": torch.ones(2, 2)}, d / "model.safetensors")
    with open(d / "config.json", "wb") as f:
        f.truncate(SPARSE)
    r, took = _run(command, d, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert took < 30
    if command == "validate":
        assert "over the 64 MiB cap" in r.stdout + r.stderr


@pytest.mark.parametrize("command", [("prune", "--keep", "1", "-n"),
                                     ("watch", "--once", "--keep", "1", "--grace", "0s",
                                      "--settle", "0s")])
def test_a_sparse_trainer_state_is_refused(tmp_path: Path, command: tuple[str, ...]) -> None:
    run = _run_dir(tmp_path)
    with open(run / "trainer_state.json", "wb") as f:
        f.truncate(SPARSE)
    r, _ = _run(command[0], run, *command[1:], timeout=60)
    # watch verifies, then reports the failed retention step as its own error line (exit 1)
    assert r.returncode == (1 if command[0] == "watch" else 2), r.stdout + r.stderr
    assert ("trainer_state.json: the trainer state is 5,368,709,120 bytes, over the 64 MiB "
            "cap") in r.stderr
