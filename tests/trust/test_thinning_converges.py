"""A thinning prune killed (SIGKILL) at any point converges after ONE more prune, in every layout
(torch files and step directories, Lightning ``.ckpt``, HF Trainer ``checkpoint-N``, DCP, and
``--thin-to bf16``): the checkpoint is thinned, has its manifest and its confirming ``thinned``
ledger line, and ``validate --strict`` is clean (issue 45 item 6: 4 of 42 kills left an HF
checkpoint whole in FP32, or a DCP one thinned with no manifest and no confirming line)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt_cli.formats import read_index
from ckpt_cli.formats.names import is_own_temporary
from ckpt_cli.manifest import verify_manifest
from ckpt_cli.trust.ledger import manifest_digest, read_ledger
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.loads import holds_optimizer_state

pytestmark = [pytest.mark.requires_torch, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
POINTS_PER_LAYOUT = 8


def _torch_run(run: Path) -> None:
    """Top-level torch files and step directories holding one."""
    run.mkdir()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    for step in (100, 200, 300):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
        if step == 200:
            (run / f"step_{step:06d}").mkdir()
            torch.save(state, run / f"step_{step:06d}" / "checkpoint.pt")
        else:
            torch.save(state, run / f"step_{step:04d}.pt")


def _lightning(run: Path) -> None:
    from tests.helpers.makers import lightning_run

    lightning_run(run, steps=6, every=2, save_last=False)


def _hf(run: Path) -> None:
    from tests.helpers.makers import hf_trainer_run

    hf_trainer_run(run, steps=6, save_steps=2)


def _dcp(run: Path) -> None:
    from tests.trust.conftest import _dcp_run

    _dcp_run(run, (100, 200, 300))


def _weights_dtypes(ck: Path) -> set[str]:
    """The dtypes of a thinned checkpoint's floating-point weights."""
    if ck.is_file() or (ck / "checkpoint.pt").is_file():
        f = ck if ck.is_file() else ck / "checkpoint.pt"
        state = torch.load(f, weights_only=True)
        sd = state.get("state_dict", state.get("model"))
        return {str(v.dtype) for v in sd.values() if v.is_floating_point()}
    if (ck / "trainer_state.json").is_file():
        return {t.dtype for t in read_index(ck / "model.safetensors").tensors.values()}
    return {t.dtype for n, t in read_index(ck).tensors.items() if n.startswith("model.")}


def _holds_state(ck: Path) -> bool:
    if ck.is_file() or (ck / "checkpoint.pt").is_file():
        return holds_optimizer_state(torch.load(ck if ck.is_file() else ck / "checkpoint.pt",
                                                weights_only=True))
    if (ck / "trainer_state.json").is_file():
        return holds_optimizer_state(torch.load(ck / "optimizer.pt", weights_only=True))
    return any(".state." in n for n in read_index(ck).tensors)


LAYOUTS: dict[str, tuple[Callable[[Path], None], str | None]] = {
    "torch": (_torch_run, None), "torch-bf16": (_torch_run, "bf16"),
    "lightning": (_lightning, None), "hf": (_hf, None), "hf-bf16": (_hf, "bf16"),
    "dcp": (_dcp, None), "dcp-bf16": (_dcp, "bf16"),
}
BUILDERS = {"torch": _torch_run, "lightning": _lightning, "hf": _hf, "dcp": _dcp}


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One run per kind, trained once, watched (manifests and ledger lines), an hour old."""
    out = {}
    base = tmp_path_factory.mktemp("converge")
    for kind, build in BUILDERS.items():
        run = base / kind
        with third_party_quiet():
            build(run)
        old = 1_600_000_000
        for p in [*run.rglob("*"), run]:
            os.utime(p, (old, old))
        assert run_cli("watch", run, "--once", "--settle", "0").exit_code == 0
        out[kind] = run
    return out


def _many(to: str | None, runs: dict[Path, int]) -> dict[str, str]:
    """Kill a prune of each run at its point (one process, a fork per point)."""
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.thin_kill_at", "--many", "1",
                           to or "-", *(f"{r}:{at}" for r, at in runs.items())], env=ENV,
                          cwd=ROOT, capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(line.rsplit(" ", 1) for line in proc.stdout.splitlines())


def _checkpoints(run: Path) -> list[Path]:
    from ckpt_cli.runs import list_run

    return [e.path for e in list_run(run).entries]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_thinning_killed_anywhere_converges_after_one_more_prune(
        templates: dict[str, Path], tmp_path: Path, layout: str) -> None:
    kind = layout.split("-")[0]
    to = LAYOUTS[layout][1]
    template = templates[kind]
    full = tmp_path / "full"
    shutil.copytree(template, full, symlinks=True)
    counted = _many(to, {full: 10**9})[str(full)]
    assert counted.startswith("done:"), counted
    changes = int(counted.split(":")[1])
    assert changes > POINTS_PER_LAYOUT
    # Points spread over the whole prune, the first and the last included.
    step = max(1, changes // (POINTS_PER_LAYOUT - 1))
    points = sorted({1, changes, *range(1, changes + 1, step)})
    runs = {}
    for at in points:
        run = tmp_path / f"at-{at}"
        shutil.copytree(template, run, symlinks=True)
        runs[run] = at
    got = _many(to, runs)
    problems: list[str] = []
    for run, at in runs.items():
        assert got[str(run)] == "killed", (at, got[str(run)])
        extra = ["--thin-to", to] if to else []
        r = run_cli("prune", run, "--thin-after", "1", *extra, "--grace", "0", "--yes")
        if r.exit_code != 0:
            problems.append(f"{at}: next prune exited {r.exit_code}: {r.output[-500:]}")
            continue
        problems += [f"{at}: {why}" for why in _not_converged(run, to)]
    print(f"{layout}: {changes} changes, killed at {len(points)} points {points}")
    assert not problems, "\n".join(problems)


def _not_converged(run: Path, to: str | None) -> list[str]:
    """What is wrong with ``run`` after the prune that followed the killed one."""
    out = []
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*") if is_own_temporary(p.name))
    if left:
        out.append(f"leftovers {left}")
    v = run_cli("validate", run, "--strict")
    if v.exit_code != 0:
        out.append(f"validate --strict exited {v.exit_code}: {v.output[-800:]}")
    book = read_ledger(run)
    cks = sorted(_checkpoints(run), key=lambda p: p.stat().st_ino)  # any order; newest below
    if book is None:
        return [*out, "no ledger"]
    lines = book.latest()
    thinned = [c for c in cks if lines.get(c.name) is not None
               and lines[c.name].event == "thinned"]
    if len(thinned) != len(cks) - 1:
        out.append(f"thinned lines for {[c.name for c in thinned]} of {[c.name for c in cks]}")
    for c in cks:
        line = lines.get(c.name)
        if line is None or line.event != "thinned":
            if not _holds_state(c):  # the one kept whole
                out.append(f"{c.name}: no thinned line but thinned")
            continue
        if line.detail.get("pending"):
            out.append(f"{c.name}: its thinned line is still pending")
        if _holds_state(c):
            out.append(f"{c.name}: still holds optimizer state")
        if to == "bf16" and _weights_dtypes(c) - {"BF16", "torch.bfloat16"}:
            out.append(f"{c.name}: weights {_weights_dtypes(c)}, not BF16")
        m = verify_manifest(c)
        if m is None or not m.ok:
            out.append(f"{c.name}: manifest {'missing' if m is None else 'does not verify'}")
        elif line.manifest_digest != manifest_digest(c):
            out.append(f"{c.name}: the ledger line names another manifest")
    return out
