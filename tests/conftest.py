"""Shared fixtures: checkpoints written by the real libraries, and a CLI runner."""

from __future__ import annotations

import ast
import contextlib
import difflib
import functools
import importlib.util
import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
    """``ckpt sample``'s layout, written without training (tests/helpers/sample_files.py):
    torch step dirs, a 4-rank DCP checkpoint, an HF export, ``latest``."""
    from tests.helpers.sample_files import write_sample_files

    with third_party_quiet():
        return write_sample_files(tmp_path_factory.mktemp("sample") / "run")


@pytest.fixture(scope="session")
def trained_sample_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ckpt sample``'s own output (400 training steps): for the tests of ``ckpt sample`` and
    those that need its real loss curve. In the slow tier (:data:`SLOW_FIXTURES`)."""
    from ckpt_cli.ops.sample import write_sample

    dest = tmp_path_factory.mktemp("trained-sample") / "run"
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


#: ds_view_dir's configs: each saved, then loaded into a fresh engine, and what DeepSpeed
#: restored saved beside it (``<config>.view.pt``; see tests/helpers/ds_train.py).
DS_VIEW_CONFIGS = ("z1-fp32+view", "z2-fp32+sched+view", "z3-fp32+view", "z1-bf16+view",
                   "z2-bf16+view", "z3-bf16+sched+view", "z2-fp32+frozen+view",
                   "z1-fp32+groups+view", "z3-bf16+groups+view", "z2-fp32+sgd")


@pytest.fixture(scope="session")
def ds_view_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSpeed ZeRO checkpoints with DeepSpeed's own restored view of each (issue 48)."""
    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    from tests.helpers.makers import deepspeed_checkpoints

    return deepspeed_checkpoints(tmp_path_factory.mktemp("dsv"), list(DS_VIEW_CONFIGS))


@pytest.fixture
def s3env(endpoint: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The test credentials and the proxy's endpoint in the environment; its faults cleared
    and its traffic counters reset. ``endpoint`` is the module's own fixture (moto's URL and
    the :class:`tests.helpers.s3.Proxy` in front of it)."""
    from tests.helpers import s3

    _, proxy = endpoint
    proxy.faults.clear()
    proxy.traffic.reset()
    with s3.client_env(proxy, monkeypatch):
        yield proxy
    proxy.faults.clear()


GOLDEN = Path(__file__).parent / "golden"

Golden = Callable[..., None]


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Golden:
    """``golden(name, doc, normalise=None)``: compare ``doc`` with tests/golden/NAME.

    The document (after ``normalise``, which pins what varies: paths, times, the last bits of
    floats) is written as sorted, indented JSON. With ``--update-golden`` the file is rewritten
    instead; a difference fails with a unified diff of the two texts.
    """
    update = bool(request.config.getoption("--update-golden"))

    def check(name: str, doc: Any, normalise: Callable[[Any], Any] | None = None) -> None:
        if normalise is not None:
            doc = normalise(doc)
        text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
        path = GOLDEN / name
        if update:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
            return
        if not path.is_file():
            pytest.fail(f"no golden file {path.name}: run pytest with --update-golden to make "
                        f"it, and review it before committing")
        want = path.read_text()
        if text != want:
            diff = "".join(difflib.unified_diff(want.splitlines(keepends=True),
                                                text.splitlines(keepends=True),
                                                f"golden/{name}", "current output"))
            pytest.fail(f"output differs from golden/{name} (if intended, rerun with "
                        f"--update-golden and review the change):\n{diff}", pytrace=False)

    return check


def pytest_configure(config: pytest.Config) -> None:
    """``ckpt stats`` keeps figures in the user's cache directory: every test (and every
    process a test starts) gets one of its own, never the user's ``~/.cache/ckpt``."""
    import os
    import tempfile

    os.environ["CKPT_CACHE_DIR"] = tempfile.mkdtemp(prefix="ckpt-test-cache-")


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--update-golden`` rewrites tests/golden/*.json from the current output."""
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite golden files instead of comparing against them")


# --- every test that imports torch carries the requires_torch marker ---------------------------

def _is_torch(module: str | None) -> bool:
    return module is not None and (module == "torch" or module.startswith("torch.")
                                   or module == "safetensors.torch")


def imports_torch(nodes: list[ast.stmt]) -> bool:
    """Whether any import statement among ``nodes`` (searched through) imports torch."""
    for stmt in nodes:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Import) and any(_is_torch(a.name) for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_torch(node.module):
                return True
    return False


def module_imports_torch(tree: ast.Module) -> bool:
    """Whether the module imports torch at its top level (outside functions and classes)."""
    top = [s for s in tree.body
           if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return imports_torch(top)


def function_imports_torch(tree: ast.Module, name: str) -> bool:
    """Whether the test function ``name`` (top level or in a class) imports torch itself."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            if imports_torch(node.body):
                return True
    return False


@functools.cache
def _parsed(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text(), filename=path)


# The full suite's slowest parts (per-test times of a full run, docs/development.md): whole
# modules that train, spawn training processes, start an S3 endpoint or fuzz, and tests
# that ask for DeepSpeed's checkpoints or the S3 endpoint. They are the `slow` tier;
# `pytest -m "not slow"` is the fast tier, and README's test command runs both.
SLOW_MODULES = frozenset({
    "test_docs_examples.py", "test_fuzz.py", "test_big_tensors.py", "test_s3.py",
    "test_s3_outputs.py", "test_s3_torch_zips.py", "test_api_s3.py",
    "test_thinning_converges.py", "test_integrations.py", "test_watch.py", "test_watch_s3.py",
    "test_thinning_s3.py", "test_thinning_s3_dcp.py", "test_careful_adversary.py",
    "test_rollback_retention.py", "test_verdicts.py", "test_thinning_kills.py",
    "test_thinning_settles.py", "test_prune_concurrent.py", "test_resumes.py",
    "test_sources_deepspeed.py"})
SLOW_FIXTURES = frozenset({"ds_dir", "ds_view_dir", "endpoint", "bucket_run", "s3env",
                           "trained_sample_run"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the slow tier (:data:`SLOW_MODULES`, :data:`SLOW_FIXTURES`); refuse to run when a
    test imports torch without the ``requires_torch`` marker."""
    for item in items:
        if item.path.name in SLOW_MODULES or SLOW_FIXTURES & set(
                getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    missing = []
    for item in items:
        if not isinstance(item, pytest.Function) or item.get_closest_marker("requires_torch"):
            continue
        tree = _parsed(str(item.path))
        name = item.originalname
        if module_imports_torch(tree) or function_imports_torch(tree, name):
            missing.append(f"{item.path.name}::{name}")
    if missing:
        shown = ", ".join(sorted(set(missing))[:20])
        raise pytest.UsageError(
            f"{len(missing)} test(s) import torch without the requires_torch marker (add "
            f"`pytestmark = pytest.mark.requires_torch` to the file, or "
            f"@pytest.mark.requires_torch to the test): {shown}")
