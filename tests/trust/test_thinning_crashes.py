"""``prune --thin-after`` killed at each point of a rewrite (the checkpoint is the old one or the
thinned one, never a mix, and the next prune finishes the job), and DCP checkpoints thinned
where directories cannot be swapped, by ``watch``, and in torchtitan's layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckpt_cli.trust.ledger import read_ledger
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.loads import holds_optimizer_state
from tests.trust.conftest import (
    _aged_run,
    _dcp_load,
    _dcp_model,
    _dcp_run,
    _watch_thinning,
)

pytestmark = pytest.mark.requires_torch


class _Killed(Exception):
    """Stands for the prune process dying at that point."""


def _kill_at(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    from ckpt_cli.trust.thinning import base as thinning

    if where == "manifest-set-aside":  # the old manifest removed, the file not yet replaced
        real = thinning._set_manifest_aside

        def aside_then_die(path: Path) -> str | None:
            real(path)
            raise _Killed

        monkeypatch.setattr(thinning, "_set_manifest_aside", aside_then_die)
    else:  # the thinned checkpoint in place, its new manifest not yet written

        def die(path: Path, algorithm: str | None) -> str | None:
            raise _Killed

        monkeypatch.setattr(thinning, "_manifest_again", die)


@pytest.mark.parametrize(("kind", "where"), [("torch", "manifest-set-aside"),
                                             ("torch", "replaced"), ("dcp", "replaced")])
def test_a_thinning_killed_midway_is_never_reported_bad(tmp_path: Path, kind: str, where: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """D6: a prune killed between setting the manifest aside and writing the new one left a
    checkpoint that the next watch pass reported bad (a false alarm, and --on-bad ran)."""
    from ckpt_cli.ops.prune import prune
    from ckpt_cli.ops.prune.retention import PrunePolicy
    from ckpt_cli.ops.resume import latest_verified

    run = tmp_path / "run"
    if kind == "torch":
        _aged_run(run, (100, 200, 300))
        names = ["step_0100.pt", "step_0200.pt", "step_0300.pt"]
    else:
        _dcp_run(run, (100, 200, 300))
        names = ["step_000100", "step_000200", "step_000300"]
    assert run_cli("watch", run, "--once", "--settle", "0").exit_code == 0
    _kill_at(monkeypatch, where)
    with pytest.raises(_Killed):
        prune(run, PrunePolicy(thin_after=1, grace=0))
    monkeypatch.undo()
    book = read_ledger(run)
    assert book is not None and book.latest()[names[0]].detail.get("pending") is True
    marker = tmp_path / "on-bad-ran"
    r = run_cli("watch", run, "--once", "--settle", "0", "--on-bad", f"touch {marker}")
    assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr
    assert not marker.exists()
    book = read_ledger(run)
    assert book is not None and all(line.good for line in book.latest().values())
    assert run_cli("validate", run / names[0]).exit_code == 0
    # Resume never takes the one whose thinning was cut short, even with the others damaged.
    assert latest_verified(run) == run / names[2]
    for name in names[1:]:
        for f in ([run / name] if kind == "torch" else list((run / name).glob("*.distcp"))):
            with open(f, "r+b") as fh:
                fh.truncate(100)
    assert latest_verified(run, verify="full") is None


@pytest.mark.parametrize("where", ["manifest-set-aside", "replaced"])
def test_the_next_prune_finishes_a_thinning_that_was_killed(tmp_path: Path, where: str,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    from ckpt_cli.manifest import verify_manifest
    from ckpt_cli.ops.prune import prune
    from ckpt_cli.ops.prune.retention import PrunePolicy
    from ckpt_cli.trust.ledger import manifest_digest

    run = tmp_path / "run"
    _aged_run(run, (100, 200, 300))
    assert run_cli("watch", run, "--once", "--settle", "0").exit_code == 0
    _kill_at(monkeypatch, where)
    with pytest.raises(_Killed):
        prune(run, PrunePolicy(thin_after=2, grace=0))
    monkeypatch.undo()
    r = run_cli("prune", run, "--thin-after", "2", "--grace", "0", "--yes")
    assert r.exit_code == 0, r.stderr
    assert not holds_optimizer_state(torch.load(run / "step_0100.pt", weights_only=True))
    book = read_ledger(run)
    assert book is not None
    line = book.latest()["step_0100.pt"]
    assert line.event == "thinned" and "pending" not in line.detail
    assert line.detail["dropped"] == ["optimizer"]
    assert line.manifest_digest == manifest_digest(run / "step_0100.pt")
    v = verify_manifest(run / "step_0100.pt")
    assert v is not None and v.ok
    r = run_cli("watch", run, "--once", "--settle", "0")
    assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr


def test_a_dcp_checkpoint_is_left_whole_where_directories_cannot_be_swapped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an atomic swap (renameat2 RENAME_EXCHANGE) a directory cannot be replaced with
    no moment at which its name is missing: it is left whole, nothing recorded, nothing left."""
    import errno

    from ckpt_cli.storage import atomic

    run = tmp_path / "run"
    _dcp_run(run, (100, 200))
    before = {p.name: p.read_bytes() for p in (run / "step_000100").iterdir()}

    def no_swap(a: Path, b: Path) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(atomic, "exchange", no_swap)
    r = run_cli("prune", run, "--thin-after", "1", "--grace", "0", "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)["thinning"]
    assert not doc["thinned"] and "swap" in doc["skipped"]["step_000100"]
    assert {p.name: p.read_bytes() for p in (run / "step_000100").iterdir()} == before
    assert sorted(p.name for p in run.iterdir()) == [".ckpt-prune.lock", "step_000100",
                                                     "step_000200"]
    assert read_ledger(run) is None


def test_watch_thins_a_dcp_run_and_trusts_it_after(tmp_path: Path) -> None:
    """``watch --thin-after`` on a DCP run: old step directories thinned as the run is watched,
    and the following passes find every checkpoint good."""
    run = tmp_path / "run"
    saved = _dcp_run(run, (100, 200, 300, 400))
    events = _watch_thinning(run)
    assert not [e for e in events if e.bad], [e.problems for e in events if e.bad]
    assert [e.thinned for e in events if e.event == "pruned"] == [["step_000100",
                                                                   "step_000200"]]
    got = _dcp_load(run / "step_000100")
    assert all(torch.equal(got["model"][k], v) for k, v in saved[100].items())
    book = read_ledger(run)
    assert book is not None and all(e.good for e in book.latest().values())


def test_thin_a_torchtitan_style_dcp_checkpoint(tmp_path: Path) -> None:
    """The model's entries at the top level and the optimizer flattened by torch's
    ``get_state_dict(flatten_optimizer_state_dict=True)`` (torchtitan's layout): the optimizer
    goes, the model (cast to BF16) and the train state stay."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from ckpt_cli.formats import read_index
    from ckpt_cli.trust.thinning import thin_file

    torch.manual_seed(0)
    model = _dcp_model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    with third_party_quiet():
        msd, osd = get_state_dict(model, opt,
                                  options=StateDictOptions(flatten_optimizer_state_dict=True))
        assert any(k.startswith("state.") for k in osd)
        dcp.save({**msd, "optimizer": osd, "lr_scheduler": {"last_epoch": 7},
                  "train_state": {"step": 7}}, checkpoint_id=str(tmp_path / "step-7"),
                 no_dist=True)
    done = thin_file(tmp_path / "step-7", to="bf16")
    assert done is not None and done.dropped == ["optimizer"]
    # The moments go; the flattened param_groups (one small pickle per parameter and
    # hyperparameter) stay.
    assert done.bytes_after < done.bytes_before * 0.65
    assert not [n for n in read_index(tmp_path / "step-7").tensors if n.startswith(
        "optimizer.state.")]
    got = {**{k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in msd.items()},
           "train_state": {"step": -1}, "lr_scheduler": {"last_epoch": -1}}
    with third_party_quiet():
        dcp.load(got, checkpoint_id=str(tmp_path / "step-7"), no_dist=True)
    assert got["train_state"]["step"] == 7 and got["lr_scheduler"]["last_epoch"] == 7
    for k, v in msd.items():
        assert torch.equal(got[k], v.to(torch.bfloat16)), k
    assert run_cli("validate", tmp_path / "step-7").exit_code == 0


@pytest.mark.parametrize("where", ["writing", "swapped"])
def test_a_dcp_thinning_killed_leaves_a_complete_checkpoint_under_its_name(
        tmp_path: Path, where: str) -> None:
    """SIGKILL while the thinned copy is being written, or right after it was swapped in: the
    name holds the original or the thinned checkpoint, complete; what is left beside it is a
    leftover no reader takes for a checkpoint, and the next prune finishes the work."""
    import signal
    import subprocess
    import sys

    from ckpt_cli.runs import list_run

    run = tmp_path / "run"
    saved = _dcp_run(run, (100, 200))
    assert run_cli("watch", run, "--once", "--settle", "0").exit_code == 0
    original = {p.name: p.read_bytes() for p in (run / "step_000100").iterdir()}
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.thin_killed", str(run), "1",
                           where], cwd=Path(__file__).parents[2], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = [p.name for p in run.iterdir() if "ckpt-tmp" in p.name or "ckpt-trash" in p.name]
    assert len(left) == 1, left
    listing = list_run(run)
    assert [e.name for e in listing.entries] == ["step_000100", "step_000200"]
    assert left[0] in listing.leftovers
    now = {p.name: p.read_bytes() for p in (run / "step_000100").iterdir()}
    if where == "writing":
        assert now == original  # untouched
        assert not (run / left[0] / ".metadata").exists()  # the copy never committed
    else:
        assert ".metadata" in now and "ckpt-manifest.json" not in now  # the thinned one
        got = _dcp_load(run / "step_000100")
        assert all(torch.equal(got["model"][k], v) for k, v in saved[100].items())
    r = run_cli("watch", run, "--once", "--settle", "0")
    assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr
    # The watch pass swept the copy (or the original) left beside it, as a prune would.
    assert not (run / left[0]).exists()
    r = run_cli("prune", run, "--thin-after", "1", "--grace", "0", "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["trash_removed"] == []
    if where == "swapped":  # the thinning is recorded as done
        assert not [p for p in run.iterdir() if "ckpt-" in p.name and "lock" not in p.name
                    and "ledger" not in p.name]
    book = read_ledger(run)
    assert book is not None
    line = book.latest()["step_000100"]
    assert line.event == "thinned" and "pending" not in line.detail
    got = _dcp_load(run / "step_000100")
    assert all(torch.equal(got["model"][k], v) for k, v in saved[100].items())
    assert run_cli("validate", run / "step_000100").exit_code == 0
