"""``prune --keep N`` beside a live writer: a trainer saving every 0.3 s, prune run from "cron"
again and again (some runs killed with SIGKILL). Once N checkpoints are complete, N complete
ones remain after every prune; nothing outside the run is touched; the next prune cleans up
what a killed one left."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.requires_torch

ROOT = Path(__file__).resolve().parents[3]
KEEP = 2


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _complete(run: Path) -> list[str]:
    """The checkpoints that load: a save in progress (truncated zip) does not."""
    out = []
    for p in sorted(run.glob("step_*.pt")):
        try:
            torch.load(p, weights_only=True)
        except Exception:  # truncated while being written, or deleted under us
            continue
        out.append(p.name)
    return out


def _prune(run: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "ckpt_cli", "prune", str(run), "--keep",
                             str(KEEP), "--grace", "0", "--yes"], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_keep_leaves_n_complete_beside_a_live_writer(tmp_path: Path) -> None:
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    torch.save({"w": torch.ones(3)}, outside / "step_0001.pt")
    (run / "train.log").write_text("training\n")
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    trainer = subprocess.Popen([sys.executable, "-m", "tests.helpers.slow_trainer", str(run),
                                "0.3", "200"], env=_env(), cwd=ROOT,
                               stdout=subprocess.DEVNULL)
    rng = random.Random(28)
    try:
        deadline = time.monotonic() + 120
        while len(_complete(run)) < KEEP:  # wait for the first two saves
            assert trainer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        rounds, killed = 0, 0
        while rounds < 12:
            p = _prune(run)
            if rounds % 3 == 2:  # cron's prune killed mid-way
                time.sleep(rng.uniform(0.05, 0.5))
                p.send_signal(signal.SIGKILL)
                killed += 1
            _, err = p.communicate()
            assert p.returncode in (0, -signal.SIGKILL), err.decode()
            rounds += 1
            complete = _complete(run)
            assert len(complete) >= KEEP, (rounds, sorted(os.listdir(run)))
            strays = [n for n in os.listdir(run) if not n.startswith(("step_", ".ckpt-trash-"))
                      and n not in (".ckpt-prune.lock", "train.log")]
            assert not strays, strays
        assert killed == 4 and trainer.poll() is None
    finally:
        trainer.kill()
        trainer.wait()
    r = _prune(run)
    _, err = r.communicate()
    assert r.returncode == 0, err.decode()
    names = sorted(os.listdir(run))
    assert not [n for n in names if n.startswith(".ckpt-trash-")], names
    assert len(_complete(run)) >= KEEP
    assert (run / "train.log").read_text() == "training\n"
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
