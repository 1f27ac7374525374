"""A verdict holds only while the files are what was verified (issue 37).

Real loops: a DCP training loop on gloo (two processes under ``torchrun``, one process where
torchrun is missing) with ``ckpt watch`` as a separate process beside it; the damage is a byte
flipped in place (same size, a new modification time), as bit rot or a stray write leaves it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from ckpt_cli.ops.resume import choose
from ckpt_cli.trust import ledger
from tests.conftest import run_cli
from tests.helpers.damage import flip
from tests.trust.test_watch import ENV, ROOT, verdicts, watch_events, watch_once, watcher

pytestmark = pytest.mark.requires_torch

TORCHRUN = Path(sys.executable).with_name("torchrun")


def loop(run: Path, saves: int, *extra: str) -> None:
    """The DCP loop (tests/helpers/dcp_loop.py) to its end: two gloo ranks under torchrun."""
    if TORCHRUN.exists():
        cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m",
               "tests.helpers.dcp_loop", str(run), str(saves), *extra]
    else:
        cmd = [sys.executable, "-m", "tests.helpers.dcp_loop", str(run), str(saves), *extra]
    r = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]


def _flip_middle(path: Path) -> None:
    before = path.stat()
    time.sleep(0.01)  # a modification time after the verdict's record (not a timing assertion)
    flip(path, before.st_size // 2, 0xFF)
    assert path.stat().st_size == before.st_size


def test_a_byte_flipped_while_the_watcher_was_down_is_caught(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    proc, out, lines = watcher(run, "--interval", "0.1s", "--settle", "0.3s")
    try:
        loop(run, 3)
        got: dict[str, str] = {}
        for ev in watch_events(lines, lambda: len(got) >= 3):
            got[ev["path"]] = ev["verdict"]
    finally:
        proc.terminate()  # the watcher goes down
        proc.wait()
        out.close()
    assert got == {"step_2": "good", "step_4": "good", "step_6": "good"}
    _flip_middle(run / "step_6" / "__0_0.distcp")
    copies = [tmp_path / "copy-crc", tmp_path / "copy"]
    for c in copies:  # copies (new inodes): watch --once with and without --crc, below
        shutil.copytree(run, c, symlinks=True)

    # resume-path's default check hashes the file whose stat changed: step_6 is passed over.
    r = run_cli("resume-path", run, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["path"] == str(run / "step_4")
    assert doc["rejected"][0]["path"] == "step_6"
    assert "content differs from the manifest" in doc["rejected"][0]["problem"]

    # A restarted watcher looks again and reports it.
    proc, out, lines = watcher(run, "--interval", "0.1s", "--settle", "0.3s")
    bad: list[dict[str, Any]] = []
    try:
        for ev in watch_events(lines, lambda: bool(bad)):
            bad.extend([ev] if ev["verdict"] == "bad" else [])
    finally:
        proc.terminate()
        proc.wait()
        out.close()
    assert [e["path"] for e in bad] == ["step_6"]
    assert verdicts(run)["step_6"] == "bad"

    # watch --once, with or without --crc, exits 1 naming it.
    for c, args in zip(copies, (["--crc"], []), strict=True):
        code, events, err = watch_once(c, *args)
        assert code == 1, (args, events, err)
        assert [(e["path"], e["verdict"]) for e in events if e["verdict"] == "bad"] == [
            ("step_6", "bad")], args
        assert "BAD" in err and "step_6" in err
        assert verdicts(c) == {"step_2": "good", "step_4": "good", "step_6": "bad"}
        # The intact checkpoints, copied (new inodes), hashed as verified: still good.
        assert choose(c) is not None and choose(c).path == c / "step_4"  # type: ignore[union-attr]


def test_a_rollback_leaves_the_resaved_checkpoints_good_and_resume_on_the_new_timeline(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    proc, out, lines = watcher(run, "--interval", "0.1s", "--settle", "0.3s")
    try:
        loop(run, 6)  # step_2 ... step_12
        got: dict[str, str] = {}
        for ev in watch_events(lines, lambda: len(got) >= 6):
            got[ev["path"]] = ev["verdict"]
        assert set(got.values()) == {"good"}, got
        # Resumed from step_4: step_6 and step_8 are saved again in place, with other bytes;
        # step_10 and step_12 belong to the timeline that was left.
        loop(run, 4, "--resume-from", "4")
        seen: list[dict[str, Any]] = []
        for ev in watch_events(lines, lambda: [e["path"] for e in seen if e["verdict"] ==
                                               "good"][-2:] == ["step_6", "step_8"]):
            seen.extend([ev])
    finally:
        proc.terminate()
        proc.wait()
        out.close()
    assert [e["path"] for e in seen if e["verdict"] == "good"][-2:] == ["step_6", "step_8"]
    assert verdicts(run) == {f"step_{s}": "good" for s in (2, 4, 6, 8, 10, 12)}
    choice = choose(run)
    assert choice is not None and choice.path == run / "step_8"
    assert [p for p, _ in choice.rejected] == ["step_12", "step_10"]
    assert all("abandoned timeline" in why for _, why in choice.rejected)
    r = run_cli("resume-path", run)
    assert r.exit_code == 0 and r.stdout.strip() == str(run / "step_8")
    # Every re-saved checkpoint matches the manifest written for its new bytes.
    assert choose(run, verify="full").path == run / "step_8"  # type: ignore[union-attr]
    # A restarted watcher finds nothing to say.
    code, events, err = watch_once(run)
    assert code == 0 and events == [], (events, err)
    # Retention never deletes (nor thins) the resume point, though higher steps of the
    # abandoned timeline are newer by step.
    r = run_cli("prune", run, "--keep", "1", "--thin-after", "1", "--grace", "0", "--yes",
                "--json")
    assert r.exit_code == 0, r.output
    step8 = next(c for c in json.loads(r.stdout)["checkpoints"] if c["name"] == "step_8")
    assert step8["action"] == "keep" and "pinned" in step8["protected_by"]
    assert (run / "step_8").is_dir() and choose(run).path == run / "step_8"  # type: ignore[union-attr]


def _forge(run: Path, name: str, step: int, **fields: Any) -> None:
    doc = {"schema_version": 1, "path": name, "step": step, "time": time.time(),
           "event": "verified", "verdict": "good", "bytes": 0, "manifest_digest": None,
           "problems": [], "detail": {}, **fields}
    with open(run / ledger.LEDGER_NAME, "ab") as f:
        f.write(orjson.dumps(doc) + b"\n")


def test_ledger_lines_name_only_direct_children_and_never_a_hostile_pickle(
        tmp_path: Path) -> None:
    from ckpt_cli.manifest import write_manifest
    from tests.helpers import pickle_corpus as pc

    run = tmp_path / "run"
    loop(run, 2)
    assert watch_once(run)[0] == 0
    # A good checkpoint outside the run, reached through a symlinked directory inside it.
    outside = tmp_path / "outside"
    shutil.copytree(run / "step_4", outside / "checkpoint-9")
    (run / "sub").symlink_to(outside)
    _forge(run, "sub/checkpoint-9", 900,
           manifest_digest=ledger.manifest_digest(outside / "checkpoint-9"))
    _forge(run, ".", 1000)
    _forge(run, "..", 1001)
    # A torch file whose pickle calls os.system, with a manifest and a forged good line.
    evil = run / "model_2000.pt"
    marker = tmp_path / "pwned"
    evil.write_bytes(pc.torch_zip(pc._records(pc.state_dict(
        pc.call(pc.glob("os", "system"), pc.s(f"touch {marker}"))))))
    write_manifest(evil)
    st = evil.stat()
    _forge(run, evil.name, 2000, manifest_digest=ledger.manifest_digest(evil),
           files={evil.name: [st.st_size, st.st_mtime_ns, st.st_ino]}, bytes=st.st_size)

    r = run_cli("resume-path", run, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["path"] == str(run / "step_4")
    assert doc["ignored"] == ["sub/checkpoint-9", ".", ".."]
    assert [x["path"] for x in doc["rejected"]] == ["model_2000.pt"]
    assert "does not read cleanly" in doc["rejected"][0]["problem"]
    assert "os.system" in doc["rejected"][0]["problem"]
    assert "not a checkpoint directly in the run" in r.stderr
    assert not marker.exists()
    assert os.path.isdir(outside / "checkpoint-9")  # untouched
    book = ledger.read_ledger(run)
    assert book is not None and book.ignored == ("sub/checkpoint-9", ".", "..")


def test_a_changed_single_file_without_checksums_is_damage_not_a_new_save(
        tmp_path: Path) -> None:
    """A safetensors file is its own commit marker and has no CRC: a flipped byte in it cannot
    be told from a new save, so it is reported bad (fail closed), never verified afresh."""
    from safetensors.torch import save_file

    run = tmp_path / "run"
    run.mkdir()
    for step in (100, 200):
        save_file({"w": torch.full((64, 64), float(step))}, run / f"model_{step}.safetensors")
    assert watch_once(run)[0] == 0
    newest = run / "model_200.safetensors"
    _flip_middle(newest)
    choice = choose(run)
    assert choice is not None and choice.path == run / "model_100.safetensors"
    code, events, err = watch_once(run)
    assert code == 1, (events, err)
    assert [(e["path"], e["verdict"]) for e in events] == [("model_200.safetensors", "bad")]
