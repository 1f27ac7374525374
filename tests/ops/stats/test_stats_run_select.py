"""``ckpt stats`` on runs: which checkpoints it reads, --part, and runs on object storage."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import run_cli, third_party_quiet
from tests.helpers import s3
from tests.helpers.train_loop import Loop, injected_run, load_model
from tests.ops.stats.run_helpers import found, model_bytes, stats_json

pytestmark = [pytest.mark.requires_torch,
              # botocore and moto call datetime.utcnow() and friends; not ckpt's code.
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).resolve().parents[3]


def figures(doc: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Each checkpoint's module figures (what must not depend on the cache or the place)."""
    return [c["modules"] for c in doc["checkpoints"]]


# --- which checkpoints --------------------------------------------------------------------------

@pytest.fixture
def ten(tmp_path: Path) -> Path:
    loop = Loop(tmp_path / "run", every=2)
    for _ in range(10):
        loop.checkpoint()
    return tmp_path / "run"  # steps 0, 2, ... 18


@pytest.mark.parametrize(("args", "steps"), [
    ((), [0, 2, 4, 6, 8, 10, 12, 14, 16, 18]),
    (("--every", "3"), [0, 6, 12, 18]),
    (("--every", "4"), [2, 10, 18]),
    (("--every", "20"), [18]),
    (("--last", "3"), [14, 16, 18]),
    (("--last", "30"), [0, 2, 4, 6, 8, 10, 12, 14, 16, 18]),
    (("--every", "2", "--last", "2"), [14, 18]),
])
def test_every_and_last_pick_the_checkpoints(ten: Path, cache: Path, args: tuple[str, ...],
                                             steps: list[int]) -> None:
    doc = stats_json(ten, *args)
    assert [c["step"] for c in doc["checkpoints"]] == steps
    # updates are between the checkpoints listed: the first has none
    assert all(m["update_ratio"] is None for m in doc["checkpoints"][0]["modules"])
    if len(steps) > 1:
        assert any(m["update_ratio"] for m in doc["checkpoints"][1]["modules"])


def _dcp_without_metadata(root: Path, step: int) -> Path:
    import torch.distributed.checkpoint as dcp

    dest = root / f"step_{step}"
    with third_party_quiet():  # no process group: torch warns it saves as one process
        dcp.save({"model": {"w": torch.ones(4, 4)}}, checkpoint_id=str(dest))
    (dest / ".metadata").unlink()
    return dest


def test_incomplete_checkpoints_are_skipped_and_named(tmp_path: Path, cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=3, jump_at=None, nan_at=None,
                        freeze_from=None)
    run = tmp_path / "run"
    _dcp_without_metadata(run, 100)
    shutil.copy(loop.saved[-1], run / "step_200.pt.tmp")
    doc = stats_json(run)
    assert [c["name"] for c in doc["checkpoints"]] == [p.name for p in loop.saved]
    skipped = {s["name"]: s["reason"] for s in doc["skipped"]}
    assert "step_100" in skipped and ".metadata" in skipped["step_100"]
    assert doc["read"]["bytes"] == sum(model_bytes(p) for p in loop.saved)
    r = run_cli("stats", run)
    assert r.exit_code == 0
    assert "1 not read" in r.stdout or "step_100" in r.stdout + r.stderr


def test_a_temporary_named_checkpoint_is_named_as_skipped(tmp_path: Path,
                                                          cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=2, jump_at=None, nan_at=None,
                        freeze_from=None)
    shutil.copy(loop.saved[-1], tmp_path / "run" / "step_200.pt.tmp")
    doc = stats_json(tmp_path / "run")
    assert "step_200.pt.tmp" in {s["name"] for s in doc["skipped"]}


def test_no_complete_checkpoint_is_an_input_error(tmp_path: Path, cache: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    _dcp_without_metadata(run, 100)
    _dcp_without_metadata(run, 200)
    r = run_cli("stats", run)
    assert r.exit_code == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


# --- --part -------------------------------------------------------------------------------------

def _cli(*args: str | Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "ckpt_cli", "stats", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)


def test_two_parts_in_two_processes_make_the_whole(tmp_path: Path, cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=6, jump_at=2, nan_at=3, freeze_from=4)
    run, shared = tmp_path / "run", tmp_path / "shared"
    n = len(load_model(loop.saved[0]))
    procs = [_cli(run, "--part", f"{i}/2", "--cache-dir", shared, "--json") for i in (1, 2)]
    outs = [p.communicate(timeout=120) for p in procs]
    docs = []
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode in (0, 1), err.decode()
        docs.append(json.loads(out))
    whole = stats_json(run, "--no-cache", code=1)
    # each computed its share, none twice
    assert sorted(d["part"]["part"] for d in docs) == [1, 2]
    assert sum(d["part"]["tensors"] for d in docs) == 6 * n
    assert all(d["part"]["tensors"] > 0 for d in docs)
    complete = [d for d in docs if d["part"]["complete"]]
    assert complete  # the last to finish found every figure
    for d in complete:
        assert d["checkpoints"] == whole["checkpoints"] and d["anomalies"] == whole["anomalies"]
    plain = stats_json(run, "--cache-dir", shared, code=1)
    assert plain["read"]["bytes"] == 0 and plain["read"]["computed_tensors"] == 0
    assert plain["checkpoints"] == whole["checkpoints"]
    assert found(plain) == found(whole) and len(found(whole)) == 3


def test_part_without_the_cache_is_a_usage_error(tmp_path: Path, cache: Path) -> None:
    injected_run(tmp_path / "run", checkpoints=2, jump_at=None, nan_at=None, freeze_from=None)
    r = run_cli("stats", tmp_path / "run", "--part", "1/2", "--no-cache")
    assert r.exit_code == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "--part" in r.stderr
    assert not cache.exists()


# --- object storage -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def endpoint() -> Iterator[tuple[str, s3.Proxy]]:
    with s3.moto_endpoint() as pair:
        yield pair


def test_a_run_on_s3_has_the_local_figures_and_uses_the_cache(
        s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy], tmp_path: Path, cache: Path) -> None:
    moto = endpoint[0]
    injected_run(tmp_path / "run", checkpoints=4, jump_at=2, nan_at=None, freeze_from=None)
    bucket = f"stats-{uuid.uuid4().hex[:10]}"
    s3.client(moto).create_bucket(Bucket=bucket)
    s3.upload(moto, tmp_path / "run", bucket, "run")
    local = stats_json(tmp_path / "run", "--no-cache", code=1)
    url = f"s3://{bucket}/run"
    remote = stats_json(url, code=1)
    assert remote["mode"] == "run"
    assert [c["name"] for c in remote["checkpoints"]] == [c["name"]
                                                         for c in local["checkpoints"]]
    assert figures(remote) == figures(local)
    assert found(remote) == found(local)
    assert remote["read"]["bytes"] == local["read"]["bytes"]
    again = stats_json(url, code=1)
    assert again["read"]["bytes"] == 0 and again["read"]["computed_tensors"] == 0
    assert figures(again) == figures(local)
