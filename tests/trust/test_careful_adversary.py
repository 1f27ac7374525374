"""A verdict survives no change a careful hand makes (issue 45 items 1 and 5).

The damage here is the one a size-and-mtime check cannot see: one byte flipped in place, then
the file's modification time put back (``touch -r``, here ``os.utime`` with the old
nanoseconds), so its size, modification time and inode are what the verdict recorded. Only the
inode-change time, which the kernel sets and no user call restores, tells. Each layout is
written by its real library: ``torch.save`` (a byte of ``data.pkl`` and a byte of tensor
data), safetensors' ``save_file``, transformers' Trainer (``checkpoint-N/model.safetensors``)
and torch.distributed.checkpoint (a ``.distcp`` file).

Then the ledger itself: a ``good`` line forged over the flip with the old manifest put back,
and a forged line for a checkpoint whose pickle calls ``os.system``, beside lines naming no
checkpoint of the run and a torn one. ``resume-path`` and ``watch`` apply the same checks and
say which lines they passed over.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from ckpt_cli.ops.resume import choose
from ckpt_cli.trust import ledger
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.damage import flip, zip_payload
from tests.trust.test_watch import train, verdicts, watch_once

pytestmark = [pytest.mark.requires_torch, pytest.mark.slow]


def _three_saves(run: Path, suffix: str, save: Callable[[dict[str, Any], Path], None],
                 ) -> list[Path]:
    """Three checkpoints ``model_{100,200,300}{suffix}`` written by ``save``."""
    run.mkdir()
    out = []
    for step in (100, 200, 300):
        torch.manual_seed(step)
        p = run / f"model_{step}{suffix}"
        save({"layer.weight": torch.randn(64, 64)}, p)
        out.append(p)
    return out


def _torch_run(run: Path) -> list[Path]:
    return _three_saves(run, ".pt", lambda sd, p: torch.save({"model": sd, "step": 1}, p))


def _flip_pickle_key(path: Path) -> Path:
    """A bit of the key ``layer.weight`` in ``data.pkl`` (``l`` becomes ``m``): the pickle
    still reads, to a state dict with another name."""
    off, size = zip_payload(path, "data.pkl")
    with open(path, "rb") as f:
        f.seek(off)
        pkl = f.read(size)
    flip(path, off + pkl.index(b"layer.weight"), 0x01)
    return path


def _flip_tensor_data(path: Path) -> Path:
    off, size = zip_payload(path, "/data/0")
    flip(path, off + size // 2, 0x10)
    return path


def _safetensors_run(run: Path) -> list[Path]:
    from safetensors.torch import save_file

    return _three_saves(run, ".safetensors", save_file)


def _flip_middle(path: Path) -> Path:
    flip(path, path.stat().st_size // 2, 0x10)
    return path


def _hf_run(run: Path) -> list[Path]:
    from tests.helpers.makers import hf_trainer_run

    with third_party_quiet():
        hf_trainer_run(run, steps=6, save_steps=2)
    return [run / f"checkpoint-{s}" for s in (2, 4, 6)]


def _dcp_run(run: Path) -> list[Path]:
    assert train(run, 3) == 0
    return [run / f"step_{s}" for s in (2, 4, 6)]


# layout -> (write a run of three checkpoints, the file of a checkpoint to damage, how)
LAYOUTS: dict[str, tuple[Callable[[Path], list[Path]], Callable[[Path], Path],
                         Callable[[Path], Path]]] = {
    "torch-data.pkl": (_torch_run, lambda c: c, _flip_pickle_key),
    "torch-tensor-data": (_torch_run, lambda c: c, _flip_tensor_data),
    "safetensors": (_safetensors_run, lambda c: c, _flip_middle),
    "hf-model.safetensors": (_hf_run, lambda c: c / "model.safetensors", _flip_middle),
    "dcp-.distcp": (_dcp_run, lambda c: c / "__0_0.distcp", _flip_middle),
}


def flip_keeping_mtime(path: Path, damage: Callable[[Path], Path]) -> None:
    """Damage ``path`` in place, then put its access and modification times back (what
    ``touch -r copy path`` does): size, mtime and inode are as the verdict recorded them."""
    before = os.stat(path)
    time.sleep(0.01)  # the inode-change time moves on (not a timing assertion)
    damage(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size, before.st_mtime_ns, before.st_ino)
    assert after.st_ctime_ns != before.st_ctime_ns


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_flip_with_its_mtime_put_back_is_caught(tmp_path: Path, layout: str) -> None:
    write, file_of, damage = LAYOUTS[layout]
    run = tmp_path / "run"
    ckpts = write(run)
    code, events, err = watch_once(run)
    assert code == 0, (events, err)
    assert set(verdicts(run).values()) == {"good"} and len(verdicts(run)) == 3
    # Two copies, each made trusted in place by a watcher pass (which hashes the copies' new
    # inodes against the manifests and records their stamps): one for a restarted `watch
    # --once`, one for `watch --once --crc`.
    copies = [tmp_path / "copy", tmp_path / "copy-crc"]
    for c in copies:
        shutil.copytree(run, c, symlinks=True)
        assert watch_once(c)[0] == 0
    newest, intact = ckpts[-1].name, ckpts[-2].name
    for where in (run, *copies):
        flip_keeping_mtime(file_of(where / newest), damage)

    # resume-path's default check passes the damaged checkpoint over.
    r = run_cli("resume-path", run, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["path"] == str(run / intact)
    assert [x["path"] for x in doc["rejected"]] == [newest]
    # A torch file is its own commit marker and carries CRCs: other bytes are taken for a new
    # save (not resumed from until verified afresh, with CRCs, which finds the flip below).
    want = "written again after it was verified" if layout.startswith("torch") else (
        "content differs from the manifest")
    assert want in doc["rejected"][0]["problem"]
    assert f"skipped {newest}" in r.stderr

    # Prune pins the intact resume point, never the damaged one: --keep 1 keeps the newest
    # by rule and the resume point by the pin; only the oldest goes.
    r = run_cli("prune", run, "--keep", "1", "--grace", "0", "--yes", "--json")
    assert r.exit_code == 0, r.output
    kept = {c["name"] for c in json.loads(r.stdout)["checkpoints"] if c["action"] == "keep"}
    assert kept == {newest, intact}
    assert (run / intact).exists() and not (run / ckpts[0].name).exists()
    assert choose(run) is not None and choose(run).path == run / intact  # type: ignore[union-attr]

    # A restarted watcher (`watch --once`), with or without --crc, reports it bad and exits 1.
    for c, args in zip(copies, ([], ["--crc"]), strict=True):
        code, events, err = watch_once(c, *args)
        assert code == 1, (args, events, err)
        assert [(e["path"], e["verdict"]) for e in events if e["verdict"]] == [
            (newest, "bad")], args
        assert verdicts(c)[newest] == "bad" and verdicts(c)[intact] == "good"
        assert choose(c) is not None and choose(c).path == c / intact  # type: ignore[union-attr]


def _append_line(run: Path, doc: dict[str, Any]) -> None:
    with open(run / ledger.LEDGER_NAME, "ab") as f:
        f.write(orjson.dumps(doc) + b"\n")


@pytest.mark.parametrize("layout", ["torch-tensor-data", "safetensors", "dcp-.distcp"])
def test_a_forged_good_line_over_the_old_manifest_put_back_is_caught(
        tmp_path: Path, layout: str) -> None:
    """The flip is hidden as well as a hand can: the mtime put back, the manifest rewritten
    after the damage and then the old one put back, and a ``good`` line appended that records
    the files as they are now (inode-change time included) with the old manifest's digest."""
    from ckpt_cli.manifest import manifest_path, write_manifest

    write, file_of, damage = LAYOUTS[layout]
    run = tmp_path / "run"
    ckpts = write(run)
    assert watch_once(run)[0] == 0
    target = ckpts[-1]
    mpath = manifest_path(target)
    old_manifest = mpath.read_bytes()
    original = ledger.read_ledger(run).latest()[target.name]  # type: ignore[union-attr]
    flip_keeping_mtime(file_of(target), damage)
    write_manifest(target)  # what validate --write-manifest would leave
    mpath.write_bytes(old_manifest)
    forged = dataclasses.replace(original, time=time.time(), files=ledger.stamp(target),
                                 manifest_digest=ledger.manifest_digest(target))
    _append_line(run, forged.to_json())
    assert ledger.read_ledger(run).latest()[target.name].files == ledger.stamp(target)  # type: ignore[union-attr]

    r = run_cli("resume-path", run, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["path"] == str(ckpts[-2])
    assert [x["path"] for x in doc["rejected"]] == [target.name]
    assert "forged or edited" in doc["rejected"][0]["problem"]
    code, events, err = watch_once(run)
    assert code == 1, (events, err)
    assert [(e["path"], e["verdict"]) for e in events if e["verdict"]] == [(target.name, "bad")]
    # A checkpoint that was only touched (same bytes, new stamps) stays good, and its new
    # stamps are recorded in its manifest and a new line, so the next look hashes nothing.
    intact = ckpts[-2]
    os.utime(file_of(intact))
    code, events, err = watch_once(run)
    assert code == 0 and events == [], (events, err)
    line = ledger.read_ledger(run).latest()[intact.name]  # type: ignore[union-attr]
    assert line.good and dict(line.files) == ledger.stamp(intact)
    from ckpt_cli.manifest import read_manifest

    assert read_manifest(intact).stamps == dict(line.files)  # type: ignore[union-attr]


def test_watch_refuses_the_forged_hostile_line_resume_path_refuses(tmp_path: Path) -> None:
    """A forged good line for a torch file whose pickle calls ``os.system`` (its manifest
    rewritten to match): ``watch --once`` reads its index through the allowlist as
    ``resume-path`` does, records it bad and exits 1; both name the ledger lines they
    ignored."""
    from ckpt_cli.manifest import write_manifest
    from tests.helpers import pickle_corpus as pc

    run = tmp_path / "run"
    assert train(run, 2) == 0
    assert watch_once(run)[0] == 0
    evil = run / "model_2000.pt"
    marker = tmp_path / "pwned"
    evil.write_bytes(pc.torch_zip(pc._records(pc.state_dict(
        pc.call(pc.glob("os", "system"), pc.s(f"touch {marker}"))))))
    write_manifest(evil)
    line = {"schema_version": 1, "path": evil.name, "step": 2000, "time": time.time(),
            "event": "verified", "verdict": "good", "bytes": evil.stat().st_size,
            "manifest_digest": ledger.manifest_digest(evil), "problems": [], "detail": {},
            "files": {k: list(v) for k, v in ledger.stamp(evil).items()}}
    _append_line(run, line)
    _append_line(run, line | {"path": "../elsewhere"})
    with open(run / ledger.LEDGER_NAME, "ab") as f:
        f.write(b'{"schema_version": 1, "path": "step_4", "verd\n')  # torn

    r = run_cli("resume-path", run, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["path"] == str(run / "step_4")
    assert doc["rejected"][0]["path"] == evil.name
    assert "os.system" in doc["rejected"][0]["problem"]
    assert doc["ignored"] == ["../elsewhere"] and doc["unreadable_lines"] == 1
    assert "'../elsewhere', which is not a checkpoint directly in the run" in r.stderr
    assert "1 ledger line could not be read" in r.stderr

    code, events, err = watch_once(run)
    assert code == 1, (events, err)
    bad = [e for e in events if e["verdict"] == "bad"]
    assert [e["path"] for e in bad] == [evil.name]
    assert "does not read cleanly" in bad[0]["problems"][0]
    assert "os.system" in bad[0]["problems"][0]
    ignored = [(e["path"], e["problems"][0]) for e in events if e["event"] == "ignored"]
    assert [p for p, _ in ignored] == ["../elsewhere", None]
    assert "could not be read" in ignored[1][1]
    assert "BAD" in err and evil.name in err
    assert not marker.exists()
    assert verdicts(run)[evil.name] == "bad"
    # Said once: a second pass has nothing new to say about the ledger, and the checkpoint
    # is bad already.
    code, events, err = watch_once(run)
    assert [e["event"] for e in events] == ["ignored", "ignored"]  # a new process says it again
    assert code == 0, (events, err)
