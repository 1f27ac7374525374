"""A thinning killed midway is settled by the next prune even when that prune does not thin the
checkpoint again (issue 45 item 6: a DCP checkpoint left thinned with no manifest and no
confirming ledger line, so ``validate --strict`` failed until a second prune).

The swap (or rename) gives the thinned checkpoint a new inode-change time, so a prune with the
default ``--grace`` right after the kill keeps it as "recent" and does not thin it; a prune
without ``--thin-after`` does not thin anything. Either way it must finish the interrupted
thinning (manifest, confirming line) or, when the checkpoint is still whole, record that the
thinning was not carried out."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt_cli.manifest import verify_manifest
from ckpt_cli.trust.ledger import manifest_digest, read_ledger, thinned_on_purpose
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.loads import holds_optimizer_state

pytestmark = pytest.mark.requires_torch

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def _torch_run(run: Path) -> None:
    from tests.trust.test_thinning_converges import _torch_run as build

    build(run)


def _dcp(run: Path) -> None:
    from tests.trust.conftest import _dcp_run

    _dcp_run(run, (100, 200, 300))


def _hf(run: Path) -> None:
    from tests.helpers.makers import hf_trainer_run

    hf_trainer_run(run, steps=4, save_steps=2)


BUILD: dict[str, Callable[[Path], None]] = {"dcp": _dcp, "hf": _hf, "torch": _torch_run}


def _watched(run: Path, kind: str) -> Path:
    with third_party_quiet():
        BUILD[kind](run)
    old = 1_600_000_000
    for p in [*run.rglob("*"), run]:
        os.utime(p, (old, old))
    assert run_cli("watch", run, "--once", "--settle", "0").exit_code == 0
    return run


def _kill_at(run: Path, step: str, to: str | None = None) -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.thin_kill_at", "--at", step,
                           str(run), "1", to or "-"], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, check=False, timeout=300)
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-2000:])


def _newest_thinned(run: Path, name: str) -> dict[str, object] | None:
    book = read_ledger(run)
    assert book is not None
    line = next((e for e in reversed(book.entries) if e.path == name and e.event == "thinned"),
                None)
    return None if line is None else {"detail": dict(line.detail),
                                      "digest": line.manifest_digest}


def _the_killed_one(run: Path) -> str:
    """The one checkpoint whose newest thinning line is a pending intent (the kill's)."""
    killed = [c.name for c in sorted(run.iterdir()) if (line := _newest_thinned(run, c.name))
              and line["detail"].get("pending")]
    assert len(killed) == 1, killed
    return killed[0]


def _holds_state(ck: Path) -> bool:
    if (ck / "trainer_state.json").is_file():
        return holds_optimizer_state(torch.load(ck / "optimizer.pt", weights_only=True))
    if ck.is_file() or (ck / "checkpoint.pt").is_file():
        return holds_optimizer_state(torch.load(ck if ck.is_file() else ck / "checkpoint.pt",
                                                weights_only=True))
    from ckpt_cli.formats import read_index

    return any(".state." in n for n in read_index(ck).tensors)


@pytest.mark.parametrize("kind", ["dcp", "hf", "torch"])
def test_a_thinning_killed_after_its_swap_is_confirmed_by_a_prune_that_does_not_thin_it(
        tmp_path: Path, kind: str) -> None:
    run = _watched(tmp_path / kind, kind)
    _kill_at(run, "manifest")
    name = _the_killed_one(run)
    assert not _holds_state(run / name)  # thinned, with no manifest and no confirming line
    assert verify_manifest(run / name) is None

    # The default --grace (10 minutes): the swap's inode-change time keeps it "recent".
    r = run_cli("prune", run, "--thin-after", "1", "--yes")
    assert r.exit_code == 0, r.output
    assert "within --grace" in r.output or "recent" in r.output, r.output
    line = _newest_thinned(run, name)
    assert line is not None and not line["detail"].get("pending"), line
    m = verify_manifest(run / name)
    assert m is not None and m.ok
    assert line["digest"] == manifest_digest(run / name)
    assert thinned_on_purpose(run / name)
    assert "finished the thinning a killed prune began" in r.output, r.output
    v = run_cli("validate", run, "--strict")
    assert v.exit_code == 0, v.output


def test_a_thinning_killed_before_any_change_is_recorded_as_not_done(tmp_path: Path) -> None:
    run = _watched(tmp_path / "torch", "torch")
    _kill_at(run, "aside")  # the intent line is written; the checkpoint is still whole
    name = _the_killed_one(run)
    assert _holds_state(run / name)

    # A prune that thins nothing (no --thin-after) still settles it.
    r = run_cli("prune", run, "--keep", "10", "--yes")
    assert r.exit_code == 0, r.output
    line = _newest_thinned(run, name)
    assert line is not None and line["detail"].get("undone") is True, line
    assert not line["detail"].get("pending") and line["detail"]["dropped"] == []
    assert not thinned_on_purpose(run / name)  # no reader takes it for thinned
    assert _holds_state(run / name)
    book = read_ledger(run)
    assert book is not None
    # Its manifest is the one its last verdict recorded: that verdict holds again.
    latest = book.latest()[name]
    assert latest.event == "verified" and latest.good
    assert latest.manifest_digest == manifest_digest(run / name)
    v = run_cli("validate", run / name, "--strict", "--require", "optimizer")
    assert v.exit_code == 0, v.output


def test_the_next_prune_after_a_settled_kill_is_quiet(tmp_path: Path) -> None:
    """Settled once, nothing is settled again: the records are written exactly once."""
    run = _watched(tmp_path / "torch", "torch")
    _kill_at(run, "manifest")
    assert run_cli("prune", run, "--keep", "10", "--yes").exit_code == 0
    book = read_ledger(run)
    assert book is not None
    lines = len(book.entries)
    r = run_cli("prune", run, "--keep", "10", "--yes")
    assert r.exit_code == 0 and "killed prune" not in r.output, r.output
    again = read_ledger(run)
    assert again is not None and len(again.entries) == lines
    shutil.rmtree(run)


@pytest.mark.parametrize("kind", ["torch", "hf"])
def test_a_whole_checkpoint_whose_thinning_died_after_its_manifest_went_is_verified_afresh(
        tmp_path: Path, kind: str) -> None:
    """Killed after the intent line and the manifest's removal, before any file changed: the
    next prune records the thinning as not done, with no manifest to re-check the files
    against; watch then verifies it afresh (never reports the intact checkpoint bad), and it
    is a resume point again."""
    from ckpt_cli.ops.resume import choose

    run = _watched(tmp_path / kind, kind)
    _kill_at(run, "removed")
    name = _the_killed_one(run)
    assert _holds_state(run / name) and verify_manifest(run / name) is None
    r = run_cli("prune", run, "--keep", "10", "--yes")
    assert r.exit_code == 0, r.output
    line = _newest_thinned(run, name)
    assert line is not None and line["detail"].get("undone") is True and line["digest"] is None
    w = run_cli("watch", run, "--once", "--settle", "0", "--json")
    assert w.exit_code == 0, w.output
    assert f"BAD: {run / name}" not in w.stderr
    book = read_ledger(run)
    assert book is not None
    latest = book.latest()[name]
    assert latest.event == "verified" and latest.good
    assert latest.manifest_digest == manifest_digest(run / name)
    m = verify_manifest(run / name)
    assert m is not None and m.ok
    newest = max((c for c in book.latest().values() if c.step is not None),
                 key=lambda e: e.step or 0)
    choice = choose(run)
    assert choice is not None and choice.path == run / newest.path


def test_a_checkpoint_thinned_before_any_verdict_is_verified_but_never_a_resume_point(
        tmp_path: Path) -> None:
    """A run pruned with --thin-after before any watcher ran: the thinned checkpoints have no
    manifest. watch verifies them afresh (not bad), and resume-path never offers one: with
    the newest damaged, there is nothing to resume from rather than a run restarted without
    its optimizer state."""
    from ckpt_cli.ops.resume import survey
    from tests.helpers.damage import truncate

    run = tmp_path / "torch"
    _torch_run(run)
    old = 1_600_000_000
    for p in [*run.rglob("*"), run]:
        os.utime(p, (old, old))
    r = run_cli("prune", run, "--thin-after", "1", "--grace", "0", "--yes", "--json")
    assert r.exit_code == 0, r.output
    book = read_ledger(run)
    assert book is not None
    thinned = sorted({e.path for e in book.entries if e.event == "thinned"})
    assert thinned and all(thinned_on_purpose(run / n) for n in thinned)
    w = run_cli("watch", run, "--once", "--settle", "0", "--json")
    assert w.exit_code == 0, w.output
    newest = max((c for c in run.iterdir() if not c.name.startswith("ckpt-")
                  and ".ckpt-manifest" not in c.name), key=lambda c: c.name)
    assert newest.name not in thinned
    truncate(newest if newest.is_file() else next(newest.rglob("*.pt")), 100)
    found = survey(run)
    assert found.choice is None
    why = dict(found.rejected)
    assert all("thinned by prune --thin-after" in why[n] for n in thinned), why
