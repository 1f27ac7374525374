"""Shared fixtures: checkpoints written by the real libraries, and a CLI runner."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from ckpt_cli.cli.app import app

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
requires_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED,
                                        reason="deepspeed is not installed (pip install "
                                               "'ckpt-cli[deepspeed]')")


def run_cli(*args: str | Path, input: str | None = None) -> Result:
    """Run ``ckpt ARGS`` in-process with NO_COLOR=1 and a 100-column terminal."""
    runner = CliRunner()
    return runner.invoke(app, [str(a) for a in args], input=input,
                         env={"NO_COLOR": "1", "COLUMNS": "100", "TERM": "dumb"})


@contextlib.contextmanager
def third_party_quiet() -> Iterator[None]:
    """Silence warnings third-party libraries emit while writing fixtures (not our code)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture
def cli() -> Callable[..., Result]:
    """The CLI runner (see :func:`run_cli`)."""
    return run_cli


@pytest.fixture(scope="session")
def sample_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ckpt sample`` output: torch step dirs, a 4-rank DCP checkpoint, an HF export."""
    from ckpt_cli.sample import write_sample

    dest = tmp_path_factory.mktemp("sample") / "run"
    with third_party_quiet():
        write_sample(dest)
    return dest


@pytest.fixture
def sample_copy(sample_run: Path, tmp_path: Path) -> Path:
    """A private copy of the sample run that a test may damage."""
    dest = tmp_path / "run"
    shutil.copytree(sample_run, dest, symlinks=True)
    return dest


@pytest.fixture(scope="session")
def hf_trainer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF Trainer output dir with checkpoint-2 and checkpoint-4 (transformers itself)."""
    from tests.helpers.makers import hf_trainer_run

    with third_party_quiet():
        return hf_trainer_run(tmp_path_factory.mktemp("hf") / "out")


@pytest.fixture(scope="session")
def lightning_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Lightning checkpoint dir: epoch=0-step=2.ckpt, epoch=0-step=4.ckpt, last.ckpt."""
    from tests.helpers.makers import lightning_run

    with third_party_quiet():
        return lightning_run(tmp_path_factory.mktemp("pl") / "ckpts")


@pytest.fixture(scope="session")
def ds_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSpeed ZeRO 1/2/3 checkpoints in fp32 and bf16, saved by deepspeed itself."""
    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    from tests.helpers.makers import deepspeed_checkpoints

    return deepspeed_checkpoints(tmp_path_factory.mktemp("ds"),
                                 ["z1-fp32", "z2-fp32", "z3-fp32", "z2-bf16", "z3-bf16",
                                  "z1-fp32+frozen", "z2-fp32+frozen"])


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--update-golden`` rewrites tests/golden/*.json from the current output."""
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite golden files instead of comparing against them")
