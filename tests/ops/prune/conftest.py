"""Fixtures and helpers the prune test modules share."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckpt_cli.ops.prune.retention import PrunePolicy
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.makers import lightning_run

KEEP1 = PrunePolicy(keep=1, grace=0)


def _json(path: Path, *args: str, exit_code: int = 0) -> dict[str, Any]:
    r = run_cli("prune", path, *args, "--json")
    assert r.exit_code == exit_code, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def _status(doc: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["status"] for c in doc["checkpoints"]}


def _why(doc: dict[str, Any], name: str) -> str:
    return "; ".join(next(c["reasons"] for c in doc["checkpoints"] if c["name"] == name))


def _names(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def _copy(src: Path, tmp_path: Path, name: str = "run") -> Path:
    dest = tmp_path / name
    shutil.copytree(src, dest, symlinks=True)
    return dest


@pytest.fixture(scope="session")
def lightning_metric_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Lightning: epoch=E-step=S-train_loss=X.ckpt at steps 2, 4, 6 and a last.ckpt symlink."""
    with third_party_quiet():
        return lightning_run(tmp_path_factory.mktemp("plm") / "ckpts", steps=6,
                             filename="{epoch}-{step}-{train_loss:.4f}", save_last="link")
