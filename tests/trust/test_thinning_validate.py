"""``validate --require optimizer`` on checkpoints thinned by ``prune --thin-after``: an optimizer
whose ``state`` is empty (its ``param_groups`` kept) holds no optimizer state, in the real
layouts (HF Trainer's ``optimizer.pt`` stays, rewritten without state; Lightning's
``optimizer_states``; DCP). Issue 45: ``--require optimizer`` passed on a thinned HF
checkpoint, and validate no longer noted that it was thinned on purpose."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import run_cli, third_party_quiet

pytestmark = pytest.mark.requires_torch


def _hf(run: Path) -> None:
    from tests.helpers.makers import hf_trainer_run

    hf_trainer_run(run, steps=4, save_steps=2)


def _lightning(run: Path) -> None:
    from tests.helpers.makers import lightning_run

    lightning_run(run, steps=4, every=2, save_last=False)


def _dcp(run: Path) -> None:
    from tests.trust.conftest import _dcp_run

    _dcp_run(run, (100, 200))


@pytest.mark.parametrize("build", [_hf, _lightning, _dcp], ids=["hf", "lightning", "dcp"])
def test_require_optimizer_fails_on_a_thinned_checkpoint_and_passes_on_a_whole_one(
        tmp_path: Path, build: Callable[[Path], None]) -> None:
    run = tmp_path / "run"
    with third_party_quiet():
        build(run)
    for p in [*run.rglob("*"), run]:
        os.utime(p, (1_600_000_000, 1_600_000_000))
    r = run_cli("prune", run, "--thin-after", "1", "--grace", "0", "--yes", "--json")
    assert r.exit_code == 0, r.output
    thinned = json.loads(r.output)["thinning"]["thinned"]
    assert len(thinned) == 1, thinned
    (old,) = thinned
    from ckpt_cli.runs import list_run

    (new,) = [e.name for e in list_run(run).entries if e.name != old]

    v = run_cli("validate", run / old, "--require", "optimizer", "--json")
    assert v.exit_code != 0, v.output
    found = [f for c in json.loads(v.output)["checkpoints"] for f in c["findings"]]
    missing = [f for f in found if f["code"] == "missing-optimizer"]
    assert missing and "thinned by ckpt prune --thin-after" in missing[0]["message"], found

    plain = run_cli("validate", run / old, "--json")
    assert plain.exit_code == 0, plain.output
    notes = [f for c in json.loads(plain.output)["checkpoints"] for f in c["findings"]
             if f["code"] == "no-optimizer"]
    assert notes and notes[0]["severity"] == "info", notes  # thinned on purpose: a note

    whole = run_cli("validate", run / new, "--require", "optimizer")
    assert whole.exit_code == 0, whole.output
