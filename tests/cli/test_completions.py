"""completions/ckpt.{bash,zsh,fish} are what the CLI generates today."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

COMPLETIONS = Path(__file__).parents[2] / "completions"


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_scripts_are_current(shell: str) -> None:
    env = {**os.environ, "_CKPT_COMPLETE": f"source_{shell}"}
    code = "from ckpt_cli.cli.app import main; main()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.stdout, r.stderr
    expected = (COMPLETIONS / f"ckpt.{shell}").read_text()
    assert r.stdout.replace(sys.executable, "ckpt") == expected.replace(sys.executable, "ckpt"), (
        f"completions/ckpt.{shell} is stale: regenerate with "
        f"_CKPT_COMPLETE=source_{shell} ckpt > completions/ckpt.{shell}")


def test_completion_answers_subcommands() -> None:
    env = {**os.environ, "_CKPT_COMPLETE": "complete_bash", "COMP_WORDS": "ckpt ins",
           "COMP_CWORD": "1"}
    code = "from ckpt_cli.cli.app import main; main()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert "inspect" in r.stdout.split()


@pytest.mark.parametrize("command", ["convert", "consolidate"])
def test_completion_offers_the_cast_targets(command: str) -> None:
    """``--to <TAB>`` offers the targets (and only those matching what is typed)."""
    code = "from ckpt_cli.cli.app import main; main()"
    answers = []
    for words in (f"ckpt {command} x --to ", f"ckpt {command} x --to b"):
        env = {**os.environ, "_CKPT_COMPLETE": "complete_bash", "COMP_WORDS": words,
               "COMP_CWORD": "4"}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=60)
        answers.append(r.stdout.split())
    every = ["fp16", "bf16", "fp32", "fp8", "keep", "dcp"] if command == "convert" else [
        "fp16", "bf16", "fp32", "keep"]
    assert answers == [every, ["bf16"]]


@pytest.mark.parametrize(("option", "typed", "want"), [
    ("--fp8-layout", "", ["block", "channel", "tensor"]), ("--fp8-layout", "c", ["channel"]),
    ("--fp8-activations", "", ["dynamic", "none"])])
def test_completion_offers_the_fp8_choices(option: str, typed: str, want: list[str]) -> None:
    """``--fp8-layout <TAB>`` and ``--fp8-activations <TAB>`` offer their values (issue 39)."""
    code = "from ckpt_cli.cli.app import main; main()"
    env = {**os.environ, "_CKPT_COMPLETE": "complete_bash",
           "COMP_WORDS": f"ckpt convert x {option} {typed}", "COMP_CWORD": "4"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.stdout.split() == want


@pytest.mark.parametrize(("command", "option", "want"), [
    ("prune", "--mode", ["min", "max"]), ("inspect", "--sort", ["name", "size"]),
    ("consolidate", "--output-format", ["safetensors", "pt"]),
    ("prune", "--thin-to", ["bf16"])])
def test_completion_offers_a_declared_options_values(command: str, option: str,
                                                     want: list[str]) -> None:
    """An option declared with a ``Literal`` type (or one in a union with None) completes to
    its values (``ckpt_cli/optionspec.py``)."""
    code = "from ckpt_cli.cli.app import main; main()"
    env = {**os.environ, "_CKPT_COMPLETE": "complete_bash",
           "COMP_WORDS": f"ckpt {command} x {option} ", "COMP_CWORD": "4"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.stdout.split() == want
