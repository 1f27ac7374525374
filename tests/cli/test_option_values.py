"""Option values as a user types them (issue 39): ``--to`` in any case and by dtype name,
count suffixes for every STEPS option, and ``--keep-fp32`` saying what it kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import run_cli

pytestmark = pytest.mark.requires_torch


@pytest.fixture
def model(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    p = tmp_path / "model.safetensors"
    save_file({"enc.ln_1.weight": torch.ones(8), "enc.proj.weight": torch.randn(8, 8),
               "head.weight": torch.randn(4, 8)}, p)
    return p


@pytest.mark.parametrize(("to", "dtype"), [
    ("FP16", torch.float16), ("float16", torch.float16), ("half", torch.float16),
    ("BF16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("Float32", torch.float32)])
@pytest.mark.parametrize("command", ["convert", "consolidate"])
def test_to_takes_any_case_and_dtype_names(model: Path, tmp_path: Path, to: str,
                                           dtype: torch.dtype, command: str) -> None:
    src = model
    if command == "consolidate":  # consolidate merges per-rank files
        (tmp_path / "ranks").mkdir()
        for rank in (0, 1):
            torch.save({f"w{rank}": torch.randn(4, 4)}, tmp_path / "ranks" / f"rank_{rank}.pt")
        src = tmp_path / "ranks"
    out = tmp_path / "out.safetensors"
    r = run_cli(command, src, "--to", to, "-o", out)
    assert r.exit_code == 0, r.output
    assert {t.dtype for t in load_file(out).values()} == {dtype}
    r = run_cli(command, src, "--to", "fp9", "-o", tmp_path / "no.safetensors")
    assert r.exit_code == 2 and "'fp9'" in r.output


def test_keep_full_every_takes_suffixes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for step in (10_000, 20_000, 30_000):
        torch.save({"model": {"w": torch.ones(2)}, "optimizer": {"state": {}}, "step": step},
                   run / f"step_{step}.pt")
    r = run_cli("prune", run, "--keep", "3", "--thin-after", "1", "--keep-full-every", "20K",
                "--dry-run", "--grace", "0s", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    reasons = {c["step"]: c["reasons"] for c in doc["checkpoints"]}
    assert ("kept whole: step 20,000 is a multiple of 20,000 (--keep-full-every 20000)"
            in reasons[20_000])
    assert not any("--keep-full-every" in why for why in reasons[10_000])
    assert run_cli("prune", run, "--keep-full-every", "0", "--dry-run").exit_code == 2


def test_keep_fp32_says_what_it_kept(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    r = run_cli("convert", model, "--to", "fp16", "--keep-fp32", "*ln_*", "--keep-fp32",
                "*norm*", "-o", out)
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "Kept in FP32: 1 matching '*ln_*' (enc.ln_1.weight); 0 matching '*norm*'" in said
    assert "--keep-fp32 '*norm*' matched no tensor of the output" in said
    doc = json.loads(run_cli("convert", model, "--to", "fp16", "--keep-fp32", "*ln_*",
                             "-o", tmp_path / "o2.safetensors", "--json").stdout)
    assert doc["kept_fp32"] == {"*ln_*": ["enc.ln_1.weight"]}
    meta = json.loads(run_cli("inspect", tmp_path / "o2.safetensors", "--json").stdout)
    assert "keep_fp32: *ln_* (1)" in meta["metadata"]["safetensors_metadata"]["ckpt.conversion"]
